#!/usr/bin/env bash
# Where the eager step's client time goes over tcp (gpu/diag_tcp_step.py: the client's writes counted and
# timed), with the gathering window, the send buffer and the GIL's switch interval changed one at a time,
# beside shm's step and tcp's compiled step (with gathering: unmeasured before). TF32 on, --pin.
# About 6 minutes; everything in $OUT/diag_tcp.tar.gz.
#
#   OUT=/some/folder bash gpu/diag_tcp.sh
BUDGET=${BUDGET:-450}
. "$(dirname "$0")/steps.sh"
export RGPU_TF32=1
TRAIN="--json --repeats 5 --pin"
DIAG="python3 $REPO/gpu/diag_tcp_step.py"
install_rgpu
step tcp 45 env RGPU_TRANSPORT=tcp $DIAG -- $TRAIN
step tcp_batch50ms 45 env RGPU_TRANSPORT=tcp $DIAG --batch-s 0.05 -- $TRAIN
step tcp_sndbuf 45 env RGPU_TRANSPORT=tcp $DIAG --sndbuf 4194304 -- $TRAIN
step tcp_switch 45 env RGPU_TRANSPORT=tcp $DIAG --switch 0.0002 -- $TRAIN
step shm 45 env RGPU_TRANSPORT=shm python3 -m rgpu.bench.train $TRAIN
step tcp_compiled 100 env RGPU_TRANSPORT=tcp $DIAG -- $TRAIN --compile reduce-overhead
summarize tcp tcp_batch50ms tcp_sndbuf tcp_switch shm tcp_compiled
pack diag_tcp.tar.gz
