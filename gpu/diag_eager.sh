#!/usr/bin/env bash
# Where the eager step's time goes on the GPU host, with the defaults of this tree (the server's C++ op
# path, shm's long spin, tcp's gathered posts and spinning reads): the server's time per op message split
# (gpu/diag_replay.py: FastOps.run, the aten call in it, the frees, a cProfile of the Python around it),
# and the step's timeline over shm and tcp (rgpu bench train --trace: server busy, GPU busy, the gaps).
# TF32 on, --pin. About 5 minutes; everything in $OUT/eager.tar.gz (the traces' tables, not the traces).
#
#   OUT=/some/folder bash gpu/diag_eager.sh
BUDGET=${BUDGET:-420}
. "$(dirname "$0")/steps.sh"
export RGPU_TF32=1
TRAIN="python3 -m rgpu.bench.train --json --repeats 5 --pin"
TRACES=$(mktemp -d)
install_rgpu
step replay 120 python3 "$REPO/gpu/diag_replay.py" --steps 5
step shm 70 env RGPU_TRANSPORT=shm $TRAIN --trace "$TRACES/shm.json.gz"
step tcp 70 env RGPU_TRANSPORT=tcp $TRAIN --trace "$TRACES/tcp.json.gz"
cp "$TRACES"/*.txt "$OUT/" 2>/dev/null
summarize shm tcp
pack eager.tar.gz
