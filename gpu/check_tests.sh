#!/usr/bin/env bash
# The tests that need the GPU host, in about 4 minutes: every GPU-marked test, and the device route's and the
# fast path's tests against a server on the GPU (the local server uses CUDA there), values against the CPU.
# Everything in $OUT/tests.tar.gz; the pytest tails in $OUT/summary.txt.
#
#   OUT=/some/folder bash gpu/check_tests.sh
BUDGET=${BUDGET:-300}
. "$(dirname "$0")/steps.sh"
install_rgpu
step probe 60 python3 "$REPO/tools/diag/probe_sdpa_align.py"
export RGPU_TEST_CUDA_TORCH_PYTHON=${RGPU_TEST_CUDA_TORCH_PYTHON:-$(command -v python3)}   # stock torch's redirect test
step gpu_marked 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rs "$REPO/tests"
step on_a_gpu_server 150 python3 -m pytest -q -p no:cacheprovider "$REPO/tests/test_fast_path_ops.py" \
    "$REPO/tests/test_device_nanogpt.py" "$REPO/tests/test_fidelity_attention_and_convolution.py" \
    "$REPO/tests/test_device_streaming.py"
cat "$OUT/probe.json" "$OUT/probe.err" >"$OUT/summary.txt" 2>&1
for s in gpu_marked on_a_gpu_server; do echo "== $s (rc $(cat "$OUT/$s.rc"))"; tail -12 "$OUT/$s.json"; done \
    >>"$OUT/summary.txt" 2>&1
pack tests.tar.gz
