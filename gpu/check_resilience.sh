#!/usr/bin/env bash
# Resilience on the GPU host, in under 7 minutes: `rgpu bench resilience` (the authenticated handshake under a
# flood of 256 strangers beside none, a resume after a drop beside a plain reconnect, the replay log's cost on
# 256 posts of 4 KiB and on a 1,000-op stream beside a session that cannot resume), the acknowledgements' cost on
# the eager training step over tcp (a resumable session beside one with RGPU_SESSION_GRACE=0, interleaved) and
# the GPU-marked test of one session's device-side assert while another trains
# (tests/test_resilience_gpu.py).
#
#   OUT=/some/folder bash gpu/check_resilience.sh      (the device tool sets $OUT)
#   STEPS=train_acks bash gpu/check_resilience.sh      some steps only (of gpu_test bench_resilience train_acks)
#
# Writes $OUT/summary.txt (the bench's rows, one line each, and the test's tail) and $OUT/resilience.tar.gz
# (bench_resilience.json: the rows; gpu_test.json: pytest's output; a .err and .rc per step: gpu/steps.sh).
BUDGET=${BUDGET:-420}
. "$(dirname "$0")/steps.sh"
stamp install
python3 -m pip install --no-deps --no-build-isolation -q "$REPO" >"$OUT/install.log" 2>&1
want() { [[ " ${STEPS:-gpu_test bench_resilience train_acks} " == *" $1 "* ]]; }
want gpu_test && step gpu_test 120 python3 -m pytest -q -p no:cacheprovider -rs "$REPO/tests/test_resilience_gpu.py"
want bench_resilience && step bench_resilience 160 python3 -m rgpu bench resilience --json --repeats 5
# the acknowledgements' cost on the eager step (target <= 1%): the bench preset's step over tcp in a resumable
# session beside one that cannot resume (RGPU_SESSION_GRACE=0), each its own process, blocks alternated (ABBA)
want train_acks && step train_acks 200 python3 -m rgpu.bench.resilience --step bench --step-only --json --repeats 9
summarize bench_resilience train_acks
want gpu_test && { echo "== gpu_test (rc $(cat "$OUT/gpu_test.rc"))"; tail -15 "$OUT/gpu_test.json"; } >>"$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack resilience.tar.gz
