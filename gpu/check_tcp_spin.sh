#!/usr/bin/env bash
# tcp reads that poll before they sleep (RGPU_TCP_SPIN_US; unset: 20 ms on this 16-core host) against
# reads that sleep at once (as before), the eager step's client writes counted (gpu/diag_tcp_step.py);
# the compiled step over tcp; and why an rgpu block between native blocks can be slower than the same
# steps back to back (gpu/diag_blocks.py: each step of each block, after a native block or after an
# idle sleep as long). TF32 on, --pin. About 6.5 minutes; everything in $OUT/tcp_spin.tar.gz.
#
#   OUT=/some/folder bash gpu/check_tcp_spin.sh
BUDGET=${BUDGET:-450}
. "$(dirname "$0")/steps.sh"
export RGPU_TF32=1
TRAIN="--json --repeats 5 --pin"
DIAG="python3 $REPO/gpu/diag_tcp_step.py"
BLOCKS="python3 $REPO/gpu/diag_blocks.py"
install_rgpu
step tcp 45 env RGPU_TRANSPORT=tcp $DIAG -- $TRAIN
step tcp_nospin 45 env RGPU_TRANSPORT=tcp RGPU_TCP_SPIN_US=0 $DIAG -- $TRAIN
step shm_blocks 45 env RGPU_TRANSPORT=shm $BLOCKS -- $TRAIN
step shm_idle 45 env RGPU_TRANSPORT=shm $BLOCKS --idle -- $TRAIN
step tcp_compiled 100 env RGPU_TRANSPORT=tcp $DIAG -- $TRAIN --compile reduce-overhead
summarize tcp tcp_nospin shm_blocks shm_idle tcp_compiled
pack tcp_spin.tar.gz
