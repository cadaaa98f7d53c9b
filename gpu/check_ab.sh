#!/usr/bin/env bash
# The fast path's figures at this tree and at an older one, interleaved on one GPU host: what a change moved,
# measured beside what it replaced (the hosts differ from call to call, so figures of two calls are not a pair).
#
#   git archive -o .ab/old.tar REV -- . ':!docs' ':!tests'      (here; carry .ab and .whl in the device call)
#   OUT=/some/folder ROUNDS=3 bash gpu/check_ab.sh                 (the device tool sets $OUT)
#
# Each round installs the new tree, runs rgpu bench ops and gpu/item_probe.py (.item() and .cpu() of 4 floats),
# then the same on the old tree. Writes $OUT/summary.txt (per round and side: the ops bench's client cost per
# streamed op and 1,000-add chain against native, .item() and .cpu() in us) and $OUT/ab.tar.gz (every file).
BUDGET=${BUDGET:-420}
ROUNDS=${ROUNDS:-3}
. "$(dirname "$0")/steps.sh"
[ -f .ab/old.tar ] || { echo "no .ab/old.tar: make it with git archive (see the top of this file)"; exit 2; }
rm -rf /tmp/ab-old /tmp/ab-new && mkdir -p /tmp/ab-old /tmp/ab-new
tar xf .ab/old.tar -C /tmp/ab-old
cp -r "$REPO/." /tmp/ab-new/ && rm -rf /tmp/ab-new/.ab /tmp/ab-new/.git
install_rgpu   # the wheels, the new tree, every native part built once (its log: build.json)
side() {  # side NAME TREE ROUND: install TREE, build what differs, run both benches
  python3 -m pip install --no-deps --no-build-isolation -q "$2" >>"$OUT/install_$1.log" 2>&1
  step "build_$1_$3" 200 python3 -m rgpu build
  step "ops_$1_$3" 60 python3 -m rgpu.bench.ops --json --repeats 5
  step "item_$1_$3" 60 python3 "$REPO/gpu/item_probe.py" 5
}
for r in $(seq 1 "$ROUNDS"); do
  side new /tmp/ab-new "$r"
  side old /tmp/ab-old "$r"
done
stamp summary
python3 - "$OUT" "$ROUNDS" <<'PY' | tee "$OUT/summary.txt"
import json, os, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def load(name):
    try:
        return json.load(open(os.path.join(out, name + ".json")))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
for side in ("new", "old"):
    for r in range(1, rounds + 1):
        ops, item = load(f"ops_{side}_{r}"), load(f"item_{side}_{r}")
        line = f"{side} round {r}:"
        if isinstance(ops, list):
            line += f" client cost per op {ops[0]['value']:.2f} us (native {ops[0]['baseline']:.2f}, ratio {ops[0]['ratio']:.3f});"
            line += f" chain {ops[1]['value']:.2f} ms (native {ops[1]['baseline']:.2f}, ratio {ops[1]['ratio']:.3f});"
        else:
            line += f" ops: {ops.get('error')};"
        if "item_us" in item:
            line += (f" .item() {statistics.median(item['item_us']):.2f} us, .cpu() {statistics.median(item['cpu_us']):.2f} us"
                     f" (C++ items {item['fast_path'].get('items', '-')}, downloads {item['fast_path'].get('downloads', '-')})")
        else:
            line += f" item probe: {item.get('error')}"
        print(line)
PY
pack ab.tar.gz
