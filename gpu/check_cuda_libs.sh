#!/usr/bin/env bash
# Stock PyTorch's math libraries on a GPU host: rgpu's libcublas.so.13, libcublasLt.so.13 and libcudnn.so.9 forwarding
# whole calls to the real libraries in the server's session worker, checked by the ladder (bench/cuda_ladder.py, rungs
# R4-R12) run natively and through `rgpu intercept run` on the same host.
#
#   OUT=/some/folder bash gpu/check_cuda_libs.sh       (the device tool sets $OUT; under 8 minutes)
#   RUNGS=R4,R5 bash gpu/check_cuda_libs.sh            some rungs only
#   RECORD=1 bash gpu/check_cuda_libs.sh               also record R4 and R9's math-library calls (RECORD_RUNGS) into
#                                                      $OUT/lib_traces/ and replay them against the fake libraries
#   TORCH_BENCH=0 ...                                  without `rgpu bench cuda --torch`
#   CHECK_DRIVER=fake CHECK_INSTALL=0 LADDER_DEVICE=cpu RUNGS=R4,R9 BENCH_QUICK=1 bash gpu/check_cuda_libs.sh
#                                                      the script itself, on a machine without a GPU (nothing installed)
#
# Steps: install the cffi wheels (.whl/) and rgpu, build the library set; start `rgpu serve --cuda-driver real`; rgpu
# into torch's Python; the ladder natively (no RGPU_* in its environment), then through rgpu, each side carried on
# in a fresh process after a rung that ran past its timeout or crashed (--resume), the eager rungs natively twice (what
# native itself does not repeat bitwise is no fault of rgpu's); `rgpu bench cuda --torch` (the GPT steps at 4x128 and
# 6x384, the CNN step, a captured step's replay, each beside native, interleaved, with its waits per step; the first
# step's synchronous calls; the step over RGPU_SIM_RTT_MS=30); the server's own cost per queued math-library record on
# this host's CPU (bench/cuda_lib_records.py: its stand-in libraries, the cuDNN convolution's seven records among
# them, in C and through Python); then `cuda_ladder.py compare`: per rung native ok, rgpu ok, bitwise equal, the
# largest difference of the float summaries, rgpu's error and the "not supported over rgpu" lines (they name the
# calls still missing); R4 again with DISABLE_ADDMM_CUDA_LT=1 where time is left; with RECORD=1 the recorded traces
# (tests/lib_traces/ takes the small ones) and their replay's report.
# Results: $OUT/summary.txt, $OUT/cuda_libs.json, $OUT/cuda_libs.tar.gz (both ladders' and the bench's JSON, every
# step's stderr, the server log, lib_traces/). Needs the ignored .whl/ folder carried with the tree.
BUDGET=${BUDGET:-465}
cd "$(dirname "$0")/.."
. gpu/steps.sh
RUNGS=${RUNGS:-R4,R5,R6,R7,R8,R9,R12,R10,R11}   # the compile rungs last: where time runs short, only they go
DEVICE=${LADDER_DEVICE:-cuda}
BENCH=(--repeats "${BENCH_REPEATS:-2}"); [ "${BENCH_QUICK:-0}" = 1 ] && BENCH=(--quick)
BENCH_S=170        # rgpu bench cuda --torch: 2 x 2 children of 4 cases and one over the simulated RTT
RECORD_S=$([ "${RECORD:-0}" = 1 ] && echo 70 || echo 0)
LIB_S=30           # bench/cuda_lib_records.py --quick: the records' server cost, no GPU used
RUNG_S=60          # an eager rung's timeout (bench/cuda_ladder_rungs.py TIMEOUTS gives the compile rungs theirs)
LADDER=$REPO/bench/cuda_ladder.py
CACHE=$(mktemp -d)  # each side's Inductor and Triton caches: the rgpu side compiles for itself, not from native's

if [ "${CHECK_INSTALL:-1}" = 1 ]; then
  install_cuda_route
fi
build_cuda_route

export RGPU_TOKEN=gpu-check-$RANDOM$RANDOM
serve_cuda "$OUT/server.log"; SERVER_PID=$SERVED_PID; export RGPU_SERVER=$SERVED
stamp "server $RGPU_SERVER (pid $SERVER_PID), libraries in $LIBDIR"
# the native runs: no rgpu library in the loader's paths, no RGPU_* variable (a server address among them)
NATIVE=(env -u LD_LIBRARY_PATH -u LD_AUDIT -u LD_PRELOAD)
for v in $(compgen -e | grep '^RGPU_'); do NATIVE+=(-u "$v"); done

