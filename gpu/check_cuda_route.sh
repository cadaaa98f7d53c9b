#!/usr/bin/env bash
# The CUDA route on a GPU host: rgpu's libcuda.so.1 in front of the real driver, through `rgpu serve --cuda-driver real`.
#
#   OUT=/some/folder bash gpu/check_cuda_route.sh        (the device tool sets $OUT; finishes in under 8 minutes)
#
# Writes $OUT/cuda_route.json (summary) and one log per step. Steps: install cffi (wheel) and rgpu; check
# libpython is shared; build rgpu's native parts (`rgpu build`) and find the interceptor; start the server on the real driver; run the CUDA C demo natively
# and through the interceptor; run numba-cuda kernels through it (both driver bindings); the GPU-marked test;
# `rgpu bench cuda --json`. A failed step is recorded and the next one still runs.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rgpu-cuda-route}
mkdir -p "$OUT"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
PY=$(command -v python3 || command -v python)   # the GPU host has python3, maybe no `python`
T0=$(date +%s)
step() {  # step NAME TIMEOUT_S COMMAND...: output to $OUT/NAME.log, status to $OUT/NAME.rc
  local name=$1 limit=$2; shift 2
  echo "== $name ($(( $(date +%s) - T0 )) s)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo $? >"$OUT/$name.rc"
  tail -n 5 "$OUT/$name.log"
}

# cffi and pycparser come as wheels (not installed on the GPU host); then rgpu itself
step install 180 bash -c "$PY -m pip install --no-deps wheels/*.whl; $PY -m pip install --no-deps --no-build-isolation -e ."
step python 30 "$PY" -c '
import json, sys, sysconfig, subprocess
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
except OSError as exc:
    smi = f"nvidia-smi: {exc}"
print(json.dumps({"python": sys.version, "shared": sysconfig.get_config_var("Py_ENABLE_SHARED"),
                  "libpython": sysconfig.get_config_var("INSTSONAME"), "nvidia_smi": smi}))'
step native 300 "$PY" -m rgpu build            # every native part ahead, one line each (the CUDA route's among them)
step build 120 "$PY" -m rgpu intercept build   # cached by now: prints the library's path
LIB=$(grep -o '/[^ ]*libcuda\.so\.1$' "$OUT/build.log" | tail -n 1)
LIBDIR=$(dirname "$LIB")
nm -D --defined-only "$LIB" | grep -c ' T cu' >"$OUT/exports.txt" 2>&1

# the server, on the real driver, on a free port, with a token of our own
export RGPU_TOKEN=gpu-check-$RANDOM$RANDOM
# CHECK_DRIVER=fake runs this script on a machine without a GPU (a dry run of the script itself)
"$PY" -m rgpu serve --port 0 --cuda-driver "${CHECK_DRIVER:-real}" --preload "" >"$OUT/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 100); do grep -q "listening on" "$OUT/server.log" && break; sleep 0.2; done
export RGPU_SERVER=$(grep -o "listening on [^;]*" "$OUT/server.log" | head -1 | awk '{print $3}')
echo "server $RGPU_SERVER (pid $SERVER_PID)"

step demo_build 60 "$PY" -c "
from rgpu.cuda_intercept.demo import build_program
print(build_program('$LIBDIR', '$LIBDIR'))"
DEMO=$(tail -n 1 "$OUT/demo_build.log")
step demo_native 60 "$DEMO"
step demo_rgpu 120 "$PY" -m rgpu intercept run -- "$DEMO"

cat >"$OUT/numba_kernels.py" <<'EOF'
"""numba-cuda kernels through rgpu's libcuda.so.1: arrays both ways, values against numpy."""
import json, math, sys
import numpy as np
# numba-cuda on the GPU host does overload(np.row_stack) in numba.cuda.np.arrayobj (imported at the first
# kernel compile), and numpy 2.5 removed np.row_stack (an alias of np.vstack): without this every kernel
# fails to compile, natively and through rgpu alike (AttributeError, run of 2026-11-30; devices and copies
# through rgpu worked). Put the alias back before numba.cuda is imported.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack
from numba import cuda

