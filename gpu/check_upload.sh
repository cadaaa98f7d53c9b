#!/usr/bin/env bash
# The 1 GiB upload and download alone, with more runs than check_regress.sh gives them: over shm (pinned and
# ordinary memory, against the same host's H2D copies) and over tcp, each beside its baseline in the same run.
# About 2 minutes with the native build; carry .whl/ (without cffi shm runs its Python path).
#
#   OUT=/some/folder REPEATS=7 bash gpu/check_upload.sh     (the device tool sets $OUT)
#
# Results: $OUT/summary.txt, $OUT/upload.tar.gz.
BUDGET=${BUDGET:-240}
. "$(dirname "$0")/steps.sh"
install_rgpu
step upload 100 python3 -m rgpu.bench.upload --json --repeats "${REPEATS:-7}" --sizes 1G
step upload_tcp 60 env RGPU_TRANSPORT=tcp python3 -m rgpu.bench.upload --json --repeats 3 --sizes 1G
summarize upload upload_tcp
pack upload.tar.gz
