#!/usr/bin/env bash
# The eager step's timeline on the GPU host as client and server see it (gpu/diag_server_step.py: each
# message's time on the server, whether it found the GPU idle, the client's phases), over shm and tcp;
# the CPU topology the bench's --pin splits. TF32 on. About 3 minutes; everything in $OUT/server_step.tar.gz.
#
#   OUT=/some/folder bash gpu/diag_server_step.sh
BUDGET=${BUDGET:-300}
. "$(dirname "$0")/steps.sh"
export RGPU_TF32=1
install_rgpu
( lscpu; grep . /sys/devices/system/cpu/cpu*/topology/thread_siblings_list; python3 -c '
from rgpu.bench import harness; print("split", harness.cpu_split())' ) >"$OUT/topology.txt" 2>&1
step server_shm 90 env RGPU_TRANSPORT=shm python3 "$REPO/gpu/diag_server_step.py" --steps 12
step server_tcp 90 env RGPU_TRANSPORT=tcp python3 "$REPO/gpu/diag_server_step.py" --steps 12
for t in shm tcp; do python3 -c "
import json; d = json.load(open('$OUT/server_$t.json')); print('$t', json.dumps(d['median'], indent=0))
for s in d['steps'][:4]: print({k: s[k] for k in ('client_phases_ms', 'server_ms_by_kind', 'found_gpu_idle_by_phase', 'server_lag_at_client_phase_ends_ms')})
" 2>&1 | tee -a "$OUT/summary.txt"; done
pack server_step.tar.gz
