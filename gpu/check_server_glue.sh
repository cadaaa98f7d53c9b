#!/usr/bin/env bash
# The server's op path with its views made straight from the storage and an op message's frees applied in
# C++ (fast_table.h), tcp's reads that poll before they sleep: the op path's GPU tests, the server's time
# per op message split (gpu/diag_replay.py), and the eager and compiled (reduce-overhead) steps over shm
# and tcp. TF32 on, --pin. About 7 minutes; everything in $OUT/glue.tar.gz.
#
#   OUT=/some/folder bash gpu/check_server_glue.sh
BUDGET=${BUDGET:-450}
. "$(dirname "$0")/steps.sh"
export RGPU_TF32=1
TRAIN="python3 -m rgpu.bench.train --json --repeats 5 --pin"
COMPILE=${COMPILE---compile reduce-overhead}   # COMPILE= (empty): the eager step alone
install_rgpu
step gpu_tests 60 python3 -m pytest -q -p no:cacheprovider -m gpu "$REPO/tests/test_server_fast_op.py" \
  "$REPO/tests/test_uploads.py"
step replay 110 python3 "$REPO/gpu/diag_replay.py" --steps 5
step shm 100 env RGPU_TRANSPORT=shm $TRAIN $COMPILE
step tcp 100 env RGPU_TRANSPORT=tcp $TRAIN $COMPILE
summarize shm tcp
cp "$OUT/gpu_tests.json" "$FINAL/gpu_tests.txt"
pack glue.tar.gz
