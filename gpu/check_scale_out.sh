#!/usr/bin/env bash
# Several GPUs through several servers, on the two-GPU host (the device tool's nvidia-h200-x2 kind), under 8 min.
#
#   OUT=/some/folder bash gpu/check_scale_out.sh           (the device tool sets $OUT)
#   DRY_RUN=1 SKIP_INSTALL=1 bash gpu/check_scale_out.sh   (a machine without a GPU: CPU servers, CPU baselines)
#
#   install  rgpu installed (not editable) and run from /tmp (SKIP_INSTALL=1: what is installed)
#   tests    tests/test_multi_server.py (two CPU servers of two devices each: routing, copies, a killed server)
#   copy     gpu/scale_out_copy.py: one `rgpu serve --device cuda` per GPU (CUDA_VISIBLE_DEVICES), x.to("rgpu:1")
#            of x on rgpu:0 (server to server) against native peer copy x.to("cuda:1"), 64 MiB to 1 GiB,
#            rounds interleaved; its bytes checked equal, the client's byte counters checked flat
#   ddp      data-parallel training through the servers (gpu/ddp_check.py, its own rows), when that file is there
#   summary  $OUT/summary.txt, $OUT/scale_out.json (every row), $OUT/scale_out.tar.gz (every step's output)
# NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0 and the tool's other variables).
BUDGET=${BUDGET:-440}
. "$(dirname "$0")/steps.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DRY=${DRY_RUN:+--dry-run}
if [ -z "${SKIP_INSTALL:-}" ]; then
  install_rgpu
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$OUT/gpu.txt" 2>&1
nvidia-smi topo -m >"$OUT/topo.txt" 2>&1

step tests 120 python3 -m pytest -q -x -p no:cacheprovider "$REPO/tests/test_multi_server.py" --rootdir "$REPO"
if [ -n "$DRY" ]; then
  step copy 150 python3 "$REPO/gpu/scale_out_copy.py" --dry-run --sizes 16,64 --rounds 2 --repeats 3
else
  step copy 200 python3 "$REPO/gpu/scale_out_copy.py" --sizes 64,256,1024 --rounds 4 --repeats 5
fi

# ---- data-parallel training (DDP through rgpu vs native DDP over NCCL): its rows in ddp.json --------------
if [ -f "$REPO/gpu/ddp_check.py" ] && [ -z "${NO_DDP:-}" ]; then   # NO_DDP=1: the copy part alone
  step ddp 240 python3 "$REPO/gpu/ddp_check.py" $DRY
fi
# ------------------------------------------------------------------------------------------------------------

summarize copy ddp
python3 - "$OUT" "$FINAL" <<'PY'
import json, os, sys
out, final = sys.argv[1:]
rows = []
for name in ("copy", "ddp"):
    try:
        rows += json.load(open(os.path.join(out, name + ".json")))
    except Exception as exc:
        rows.append({"bench": "scale_out", "metric": f"{name}: no rows", "error": f"{type(exc).__name__}: {exc}"})
json.dump(rows, open(os.path.join(final, "scale_out.json"), "w"), indent=1)
PY
pack scale_out.tar.gz
