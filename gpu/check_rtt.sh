#!/usr/bin/env bash
# The 64 B round trip on the GPU host: rgpu over shm and tcp (the bench's row), each side's Python cost,
# tcp with its reads sleeping, and the host's floor without rgpu (tools/diag/probe_rtt_floor.py).
#
#   OUT=/some/folder bash gpu/check_rtt.sh      (the device tool sets $OUT; about 2 minutes)
#
# Writes $OUT/summary.txt and $OUT/rtt.tar.gz: every step's output (host.json, floor.json, transport_shm.json:
# rgpu bench transport --transport shm --sizes 64, its rtt row carrying rgpu tcp's in the same run;
# transport_tcp_resume.json: tcp beside the raw socket and the tcp-resume row (resumable vs plain);
# lone_call.json; rtt_variants.jsonl: shm and tcp with tcp's reads polling and sleeping, RGPU_TCP_SPIN_US set
# in both processes; rtt_interleaved.json: both sessions open, slices alternating as the bench does), a
# .err and .rc per step (gpu/steps.sh).
BUDGET=${BUDGET:-300}
. "$(dirname "$0")/steps.sh"
stamp install
python3 -m pip install --no-deps --no-build-isolation -q "$REPO" >"$OUT/install.log" 2>&1
PY=python3
HERE=$REPO
step host 90 "$PY" -c '
import json, os, sys
from rgpu.transport import shm_fast
m = shm_fast.load()
import timeit, time
clock = open("/sys/devices/system/clocksource/clocksource0/current_clocksource").read().strip()
print(json.dumps({"clocksource": clock, "perf_counter_ns": timeit.timeit(time.perf_counter, number=200000) / 2e5 * 1e9}))
print(json.dumps({"python": sys.version, "cores": len(os.sched_getaffinity(0)),
                  "shm_c": "built" if m else f"not built: {shm_fast.why_not()}",
                  "native": getattr(getattr(m, "native", None), "__file__", None)}))'
step floor 60 "$PY" "$HERE/tools/diag/probe_rtt_floor.py" --json
step transport_shm 90 "$PY" -m rgpu bench transport --transport shm --sizes 64 --repeats 5 --json
# tcp's round trip beside the raw socket, and a resumable session's (the default) beside a plain one's
# (RGPU_SESSION_GRACE=0) in the same run (bench/transport_resume.py)
step transport_tcp_resume 90 "$PY" -m rgpu bench transport --transport tcp,tcp-resume --sizes 64 --repeats 9 --json
step lone_call 40 "$PY" "$HERE/tools/diag/diag_lone_call.py"
D=$(mktemp -d)
cat >"$D/sitecustomize.py" <<'PY'
import os
if os.environ.get("DIAG_TCP_SPIN_US"):   # the bench's server drops RGPU_* from its env: set it in both here
    os.environ["RGPU_TCP_SPIN_US"] = os.environ["DIAG_TCP_SPIN_US"]
PY
for spin in "" 0; do
  step "rtt_tcp_spin_${spin:-default}" 60 env PYTHONPATH="$D:$PYTHONPATH" DIAG_TCP_SPIN_US="$spin" "$PY" -c "
import json, os, statistics, time
from rgpu.bench import harness
from rgpu.bench.transport import RgpuEcho
split = harness.cpu_split()
srv = harness.LocalServer(cpus=split[1] if split else None)
if split:
    os.sched_setaffinity(0, split[0])
out = {'tcp_spin_us': os.environ.get('RGPU_TCP_SPIN_US', 'default')}
for t in ('shm', 'tcp'):
    b = RgpuEcho(t, srv.address, srv.token)
    for _ in range(2000): b.ping()
    runs = []
    for _ in range(5):
        times = []
        for _ in range(3000):
            t0 = time.perf_counter(); b.ping(); times.append(time.perf_counter() - t0)
        times.sort()
        runs.append(times[len(times) // 2] * 1e6)
    out[t] = statistics.median(runs)
    b.close()
out['ratio'] = out['shm'] / out['tcp']
srv.stop()
print(json.dumps(out))"
  tail -n 1 "$OUT/rtt_tcp_spin_${spin:-default}.json" >>"$OUT/rtt_variants.jsonl"
done
# the bench alternates slices of shm and tcp pings with both sessions open: the same here, then each alone
step rtt_interleaved 60 "$PY" -c "
import json, os, statistics, time
from rgpu.bench import harness
from rgpu.bench.transport import RgpuEcho
split = harness.cpu_split()
srv = harness.LocalServer(cpus=split[1] if split else None)
if split:
    os.sched_setaffinity(0, split[0])
ends = {t: RgpuEcho(t, srv.address, srv.token) for t in ('shm', 'tcp')}
def run(b, k):
    times = []
    for _ in range(k):
        t0 = time.perf_counter(); b.ping(); times.append(time.perf_counter() - t0)
    times.sort()
    return times[k // 2] * 1e6
for warm in (200, 2000):
    for b in ends.values():
        for _ in range(warm): b.ping()
    got = {t: [] for t in ends}
    for _ in range(15):
        for t, b in ends.items():
            got[t].append(run(b, 1600))
    out = {'warm': warm, 'mode': 'interleaved', **{t: statistics.median(v) for t, v in got.items()}}
    out['ratio'] = out['shm'] / out['tcp']
    print(json.dumps(out))
out = {'mode': 'one after the other, both open', **{t: statistics.median([run(b, 3000) for _ in range(5)]) for t, b in ends.items()}}
out['ratio'] = out['shm'] / out['tcp']
print(json.dumps(out))
for b in ends.values():
    b.close()
srv.stop()"
"$PY" - "$OUT" <<'PYEOF' >"$OUT/summary.txt" 2>&1
import json, sys
out = sys.argv[1]
for name in ("host.json", "floor.json", "rtt_variants.jsonl", "rtt_interleaved.json"):
    try:
        print(name, open(f"{out}/{name}").read().strip())
    except OSError as exc:
        print(name, "missing", exc)
for name in ("transport_shm", "transport_tcp_resume"):
    try:
        for r in json.load(open(f"{out}/{name}.json")):
            print(f"{r['transport']} {r['metric']} {r.get('direction') or ''} {r.get('size')} {r['value']:.3f} {r['unit']} "
                  f"vs {r['baseline']:.3f} ({r['baseline_name']}) ratio {r['ratio']:.3f} {r.get('ratio_spread')}")
    except (OSError, ValueError) as exc:
        print(f"{name}: no rows", exc)
print(open(f"{out}/lone_call.json").read()[-400:])
PYEOF
cat "$OUT/summary.txt"
pack rtt.tar.gz
