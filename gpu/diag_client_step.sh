#!/usr/bin/env bash
# Where the client's time goes in the eager step on the GPU host, rgpu (shm, tcp) beside native, phase by
# phase (gpu/diag_client_step.py: wall, main-thread and process CPU, each thread's CPU, the fast path's
# counts, a cProfile); the bench's eager step over shm for the same instance's ratio; the 64 B round trip
# over shm against rgpu's tcp (issue 4). TF32 on, --pin. About 5 minutes; everything in $OUT/client_step.tar.gz.
#
#   OUT=/some/folder bash gpu/diag_client_step.sh
BUDGET=${BUDGET:-400}
. "$(dirname "$0")/steps.sh"
export RGPU_TF32=1
install_rgpu
step client_shm 90 env RGPU_TRANSPORT=shm python3 "$REPO/gpu/diag_client_step.py" --profile
step client_tcp 90 env RGPU_TRANSPORT=tcp python3 "$REPO/gpu/diag_client_step.py" --profile
step rtt 60 python3 -m rgpu bench transport --transport shm --sizes 64 --repeats 5 --json
step shm 80 env RGPU_TRANSPORT=shm python3 -m rgpu.bench.train --json --repeats 5 --pin
python3 - "$OUT" <<'PY' | tee "$OUT/client_summary.txt"
import json, os, sys
for name in ("client_shm", "client_tcp"):
    try:
        d = json.load(open(os.path.join(sys.argv[1], name + ".json")))
    except Exception as exc:
        print(name, "no result", exc)
        continue
    for side, r in d.items():
        print(name, side, "steps ms", r["per_step_ms"])
        for ph, v in r["phases"].items():
            print(f"  {ph:10s} wall {v['wall_ms']:8.2f}  main cpu {v['main_cpu_ms']:8.2f}  process cpu {v['process_cpu_ms']:8.2f}")
        print("  threads (ms cpu/step)", r["threads_cpu_ms_per_step"])
        print("  fast path", r.get("fast_path_per_step"), "messages", r.get("messages_per_step"))
        for row in r.get("profile_us_per_step", [])[:20]:
            print("   ", row)
PY
summarize rtt shm
pack client_step.tar.gz
