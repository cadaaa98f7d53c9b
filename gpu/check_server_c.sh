#!/usr/bin/env bash
# The server's C++ op path (RGPU_SERVER_C) and whole uploads through a pinned ring on the GPU host: the
# GPU tests of both, then the eager training step with the C++ path on and off (TF32 on, --pin, shm then
# tcp), the compiled step (reduce-overhead) beside them, the shm one traced at both ends. About 8 minutes;
# everything in $OUT/server_c.tar.gz beside summary.txt.
#
#   OUT=/some/folder bash gpu/check_server_c.sh
BUDGET=${BUDGET:-470}
. "$(dirname "$0")/steps.sh"
export RGPU_TF32=1
TRAIN="python3 -m rgpu.bench.train --json --repeats 5 --pin"
install_rgpu
step tests 100 python3 -m pytest -q -p no:cacheprovider -m gpu -k "fast_op or uploads or cuda_graphs" \
  "$REPO/tests/test_server_fast_op.py" "$REPO/tests/test_uploads.py" "$REPO/tests/test_cuda_graphs.py"
step shm_c 130 env RGPU_TRANSPORT=shm RGPU_SERVER_C=1 $TRAIN --compile reduce-overhead --trace "$OUT/shm_trace.json.gz"
step shm_py 60 env RGPU_TRANSPORT=shm RGPU_SERVER_C=0 $TRAIN
step tcp_c 100 env RGPU_TRANSPORT=tcp RGPU_SERVER_C=1 $TRAIN --compile reduce-overhead
step tcp_py 60 env RGPU_TRANSPORT=tcp RGPU_SERVER_C=0 $TRAIN
summarize shm_c shm_py tcp_c tcp_py
pack server_c.tar.gz
