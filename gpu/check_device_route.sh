#!/usr/bin/env bash
# The device route on the GPU host, whole, in under 8 minutes; everything lands in $OUT.
#   build     the C++ part against this torch (timed, cold), loaded by a client; the server must not load it
#   correct   the 6-layer/384-wide nanoGPT step: 5 steps on rgpu against the same 5 natively on CUDA
#             (native in a child process that never imports rgpu: CUDA autograd breaks where rgpu is registered)
#   bench     rgpu bench ops --json, rgpu bench train --json (client and server over loopback), with
#             cProfiles of rgpu steps on the client and in the server's executor
#   tests     the device test files against a CUDA server (the CPU reference tests run unchanged)
#   profile   torch's CUDA profile of the native step, for where the GPU time goes
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/log.txt"; }
python3 -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | grep -v WARNING | tail -5
python3 -m pip install --no-deps -q wheels/*.whl 2>/dev/null | tail -1
REPO=$PWD
export XDG_CACHE_HOME=/tmp/rgpu-cold-cache-$$   # a cold build of the C++ part, timed
export RGPU_TRANSPORT=${RGPU_TRANSPORT:-tcp}   # this issue's figures: loopback tcp (shm rows: the fast-path check)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.csv" 2>&1

stamp build
( cd /tmp && timeout 150 python3 - > "$OUT/build.json" 2> "$OUT/build.err" ) <<'PY'
import json, sys, time
r = {}
import torch
r["torch"], r["python"] = torch.__version__, sys.version.split()[0]
import rgpu.server, rgpu.server.ops.executor
from rgpu.device_backend import build
r["server_import_loaded_cpp"] = build._module is not None
t0 = time.perf_counter(); build.load(); r["build_s"] = time.perf_counter() - t0
t0 = time.perf_counter()
x = torch.randn(256, 256)
y = x.to("rgpu")
r["first_use_s"] = time.perf_counter() - t0
r["matmul_err"] = float(((y @ y).relu().cpu() - (x @ x).relu()).abs().max())
r["device_name"], r["device_count"] = torch.rgpu.get_device_name(), torch.rgpu.device_count()
print(json.dumps(r, indent=1))
PY
cat "$OUT/build.json"; tail -5 "$OUT/build.err"

stamp correct
# rgpu here, native CUDA in a child that never imports rgpu (bench/native_step.py): with the rgpu device
# registered, CUDA autograd in the same process fails (engine.cpp opt_ready_stream assert, torch #161129)
( cd /tmp && timeout 120 python3 - > "$OUT/correct.json" 2> "$OUT/correct.err" ) <<PY
import json, sys, torch, rgpu
sys.path.insert(0, "$REPO/examples/nanogpt")
from model import GPT, GPTConfig
from rgpu.bench.native_step import Native, make_batches
p = dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch=64)
with Native("cuda", p, 97, tf32=False, batches=5) as native:
    cuda = native.warm(5)
torch.manual_seed(0)
m = GPT(GPTConfig(vocab_size=97, block_size=256, n_layer=6, n_head=6, n_embd=384, dropout=0.0)).to("rgpu")
opt = m.configure_optimizer(3e-4); out = []
for x, y in make_batches(torch, 97, 64, 256, 5):
    _, loss = m(x.to("rgpu"), y.to("rgpu")); opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    out.append(loss.item())
losses = {"cuda (child process, no rgpu)": cuda, "rgpu": out}
print(json.dumps({"losses": losses, "max_abs_diff": max(abs(a - b) for a, b in zip(cuda, out))}, indent=1))
PY
cat "$OUT/correct.json"; tail -5 "$OUT/correct.err"

stamp bench ops
( cd /tmp && (timeout 60 rgpu bench ops --json || timeout 60 python3 -m rgpu.bench.ops --json) > "$OUT/bench_ops.json" 2> "$OUT/bench_ops.err" )
cat "$OUT/bench_ops.json"; tail -3 "$OUT/bench_ops.err"

stamp bench train
( cd /tmp && timeout 150 python3 -m rgpu.bench.train --json --profile "$OUT/train_profile.txt" > "$OUT/bench_train.json" 2> "$OUT/bench_train.err" )
cat "$OUT/bench_train.json"; tail -3 "$OUT/bench_train.err"
head -45 "$OUT/train_profile.txt"; head -45 "$OUT/train_profile.txt.server"

stamp tests
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_device_registration.py tests/test_device_ops.py \
  tests/test_device_streaming.py tests/test_device_nanogpt.py tests/test_device_executor.py > "$OUT/tests.txt" 2>&1
tail -15 "$OUT/tests.txt"

stamp native profile
( cd /tmp && timeout 45 python3 - > "$OUT/native_profile.txt" 2>&1 ) <<PY
import sys, torch
sys.path.insert(0, "$REPO/examples/nanogpt")
from model import GPT, GPTConfig
from torch.profiler import profile, ProfilerActivity
m = GPT(GPTConfig(vocab_size=97, block_size=256, n_layer=6, n_head=6, n_embd=384)).cuda()
opt = m.configure_optimizer(3e-4); b = torch.randint(0, 97, (64, 256), device="cuda")
def step():
    _, loss = m(b, b); opt.zero_grad(set_to_none=True); loss.backward(); opt.step(); loss.item()
for _ in range(3): step()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    for _ in range(3): step()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=25))
PY
head -40 "$OUT/native_profile.txt"
stamp done