@cuda.jit
def add(a, b, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a[i] + b[i]

@cuda.jit
def poly(x, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = 3.0 * x[i] * x[i] - 2.0 * x[i] + math.sin(x[i])

@cuda.jit
def row_sums(m, out):
    r = cuda.grid(1)
    if r < m.shape[0]:
        s = 0.0
        for c in range(m.shape[1]):
            s += m[r, c]
        out[r] = s

@cuda.jit
def histogram(v, bins):
    i = cuda.grid(1)
    if i < v.size:
        cuda.atomic.add(bins, v[i] % bins.size, 1)

rng = np.random.default_rng(7)
n = 1 << 20
a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
res = {"device": cuda.get_current_device().name.decode() if isinstance(cuda.get_current_device().name, bytes)
       else str(cuda.get_current_device().name)}
da, db, dout = cuda.to_device(a), cuda.to_device(b), cuda.device_array(n, np.float32)
add[(n + 255) // 256, 256](da, db, dout)
res["add"] = bool(np.array_equal(dout.copy_to_host(), a + b))
x = rng.standard_normal(4096)
out = cuda.device_array(4096)
poly[16, 256](cuda.to_device(x), out)
res["poly_max_err"] = float(np.max(np.abs(out.copy_to_host() - (3 * x * x - 2 * x + np.sin(x)))))
m = rng.standard_normal((512, 300))
sums = cuda.device_array(512)
row_sums[4, 128](cuda.to_device(m), sums)
res["row_sums_max_err"] = float(np.max(np.abs(sums.copy_to_host() - m.sum(axis=1))))
v = rng.integers(0, 1 << 30, 100000).astype(np.int64)
bins = cuda.to_device(np.zeros(64, np.int64))
histogram[(v.size + 255) // 256, 256](cuda.to_device(v), bins)
res["histogram"] = bool(np.array_equal(bins.copy_to_host(), np.bincount(v % 64, minlength=64)))
stream = cuda.stream()
dz = cuda.to_device(a, stream=stream)
add[(n + 255) // 256, 256, stream](dz, dz, dout)
res["stream_add"] = bool(np.array_equal(dout.copy_to_host(stream=stream), a + a))
stream.synchronize()
res["libcuda"] = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libcuda" in l})
res["ok"] = res["add"] and res["histogram"] and res["stream_add"] and res["poly_max_err"] < 1e-9 \
    and res["row_sums_max_err"] < 1e-9
print(json.dumps(res))
sys.exit(0 if res["ok"] else 1)
EOF
step numba_native 120 "$PY" "$OUT/numba_kernels.py"
step numba_rgpu 150 env NUMBA_CUDA_USE_NVIDIA_BINDING=1 "$PY" -m rgpu intercept run -- "$PY" "$OUT/numba_kernels.py"
step numba_rgpu_ctypes_binding 120 env NUMBA_CUDA_USE_NVIDIA_BINDING=0 \
  "$PY" -m rgpu intercept run -- "$PY" "$OUT/numba_kernels.py"
# the GPU-marked test, called directly: the suite's conftest needs hypothesis, which this host lacks
step real_driver 120 "$PY" -c "
import sys; sys.path.insert(0, 'tests')
import test_cuda_real_driver as t
t.test_on_a_gpu_the_real_driver_runs_the_ptx_vector_add(); print('real driver: PTX vecAdd of 65536 floats OK')"
step bench 240 "$PY" -m rgpu.bench.cuda --json --repeats 3 --server "$RGPU_SERVER"

kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null
"$PY" - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
summary = {}
for rc in sorted(out.glob("*.rc")):
    name = rc.stem
    log = (out / f"{name}.log").read_text(errors="replace")
    summary[name] = {"rc": int(rc.read_text().strip() or -1), "tail": log[-3000:]}
for name in ("python", "numba_native", "numba_rgpu", "numba_rgpu_ctypes_binding"):
    try:
        summary[name]["json"] = json.loads(summary[name]["tail"].strip().splitlines()[-1])
    except Exception:
        pass
try:
    summary["bench"]["rows"] = json.loads((out / "bench.log").read_text()[(out / "bench.log").read_text().index("["):])
except Exception:
    pass
summary["exports"] = (out / "exports.txt").read_text().strip()
summary["server_log_tail"] = (out / "server.log").read_text(errors="replace")[-4000:]
(out / "cuda_route.json").write_text(json.dumps(summary, indent=1))
print(json.dumps({k: v.get("rc") if isinstance(v, dict) else v for k, v in summary.items() if k != "server_log_tail"}))
EOF
echo "done in $(( $(date +%s) - T0 )) s"
