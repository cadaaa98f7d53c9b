#!/usr/bin/env bash
# Run several GPU-host checks in one device call; each comes back as $OUT/<name>.tar.gz
# (the device tool returns at most 8 files).  usage: bash gpu/run_all.sh device_route cuda_route ...
# BUDGET_<name>=seconds caps one check (default 420); the check is told (BUDGET, 10 s less, for packing), so its
# steps fit inside it, and one stopped anyway packs what it has (gpu/steps.sh).
set -u
FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$FINAL/gpu.txt" 2>&1
for name in "$@"; do
  d=/tmp/rgpu-out/$name; mkdir -p "$d"
  budget_var="BUDGET_$name"; budget=${!budget_var:-420}
  start=$(date +%s)
  OUT=$d BUDGET=$(( budget - 10 )) timeout "$budget" bash "gpu/check_$name.sh" > "$d/stdout.txt" 2>&1
  echo "check_$name: rc=$? in $(( $(date +%s) - start )) s (budget $budget s)" | tee -a "$d/stdout.txt" "$FINAL/summary.txt"
  tail -15 "$d/stdout.txt"
  tar czf "$FINAL/$name.tar.gz" -C /tmp/rgpu-out "$name"
done
