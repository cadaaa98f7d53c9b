#!/usr/bin/env bash
# The figures a change to the transport, the connection or the fast path must not move, on the GPU host in about
# 5 minutes (the short form of check_fast_path.sh, check_rtt.sh and check_transports.sh, for a device call with
# little time left): the eager nanoGPT-class step over shm and over tcp (resumable, the default, and not:
# RGPU_SESSION_GRACE=0; the acknowledgements' cost is the ratio of the two ratios), the client's cost per streamed
# op and the 1,000-add chain, the 64 B round trips (shm/tcp, tcp/raw socket, resumable/plain), a 1 GiB upload and
# download over tcp and over shm, each beside its baseline in the same run; tests/test_uploads.py on the GPU; and
# greedy generation of a GPT-2-small-sized model beside native (rgpu bench generate: tokens/s and tokens equal).
#
#   OUT=/some/folder bash gpu/check_regress.sh      (the device tool sets $OUT)
#
# Writes $OUT/summary.txt (each step's rows, one line each) and $OUT/regress.tar.gz (a .json, .err, .rc per step).
BUDGET=${BUDGET:-420}
. "$(dirname "$0")/steps.sh"
install_rgpu
# without shm's C modules every shm figure below is its Python path's: say so where the summary is read
grep -q "^shm .*skipped" "$OUT/build.json" && echo "WARNING: shm's C modules were not built ($(grep '^shm' "$OUT/build.json" | sed 's/  */ /g')); carry .whl" | tee "$OUT/warning.txt"
step train 60 python3 -m rgpu.bench.train --json --repeats 3
step upload_tcp 50 env RGPU_TRANSPORT=tcp python3 -m rgpu.bench.upload --json --repeats 3 --sizes 1G
# the uploads' GPU tests (the ring, the pinned slots and receive blocks, registrations): values against the CPU's
step upload_tests 60 python3 -m pytest -q -p no:cacheprovider -rs "$REPO/tests/test_uploads.py" \
  "$REPO/tests/test_download_readback.py" "$REPO/tests/test_receive_pool.py"
step upload 40 python3 -m rgpu.bench.upload --json --repeats 3 --sizes 1G
step ops 40 python3 -m rgpu.bench.ops --json --repeats 3
step rtt 40 python3 -m rgpu bench transport --transport shm,tcp,tcp-resume --sizes 64 --repeats 7 --json
step train_tcp 60 env RGPU_TRANSPORT=tcp python3 -m rgpu.bench.train --json --repeats 3
step train_tcp_plain 60 env RGPU_TRANSPORT=tcp RGPU_SESSION_GRACE=0 python3 -m rgpu.bench.train --json --repeats 3
step generate 120 python3 -m rgpu.bench.generate --json --repeats 3
summarize train upload_tcp upload ops rtt train_tcp train_tcp_plain generate
{ echo "== upload_tests (rc $(cat "$OUT/upload_tests.rc"))"; tail -8 "$OUT/upload_tests.json"; } >>"$OUT/summary.txt" 2>&1
[ -f "$OUT/warning.txt" ] && cat "$OUT/warning.txt" >>"$OUT/summary.txt"
cat "$OUT/summary.txt"
pack regress.tar.gz
