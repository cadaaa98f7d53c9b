#!/usr/bin/env bash
# The CUDA runtime layer on a GPU host: rgpu's libcudart.so.13 (translated into driver calls on rgpu's
# libcuda.so.1) against the real runtime, same host, same programs.
#
#   OUT=/some/folder bash gpu/check_cuda_runtime.sh      (the device tool sets $OUT; under 8 minutes)
#
# Steps: install rgpu and the cffi wheels (.whl/; the host has no cffi), build the library set; start
# `rgpu serve --cuda-driver real`; build the five test programs (tests/cuda_programs, nvcc -cudart shared,
# sm_90) and run each natively and through `rgpu intercept run`, values compared line by line and with
# numpy; then stock torch (the first Python that imports it): is_available, device_count, properties,
# 1024-float copies both ways (pinned too), add/sum/softmax/arange/seeded randn and an elementwise chain,
# natively and through rgpu, compared bitwise, with the CUDA libraries each run mapped.
# Results: $OUT/summary.txt and $OUT/cuda_runtime.tar.gz (cuda_runtime.json inside, one log per step).
# Needs nvcc on the host (the programs are built there) and the ignored .whl/ folder carried with the tree.
BUDGET=${BUDGET:-450}
cd "$(dirname "$0")/.."
. gpu/steps.sh

install_cuda_route   # the device's C++ part is not needed here: no install_rgpu build step
build_cuda_route
readelf --dyn-syms -W "$LIBDIR/libcudart.so.13" | grep -c '@@libcudart.so.13' >"$OUT/cudart_exports.txt" 2>&1

export RGPU_TOKEN=gpu-check-$RANDOM$RANDOM
serve_cuda "$OUT/server.log"; SERVER_PID=$SERVED_PID; export RGPU_SERVER=$SERVED
stamp "server $RGPU_SERVER (pid $SERVER_PID), libraries in $LIBDIR"

# ---- the nvcc programs: native vs rgpu ------------------------------------------------------------
step programs 200 python3 "$REPO/gpu/cuda_programs_check.py" "$REPO" shared

# ---- stock torch: R0-R3 natively and through rgpu -------------------------------------------------
program_python torch "$OUT/torch_install.log" "${TORCH_PYTHON:-}"; TPY=$PROGRAM_PY
[ -n "$TPY" ] && "$TPY" -c "import rgpu.cuda_intercept.client, cffi; print('rgpu imports in', __import__('sys').executable)" \
  >>"$OUT/torch_install.log" 2>&1
cat >"$OUT/torch_r3.py" <<'EOF'
"""Stock torch on cuda: rungs R0-R3; each result as its bytes' sha256, so two runs compare bitwise."""
import hashlib, json, sys
import torch
def h(t):
    return hashlib.sha256(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
res = {"torch": torch.__version__}
try:
    res["available"] = torch.cuda.is_available()
    res["count"] = torch.cuda.device_count()
    p = torch.cuda.get_device_properties(0)
    res["props"] = {k: getattr(p, k) for k in ("name", "major", "minor", "total_memory", "multi_processor_count",
                                               "warp_size", "L2_cache_size") if hasattr(p, k)}
    x = torch.arange(1024, dtype=torch.float32) * 0.5 - 7
    d = x.cuda()
    res["copy_both_ways"] = bool(torch.equal(d.cpu(), x))
    pinned = x.pin_memory()
    res["copy_pinned"] = bool(torch.equal(pinned.cuda(non_blocking=True).cpu(), x))
    g = torch.Generator(device="cuda").manual_seed(1234)
    r = torch.randn(4096, device="cuda", generator=g)
    a = torch.arange(3000, device="cuda", dtype=torch.float32)
    res["digests"] = {"add": h(d + d * 3), "sum": h(d.sum()), "softmax": h(torch.softmax(d.view(32, 32), dim=1)),
                      "arange": h(a), "randn": h(r), "chain": h(((d * 1.5 + 2).relu() - d.sin()).exp().clamp(max=9))}
    torch.cuda.synchronize()
except Exception as exc:
    res["error"] = f"{type(exc).__name__}: {str(exc)[:1500]}"
res["maps"] = sorted({l.split()[-1] for l in open("/proc/self/maps")
                      if any(k in l for k in ("libcuda", "libcudart", "libcublas", "libcudnn"))})
print(json.dumps(res))
EOF
if [ -n "$TPY" ]; then
  step torch_native 120 env -u LD_LIBRARY_PATH "$TPY" "$OUT/torch_r3.py"
  step torch_rgpu 180 "$TPY" -m rgpu intercept run -- "$TPY" "$OUT/torch_r3.py"
fi

# ---- CuPy: elementwise, a reduction and a RawKernel (NVRTC compiles on the client) -----------------
if [ -n "$TPY" ] && "$TPY" -c "import cupy" 2>/dev/null; then
  step cupy_native 120 env -u LD_LIBRARY_PATH "$TPY" "$REPO/gpu/cupy_check.py"
  step cupy_rgpu 180 "$TPY" -m rgpu intercept run -- "$TPY" "$REPO/gpu/cupy_check.py"
fi

kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null
stamp summary
python3 - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / f"{name}.json").read_text().strip().splitlines()[-1] if name.startswith(("torch", "cupy"))
                          else (out / f"{name}.json").read_text())
    except Exception as exc:
        err = (out / f"{name}.err").read_text(errors="replace")[-2000:] if (out / f"{name}.err").exists() else ""
        return {"unreadable": f"{type(exc).__name__}: {exc}", "stderr": err}
s = {"cudart_exports_with_node": (out / "cudart_exports.txt").read_text().strip(),
     "programs": load("programs"), "torch_native": load("torch_native"), "torch_rgpu": load("torch_rgpu")}
tn, tr = s["torch_native"], s["torch_rgpu"]
if isinstance(tn, dict) and isinstance(tr, dict):
    keys = ("available", "count", "props", "copy_both_ways", "copy_pinned", "digests")
    s["torch_equal"] = {k: tn.get(k) == tr.get(k) for k in keys}
    s["torch_ok"] = not tn.get("error") and not tr.get("error") and all(s["torch_equal"].values())
    s["torch_rgpu_loaded_only_rgpu"] = all("rgpu" in m or "libcuda.so" not in m for m in tr.get("maps", []))
cn, cr = load("cupy_native"), load("cupy_rgpu")
s["cupy_native"], s["cupy_rgpu"] = cn, cr
if isinstance(cn, dict) and isinstance(cr, dict):
    s["cupy_ok"] = not cn.get("error") and not cr.get("error") and cn.get("digests") == cr.get("digests")
s["rc"] = {p.stem: p.read_text().strip() for p in out.glob("*.rc")}
s["server_log_tail"] = (out / "server.log").read_text(errors="replace")[-3000:]
(out / "cuda_runtime.json").write_text(json.dumps(s, indent=1))
progs = s["programs"] if isinstance(s["programs"], list) else []
print("cudart exports with node:", s["cudart_exports_with_node"])
for r in progs:
    print(f"program {r['program']:9s} ok={r['ok']} same={r.get('same')} numpy native={r.get('native_numpy')} "
          f"rgpu={r.get('rgpu_numpy')} {r.get('error', '')}")
print("torch ok:", s.get("torch_ok"), "equal:", s.get("torch_equal"), "| rgpu run error:", tr.get("error") if isinstance(tr, dict) else tr)
print("cupy ok:", s.get("cupy_ok"), "| rgpu run:", cr.get("error") if isinstance(cr, dict) else cr)
print("rc:", s["rc"])
EOF
pack cuda_runtime.tar.gz
