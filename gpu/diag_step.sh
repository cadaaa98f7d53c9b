#!/usr/bin/env bash
# Where a TF32 training step's time goes on the GPU host: the server's timeline (torch.profiler: its CPU,
# each message a span, and every GPU kernel) against native's GPU time, and tcp's posts written on the
# caller's thread vs its I/O thread; the compiled step over tcp, TF32 on and off. About 8 minutes;
# everything in $OUT/step.tar.gz.
#
#   OUT=/some/folder bash gpu/diag_step.sh
#
#   shm        RGPU_TF32=1 RGPU_TRANSPORT=shm rgpu bench train --compile reduce-overhead --trace: eager and
#              compiled steps, each with its server trace rows (bench/timeline.py) and native's GPU time
#   tcp_io     RGPU_TF32=1 RGPU_TRANSPORT=tcp rgpu bench train --trace, tcp posts through the I/O thread
#   tcp_inline the same with tcp posts written on the caller's thread (TcpTransport.posts_inline)
#   tcp_ro     RGPU_TF32=1 RGPU_TRANSPORT=tcp rgpu bench train --compile reduce-overhead
#   tcp_ro_fp32  the same with TF32 off
set -u
FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
OUT=$(mktemp -d)
BUDGET=${BUDGET:-540}
T0=$(date +%s)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 RGPU_TF32=1
unset RGPU_SERVER RGPU_TRANSPORT RGPU_SIM_RTT_MS
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
# rgpu bench train over tcp, posts written inline (1) or through the I/O thread (0)
TCP_BENCH='import sys; from rgpu.transport import tcp; tcp.TcpTransport.posts_inline = sys.argv.pop(1) == "1"
from rgpu.bench import train; raise SystemExit(train.main(sys.argv[1:]))'
stamp install
python3 -m pip install --no-deps --no-build-isolation -q . >"$OUT/install.log" 2>&1
step build 150 python3 -c 'import torch, rgpu; from rgpu.device_backend import build; build.load(); print("{}")'
step shm 150 env RGPU_TRANSPORT=shm python3 -m rgpu.bench.train --json --compile reduce-overhead --repeats 5 \
  --trace "$OUT/shm_trace.json.gz"
step tcp_io 90 env RGPU_TRANSPORT=tcp python3 -c "$TCP_BENCH" 0 --json --repeats 5 --trace "$OUT/tcp_io_trace.json.gz"
step tcp_inline 90 env RGPU_TRANSPORT=tcp python3 -c "$TCP_BENCH" 1 --json --repeats 5 --trace "$OUT/tcp_inline_trace.json.gz"
step tcp_ro 150 env RGPU_TRANSPORT=tcp python3 -m rgpu.bench.train --json --compile reduce-overhead --repeats 5
step tcp_ro_fp32 150 env RGPU_TF32=0 RGPU_TRANSPORT=tcp python3 -m rgpu.bench.train --json --compile reduce-overhead \
  --repeats 5
stamp summary
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, os, sys
out = sys.argv[1]
for name in ("shm", "tcp_io", "tcp_inline", "tcp_ro", "tcp_ro_fp32"):
    try:
        rows = json.load(open(os.path.join(out, name + ".json")))
    except Exception as exc:
        print(f"{name}: no rows ({type(exc).__name__}: {exc})")
        continue
    for r in rows:
        if "CUDA graphs" in r["metric"] or "loss" in r["metric"]:
            continue
        v, ratio = r.get("value"), r.get("ratio")
        print(f"{name:10s} {str(r.get('metric'))[:84]:84s} {'-' if v is None else format(v, '.4g'):>10} "
              f"{r.get('unit') or '':5s} ratio {'-' if ratio is None else format(ratio, '.3f')}")
PY
stamp done
cp "$OUT/summary.txt" "$FINAL/" && tar czf "$FINAL/step.tar.gz" -C "$OUT" .
