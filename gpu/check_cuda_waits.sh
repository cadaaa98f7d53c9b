#!/usr/bin/env bash
# Waits on the CUDA route with stock PyTorch on a GPU host: the R7 GPT's first step and steady steps (each wait by
# call name: target one per step, <= 60 in the first) and torch.compile(mode="reduce-overhead") through rgpu.
#
#   OUT=/some/folder bash gpu/check_cuda_waits.sh     (the device tool sets $OUT; about 3 minutes; carry .whl/)
#   CHECK_DRIVER=fake CHECK_INSTALL=0 TORCH_PYTHON=/path/python bash gpu/check_cuda_waits.sh
#                                                     the script itself, without a GPU (the probe then fails at
#                                                     torch's first kernel: the fake runs none of them)
#
# Results: $OUT/summary.txt, $OUT/cuda_waits.tar.gz (the probe's JSON, its stderr with the wait report, the server log).
BUDGET=400
cd "$(dirname "$0")/.."
. gpu/steps.sh
if [ "${CHECK_INSTALL:-1}" = 1 ]; then
  install_cuda_route
fi
TPY=${TORCH_PYTHON:-python3}
build_cuda_route
export RGPU_TOKEN=gpu-check-$RANDOM$RANDOM
serve_cuda "$OUT/server.log"; SERVER_PID=$SERVED_PID; export RGPU_SERVER=$SERVED
stamp "server $RGPU_SERVER"
RGPU_CUDA_WAIT_REPORT=1 step probe 240 python3 -m rgpu intercept run -- "$TPY" "$REPO/gpu/cuda_waits_probe.py"
kill "$SERVER_PID" 2>/dev/null
python3 - "$OUT/probe.json" <<'PY' | tee "$OUT/summary.txt"
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
print("reduce-overhead", {k: v for k, v in r["reduce_overhead"].items() if k != "traceback"})
PY
cp "$OUT/summary.txt" "$FINAL/summary.txt"
tar czf "$FINAL/cuda_waits.tar.gz" -C "$OUT" .
