#!/usr/bin/env bash
# The training step on the GPU host with client and server pinned apart (bench train --pin) and not, TF32
# on and off, shm and tcp: whether placement is what made the eager step swing between runs (run8: 16-27
# ms, TF32 on, shm). About 7 minutes; everything in $OUT/pinned.tar.gz beside summary.txt.
#
#   OUT=/some/folder bash gpu/check_pinned.sh
#
#   free_shm   RGPU_TF32=1 RGPU_TRANSPORT=shm rgpu bench train --compile reduce-overhead (placement left free)
#   pin_shm    the same, --pin
#   pin_tcp    the same over tcp, --pin
#   free_shm2  free_shm's eager step again, in a fresh pair of processes
#   fp32_shm   TF32 off, shm, --pin: the eager step only
#   fp32_tcp   TF32 off, tcp, --pin: the eager step only
set -u
FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
OUT=$(mktemp -d)
BUDGET=${BUDGET:-440}
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
TRAIN="python3 -m rgpu.bench.train --json --repeats 5"
stamp install
python3 -m pip install --no-deps --no-build-isolation -q . >"$OUT/install.log" 2>&1
step build 150 python3 -c 'import torch, rgpu; from rgpu.device_backend import build; build.load(); print("{}")'
step free_shm 120 env RGPU_TF32=1 RGPU_TRANSPORT=shm $TRAIN --compile reduce-overhead
step pin_shm 120 env RGPU_TF32=1 RGPU_TRANSPORT=shm $TRAIN --compile reduce-overhead --pin
step pin_tcp 120 env RGPU_TF32=1 RGPU_TRANSPORT=tcp $TRAIN --compile reduce-overhead --pin
step free_shm2 60 env RGPU_TF32=1 RGPU_TRANSPORT=shm $TRAIN
step fp32_shm 60 env RGPU_TRANSPORT=shm $TRAIN --pin
step fp32_tcp 60 env RGPU_TRANSPORT=tcp $TRAIN --pin
stamp summary
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, os, sys
out = sys.argv[1]
for name in ("free_shm", "pin_shm", "pin_tcp", "free_shm2", "fp32_shm", "fp32_tcp"):
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
cp "$OUT/summary.txt" "$FINAL/" && tar czf "$FINAL/pinned.tar.gz" -C "$OUT" .