program_python torch "$OUT/torch_install.log" "${TORCH_PYTHON:-}"; TPY=$PROGRAM_PY
[ -n "$TPY" ] || { stamp "no Python here imports torch"; TPY=python3; }

ladder() {  # ladder SIDE CAP_S RUNGS PREFIX...: each rung once into $OUT/ladder_SIDE.json, a fresh process after a hang or crash
  local side=$1 cap=$2 rungs=$3 n=0 rc; shift 3
  local until=$(( $(date +%s) + cap ))
  while [ "$n" -lt 10 ] && [ $(( until - $(date +%s) )) -ge 20 ]; do
    n=$((n + 1))
    step "${side}_run$n" $(( until - $(date +%s) )) env TORCHINDUCTOR_CACHE_DIR="$CACHE/$side/inductor" \
      TRITON_CACHE_DIR="$CACHE/$side/triton" "$@" "$TPY" "$LADDER" --rungs "$rungs" --device "$DEVICE" --resume \
      --rung-timeout "$RUNG_S" --quick-exit --out "$OUT/ladder_$side.json"
    rc=$(cat "$OUT/${side}_run$n.rc")
    case $rc in 0|1|skipped) break ;; esac   # 0: every rung ran, 1: one failed; else a rung timed out (3) or the process died
  done
}

ladder native 150 "$RUNGS" "${NATIVE[@]}"
# the eager rungs natively once more: which results native itself does not repeat bitwise
ladder native_again 60 "$(echo "$RUNGS" | tr , '\n' | grep -vx 'R10\|R11' | paste -sd,)" "${NATIVE[@]}"
# rgpu gets what is left but the bench, the recording and the summary
ladder rgpu $(( BUDGET - ($(date +%s) - T0) - BENCH_S - LIB_S - RECORD_S - 10 )) "$RUNGS" "$TPY" -m rgpu intercept run --
# each side a child of torch's Python, natively (the same clean environment) and through rgpu, interleaved
[ "${TORCH_BENCH:-1}" = 1 ] && step torch_bench "$BENCH_S" env TORCH_PYTHON="$TPY" python3 -m rgpu bench cuda --torch --json --server "$RGPU_SERVER" \
  "${BENCH[@]}"
step lib_records "$LIB_S" python3 -m rgpu.bench.cuda_lib_records --json --quick --repeats 3

if [ "${RECORD:-0}" = 1 ]; then   # a second server records every math-library call and the GEMMs' bytes
  serve_cuda "$OUT/record_server.log" RGPU_CUDA_LIB_RECORD="$OUT/lib_traces"; REC_PID=$SERVED_PID; REC_SERVER=$SERVED
  for r in $(echo "${RECORD_RUNGS:-R4,R9}" | tr , ' '); do   # a process, so a trace file, per rung
    ladder "rgpu_record_$r" 30 "$r" env RGPU_SERVER="$REC_SERVER" "$TPY" -m rgpu intercept run --
  done
  sleep 2; kill "$REC_PID" 2>/dev/null; wait "$REC_PID" 2>/dev/null   # each session closed (its footer) first
  step lib_trace_replay 20 "$TPY" -c "import glob, json, sys; from rgpu.server.cuda.libs import trace
