#!/usr/bin/env bash
# The compiled step on the GPU host once a replay takes the forward's saved activations (CUDA graph outputs
# the client names anew at every call) as the captured tensors instead of building ~100 views before the
# backward's launch (run8 call 3's trace: 1.4 ms of the backward call's server time came before its
# launch). TF32 on, --pin, shm then tcp, eager and compiled (reduce-overhead). About 3 minutes; everything
# in $OUT/replay.tar.gz beside summary.txt.
#
#   OUT=/some/folder bash gpu/check_replay.sh
BUDGET=${BUDGET:-170}
. "$(dirname "$0")/steps.sh"
TRAIN="python3 -m rgpu.bench.train --json --repeats 5 --pin --compile reduce-overhead"
install_rgpu
step shm 100 env RGPU_TF32=1 RGPU_TRANSPORT=shm $TRAIN
step tcp 100 env RGPU_TF32=1 RGPU_TRANSPORT=tcp $TRAIN
summarize shm tcp
pack replay.tar.gz
