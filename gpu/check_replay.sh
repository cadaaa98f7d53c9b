#!/usr/bin/env bash
# The compiled step on the GPU host once a replay takes the forward's saved activations (CUDA graph outputs
# the client names anew at every call) as the captured tensors instead of building ~100 views before the
# backward's launch (run8 call 3's trace: 1.4 ms of the backward call's server time came before its
# launch). TF32 on, --pin, shm then tcp, eager and compiled (reduce-overhead). About 3 minutes; everything
# in $OUT/replay.tar.gz beside summary.txt.
#
#   OUT=/some/folder bash gpu/check_replay.sh
set -u
FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
OUT=$(mktemp -d)
BUDGET=${BUDGET:-170}
T0=$(date +%s)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
unset RGPU_SERVER RGPU_TRANSPORT RGPU_SIM_RTT_MS RGPU_TF32
REPO=$PWD
export PYTHONPATH=$REPO/examples/nanogpt
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/log.txt"; }
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$left" -lt 20 ]; then stamp "skip $name (no time left)"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  stamp "$name (limit $limit s)"
  ( cd /tmp && timeout "$limit" "$@" >"$OUT/$name.json" 2>"$OUT/$name.err" )
  echo $? >"$OUT/$name.rc"
}
TRAIN="python3 -m rgpu.bench.train --json --repeats 5 --pin --compile reduce-overhead"
stamp install
python3 -m pip install --no-deps --no-build-isolation -q . >"$OUT/install.log" 2>&1
step build 150 python3 -c 'import torch, rgpu; from rgpu.device_backend import build; build.load(); print("{}")'
step shm 100 env RGPU_TF32=1 RGPU_TRANSPORT=shm $TRAIN
step tcp 100 env RGPU_TF32=1 RGPU_TRANSPORT=tcp $TRAIN
stamp summary
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, os, sys
out = sys.argv[1]
for name in ("shm", "tcp"):
    try:
        rows = json.load(open(os.path.join(out, name + ".json")))
    except Exception as exc:
        print(f"{name}: no rows ({type(exc).__name__}: {exc})")
        continue
    for r in rows:
        if "CUDA graphs" in r["metric"]:
            continue
        v, ratio, spread = r.get("value"), r.get("ratio"), r.get("spread")
        print(f"{name:9s} {str(r.get('metric'))[:70]:70s} {'-' if v is None else format(v, '.4g'):>10} "
              f"{r.get('unit') or '':5s} ratio {'-' if ratio is None else format(ratio, '.3f')}"
              + (f" spread {spread[0]:.2f}-{spread[1]:.2f}" if spread else ""))
PY
stamp done
cp "$OUT/summary.txt" "$FINAL/" && tar czf "$FINAL/replay.tar.gz" -C "$OUT" .
