#!/usr/bin/env bash
# Where a streamed op's client time goes on the GPU host, per transport (tcp, shm, shm with posts written
# inline), and the 64 B round trip of each: $OUT/diag.json and the logs. About 2 minutes.
#   OUT=/some/folder bash gpu/diag_client.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
unset RGPU_SERVER RGPU_TRANSPORT
[ -z "${SKIP_INSTALL:-}" ] && python3 -m pip install --no-deps --no-build-isolation -q . >"$OUT/install.log" 2>&1
cd /tmp
python3 -c 'import torch, rgpu; torch.ones(2, device="rgpu").cpu()' >"$OUT/warm.log" 2>&1
for variant in tcp shm shm_inline; do
  t=${variant%_inline}
  RGPU_TRANSPORT=$t timeout 60 python3 -c "
import sys
from rgpu.transport import shm
shm.ShmTransport.posts_inline = '$variant'.endswith('inline')
from rgpu.bench import client_profile
r = client_profile.rows(type('A', (), {'ops': 5000})())
r[0]['variant'] = '$variant'
import json; print(json.dumps(r[0]))" >>"$OUT/profile.jsonl" 2>>"$OUT/profile.err"
done
cat "$OUT/profile.jsonl"
for variant in tcp shm shm_inline; do
  t=${variant%_inline}
  RGPU_TRANSPORT=$t timeout 60 python3 -c "
from rgpu.transport import shm
shm.ShmTransport.posts_inline = '$variant'.endswith('inline')
from rgpu.bench import ops
import json; print(json.dumps({'variant': '$variant', 'rows': ops.rows(type('A', (), {'repeats': 5})())}))" \
    >>"$OUT/ops.jsonl" 2>>"$OUT/ops.err"
done
timeout 90 python3 -m rgpu bench transport --transport shm --sizes 64 --repeats 5 --json >"$OUT/rtt_shm.json" 2>"$OUT/rtt.err"
grep -h '"value"\|"metric"\|ratio"' "$OUT/rtt_shm.json" | head -30
python3 -c '
import json
for l in open("'$OUT'/ops.jsonl"):
    d = json.loads(l)
    print(d["variant"], [(r["metric"][:30], round(r["value"], 2), round(r["baseline"], 2)) for r in d["rows"][:2]])'
