#!/usr/bin/env bash
# The defaults this session settled on, on the GPU host: the server's C++ op path on and shm's long spin
# on a machine of 8+ cores (RGPU_SHM_SPIN_US unset), against each turned back on the same instance: the
# eager step with a 100 us spin, and with the C++ op path off. TF32 on, --pin; the compiled step
# (reduce-overhead) over shm and tcp beside. About 7 minutes; everything in $OUT/defaults.tar.gz.
#
#   OUT=/some/folder bash gpu/check_spin_default.sh
BUDGET=${BUDGET:-440}
. "$(dirname "$0")/steps.sh"
export RGPU_TF32=1
TRAIN="python3 -m rgpu.bench.train --json --repeats 5 --pin"
install_rgpu
step shm 110 env RGPU_TRANSPORT=shm $TRAIN --compile reduce-overhead
step shm_spin100 55 env RGPU_TRANSPORT=shm RGPU_SHM_SPIN_US=100 $TRAIN
step shm_python 55 env RGPU_TRANSPORT=shm RGPU_SERVER_C=0 $TRAIN
step tcp 100 env RGPU_TRANSPORT=tcp $TRAIN --compile reduce-overhead
summarize shm shm_spin100 shm_python tcp
pack defaults.tar.gz
