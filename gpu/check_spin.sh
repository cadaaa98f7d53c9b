#!/usr/bin/env bash
# Whether a longer shm spin (RGPU_SHM_SPIN_US) shortens the training step on the GPU host: each waiting end
# polls instead of sleeping, so neither pays a wake-up at each step's start (run8's server traces: ~1 ms
# between one loss.item() and the next step's first message, where the client itself needs ~0.1 ms).
# TF32 on, shm, --pin, eager and compiled (reduce-overhead); default, 10 ms, default again. About 4
# minutes; everything in $OUT/spin.tar.gz beside summary.txt.
#
#   OUT=/some/folder bash gpu/check_spin.sh
BUDGET=${BUDGET:-300}
. "$(dirname "$0")/steps.sh"
TRAIN="python3 -m rgpu.bench.train --json --repeats 5 --pin --compile reduce-overhead"
install_rgpu
step spin_default 120 env RGPU_TF32=1 RGPU_TRANSPORT=shm $TRAIN
step spin_10ms 120 env RGPU_TF32=1 RGPU_TRANSPORT=shm RGPU_SHM_SPIN_US=10000 $TRAIN
step spin_default2 120 env RGPU_TF32=1 RGPU_TRANSPORT=shm $TRAIN
summarize spin_default spin_10ms spin_default2
pack spin.tar.gz