print(json.dumps([trace.replay(p) for p in sorted(glob.glob(sys.argv[1] + '/*.rgputrace'))], indent=1))" "$OUT/lib_traces"
  mkdir -p "$FINAL/lib_traces"   # beside the tarball, each its own file (the device tool brings back 16 MiB a file)
  for f in "$OUT"/lib_traces/*.rgputrace; do [ -f "$f" ] && mv "$f" "$FINAL/lib_traces/"; done
fi

# R4 once more with torch's cuBLASLt path off (Linear and addmm on plain cuBLAS), where time is left: it tells a
# cuBLASLt fault from a cuBLAS one
ladder native_nolt 30 R4 env DISABLE_ADDMM_CUDA_LT=1 "${NATIVE[@]}"
ladder rgpu_nolt 30 R4 env DISABLE_ADDMM_CUDA_LT=1 "$TPY" -m rgpu intercept run --

kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null
stamp summary
if [ -f "$OUT/ladder_rgpu_nolt.json" ]; then
  (cd /tmp && python3 "$LADDER" compare "$OUT/ladder_native_nolt.json" "$OUT/ladder_rgpu_nolt.json" \
    --stderr "$OUT"/rgpu_nolt_run*.err --out "$OUT/cuda_libs_nolt.json") >"$OUT/compare_nolt.txt" 2>&1
fi
(cd /tmp && python3 "$LADDER" compare "$OUT/ladder_native.json" "$OUT/ladder_rgpu.json" --stderr "$OUT"/rgpu_run*.err \
  --native-again "$OUT/ladder_native_again.json" --out "$OUT/cuda_libs.json") \
  >"$OUT/compare.txt" 2>&1
python3 - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
try:
    s = json.loads((out / "cuda_libs.json").read_text())
except Exception as exc:
    s = {"compare_failed": f"{type(exc).__name__}: {exc}"}
s["rc"] = {p.stem: p.read_text().strip() for p in sorted(out.glob("*.rc"))}
s["server_log_tail"] = (out / "server.log").read_text(errors="replace")[-3000:] if (out / "server.log").exists() else ""
s["rgpu_stderr_head"] = {p.stem: p.read_text(errors="replace").splitlines()[:30] for p in sorted(out.glob("rgpu_*run*.err"))}
try:
    s["torch_bench"] = json.loads((out / "torch_bench.json").read_text())
except Exception as exc:
    s["torch_bench"] = f"no rows ({type(exc).__name__}: {exc}): " + (out / "torch_bench.err").read_text(errors="replace")[-1500:] \
        if (out / "torch_bench.err").exists() else f"not run ({exc})"
try:
    s["lib_records"] = json.loads((out / "lib_records.json").read_text())
except Exception as exc:
    s["lib_records"] = f"no rows ({type(exc).__name__}: {exc})"
try:
    s["lib_trace_replay"] = [{k: r[k] for k in ("path", "calls", "replayed", "compared", "skipped", "status_mismatch",
                              "value_mismatch", "errors", "live_after_close", "ok")}
                             for r in json.loads((out / "lib_trace_replay.json").read_text())]
except Exception:
    pass
if (out / "cuda_libs_nolt.json").exists():
    s["r4_without_cublaslt"] = json.loads((out / "cuda_libs_nolt.json").read_text())["rungs"]
(out / "cuda_libs.json").write_text(json.dumps(s, indent=1))
print((out / "compare.txt").read_text(errors="replace").rstrip())
if (out / "compare_nolt.txt").exists():
    print("R4 with DISABLE_ADDMM_CUDA_LT=1:", *(out / "compare_nolt.txt").read_text(errors="replace").splitlines()[:-1], sep="\n")
if isinstance(s["torch_bench"], list):
    print("rgpu bench cuda --torch:")
    for r in s["torch_bench"]:
        v, b, q, sp = r.get("value"), r.get("baseline"), r.get("ratio"), r.get("spread")
        f = lambda x: "-" if x is None else format(x, ".4g")
        print(f"  {r['metric'][:78]:78s} {f(v):>9} {r['unit']:5s} base {f(b):>9} ratio {f(q):>6}"
              + (f" spread {sp[0]:.3g}-{sp[1]:.3g}" if sp else "") + (f" target {r['target_ratio']}" if "target_ratio" in r else "")
              + (f" ERROR {r['errors'][0][:200]}" if r.get("errors") else "") + (f" skipped: {r['skipped']}" if r.get("skipped") else ""))
else:
    print("rgpu bench cuda --torch:", s["torch_bench"])
if isinstance(s["lib_records"], list):
    print("server cost per queued record (bench/cuda_lib_records.py, stand-in libraries):")
    for r in s["lib_records"]:
        print(f"  {r['record']:28s} {r['value']:8.3g} us in C (spread {r['spread'][0]:.3g}-{r['spread'][1]:.3g}),"
              f" {r['baseline']:8.3g} us through Libraries.run")
else:
    print("lib records:", s["lib_records"])
for r in s.get("lib_trace_replay", []):
    print(f"trace {r['path'].rsplit('/', 1)[-1]}: ok={r['ok']} calls {r['calls']} replayed {r['replayed']} compared "
          f"{r['compared']} skipped {sum(r['skipped'].values())} mismatches {r['status_mismatch'][:2]} {r['value_mismatch'][:2]} {r['errors'][:2]}")
print("rc:", s["rc"])
print("server log tail:", *s["server_log_tail"].splitlines()[-12:], sep="\n  ")
EOF
cp "$OUT/cuda_libs.json" "$FINAL/" 2>/dev/null
rm -rf "$CACHE"
pack cuda_libs.tar.gz
