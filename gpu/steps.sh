# Sourced by the gpu/ scripts that run benches in timed steps and bring back one tarball.
#
#   BUDGET=540; . gpu/steps.sh       then: install_rgpu (or install_cuda_route; build_cuda_route; program_python MOD LOG);
#                                    step NAME LIMIT_S COMMAND...; serve_cuda LOG; summarize NAME...; pack FILE
#
# $OUT (the caller's, where the device tool collects) becomes $FINAL; $OUT is then a scratch folder that
# pack() tars into $FINAL/FILE beside summary.txt (the device tool returns at most 8 files a call).
# Every step has its own time limit within BUDGET seconds for the whole script, so one that hangs costs
# only itself; rgpu is installed (not editable) and the steps run from /tmp, so ./rgpu never shadows it.
set -u
FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
OUT=$(mktemp -d)
BUDGET=${BUDGET:-540}   # the caller's, if it set one first
T0=$(date +%s)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
unset RGPU_SERVER RGPU_TRANSPORT RGPU_SIM_RTT_MS RGPU_TF32
REPO=$PWD
export PYTHONPATH=$REPO/examples/nanogpt   # the benches' model (examples/ is not installed)

stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/log.txt"; }
# stopped from outside (run_all.sh's timeout): what the steps wrote comes back as $FINAL/partial.tar.gz
trap 'stamp "stopped from outside: packing what there is as partial.tar.gz"; tar czf "$FINAL/partial.tar.gz" -C "$OUT" .; exit 124' TERM

step() {  # step NAME LIMIT_S COMMAND...: stdout to $OUT/NAME.json, stderr to $OUT/NAME.err, exit status to NAME.rc
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$left" -lt 20 ]; then stamp "skip $name (no time left)"; echo skipped >"$OUT/$name.rc"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  stamp "$name (limit $limit s)"
  ( cd /tmp && timeout "$limit" "$@" >"$OUT/$name.json" 2>"$OUT/$name.err" )
  echo $? >"$OUT/$name.rc"
}

install_rgpu() {  # rgpu from this tree, and every native part built against the host's torch (a step); the cffi
  # wheels first where the call carried them (.whl/: the host has no cffi, and without it shm runs its Python path)
  ls .whl/*.whl >/dev/null 2>&1 && { stamp wheels; python3 -m pip install --no-index --no-deps -q .whl/*.whl >"$OUT/wheels.log" 2>&1; }
  stamp install
  python3 -m pip install --no-deps --no-build-isolation -q "$REPO" >"$OUT/install.log" 2>&1
  step build 240 python3 -m rgpu build   # a line per part (built, cached, skipped: why); exit 1 when one fails
}

install_cuda_route() {  # the cffi wheels (.whl/: the host has no cffi) and rgpu into python3, not editable
  stamp wheels
  python3 -m pip install --no-index --no-deps -q .whl/*.whl >"$OUT/wheels.log" 2>&1
  stamp install
  python3 -m pip install --no-deps --no-build-isolation -q "$REPO" >"$OUT/install.log" 2>&1
}

build_cuda_route() {  # the CUDA route's libraries (a step named libs); their folder in $LIBDIR
  step libs 120 python3 -c "from rgpu.cuda_intercept import libraries; print(libraries.build())"
  LIBDIR=$(tail -n 1 "$OUT/libs.json")
}

rgpu_into() {  # rgpu_into PYTHON LOG: the wheels and rgpu into the program's own Python (rgpu must import there)
  { "$1" -m pip install --no-index --no-deps .whl/*.whl
    "$1" -m pip install --no-deps --no-build-isolation "$REPO"; } >"$2" 2>&1
}

program_python() {  # program_python MODULE LOG [PY]: the first Python that imports MODULE ($PY, torch's venv,
  # python3) into $PROGRAM_PY, with rgpu (and cffi) installed there and what it still lacks of rgpu's dependencies
  # linked from python3's (same version) through $OUT/pylink on PYTHONPATH; python3 when none imports MODULE
  local mod=$1 log=$2 p dep src; PROGRAM_PY=""
  for p in "${3:-}" /opt/torch/.venv/bin/python python3; do
    [ -n "$p" ] && "$p" -c "import $mod" 2>/dev/null && { PROGRAM_PY=$p; break; }
  done
  stamp "$mod python: ${PROGRAM_PY:-none}"
  if [ -n "$PROGRAM_PY" ] && [ "$PROGRAM_PY" != python3 ] && [ "${CHECK_INSTALL:-1}" = 1 ]; then
    rgpu_into "$PROGRAM_PY" "$log"
    mkdir -p "$OUT/pylink"
    for dep in msgpack cffi _cffi_backend pycparser; do
      "$PROGRAM_PY" -c "import $dep" 2>/dev/null && continue
      src=$(python3 -c "import $dep, os; f = $dep.__file__; print(os.path.dirname(f) if f.endswith('__init__.py') else f)" 2>/dev/null)
      [ -n "$src" ] && ln -sf "$src" "$OUT/pylink/" && echo "linked $dep from $src" >>"$log"
    done
    export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$OUT/pylink
  fi
}

serve_cuda() {  # serve_cuda LOG [VAR=VALUE...]: `rgpu serve --cuda-driver ${CHECK_DRIVER:-real}` in the background
  # (RGPU_TOKEN exported first), from /tmp so ./rgpu never shadows the installed package; once it listens, its
  # address is in $SERVED and its pid in $SERVED_PID
  local log=$1; shift
  (cd /tmp && exec env "$@" python3 -m rgpu serve --port 0 --cuda-driver "${CHECK_DRIVER:-real}" --preload "") >"$log" 2>&1 &
  SERVED_PID=$!
  for _ in $(seq 150); do grep -q "listening on" "$log" && break; sleep 0.2; done
  SERVED=$(grep -o "listening on [^;]*" "$log" | head -1 | awk '{print $3}')
}

summarize() {  # summarize NAME...: each step's bench rows, one line each, into $OUT/summary.txt
  stamp summary
  python3 - "$OUT" "$@" <<'PY' | tee "$OUT/summary.txt"
import json, os, sys
out = sys.argv[1]
for name in sys.argv[2:]:
    try:
        rows = json.load(open(os.path.join(out, name + ".json")))
        rows = rows["bench"]["rows"] if isinstance(rows, dict) else rows   # rgpu bench transport's shape
    except Exception as exc:
        print(f"{name}: no rows ({type(exc).__name__}: {exc})")
        continue
    for r in rows:
        v, ratio, spread = r.get("value"), r.get("ratio"), r.get("spread")
        print(f"{name:10s} {str(r.get('metric'))[:84]:84s} {'-' if v is None else format(v, '.4g'):>10} "
              f"{r.get('unit') or '':5s} ratio {'-' if ratio is None else format(ratio, '.3f')}"
              + (f" spread {spread[0]:.2f}-{spread[1]:.2f}" if spread else ""))
PY
}

pack() {  # pack FILE: summary.txt and everything else of the run, as $FINAL/FILE
  stamp done
  cp "$OUT/summary.txt" "$FINAL/" && tar czf "$FINAL/$1" -C "$OUT" .
}
