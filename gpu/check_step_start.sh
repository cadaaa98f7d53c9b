#!/usr/bin/env bash
# The eager step's start on the GPU host after small uploads are posted from C++ and a post on a quiet tcp
# connection goes at once: the step's timeline (gpu/diag_server_step.py: the first op's arrival, the messages
# that found the GPU idle), the server's cost of one small upload (gpu/diag_server_upload.py), the GPU tests of
# uploads and the server's op path, and the bench's eager step over shm and tcp (TF32 on, --pin, --repeats 5);
# COMPILE="--compile reduce-overhead" adds the compiled step. About 5 minutes (7 compiled); everything
# in $OUT/step_start.tar.gz.
#
#   OUT=/some/folder [COMPILE="--compile reduce-overhead"] bash gpu/check_step_start.sh
BUDGET=${BUDGET:-330}
. "$(dirname "$0")/steps.sh"
export RGPU_TF32=1
TRAIN="python3 -m rgpu.bench.train --json --repeats 5 --pin ${COMPILE-}"
install_rgpu
step server_upload 60 python3 "$REPO/gpu/diag_server_upload.py"
step gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu -k "upload or attention or argument_kinds" \
    "$REPO/tests/test_uploads.py" "$REPO/tests/test_server_fast_op.py"
step server_shm 60 env RGPU_TRANSPORT=shm python3 "$REPO/gpu/diag_server_step.py" --steps 12
step server_tcp 60 env RGPU_TRANSPORT=tcp python3 "$REPO/gpu/diag_server_step.py" --steps 12
step shm 130 env RGPU_TRANSPORT=shm $TRAIN
step tcp 130 env RGPU_TRANSPORT=tcp $TRAIN
for t in shm tcp; do python3 -c "
import json; d = json.load(open('$OUT/server_$t.json')); print('$t', json.dumps(d['median']))
for s in d['steps'][:3]: print({k: s[k] for k in ('client_phases_ms', 'server_ms_by_kind', 'first_messages')})
" >>"$OUT/timeline.txt" 2>&1; done
summarize shm tcp
cat "$OUT/timeline.txt" >>"$OUT/summary.txt"
cat "$OUT/server_upload.json" "$OUT/server_upload.err" >>"$OUT/summary.txt" 2>&1
tail -5 "$OUT/gpu_tests.json" >>"$OUT/summary.txt" 2>&1
pack step_start.tar.gz
