#!/usr/bin/env bash
# Programs on the *static* CUDA runtime on a GPU host: nvcc's default `-cudart static` and CuPy (its wheels
# link the runtime statically), native against `rgpu intercept run`, same host, same programs.  The
# runtime inside them asks rgpu's libcuda.so.1 for the driver's private tables (cuda_intercept/export_tables.c).
#
#   OUT=/some/folder bash gpu/check_cuda_static.sh      (the device tool sets $OUT; under 5 minutes)
#
# Steps: install rgpu and the cffi wheels (.whl/), build the library set; start `rgpu serve --cuda-driver real`;
# build the five test programs (tests/cuda_programs, nvcc -cudart static, sm_90), run each natively and through
# rgpu, outputs compared line by line and with numpy; then CuPy (the first Python that imports it): elementwise,
# reductions, a RawKernel, an ElementwiseKernel, natively and through rgpu, compared bitwise.  What runs where:
# CuPy's NVRTC compiles on the client (its maps show libnvrtc), the kernels run on the server's GPU.
# Results: $OUT/summary.txt and $OUT/cuda_static.tar.gz (cuda_static.json inside, one log per step, and
# saxpy-static.trace: saxpy's run through rgpu with the driver-call trace of gpu/cuda_call_trace).
BUDGET=${BUDGET:-280}
cd "$(dirname "$0")/.."
. gpu/steps.sh

install_cuda_route
build_cuda_route

export RGPU_TOKEN=gpu-check-$RANDOM$RANDOM
serve_cuda "$OUT/server.log"; SERVER_PID=$SERVED_PID; export RGPU_SERVER=$SERVED
stamp "server $RGPU_SERVER (pid $SERVER_PID), libraries in $LIBDIR"

# ---- the nvcc programs, -cudart static: native vs rgpu ---------------------------------------------
# (saxpy once more with the driver-call trace: $OUT/saxpy-static.trace, in the tarball)
step programs 150 python3 "$REPO/gpu/cuda_programs_check.py" "$REPO" static "$OUT"

# ---- CuPy: elementwise, reductions, RawKernel, ElementwiseKernel ------------------------------------
program_python cupy "$OUT/cupy_install.log" "${CUPY_PYTHON:-}"; CPY=$PROGRAM_PY
if [ -n "$CPY" ]; then
  step cupy_native 90 env -u LD_LIBRARY_PATH "$CPY" "$REPO/gpu/cupy_check.py"
  step cupy_rgpu 120 "$CPY" -m rgpu intercept run -- "$CPY" "$REPO/gpu/cupy_check.py"
fi

kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null
stamp summary
python3 - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    try:
        text = (out / f"{name}.json").read_text()
        return json.loads(text.strip().splitlines()[-1] if name.startswith("cupy") else text)
    except Exception as exc:
        err = (out / f"{name}.err").read_text(errors="replace")[-2000:] if (out / f"{name}.err").exists() else ""
        return {"unreadable": f"{type(exc).__name__}: {exc}", "stderr": err}
s = {"programs": load("programs"), "cupy_native": load("cupy_native"), "cupy_rgpu": load("cupy_rgpu")}
cn, cr = s["cupy_native"], s["cupy_rgpu"]
if isinstance(cn, dict) and isinstance(cr, dict):
    s["cupy_ok"] = not cn.get("error") and not cr.get("error") and bool(cn.get("digests")) \
        and cn.get("digests") == cr.get("digests")
    s["cupy_equal"] = {k: cn.get("digests", {}).get(k) == v for k, v in cr.get("digests", {}).items()}
    s["cupy_rgpu_driver_is_rgpus"] = any("rgpu" in m and "libcuda.so" in m for m in cr.get("maps", []))
    s["cupy_nvrtc_on_client"] = any("libnvrtc" in m for m in cr.get("maps", []))
s["rc"] = {p.stem: p.read_text().strip() for p in out.glob("*.rc")}
s["server_log_tail"] = (out / "server.log").read_text(errors="replace")[-3000:]
(out / "cuda_static.json").write_text(json.dumps(s, indent=1))
for r in s["programs"] if isinstance(s["programs"], list) else []:
    print(f"static program {r['program']:9s} ok={r['ok']} same={r.get('same')} numpy native={r.get('native_numpy')} "
          f"rgpu={r.get('rgpu_numpy')} libcudart linked={r.get('links_libcudart')} {r.get('error', '')}")
print("cupy ok:", s.get("cupy_ok"), "equal:", s.get("cupy_equal"), "| rgpu driver:", s.get("cupy_rgpu_driver_is_rgpus"),
      "| nvrtc on client:", s.get("cupy_nvrtc_on_client"), "| rgpu run:", cr.get("error") if isinstance(cr, dict) else cr)
print("rc:", s["rc"])
EOF
pack cuda_static.tar.gz
