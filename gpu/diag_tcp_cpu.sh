#!/usr/bin/env bash
# Where the CPU goes while the eager step runs over tcp and over shm on the GPU host: each CPU's user, system
# and softirq time (/proc/stat) and NET_RX softirqs (/proc/softirqs) around gpu/diag_client_step.py (client
# phase by phase, with the bench's --pin placement: which CPUs are the client's is in its JSON). Asks whether
# loopback TCP's kernel work lands on the client's cores. TF32 on. About 3 minutes; $OUT/tcp_cpu.tar.gz.
#
#   OUT=/some/folder bash gpu/diag_tcp_cpu.sh
BUDGET=${BUDGET:-200}
. "$(dirname "$0")/steps.sh"
export RGPU_TF32=1
install_rgpu
( cd /tmp && python3 -c 'from rgpu.bench import harness; print(harness.cpu_split())' ) >"$OUT/split.txt" 2>&1
for t in tcp shm; do
  cat /proc/stat >"$OUT/stat_before_$t.txt"; cat /proc/softirqs >"$OUT/softirqs_before_$t.txt"
  step client_$t 60 env RGPU_TRANSPORT=$t python3 "$REPO/gpu/diag_client_step.py" --steps 20
  cat /proc/stat >"$OUT/stat_after_$t.txt"; cat /proc/softirqs >"$OUT/softirqs_after_$t.txt"
done
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, os, sys
out = sys.argv[1]
def stat(path):
    rows = {}
    for line in open(path):
        f = line.split()
        if f[0].startswith("cpu") and f[0] != "cpu":
            rows[int(f[0][3:])] = [int(x) for x in f[1:8]]   # user nice system idle iowait irq softirq
    return rows
def netrx(path):
    lines = open(path).read().splitlines()
    for line in lines[1:]:
        f = line.split()
        if f[0] == "NET_RX:":
            return [int(x) for x in f[1:]]
    return []
print("split (client CPUs, server CPUs):", open(os.path.join(out, "split.txt")).read().strip())
for t in ("tcp", "shm"):
    a, b = stat(f"{out}/stat_before_{t}.txt"), stat(f"{out}/stat_after_{t}.txt")
    ra, rb = netrx(f"{out}/softirqs_before_{t}.txt"), netrx(f"{out}/softirqs_after_{t}.txt")
    print(t, "per CPU: user system softirq (ticks), NET_RX softirqs")
    for cpu in sorted(b):
        d = [y - x for x, y in zip(a[cpu], b[cpu])]
        n = rb[cpu] - ra[cpu] if cpu < len(rb) and cpu < len(ra) else -1
        print(f"  cpu{cpu:2d} {d[0]:6d} {d[2]:6d} {d[6]:6d} {n:8d}")
    try:
        r = json.load(open(f"{out}/client_{t}.json"))
        for side in ("rgpu", "native"):
            ph = r[side]["phases"]
            print(" ", side, {k: round(v["wall_ms"], 2) for k, v in ph.items()})
    except Exception as exc:
        print("  no client rows:", exc)
PY
pack tcp_cpu.tar.gz
