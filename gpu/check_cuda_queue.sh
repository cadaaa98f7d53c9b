#!/usr/bin/env bash
# How soon the CUDA route's client posts its queued work, on a GPU host: stock PyTorch's GPT eager steps (6x384 and
# 4x128) through rgpu with RGPU_CUDA_QUEUE_BYTES at each of QUEUE (default 256K,64K,16K; an entry FIRST:LIMIT sets
# RGPU_CUDA_QUEUE_FIRST_BYTES too, 64K:64K a fixed size), every run beside a native
# run, interleaved (`rgpu bench cuda --torch --queue-bytes`). A post hands the server what the client queued so far;
# until then the server has nothing to run beside the client.
#
#   OUT=/some/folder bash gpu/check_cuda_queue.sh      (the device tool sets $OUT; about 3 minutes; carry .whl/)
#
# Results: $OUT/summary.txt, $OUT/cuda_queue.tar.gz (the bench's JSON and stderr, the server log).
BUDGET=${BUDGET:-300}
cd "$(dirname "$0")/.."
. gpu/steps.sh
if [ "${CHECK_INSTALL:-1}" = 1 ]; then
  install_cuda_route
fi
build_cuda_route
export RGPU_TOKEN=gpu-check-$RANDOM$RANDOM
serve_cuda "$OUT/server.log"; SERVER_PID=$SERVED_PID
stamp "server $SERVED"
program_python torch "$OUT/torch_install.log" "${TORCH_PYTHON:-}"; TPY=${PROGRAM_PY:-python3}
step queue $(( BUDGET - ($(date +%s) - T0) - 15 )) env TORCH_PYTHON="$TPY" python3 -m rgpu bench cuda --torch --json \
  --server "$SERVED" --queue-bytes "${QUEUE:-256K,64K,16K}" --repeats "${REPEATS:-2}"
kill "$SERVER_PID" 2>/dev/null
summarize queue
pack cuda_queue.tar.gz
