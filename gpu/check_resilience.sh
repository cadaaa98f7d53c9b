#!/usr/bin/env bash
# Resilience on the GPU host, in under 7 minutes: `rgpu bench resilience` (the authenticated handshake under a
# flood of 256 strangers beside none, a resume after a drop beside a plain reconnect, the replay log's cost on
# 256 posts of 4 KiB and on a 1,000-op stream beside a session that cannot resume), the acknowledgements' cost on
# the eager training step over tcp (`rgpu bench train` resumable and with RGPU_SESSION_GRACE=0, each beside native
# CUDA) and the GPU-marked test of one session's device-side assert while another trains
# (tests/test_resilience_gpu.py).
#
#   OUT=/some/folder bash gpu/check_resilience.sh      (the device tool sets $OUT)
#
# Writes $OUT/summary.txt (the bench's rows, one line each, and the test's tail) and $OUT/resilience.tar.gz
# (bench_resilience.json: the rows; gpu_test.json: pytest's output; a .err and .rc per step: gpu/steps.sh).
BUDGET=${BUDGET:-420}
. "$(dirname "$0")/steps.sh"
stamp install
python3 -m pip install --no-deps --no-build-isolation -q "$REPO" >"$OUT/install.log" 2>&1
step gpu_test 120 python3 -m pytest -q -p no:cacheprovider -rs "$REPO/tests/test_resilience_gpu.py"
step bench_resilience 160 python3 -m rgpu bench resilience --json --repeats 5
# the acknowledgements' cost on the eager step (target <= 1%): the step over tcp, resumable (the default) and
# not (RGPU_SESSION_GRACE=0), each beside native CUDA in its own run; the cost is the ratio of the two ratios
step train_tcp_resumable 100 env RGPU_TRANSPORT=tcp python3 -m rgpu bench train --json --repeats 5
step train_tcp_plain 100 env RGPU_TRANSPORT=tcp RGPU_SESSION_GRACE=0 python3 -m rgpu bench train --json --repeats 5
summarize bench_resilience train_tcp_resumable train_tcp_plain
python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import json, os, sys
def step(name):
    try:
        rows = json.load(open(os.path.join(sys.argv[1], name + ".json")))
    except Exception as exc:
        return None, f"{name}: no rows ({type(exc).__name__})"
    r = next((r for r in rows if r.get("metric") == "training step" and r.get("ratio")), None)
    return (r, "") if r else (None, f"{name}: no training step row")
(res, why1), (plain, why2) = step("train_tcp_resumable"), step("train_tcp_plain")
if res and plain:
    print(f"acknowledgements' cost on the eager step over tcp: resumable {res['ratio']:.3f} of native, not resumable "
          f"{plain['ratio']:.3f} of native: cost {res['ratio'] / plain['ratio'] - 1:+.1%} (target <= +1%)")
else:
    print("acknowledgements' cost on the eager step:", why1, why2)
PY
{ echo "== gpu_test (rc $(cat "$OUT/gpu_test.rc"))"; tail -15 "$OUT/gpu_test.json"; } >>"$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
pack resilience.tar.gz
