#!/usr/bin/env bash
# The 64 B round trip over shm on the GPU host on shm's C path and its Python path (RGPU_SHM_C) and with
# other spin settings (busy = keep the core, then yield until spin, then sleep), beside tcp; a
# sitecustomize sets them in client and server alike. About 1 minute.
#   OUT=/some/folder bash gpu/diag_rtt.sh        (rgpu installed)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
D=$(mktemp -d)
cat >"$D/sitecustomize.py" <<'PY'
import os
if os.environ.get("DIAG_SHM_C"):
    os.environ["RGPU_SHM_C"] = os.environ["DIAG_SHM_C"]   # the bench's server drops RGPU_* from its env
if os.environ.get("DIAG_BUSY_US"):
    from rgpu.transport import shm
    shm.ShmTransport.busy_s = float(os.environ["DIAG_BUSY_US"]) * 1e-6
    shm.ShmTransport.spin_s = float(os.environ["DIAG_SPIN_US"]) * 1e-6
PY
cd /tmp
for v in "1 20 100" "0 20 100" "1 100 200" "1 0 100"; do
  set -- $v
  PYTHONPATH=$D DIAG_SHM_C=$1 DIAG_BUSY_US=$2 DIAG_SPIN_US=$3 timeout 60 python3 -c "
import json, statistics, time
from rgpu.bench import harness
from rgpu.bench.transport import RgpuEcho
srv = harness.LocalServer()
out = {'shm_c': $1, 'busy_us': $2, 'spin_us': $3}
for t in ('shm', 'tcp'):
    b = RgpuEcho(t, srv.address, srv.token)
    for _ in range(2000): b.ping()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(3000): b.ping()
        runs.append((time.perf_counter() - t0) / 3000 * 1e6)
    out[t] = statistics.median(runs)
    b.close()
out['ratio'] = out['shm'] / out['tcp']
srv.stop()
print(json.dumps(out))" >>"$OUT/rtt_variants.jsonl" 2>>"$OUT/rtt_variants.err"
done
cat "$OUT/rtt_variants.jsonl"
