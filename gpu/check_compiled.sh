#!/usr/bin/env bash
# The compiled step on the GPU host with rgpu's own CUDA graphs (reduce-overhead), TF32 off and on, the GPU
# tests of CUDA graphs and compile, and shm's 64 B round trip; about 8 minutes, everything in $OUT.
#
#   OUT=/some/folder bash gpu/check_compiled.sh
#
#   install   rgpu installed (not editable) and its C++ part built, run from /tmp
#   ro_tf32   RGPU_TF32=1 RGPU_TRANSPORT=tcp rgpu bench train --compile reduce-overhead: rgpu's compiled step
#             (CUDA graphs on the server) vs native eager, TF32 on both sides, with native torch.compile in the
#             same mode as its reference
#   tests     the GPU tests of tests/test_cuda_graphs.py and tests/test_compile.py
#   rtt       rgpu bench transport --transport shm --sizes 64 (shm's round trip vs rgpu tcp)
#   ro_tf32_shm  ro_tf32 over shm
#   ro        ro_tf32 with TF32 off (the issue's fp32 setting)
# Every step's output goes into $OUT/compiled.tar.gz, beside summary.txt (the device tool returns at most
# 8 files a call: run7 lost the rest).
set -u
FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
OUT=$(mktemp -d)
BUDGET=${BUDGET:-540}
T0=$(date +%s)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
unset RGPU_SERVER RGPU_TRANSPORT RGPU_SIM_RTT_MS RGPU_TF32
REPO=$PWD
export PYTHONPATH=$REPO/examples/nanogpt
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/log.txt"; }
step() {  # step NAME LIMIT_S COMMAND...: stdout to $OUT/NAME.json, stderr to $OUT/NAME.err, run from /tmp
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$left" -lt 20 ]; then stamp "skip $name (no time left)"; echo skipped >"$OUT/$name.rc"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  stamp "$name (limit $limit s)"
  ( cd /tmp && timeout "$limit" "$@" >"$OUT/$name.json" 2>"$OUT/$name.err" )
  echo $? >"$OUT/$name.rc"
}
stamp install
python3 -m pip install --no-deps --no-build-isolation -q . >"$OUT/install.log" 2>&1
step build 150 python3 -c 'import torch, rgpu; from rgpu.device_backend import build; build.load(); print("{}")'
step ro_tf32 170 env RGPU_TF32=1 RGPU_TRANSPORT=tcp python3 -m rgpu.bench.train --json --compile reduce-overhead --repeats 5
step tests 150 python3 -m pytest -q -p no:cacheprovider --tb=short -rs "$REPO/tests/test_cuda_graphs.py" \
  "$REPO/tests/test_compile.py" -k "gpu"
step rtt 40 python3 -m rgpu bench transport --transport shm --sizes 64 --repeats 5 --json
step ro_tf32_shm 140 env RGPU_TF32=1 RGPU_TRANSPORT=shm python3 -m rgpu.bench.train --json --compile reduce-overhead --repeats 5
step ro 170 env RGPU_TRANSPORT=tcp python3 -m rgpu.bench.train --json --compile reduce-overhead --repeats 5
stamp summary
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, os, sys
out = sys.argv[1]
for name in ("ro_tf32", "rtt", "ro_tf32_shm", "ro"):
    try:
        rows = json.load(open(os.path.join(out, name + ".json")))
    except Exception as exc:
        print(f"{name}: no rows ({type(exc).__name__}: {exc})")
        continue
    for r in rows:
        v, ratio = r.get("value"), r.get("ratio")
        print(f"{name:8s} {str(r.get('metric'))[:78]:78s} {'-' if v is None else format(v, '.4g'):>10} "
              f"{r.get('unit') or '':5s} ratio {'-' if ratio is None else format(ratio, '.3f')}")
PY
tail -n 5 "$OUT/tests.json"
stamp done
cp "$OUT/summary.txt" "$FINAL/" && tar czf "$FINAL/compiled.tar.gz" -C "$OUT" .
