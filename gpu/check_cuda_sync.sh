#!/usr/bin/env bash
# Where a synchronising call's time goes on the CUDA route (gpu/cuda_sync_probe.py): stock torch's .item() and
# synchronize on an idle GPU and a captured graph's replay split into launch and read, natively and through rgpu,
# twice each, alternating. About 2 minutes; carry .whl/.
#
#   OUT=/some/folder bash gpu/check_cuda_sync.sh     (the device tool sets $OUT)
#
# Results: $OUT/summary.txt (each figure: native, rgpu, the difference), $OUT/cuda_sync.tar.gz.
BUDGET=${BUDGET:-240}
cd "$(dirname "$0")/.."
. gpu/steps.sh
install_cuda_route
build_cuda_route
program_python torch "$OUT/torch_install.log"
TPY=${PROGRAM_PY:-python3}
export RGPU_TOKEN=gpu-check-$RANDOM$RANDOM
serve_cuda "$OUT/server.log"; SERVER_PID=$SERVED_PID; export RGPU_SERVER=$SERVED
NATIVE=(env -u LD_LIBRARY_PATH -u LD_AUDIT -u LD_PRELOAD)
for v in $(compgen -e | grep '^RGPU_'); do NATIVE+=(-u "$v"); done
for n in 1 2; do
  step "native_$n" 60 "${NATIVE[@]}" "$TPY" "$REPO/gpu/cuda_sync_probe.py"
  step "rgpu_$n" 90 python3 -m rgpu intercept run -- "$TPY" "$REPO/gpu/cuda_sync_probe.py"
done
kill "$SERVER_PID" 2>/dev/null
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, os, statistics, sys
out = sys.argv[1]
def runs(side):
    got = []
    for n in (1, 2):
        try:
            got.append(json.loads(open(os.path.join(out, f"{side}_{n}.json")).read().strip().splitlines()[-1]))
        except Exception as exc:
            print(f"{side}_{n}: no result ({type(exc).__name__}: {exc})")
    return got
native, rgpu = runs("native"), runs("rgpu")
for key in ("item_idle", "sync_idle", "replay_launch", "replay_item", "replay_step", "gpu_us"):
    a = [r[key] for r in native if key in r]
    b = [r[key] for r in rgpu if key in r]
    if a and b:
        na, rb = statistics.median(a), statistics.median(b)
        print(f"{key:14s} native {na:9.1f} us   rgpu {rb:9.1f} us   rgpu - native {rb - na:+8.1f} us   ratio {rb / na:.3f}")
print("replayed output equal to eager:", [r.get("equal") for r in native], [r.get("equal") for r in rgpu])
PY
pack cuda_sync.tar.gz
