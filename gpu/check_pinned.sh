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
BUDGET=${BUDGET:-440}
. "$(dirname "$0")/steps.sh"
TRAIN="python3 -m rgpu.bench.train --json --repeats 5"
install_rgpu
step free_shm 120 env RGPU_TF32=1 RGPU_TRANSPORT=shm $TRAIN --compile reduce-overhead
step pin_shm 120 env RGPU_TF32=1 RGPU_TRANSPORT=shm $TRAIN --compile reduce-overhead --pin
step pin_tcp 120 env RGPU_TF32=1 RGPU_TRANSPORT=tcp $TRAIN --compile reduce-overhead --pin
step free_shm2 60 env RGPU_TF32=1 RGPU_TRANSPORT=shm $TRAIN
step fp32_shm 60 env RGPU_TRANSPORT=shm $TRAIN --pin
step fp32_tcp 60 env RGPU_TRANSPORT=tcp $TRAIN --pin
summarize free_shm pin_shm pin_tcp free_shm2 fp32_shm fp32_tcp
pack pinned.tar.gz
