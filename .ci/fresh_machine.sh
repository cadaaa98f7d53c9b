#!/usr/bin/env bash
# CI: the README's main job on a fresh machine. From a fresh clone in a temp folder and a fresh venv it
# runs the README's first command exactly as README.md writes it (read from there, so the two cannot
# drift) and fails unless it exits 0 with its checkpoint and plot written. Then it builds the wheel,
# installs it into another fresh venv outside the tree and runs the main job and a smoke test there
# (nothing may rely on the checkout: the native sources travel as package data).
#
#   bash .ci/fresh_machine.sh            # about 4-6 min on 2 cores; pip's cache and rgpu's build cache reused
#   RGPU_FRESH_CACHE=1 bash .ci/fresh_machine.sh   # also an empty rgpu build cache: first use's builds, timed
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d "${TMPDIR:-/tmp}/rgpu-fresh.XXXXXX")"
trap 'rm -rf "$work"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
[ "${RGPU_FRESH_CACHE:-0}" = 1 ] && export XDG_CACHE_HOME="$work/cache" && mkdir -p "$XDG_CACHE_HOME"
for name in $(env | sed -n 's/^\(RGPU_[A-Z_]*\)=.*/\1/p'); do
  [ "$name" = RGPU_FRESH_CACHE ] || unset "$name"            # the user's settings are not a fresh machine's
done
step() { echo "fresh_machine: $* ($(( SECONDS ))s)"; }
fail() { echo "fresh_machine: FAILED: $*" >&2; exit 1; }

step "a fresh clone of $(git -C "$here" rev-parse --short HEAD) in $work"
git clone -q "$here" "$work/rgpu"
cd "$work/rgpu"
main_job="$(sed -n '/^```bash$/,/^```$/p' README.md | grep -m1 '^pip install .* && python examples/nanogpt/train.py' || true)"
[ -n "$main_job" ] || fail "README.md has no first command (pip install ... && python examples/nanogpt/train.py ...)"

step "a fresh venv; the README's first command: $main_job"
"$python" -m venv "$work/venv"
( . "$work/venv/bin/activate" && timeout 900 bash -ec "$main_job" ) > "$work/main_job.log" 2>&1 \
  || { tail -n 40 "$work/main_job.log" >&2; fail "the README's first command did not exit 0"; }
grep -aE "^rgpu: |parameters on|steps in|^wrote|^no loss" "$work/main_job.log" || true   # what a user sees, the bar aside
for f in out/nanogpt/ckpt.pt out/nanogpt/loss.png; do
  [ -s "$f" ] || { tail -n 20 "$work/main_job.log" >&2; fail "the main job wrote no $f"; }
done
grep -q "^wrote out/nanogpt/ckpt.pt and out/nanogpt/loss.png" "$work/main_job.log" || fail "the main job did not say what it wrote"

step "the wheel (python -m build)"
"$work/venv/bin/python" -m pip install -q build
"$work/venv/bin/python" -m build --wheel --no-isolation --outdir "$work/dist" . > "$work/build.log" 2>&1 \
  || { tail -n 30 "$work/build.log" >&2; fail "python -m build failed"; }
wheel="$(ls "$work"/dist/rgpu-*.whl)"
"$python" -m zipfile -l "$wheel" > "$work/wheel.txt"
for part in rgpu/device_backend/bindings.cpp rgpu/device_backend/rgpu_device.h rgpu/server/ops/fast_op.cpp \
            rgpu/transport/shm_native.c rgpu/cuda_intercept/shim.c rgpu/cuda_intercept/abi/; do
  grep -q "^$part" "$work/wheel.txt" || fail "the wheel lacks $part"
done

step "the wheel in a second fresh venv, used outside the tree"
"$python" -m venv "$work/venv2"
mkdir "$work/elsewhere" && cp -r examples/nanogpt "$work/elsewhere/nanogpt"
cd "$work/elsewhere"
"$work/venv2/bin/python" -m pip install -q torch==2.13.0 "$wheel[example]" > "$work/install2.log" 2>&1 \
  || { tail -n 20 "$work/install2.log" >&2; fail "pip install of the wheel failed"; }
( . "$work/venv2/bin/activate" && timeout 900 python nanogpt/train.py --device rgpu --out out ) > "$work/wheel_job.log" 2>&1 \
  || { tail -n 40 "$work/wheel_job.log" >&2; fail "the main job from the wheel did not exit 0"; }
grep -aE "^rgpu: |steps in|^wrote" "$work/wheel_job.log" || true
[ -s out/ckpt.pt ] && [ -s out/loss.png ] || fail "the main job from the wheel wrote no checkpoint or plot"

step "a smoke test of the wheel: where rgpu comes from, a tensor's round trip, rgpu config, rgpu doctor"
( . "$work/venv2/bin/activate" && work="$work" timeout 600 bash -ec '
  python - <<EOF
import rgpu, torch
where = rgpu.__file__
assert where.startswith("$work/venv2/"), f"rgpu imported from {where}, not the wheel"
x = torch.arange(6.0).to("rgpu")
assert (x * 2 + 1).cpu().tolist() == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
print("smoke: rgpu", rgpu.__version__, "from", where, "; a tensor went there and back")
EOF
  RGPU_TOKEN=fresh-machine-secret rgpu config | grep -q "^RGPU_TOKEN *set (from RGPU_TOKEN; not shown)"
  ! RGPU_TOKEN=fresh-machine-secret rgpu config | grep -q fresh-machine-secret
  rgpu doctor' ) > "$work/smoke.log" 2>&1 || { tail -n 30 "$work/smoke.log" >&2; fail "the smoke test failed"; }
grep -E "^smoke:|^  (ok|WARN|FAIL)" "$work/smoke.log"
step "passed"
