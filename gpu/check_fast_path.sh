#!/usr/bin/env bash
# The fast path on the GPU host, whole, in about 6 minutes; everything lands in $OUT.
#
#   OUT=/some/folder bash gpu/check_fast_path.sh     (or: bash gpu/run_all.sh fast_path)
#
#   install   rgpu installed (not editable) and run from /tmp, so ./rgpu never shadows it
#   warm      the C++ part built against this torch (cold, timed) and a first op on the GPU server
#   train     rgpu bench train (default transport: shm on one host): the eager step vs native CUDA eager,
#             round trips, warm-up losses vs native
#   upload    rgpu bench upload (1 GiB up from pinned and from ordinary memory, and down, each beside its
#             native copy), shm, later tcp
#   ops       rgpu bench ops (client cost per streamed op vs native CUDA enqueue; the 1,000-add chain vs native)
#   server_ops rgpu bench server_ops (the server's cost per op message in-process, split: decode, table, call, bind)
#   rtt       rgpu bench rtt: a chain of 200 ops and one wait behind a simulated round trip vs 0 ms + 1 RTT
#   profile   python -m rgpu.bench.client_profile over shm, then tcp: a streamed op's time by thread and process
#   train_compiled  RGPU_TRANSPORT=tcp rgpu bench train --compile: the eager step over tcp, the compiled
#             step (Inductor on the server: its first step compiles) with its client, wait and server times,
#             native torch.compile as its reference, graphs and how the server runs them, losses vs native
#   train_rtt rgpu bench train --sim-rtt 1,10,30: eager steps behind a simulated round trip vs 0 ms + 1 RTT
#   then, while time is left: the compiled step in reduce-overhead mode (small preset), and
#             the GPU test of tests/test_compile.py (Inductor on the server, losses vs native CUDA)
#   summary   $OUT/fast_path.json: each target of the fast-path issue beside its figure
# Each step has its own time limit, so one that hangs costs only itself. QUICK=1 SKIP_INSTALL=1: the
# benches' --quick presets with the rgpu already installed (a dry run of the script on a machine without a GPU).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-350}      # seconds for the whole script
Q=${QUICK:+--quick}
T0=$(date +%s)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
unset RGPU_SERVER RGPU_TRANSPORT RGPU_SIM_RTT_MS
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/log.txt"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
step() {  # step NAME LIMIT_S COMMAND...: stdout to $OUT/NAME.json, stderr to $OUT/NAME.err, run from /tmp
  local name=$1 limit=$2; shift 2
  local budget; budget=$(left)
  if [ "$budget" -lt 20 ]; then stamp "skip $name (no time left)"; echo skipped >"$OUT/$name.rc"; return; fi
  [ "$limit" -gt "$budget" ] && limit=$budget
  stamp "$name (limit $limit s)"
  ( cd /tmp && timeout "$limit" "$@" >"$OUT/$name.json" 2>"$OUT/$name.err" )
  echo $? >"$OUT/$name.rc"
  tail -c 1500 "$OUT/$name.json"; echo; tail -n 3 "$OUT/$name.err"
}

stamp install
if [ -z "${SKIP_INSTALL:-}" ]; then  # SKIP_INSTALL=1: use what is installed (a dry run beside an editable install)
  python3 -m pip install --no-deps --no-build-isolation -q . >"$OUT/install.log" 2>&1; tail -3 "$OUT/install.log"
fi
REPO=$PWD
export PYTHONPATH=$REPO/examples/nanogpt  # the benches' model (examples/ is not installed); rgpu comes from site-packages
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$OUT/gpu.txt" 2>&1

step warm 150 python3 -c '
import json, sys, time
t0 = time.perf_counter()
import torch, rgpu
from rgpu.device_backend import build
build.load(); built = time.perf_counter() - t0
x = torch.randn(256, 256); y = x.to("rgpu")
err = float(((y @ y).relu().cpu() - (x @ x).relu()).abs().max())
print(json.dumps({"torch": torch.__version__, "build_and_import_s": built, "first_use_s": time.perf_counter() - t0,
                  "matmul_err": err, "device": torch.rgpu.get_device_name()}))'

step train 80 python3 -m rgpu.bench.train --json --repeats 5 $Q
step upload 60 python3 -m rgpu.bench.upload --json --repeats 5 $Q
step ops 60 python3 -m rgpu.bench.ops --json --repeats 5 $Q
step server_ops 60 python3 -m rgpu.bench.server_ops --json --repeats 5 $Q   # the server's cost per op message, split
step rtt 40 python3 -m rgpu.bench.rtt --json --sim-rtt 1,10,30 --repeats 7 $Q
step profile 40 python3 -m rgpu.bench.client_profile --json --ops 5000
step profile_tcp 40 env RGPU_TRANSPORT=tcp python3 -m rgpu.bench.client_profile --json --ops 5000
step train_compiled 220 env RGPU_TRANSPORT=tcp python3 -m rgpu.bench.train --json --compile --repeats 5 $Q
step train_rtt 90 python3 -m rgpu.bench.train --json --sim-rtt 1,10,30 --repeats 5 $Q
step upload_tcp 50 env RGPU_TRANSPORT=tcp python3 -m rgpu.bench.upload --json --repeats 3 $Q
step train_reduce_overhead 120 env RGPU_TRANSPORT=tcp python3 -m rgpu.bench.train --json --quick --compile reduce-overhead --repeats 5
step tests 100 python3 -m pytest -q -p no:cacheprovider -rs "$REPO/tests/test_compile.py" -k on_a_gpu_server  # text

