#!/usr/bin/env bash
# The compiled step on the GPU host with rgpu's own CUDA graphs (reduce-overhead), TF32 off and on, the GPU
# tests of CUDA graphs and compile, and shm's 64 B round trip; about 8 minutes, everything in $OUT.
#
#   OUT=/some/folder bash gpu/check_compiled.sh
#
#   install   rgpu installed (not editable) and its C++ part built, run from /tmp
#   ro_tf32   RGPU_TF32=1 RGPU_TRANSPORT=tcp rgpu bench train --compile reduce-overhead: rgpu's compiled step
#             (CUDA graphs on the server) vs native eager, TF32 on both sides, with native torch.compile in the
#             same mode as its reference
#   tests     the GPU tests of tests/test_cuda_graphs.py and tests/test_compile.py
#   rtt       rgpu bench transport --transport shm --sizes 64 (shm's round trip vs rgpu tcp)
#   ro_tf32_shm  ro_tf32 over shm
#   ro        ro_tf32 with TF32 off (the issue's fp32 setting)
# Every step's output goes into $OUT/compiled.tar.gz, beside summary.txt (the device tool returns at most
# 8 files a call: run7 lost the rest).
BUDGET=${BUDGET:-540}
. "$(dirname "$0")/steps.sh"
install_rgpu
TRAIN="python3 -m rgpu.bench.train --json --compile reduce-overhead --repeats 5"
step ro_tf32 170 env RGPU_TF32=1 RGPU_TRANSPORT=tcp $TRAIN
step tests 150 python3 -m pytest -q -p no:cacheprovider --tb=short -rs "$REPO/tests/test_cuda_graphs.py" \
  "$REPO/tests/test_compile.py" -k "gpu"
step rtt 40 python3 -m rgpu bench transport --transport shm --sizes 64 --repeats 5 --json
step ro_tf32_shm 140 env RGPU_TF32=1 RGPU_TRANSPORT=shm $TRAIN
step ro 170 env RGPU_TRANSPORT=tcp $TRAIN
summarize ro_tf32 rtt ro_tf32_shm ro
tail -n 5 "$OUT/tests.json"
pack compiled.tar.gz
