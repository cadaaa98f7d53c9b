#!/usr/bin/env bash
# Why mode="reduce-overhead" (CUDA graphs on the server) killed the worker, and the compiled step with TF32.
#   OUT=/some/folder bash gpu/diag_cudagraphs.sh        (rgpu installed; about 7 minutes)
# A sitecustomize, active in the server's worker only, turns Inductor's CUDA graphs back on and applies
# one variant (DIAG_CG): asis | noinf (the graph called outside the session's inference mode) |
# clone (that, and its outputs cloned out of the CUDA graph pool) | step (cudagraph_mark_step_begin first).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
unset RGPU_SERVER RGPU_TRANSPORT RGPU_SIM_RTT_MS
REPO=$PWD
export PYTHONPATH=$REPO/examples/nanogpt
D=$(mktemp -d)
cat >"$D/sitecustomize.py" <<'PY'
import os, sys
variant = os.environ.get("DIAG_CG")
if variant and "--control-fd" in sys.argv:   # the server's worker (python -m rgpu.server.worker)
    import torch
    from rgpu.server.ops import graphs
    graphs.INDUCTOR_OPTIONS["reduce-overhead"] = {"triton.cudagraphs": True}
    graphs.WITHOUT_CUDAGRAPHS = set()
    run = graphs.Graph.run
    def patched(self, inputs):
        if variant == "step":
            torch.compiler.cudagraph_mark_step_begin()
        if variant in ("noinf", "clone"):
            with torch.inference_mode(False), torch.no_grad():
                out = run(self, inputs)
            if variant == "clone":
                out = [o.clone() if isinstance(o, torch.Tensor) else o for o in out]
            return out
        return run(self, inputs)
    graphs.Graph.run = patched
    print(f"diag: CUDA graphs on, variant {variant}", file=sys.stderr)
PY
cd /tmp
for v in asis noinf clone step; do
  echo "== $v"
  PYTHONPATH=$D:$PYTHONPATH DIAG_CG=$v RGPU_TRANSPORT=tcp timeout 110 \
    python3 -m rgpu.bench.train --json --quick --compile reduce-overhead --repeats 3 >"$OUT/cg_$v.json" 2>"$OUT/cg_$v.err"
  echo "rc=$?" | tee "$OUT/cg_$v.rc"
  grep -h -E "compile|loss|native" "$OUT/cg_$v.json" | head -12
  grep -v "^ *$" "$OUT/cg_$v.err" | grep -E "Error|error|Segmentation|diag:|File .*(graphs|cudagraph)" | head -8
done
echo "== tf32 compiled (bench preset)"
RGPU_TF32=1 RGPU_TRANSPORT=tcp timeout 170 python3 -m rgpu.bench.train --json --compile --repeats 3 \
  >"$OUT/train_compiled_tf32.json" 2>"$OUT/train_compiled_tf32.err"
echo "rc=$?"
python3 - "$OUT/train_compiled_tf32.json" <<'PY'
import json, sys
try:
    for r in json.load(open(sys.argv[1])):
        print(f"{r.get('metric','')[:70]:70s} {r.get('value')} {r.get('unit')} ratio {r.get('ratio')}")
except Exception as exc:
    print("no rows:", exc)
PY
