#!/usr/bin/env bash
# tcp's posts gathered and written by the caller (Connection, TcpTransport.post_batch_s) against the way
# before (each post handed to the I/O thread) on the same instance, and the defaults over shm once more.
# TF32 on, --pin. About 5 minutes; everything in $OUT/tcp.tar.gz.
#
#   OUT=/some/folder bash gpu/check_tcp.sh
#
#   tcp         the defaults: posts gathered; eager and compiled (reduce-overhead)
#   tcp_before  posts handed to the I/O thread one by one: as before
#   shm         the defaults over shm, eager and compiled
#
# (Run9's call 6 ran this with a server whose tcp reads polled 20 ms in Python before sleeping, since taken
# out, and before a race in the gathering was fixed: that step ran out of time; see docs/perf/fast_path.md.)
BUDGET=${BUDGET:-330}
. "$(dirname "$0")/steps.sh"
export RGPU_TF32=1
TRAIN="--json --repeats 5 --pin"
# rgpu bench train with tcp's posts gathered (1) or handed to the I/O thread one by one (0)
TCP_BENCH='import sys; from rgpu.transport import tcp
if sys.argv.pop(1) == "0": tcp.TcpTransport.post_batch_s = None
from rgpu.bench import train; raise SystemExit(train.main(sys.argv[1:]))'
install_rgpu
step tcp 90 env RGPU_TRANSPORT=tcp python3 -c "$TCP_BENCH" 1 $TRAIN --compile reduce-overhead
step tcp_before 35 env RGPU_TRANSPORT=tcp python3 -c "$TCP_BENCH" 0 $TRAIN
step shm 90 env RGPU_TRANSPORT=shm python3 -m rgpu.bench.train $TRAIN --compile reduce-overhead
summarize tcp tcp_before shm
pack tcp.tar.gz
