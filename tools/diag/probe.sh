#!/usr/bin/env bash
# First look at the GPU host: what the later per-issue scripts rely on. Writes $OUT/probe.json.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install --no-deps --no-build-isolation -q . 2>&1 | grep -v WARNING | tail -15; python3 -c "import setuptools; print(\"setuptools\", setuptools.__version__)"
python3 -m pip install --no-deps -q wheels/*.whl 2>&1 | tail -1
REPO=$PWD; cd /tmp   # so ./rgpu does not shadow the installed package
python3 - <<'PY' > "$OUT/probe.json" 2> "$OUT/probe.err"
import json, os, sys, sysconfig, subprocess, time, ctypes
r = {"python": sys.version, "py_enable_shared": sysconfig.get_config_var("Py_ENABLE_SHARED")}
import torch
r["torch"] = torch.__version__; r["gpu"] = torch.cuda.get_device_name(0)
try:
    import cffi; r["cffi"] = cffi.__version__
except Exception as e: r["cffi"] = repr(e)
r["libcuda"] = subprocess.run("ldconfig -p | grep libcuda.so", shell=True, capture_output=True, text=True).stdout
# a memfd mapping registered as pinned memory
import mmap
fd = os.memfd_create("rgpu-probe"); n = 64 << 20; os.ftruncate(fd, n)
m = mmap.mmap(fd, n)
buf = (ctypes.c_char * n).from_buffer(m); ptr = ctypes.addressof(buf)
rt = torch.cuda.cudart()
r["host_register"] = int(rt.cudaHostRegister(ptr, n, 0))
t = torch.frombuffer(m, dtype=torch.uint8); d = torch.empty(n, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize(); t0 = time.perf_counter()
for _ in range(10): d.copy_(t, non_blocking=True)
torch.cuda.synchronize(); r["memfd_h2d_GBps"] = 10 * n / (time.perf_counter() - t0) / 1e9
del t, buf
# the device route end to end: C++ part built against this torch, a server on this GPU
t0 = time.perf_counter()
import rgpu
x = torch.randn(64, 64)
y = x.to("rgpu"); z = (y @ y + 1).relu()
r["device_route_err"] = float((z.cpu() - (x @ x + 1).relu()).abs().max())
m = torch.nn.Linear(64, 8).to("rgpu"); m(y).sum().backward()
r["device_route_grad_ok"] = bool(torch.isfinite(m.weight.grad.cpu()).all())
r["device_route_s"] = time.perf_counter() - t0
try:
    r["device_name"] = torch.rgpu.get_device_name()
except Exception as e: r["device_name"] = repr(e)
print(json.dumps(r, indent=1))
PY
cat "$OUT/probe.json"; tail -20 "$OUT/probe.err"