stamp summary
python3 - "$OUT" >"$OUT/fast_path.json" 2>"$OUT/summary.err" <<'PY'
import json, os, sys
out = sys.argv[1]

def rows(name):
    try:
        with open(os.path.join(out, name + ".json")) as f:
            return json.load(f)
    except Exception as exc:  # a step that failed or was skipped
        return [{"error": f"{name}: {type(exc).__name__}: {exc}"}]

def pick(name, prefix):
    for r in rows(name):
        if str(r.get("metric", "")).startswith(prefix):
            return r
    return None

def line(figure, target, r, name):
    if r is None:
        return {"figure": figure, "target": target, "from": name, "value": None}
    return {"figure": figure, "target": target, "from": name, "metric": r.get("metric"), "transport": r.get("transport"),
            "value": r.get("value"), "unit": r.get("unit"), "baseline": r.get("baseline"),
            "baseline_name": r.get("baseline_name"), "ratio": r.get("ratio"), "spread": r.get("spread"),
            **({"server_pieces": r["server_pieces"]} if "server_pieces" in r else {})}

summary = [
    line("rgpu eager step / native CUDA eager step", "<= 1.10", pick("train", "training step"), "train"),
    line("rgpu eager step / native CUDA eager step (tcp)", "<= 1.10", pick("train_compiled", "training step"),
         "train_compiled"),
    line("rgpu compiled step / native CUDA eager step (tcp)", "<= 0.90",
         pick("train_compiled", "training step, torch.compile"), "train_compiled"),
    line("native CUDA compiled step / native eager (reference)", "", pick("train_compiled", "native CUDA step"),
         "train_compiled"),
    line("compiled step (reduce-overhead, small preset) / native eager", "",
         pick("train_reduce_overhead", "training step, torch.compile"), "train_reduce_overhead"),
    line("client cost per streamed op / native CUDA enqueue", "<= 1.0", pick("ops", "client cost per streamed op"), "ops"),
    line("server cost per op message, C++ path", "", pick("server_ops", "server cost per op message, C++ op path"), "server_ops"),
    line("chain of 1000 adds ending in .cpu() / native", "<= 1.5", pick("ops", "chain of 1000 adds"), "ops"),
    line("1 GiB upload into GPU memory / pinned host-to-device copy", ">= 0.50",
         pick("upload", "upload from pinned memory"), "upload"),
    line("1 GiB upload from ordinary memory / pageable host-to-device copy", "recorded",
         pick("upload", "upload from ordinary memory"), "upload"),
    line("1 GiB download (.cpu()) / native .cpu()", "recorded", pick("upload", "download"), "upload"),
    line("1 GiB upload over tcp, pinned / pinned host-to-device copy", "recorded",
         pick("upload_tcp", "upload from pinned memory"), "upload_tcp"),
    line("1 GiB upload over tcp, ordinary / pageable host-to-device copy", "recorded",
         pick("upload_tcp", "upload from ordinary memory"), "upload_tcp"),
    line("1 GiB download over tcp / native .cpu()", "recorded", pick("upload_tcp", "download"), "upload_tcp"),
]
for ms in ("1", "10", "30"):
    for what in ("training step",):
        summary.append(line(f"{what} at {ms} ms / (at 0 ms + 1 RTT)", "<= 1.10",
                            pick("train_rtt", f"{what} at a simulated {ms} ms"), "train_rtt"))
    summary.append(line(f"chain of 200 ops + one wait at {ms} ms / (at 0 ms + 1 RTT)", "~1",
                        pick("rtt", f"chain of 200 ops and one wait at {ms} ms"), "rtt"))
for name, prefix in (("train", "round trips per step"), ("train_compiled", "round trips per compiled step"),
                     ("train_compiled", "messages per compiled step"), ("train", "messages per step"),
                     ("train_compiled", "client time to enqueue a compiled step"),
                     ("train_compiled", "wait at loss.item(), compiled"), ("train_compiled", "server time per compiled"),
                     ("train", "client time to enqueue a step"), ("train", "wait at loss.item()"),
                     ("train_compiled", "graphs shipped"), ("train", "max |loss - native loss| over 3 warm-up steps"),
                     ("train_compiled", "max |loss - native loss| over 3 warm-up steps, compiled")):
    summary.append(line(prefix, "", pick(name, prefix), name))
print(json.dumps(summary, indent=1))
PY
python3 - "$OUT/fast_path.json" <<'PY'
import json, sys
for s in json.load(open(sys.argv[1])):
    v, r = s.get("value"), s.get("ratio")
    print(f"{s['figure'][:62]:62s} {'-' if v is None else format(v, '.4g'):>10} {s.get('unit') or '':5s}"
          f" ratio {'-' if r is None else format(r, '.3f'):>6}  target {s['target']}")
PY
stamp done
