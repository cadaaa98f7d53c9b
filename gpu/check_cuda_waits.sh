#!/usr/bin/env bash
# Waits on the CUDA route with stock PyTorch on a GPU host: the R7 GPT's first step and steady steps (each wait by
# call name: target one per step, <= 60 in the first) and torch.compile(mode="reduce-overhead") through rgpu.
#
#   OUT=/some/folder bash gpu/check_cuda_waits.sh     (the device tool sets $OUT; about 3 minutes; carry .whl/)
#   CHECK_DRIVER=fake CHECK_INSTALL=0 TORCH_PYTHON=/path/python bash gpu/check_cuda_waits.sh
#                                                     the script itself, without a GPU (the probe then fails at
#                                                     torch's first kernel: the fake runs none of them)
#
# The server reports each session's answered calls, its batches' time and the records it ran in Python; the probe
# runs natively too, for the steady step's baseline.
# Results: $OUT/summary.txt, $OUT/cuda_waits.tar.gz (the probe's JSON, its stderr with the wait report, the server log).
BUDGET=${BUDGET:-400}
cd "$(dirname "$0")/.."
. gpu/steps.sh
if [ "${CHECK_INSTALL:-1}" = 1 ]; then
  install_cuda_route
fi
TPY=${TORCH_PYTHON:-python3}
build_cuda_route
export RGPU_TOKEN=gpu-check-$RANDOM$RANDOM
serve_cuda "$OUT/server.log" RGPU_CUDA_WAIT_REPORT=1; SERVER_PID=$SERVED_PID; export RGPU_SERVER=$SERVED
stamp "server $RGPU_SERVER"
RGPU_CUDA_WAIT_REPORT=1 step probe 240 python3 -m rgpu intercept run -- "$TPY" "$REPO/gpu/cuda_waits_probe.py"
# the same probe natively (no rgpu library, no RGPU_* variable): its steady steps' times are the baseline
NATIVE=(env -u LD_LIBRARY_PATH -u LD_AUDIT -u LD_PRELOAD)
for v in $(compgen -e | grep '^RGPU_'); do NATIVE+=(-u "$v"); done
step native 120 "${NATIVE[@]}" "$TPY" "$REPO/gpu/cuda_waits_probe.py"
kill "$SERVER_PID" 2>/dev/null; sleep 1
python3 - "$OUT/probe.json" "$OUT/native.json" "$OUT/server.log" <<'PY' | tee "$OUT/summary.txt"
import json, sys
try:
    r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
except Exception as exc:
    print("no probe output:", exc); sys.exit(0)
if r["steps"]:
    print("first step waits", r["steps"][0]["total"], r["steps"][0]["by_name"])
    print("steady steps waits", [s["total"] for s in r["steps"][1:]], "last by name", r["steps"][-1]["by_name"])
    print("setup waits", sum(r["setup"].values()), r["setup"])
print("gpt error", r.get("gpt_error"))
try:
    n = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
    print("steady step ms rgpu", r.get("steady_ms"), "native", n.get("steady_ms"))
except Exception as exc:
    print("no native output:", exc)
for line in open(sys.argv[3]):     # the server's report of the session (RGPU_CUDA_WAIT_REPORT)
    if "rgpu worker:" in line:
        print(line.strip()[:1500])
print("reduce-overhead", {k: v for k, v in r["reduce_overhead"].items() if k != "traceback"})
PY
cp "$OUT/summary.txt" "$FINAL/summary.txt"
tar czf "$FINAL/cuda_waits.tar.gz" -C "$OUT" .
