#!/usr/bin/env bash
# The server's C++ op path (RGPU_SERVER_C) and whole uploads through a pinned ring on the GPU host: the
# GPU tests of both; where the server's time per message goes without a profiler (diag_replay.py: the
# recorded messages of eager steps replayed on each path, the ops' own time beside them); the client's
# cost of a small upload (diag_small_upload.py); then the eager and compiled (reduce-overhead) training
# steps with TF32 on and --pin over shm (also with a 20 ms spin: waits that keep their core, as CUDA's
# own synchronize does on a host with more cores than GPUs) and tcp. About 8 minutes; everything in
# $OUT/server_c.tar.gz beside summary.txt.
#
#   OUT=/some/folder bash gpu/check_server_c.sh
BUDGET=${BUDGET:-470}
. "$(dirname "$0")/steps.sh"
export RGPU_TF32=1
TRAIN="python3 -m rgpu.bench.train --json --repeats 5 --pin"
install_rgpu
step tests 90 python3 -m pytest -q -p no:cacheprovider -m gpu -k "fast_op or uploads or cuda_graphs" \
  "$REPO/tests/test_server_fast_op.py" "$REPO/tests/test_uploads.py" "$REPO/tests/test_cuda_graphs.py"
step replay 100 python3 "$REPO/gpu/diag_replay.py" --steps 5
step upload_shm 30 python3 "$REPO/gpu/diag_small_upload.py" shm
step upload_tcp 30 python3 "$REPO/gpu/diag_small_upload.py" tcp
step shm 110 env RGPU_TRANSPORT=shm $TRAIN --compile reduce-overhead
step shm_spin 60 env RGPU_TRANSPORT=shm RGPU_SHM_SPIN_US=20000 $TRAIN
step tcp 100 env RGPU_TRANSPORT=tcp $TRAIN --compile reduce-overhead
summarize shm shm_spin tcp
python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
out = sys.argv[1]
try:
    d = json.load(open(f"{out}/replay.json"))
    for k in ("cpp", "python"):
        v = d[k]
        print(f"replay {k:6s} {v['op_messages_per_step']:.0f} op messages/step: {v['us_per_op_message']:.1f} us each, "
              f"in the op itself {v['aten_us_per_op_message'] or float('nan'):.1f} us; OP {v['ms_per_step_by_kind']['OP']:.2f} ms/step")
    print(f"replay msgpack pack+unpack {d['msgpack_pack_unpack_us_per_message']:.1f} us/message")
except Exception as exc:
    print("replay:", type(exc).__name__, exc)
for t in ("shm", "tcp"):
    try:
        d = json.load(open(f"{out}/upload_{t}.json"))
        print(f"small upload {t}: {d['upload_us_after_idle']:.0f} us after idle, {d['upload_us_back_to_back']:.0f} back to back, copy {d['copy_us']}")
    except Exception as exc:
        print(f"small upload {t}:", type(exc).__name__, exc)
PY
pack server_c.tar.gz
