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
BUDGET=${BUDGET:-540}
. "$(dirname "$0")/steps.sh"
export RGPU_TF32=1
# rgpu bench train over tcp, posts written inline (1) or through the I/O thread (0)
TCP_BENCH='import sys; from rgpu.transport import tcp; tcp.TcpTransport.posts_inline = sys.argv.pop(1) == "1"
from rgpu.bench import train; raise SystemExit(train.main(sys.argv[1:]))'
install_rgpu
step shm 150 env RGPU_TRANSPORT=shm python3 -m rgpu.bench.train --json --compile reduce-overhead --repeats 5 \
  --trace "$OUT/shm_trace.json.gz"
step tcp_io 90 env RGPU_TRANSPORT=tcp python3 -c "$TCP_BENCH" 0 --json --repeats 5 --trace "$OUT/tcp_io_trace.json.gz"
step tcp_inline 90 env RGPU_TRANSPORT=tcp python3 -c "$TCP_BENCH" 1 --json --repeats 5 --trace "$OUT/tcp_inline_trace.json.gz"
step tcp_ro 150 env RGPU_TRANSPORT=tcp python3 -m rgpu.bench.train --json --compile reduce-overhead --repeats 5
step tcp_ro_fp32 150 env RGPU_TF32=0 RGPU_TRANSPORT=tcp python3 -m rgpu.bench.train --json --compile reduce-overhead \
  --repeats 5
summarize shm tcp_io tcp_inline tcp_ro tcp_ro_fp32
pack step.tar.gz
