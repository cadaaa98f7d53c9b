#!/usr/bin/env bash
# The fast-path issue's other rows on the GPU host with today's tree, in about 5 minutes (the eager and
# compiled steps: gpu/check_step_start.sh): client cost per streamed op vs native enqueue, 1 GiB upload
# over shm vs pinned host-to-device, the eager step behind a simulated 1/10/30 ms round trip vs 0 ms + 1 RTT,
# and the eager step over shm without TF32 (the issue's default). Everything in $OUT/targets.tar.gz.
#
#   OUT=/some/folder bash gpu/check_targets.sh
BUDGET=${BUDGET:-330}
. "$(dirname "$0")/steps.sh"
install_rgpu
step ops 60 python3 -m rgpu.bench.ops --json --repeats 5
step upload 60 python3 -m rgpu.bench.upload --json --repeats 5
step train 80 python3 -m rgpu.bench.train --json --repeats 5 --pin
step train_rtt 100 python3 -m rgpu.bench.train --json --sim-rtt 1,10,30 --repeats 5
summarize ops upload train train_rtt
pack targets.tar.gz
