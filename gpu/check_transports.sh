#!/usr/bin/env bash
# tcp and shm on the GPU host (16 cores): `rgpu bench transport` rows, the parallel copy beside copyto, shm tests.
#
#   OUT=/some/folder bash gpu/check_transports.sh      (the device tool sets $OUT; about 4 minutes, at most 7.5:
#   on a fresh host the first shm test builds the C modules and compiles the numba copy, ~30 s)
#
# Writes to $OUT: transport_tcp.json and transport_shm.json (rgpu bench transport --json: bandwidth up and down
# from 64 B to 256 MiB and the 64 B round trip; tcp beside a raw socket, shm beside one-thread numpy.copyto and
# rgpu tcp) with a plot each, copy.json (numba prange copy beside numpy.copyto, 4-256 MiB: whether fastcopy's
# parallel copy wins here), streams.json (rgpu bench streams: 256 MiB and 1 GiB up and down over tcp on one stream
# and on 4 (RGPU_TCP_STREAMS) beside one raw socket, and TLS over 4 beside plain tcp on 4; STREAMS=8 for 8),
# lan_{10,25}gbit_x{1,4}.json (the namespace LAN at 10 and 25 Gbit/s on 1 and 4 tcp streams, where root),
# host.json, summary.txt, one log and one .rc per step. No UCXX there: no ucx rows.
# A failed step is recorded and the next one still runs.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rgpu-transports}
mkdir -p "$OUT"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
PY=$(command -v python3 || command -v python)   # the GPU host has python3, maybe no `python`
T0=$(date +%s)
BUDGET=${BUDGET:-460}   # seconds for the whole script: no step runs past it
step() {  # step NAME TIMEOUT_S COMMAND...: output to $OUT/NAME.log, status to $OUT/NAME.rc
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  (( limit > left )) && limit=$left
  echo "== $name ($(( $(date +%s) - T0 )) s, at most $limit s)"
  if (( limit < 5 )); then echo "out of time" >"$OUT/$name.log"; echo skipped >"$OUT/$name.rc"; return; fi
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo $? >"$OUT/$name.rc"
  tail -n 5 "$OUT/$name.log"
}

step install 60 "$PY" -m pip install --no-deps --no-build-isolation -e .
step host 20 "$PY" -c '
import json, os, platform, sys
info = {"python": sys.version, "cores": len(os.sched_getaffinity(0)), "machine": platform.machine(),
        "kernel": platform.release(), "infiniband": sorted(os.listdir("/sys/class/infiniband"))
        if os.path.isdir("/sys/class/infiniband") else []}
try:
    import numba
    info["numba"] = numba.__version__
except ImportError as exc:
    info["numba"] = f"absent: {exc}"
from rgpu.transport import fastcopy, negotiate, shm_fast
info["shm"] = negotiate.unavailable("shm") or "available"
info["shm_c"] = "built" if shm_fast.load() else f"not built: {shm_fast.why_not()}"   # the C path (cffi)
info["ucx"] = negotiate.unavailable("ucx") or "available"
info["fastcopy"] = fastcopy.backend()
print(json.dumps(info))'
tail -n 1 "$OUT/host.log" >"$OUT/host.json"

# the figures: rows as JSON on stdout, the plot beside them; one run per transport so that a slow one
# leaves the other's rows (shm's rtt row carries its own rgpu tcp baseline)
SIZES=${SIZES:-64,64K,1M,16M,64M,256M}
step transport_tcp 60 bash -c "'$PY' -m rgpu bench transport --transport tcp --sizes $SIZES --repeats 5 --json \
  --plot '$OUT/transport_tcp.png' >'$OUT/transport_tcp.json'"
step transport_shm 60 bash -c "'$PY' -m rgpu bench transport --transport shm --sizes $SIZES --repeats 5 --json \
  --plot '$OUT/transport_shm.png' >'$OUT/transport_shm.json'"
# big transfers on several tcp streams: 1 vs 4 (STREAMS=8: 8) beside one raw socket; TLS over them vs plain
STREAM_SIZES=${STREAM_SIZES:-256M,1G}
step streams 220 bash -c "'$PY' -m rgpu.bench.streams --streams ${STREAMS:-4} --tls --sizes $STREAM_SIZES --repeats 3 \
  --json >'$OUT/streams.json'"
step copy 25 bash -c "'$PY' -m rgpu.bench.transport_fast --copy --repeats 5 --json >'$OUT/copy.json'"

# the shm tests where pytest (and the suite's own needs) are there; skipped, with the reason, otherwise
if "$PY" -c "import pytest, hypothesis" 2>/dev/null; then
  step tests 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_transport_shm.py tests/test_transport_contract.py \
    tests/test_transport_select.py tests/test_shm_lone.py tests/test_exchange.py tests/test_tcp_streams.py
else
  echo "pytest or hypothesis missing: shm tests not run here" >"$OUT/tests.log"; echo skipped >"$OUT/tests.rc"
fi

# the namespace LAN (root, `ip`): tcp on 1 and on 4 streams at 10 and 25 Gbit/s beside a raw socket there,
# with what is left of the budget (rows carry tcp_streams)
if "$PY" -c "from rgpu.bench import netns; import sys; sys.exit(1 if netns.unavailable() else 0)" 2>/dev/null; then
  for rate in 10gbit 25gbit; do
    for n in 1 4; do
      step "lan_${rate}_x$n" 45 env RGPU_TCP_STREAMS=$n bash -c "'$PY' -m rgpu bench transport --netns --rate $rate \
        --transport tcp --sizes 256M --repeats 3 --json >'$OUT/lan_${rate}_x$n.json'"
    done
  done
else
  echo "no network namespaces here (root and ip needed): no LAN rows" >"$OUT/lan.log"
fi

"$PY" - "$OUT" <<'EOF' >"$OUT/summary.txt" 2>&1
import json, sys
out = sys.argv[1]
lans = [f"lan_{r}_x{n}" for r in ("10gbit", "25gbit") for n in (1, 4)]
for name in ("transport_tcp", "transport_shm", "streams", "copy", *lans):
    try:
        rows = json.load(open(f"{out}/{name}.json"))
    except (OSError, ValueError) as exc:
        print(f"{name}: no rows ({exc})")
        continue
    print(f"== {name}")
    for r in rows:
        size = r.get("size")
        print(f"{r['transport']:12} {r['metric']:10} {r.get('direction') or '':8} {size!s:>10} "
              f"{r['value']:10.3f} {r['unit']:5} vs {r['baseline']:10.3f} ({r['baseline_name']}) ratio {r['ratio']:.3f}")
EOF
cat "$OUT/summary.txt"
echo "done in $(( $(date +%s) - T0 )) s"
