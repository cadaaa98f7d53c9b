"""Stock PyTorch's ladder on cuda (rungs R4-R12: cuBLAS, cuBLASLt, cuDNN, SDPA, training, compile, CUDA graphs), run
natively and through rgpu on the GPU host (gpu/check_cuda_libs.sh), and the comparison of the two runs.

    python bench/cuda_ladder.py --rungs R4,R5 --out FILE.json [--device cuda] [--resume] [--rung-timeout S]
    python bench/cuda_ladder.py --bench --out FILE.json [--steps 30] [--warmup 5]       the R7 eager step, timed
    python bench/cuda_ladder.py compare NATIVE.json RGPU.json [--stderr FILE ...] [--bench-native F ...]
                                [--bench-rgpu F ...] [--out SUMMARY.json]               the table of both runs

Every rung runs in this process, each in its own try/except (``cuda_ladder_rungs.py`` has them); a rung
records ok, error (type, message, short traceback), wall time and its results, each the sha256 of its bytes
and a float summary (sum, abs-max, first values). The JSON is rewritten after each rung; a rung past its
timeout is recorded so and the process ends, and ``--resume`` carries on after it in a fresh one (a rung a
dead process left running is marked so). Each rung starts with a marker line on stderr, so the comparison
assigns the "not supported over rgpu" lines to their rungs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:   # run as a file
    import cuda_ladder_rungs as rungs
    sys.path.pop(0)      # then off the path: this folder's cuda.py would shadow cuda-python, which torch imports
else:
    from . import cuda_ladder_rungs as rungs

MARK = "== cuda_ladder rung "
DEFAULT_TIMEOUT = 120


# ---- running them --------------------------------------------------------------------------------------

def _save(doc: dict, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)                    # whole or not at all: a killed process leaves the last rung's file


def _meta(dev) -> dict:
    torch = rungs.torch
    maps = sorted({l.split()[-1] for l in open("/proc/self/maps")
                   if any(k in l for k in ("libcuda.so", "libcudart", "libcublas", "libcudnn"))}) if os.path.exists("/proc/self/maps") else []
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(dev), "python": sys.version.split()[0],
            "name": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "libraries": maps,
            "rgpu": any("rgpu" in p for p in maps)}


def _died(when: str) -> dict:
    return {"ok": False, "wall_s": None, "results": {}, "failed": [], "error": {
        "type": "ProcessDied", "message": f"the ladder process ended {when} (a crash, or killed at the step's time "
                                          "limit): its stderr says which", "traceback": ""}}


def run_ladder(names: list[str], device: str, out: str, resume: bool = False, timeout: float = DEFAULT_TIMEOUT) -> int:
    """Run ``names`` in order into ``out``; 0 when every rung ran (ok or skipped), 1 when one failed, 3 on a timeout."""
    doc = {"rungs": {}, "running": None, "attempts": 0, "recorded_at_start": -1}
    if resume and os.path.exists(out):
        doc = json.loads(Path(out).read_text())
    if doc.get("running"):                   # the process before this one died inside that rung
        doc["rungs"][doc["running"]], doc["running"] = _died("during this rung"), None
    elif doc["attempts"] and len(doc["rungs"]) == doc["recorded_at_start"]:   # ... or before its first: so would this one
        for name in names:
            doc["rungs"].setdefault(name, _died("before this rung, twice"))
    doc["attempts"] += 1
    doc["recorded_at_start"] = len(doc["rungs"])
    todo = [n for n in names if n not in doc["rungs"]]
    _save(doc, out)
    try:
        if todo:
            torch = rungs.load_torch()
            dev = torch.device(device)
    except Exception as exc:
        for name in todo:
            doc["rungs"][name] = {"ok": False, "wall_s": None, "results": {}, "failed": [], "error": rungs.error(exc)}
        _save(doc, out)
        return 1
    lock = threading.Lock()
    for name in todo:
        rung, limit = rungs.Rung(dev), rungs.TIMEOUTS.get(name, timeout)
        with lock:
            doc["running"] = name
            _save(doc, out)
        sys.stderr.flush()
        os.write(2, f"\n{MARK}{name} ==\n".encode())

        def expire(name=name, rung=rung, limit=limit):
            with lock:
                doc["rungs"][name] = {"ok": False, "wall_s": limit, "results": dict(rung.results), "failed": [], "error": {
                    "type": "Timeout", "message": f"the rung ran past {limit} s; the process ends so the next rungs "
                                                  "run in a fresh one (--resume)", "traceback": ""}}
                doc["running"] = None
                _save(doc, out)
            os.write(2, f"cuda_ladder: {name} timed out after {limit} s\n".encode())
            os._exit(3)
        timer = threading.Timer(limit, expire)
        timer.daemon = True
        timer.start()
        t0 = time.perf_counter()
        rec = {"ok": True, "error": None}
        try:
            if name not in rungs.RUNGS:
                raise ValueError(f"no rung {name!r} (the rungs: {', '.join(rungs.RUNGS)})")
            rungs.RUNGS[name](rung)
            if dev.type == "cuda":
                torch.cuda.synchronize()     # a deferred error of a queued call surfaces here, in its rung
        except rungs.Skip as exc:
            rec = {"ok": None, "skipped": str(exc), "error": None}
        except Exception as exc:
            rec = {"ok": False, "error": rungs.error(exc)}
        timer.cancel()
        failed = [k for k, v in rung.results.items() if "error" in v]
        rec.update(ok=False if failed else rec["ok"], wall_s=round(time.perf_counter() - t0, 3),
                   results=rung.results, failed=failed)
        with lock:
            doc["rungs"][name], doc["running"], doc["meta"] = rec, None, _meta(dev)
            _save(doc, out)
        print(f"cuda_ladder: {name} ok={rec['ok']} {rec['wall_s']:.1f} s failed={failed[:4]}", file=sys.stderr)
    return 0 if all(doc["rungs"][n].get("ok") is not False for n in names) else 1


def _round_trips():
    """The interceptor connection's round trips so far, when rgpu's libcuda.so.1 runs in this process, else None.
    Looked up, never imported: importing rgpu's client elsewhere would build (or wait for) rgpu's native parts."""
    client = sys.modules.get("rgpu.cuda_intercept.client")
    conn = getattr(getattr(client, "_client", None), "conn", None)
    return conn.stats.get("round_trips") if conn is not None else None


def bench(device: str, steps: int, warmup: int, out: str) -> int:
    """The R7 eager step (forward, backward, AdamW, loss.item()), timed: median and spread over ``steps``."""
    times, trips = [], []
    try:
        dev = rungs.load_torch().device(device)
        model, opt, batches = rungs.gpt_setup(dev)
        for i in range(warmup + steps):
            x, y = batches[i % len(batches)]
            before, t = _round_trips(), time.perf_counter()
            rungs.train_step(model, opt, x, y, dev)
            ms, after = (time.perf_counter() - t) * 1e3, _round_trips()
            if i >= warmup:
                times.append(ms)
                if before is not None and after is not None:
                    trips.append(after - before)
    except Exception as exc:                 # the comparison shows it in place of the figures
        _save({"error": rungs.error(exc), "times_ms": times}, out)
        return 1
    _save({"median_ms": statistics.median(times), "spread_ms": [min(times), max(times)],
           "quartiles_ms": statistics.quantiles(times, n=4) if len(times) > 1 else times, "times_ms": times,
           "steps": steps, "warmup": warmup, "round_trips_per_step": statistics.median(trips) if trips else None,
           "meta": _meta(dev)}, out)
    return 0


# ---- comparing a native and an rgpu run ------------------------------------------------------------------

def _load(path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except Exception as exc:                 # a step that never wrote its file: the table says so
        return {"unreadable": f"{type(exc).__name__}: {exc}", "rungs": {}}


def _brief(err) -> str | None:
    return f"{err['type']}: {err['message'][:400]}" if isinstance(err, dict) and err else None


def _max_diff(a: dict, b: dict) -> float | None:
    """The largest absolute difference of two results' float summaries (NaN against NaN is none)."""
    pairs = []
    for key in ("sum", "absmax", "first", "values"):
        u, v = a.get(key), b.get(key)
        if u is not None and v is not None:
            u, v = (u, v) if isinstance(u, list) else ([u], [v])
            pairs += list(zip(u, v)) if len(u) == len(v) else [(0.0, float("inf"))]
    if not pairs:
        return None
    return max(0.0 if (x != x and y != y) else abs(x - y) if x == x and y == y else float("inf") for x, y in pairs)


def _as_one(res: dict, other: dict) -> dict:
    """``res`` with the parts (``name.y``, ``name.dx``) of a result that failed on the other side as one entry."""
    out = dict(res)
    for name, v in other.items():
        parts = [k for k in out if k.startswith(name + ".")] if "error" in v else []
        for k in parts:
            del out[k]
        if parts:
            out[name] = {"parts": len(parts)}
    return out


def compare_rung(native: dict | None, ours: dict | None) -> dict:
    """One rung's row: each side ok, whether every result is bitwise equal, the largest summary difference."""
    n, r = native or {}, ours or {}
    nres, rres = n.get("results", {}), r.get("results", {})
    nres, rres = _as_one(nres, rres), _as_one(rres, nres)
    row = {"native_ok": n.get("ok") if native else "not run", "rgpu_ok": r.get("ok") if ours else "not run",
           "native_wall_s": n.get("wall_s"), "rgpu_wall_s": r.get("wall_s"), "native_error": _brief(n.get("error")),
           "rgpu_error": _brief(r.get("error")), "skipped": n.get("skipped") or r.get("skipped"),
           "compared": 0, "equal": 0, "mismatched": [], "rgpu_failed": {}, "native_failed": {}, "both_failed": {}, "max_abs_diff": None}
    for key in sorted(set(nres) | set(rres)):
        a, b = nres.get(key), rres.get(key)
        if (a and "info" in a) or (b and "info" in b):
            continue
        if a is None or b is None:
            row["mismatched"].append(f"{key} (only {'rgpu' if a is None else 'native'} has it)")
        elif "error" in a and "error" in b:
            row["both_failed"][key] = _brief(b["error"])
        elif "error" in b or "error" in a:
            row["rgpu_failed" if "error" in b else "native_failed"][key] = _brief((b if "error" in b else a)["error"])
        else:
            row["compared"] += 1
            d = _max_diff(a, b)
            row["max_abs_diff"] = d if row["max_abs_diff"] is None else max(row["max_abs_diff"], d or 0.0)
            if a["sha256"] == b["sha256"]:
                row["equal"] += 1
            else:
                row["mismatched"].append(key)
    bad = row["mismatched"] or row["rgpu_failed"] or row["native_failed"] or row["rgpu_error"] or row["native_error"]
    row["bitwise_equal"] = False if bad or not (native and ours) else (True if row["compared"] else None)
    return row


def not_supported(paths) -> dict[str, list[str]]:
    """Per rung (by the stderr markers), the first distinct lines naming a call rgpu refuses."""
    out = {}
    for path in paths:
        rung = "(start)"
        text = Path(path).read_text(errors="replace") if Path(path).exists() else ""
        for line in text.splitlines():
            if line.startswith(MARK):
                rung = line[len(MARK):].strip(" =")
            elif "not supported over rgpu" in line or "cannot be served over rgpu" in line:
                seen = out.setdefault(rung, [])
                if line.strip()[:300] not in seen and len(seen) < 12:
                    seen.append(line.strip()[:300])
    return out


def compare_bench(natives, ours) -> dict:
    """The eager step's medians, each side's spread, and rgpu/native as the median of the interleaved pairs."""
    n, r = [_load(p) for p in natives], [_load(p) for p in ours]
    pairs = [b["median_ms"] / a["median_ms"] for a, b in zip(n, r) if "median_ms" in a and "median_ms" in b]
    side = lambda runs: {"median_ms": statistics.median(x["median_ms"] for x in runs),
                         "spread_ms": [min(x["spread_ms"][0] for x in runs), max(x["spread_ms"][1] for x in runs)],
                         "round_trips_per_step": runs[0].get("round_trips_per_step")} if runs else None
    return {"native": side([x for x in n if "median_ms" in x]), "rgpu": side([x for x in r if "median_ms" in x]),
            "ratio": statistics.median(pairs) if pairs else None, "ratio_spread": [min(pairs), max(pairs)] if pairs else None,
            "errors": [x.get("unreadable") or _brief(x["error"]) for x in n + r if "unreadable" in x or "error" in x]}


def compare(native_path, rgpu_path, stderr=(), bench_native=(), bench_rgpu=(), native_again=None) -> dict:
    """Both runs rung by rung; ``native_again``, a second native run, tells which results native itself
    does not repeat bitwise (a difference there is no fault of rgpu's)."""
    n, r = _load(native_path), _load(rgpu_path)
    n2 = _load(native_again) if native_again else {"rungs": {}}
    for run in (n, r, n2):                   # a rung the last process died in, with no time left to resume
        if run.get("running") and run["running"] not in run["rungs"]:
            run["rungs"][run["running"]] = _died("during this rung, and no time was left to carry on")
    names = list(dict.fromkeys([*n.get("rungs", {}), *r.get("rungs", {})]))
    rows = {name: compare_rung(n["rungs"].get(name), r["rungs"].get(name)) for name in names}
    refused = not_supported(stderr)
    for name, row in rows.items():
        row["not_supported"] = refused.get(name, [])
        again = compare_rung(n["rungs"].get(name), n2["rungs"][name]) if name in n2["rungs"] else None
        row["native_repeats"] = again["bitwise_equal"] if again else None
        row["native_unstable"] = again["mismatched"] if again else []
    return {"rungs": rows, "not_supported_at_start": refused.get("(start)", []), "native_meta": n.get("meta"),
            "rgpu_meta": r.get("meta"), "unreadable": [x["unreadable"] for x in (n, r) if "unreadable" in x],
            "all_equal": bool(rows) and all(x["bitwise_equal"] is not False for x in rows.values()),
            "bench": compare_bench(bench_native, bench_rgpu) if bench_native or bench_rgpu else None}


def format_summary(s: dict) -> str:
    word = {True: "ok", False: "FAIL", None: "skip"}
    lines = [f"{'rung':5s} {'native':6s} {'rgpu':6s} {'bitwise':8s} {'max|diff|':>10s} {'equal/n':>8s} {'repeats':7s} "
             f"{'native s':>8s} {'rgpu s':>7s}  rgpu error"]
    secs = lambda v: "-" if v is None else f"{v:.1f}"
    for name, x in s["rungs"].items():
        nd = "-" if x["max_abs_diff"] is None else f"{x['max_abs_diff']:.3g}"
        rep = {True: "yes", False: "NO", None: "-"}[x.get("native_repeats")]
        failed = ", ".join(list(x["rgpu_failed"])[:3])
        both = x["both_failed"]
        err = x["rgpu_error"] or (f"{len(x['rgpu_failed'])} failed: {failed}: {next(iter(x['rgpu_failed'].values()))}"
                                  if x["rgpu_failed"] else "") or x["skipped"] or (
            f"native too: {', '.join(list(both)[:3])}: {next(iter(both.values()))}" if both else "")
        lines.append(f"{name:5s} {word.get(x['native_ok'], str(x['native_ok'])):6s} {word.get(x['rgpu_ok'], str(x['rgpu_ok'])):6s} "
                     f"{ {True: 'equal', False: 'differs'}.get(x['bitwise_equal'], '-'):8s} {nd:>10s} "
                     f"{x['equal']:>3d}/{x['compared']:<4d} {rep:7s} {secs(x['native_wall_s']):>8s} {secs(x['rgpu_wall_s']):>7s}  {err[:160]}")
        lines += [f"      refused: {line}" for line in x["not_supported"][:4]]
        if x.get("native_unstable"):
            lines.append(f"      native differs from itself on: {', '.join(x['native_unstable'][:6])}")
    b = s.get("bench")
    if b and b["native"] and b["rgpu"]:
        lines.append(f"bench R7 eager step: native {b['native']['median_ms']:.2f} ms ({b['native']['spread_ms'][0]:.2f}-"
                     f"{b['native']['spread_ms'][1]:.2f}), rgpu {b['rgpu']['median_ms']:.2f} ms ({b['rgpu']['spread_ms'][0]:.2f}-"
                     f"{b['rgpu']['spread_ms'][1]:.2f}), rgpu/native {b['ratio']:.2f} ({b['ratio_spread'][0]:.2f}-"
                     f"{b['ratio_spread'][1]:.2f}), round trips per step {b['rgpu']['round_trips_per_step']}")
    elif b:
        lines.append(f"bench: incomplete (native {b['native']}, rgpu {b['rgpu']}): {'; '.join(b['errors'])[:600]}")
    meta = s["rgpu_meta"] or {}
    stock = [p for p in meta.get("libraries", []) if "rgpu" not in p]
    lines.append(f"all equal: {s['all_equal']}; rgpu side loaded rgpu's libraries: {meta.get('rgpu')}"
                 + (f"; and stock ones too: {', '.join(stock)}" if stock else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        p = argparse.ArgumentParser(prog="cuda_ladder.py compare")
        p.add_argument("native"), p.add_argument("rgpu")
        for flag in ("--stderr", "--bench-native", "--bench-rgpu"):
            p.add_argument(flag, nargs="*", default=[])
        p.add_argument("--native-again", help="a second native run: which results native repeats bitwise")
        p.add_argument("--out")
        a = p.parse_args(argv[1:])
        s = compare(a.native, a.rgpu, a.stderr, a.bench_native, a.bench_rgpu, a.native_again)
        if a.out:
            Path(a.out).write_text(json.dumps(s, indent=1))
        print(format_summary(s))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rungs", default=",".join(rungs.RUNGS))
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", help="cpu: the harness's own tests")
    p.add_argument("--resume", action="store_true", help="keep the rungs --out already holds, run the others")
    p.add_argument("--rung-timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds (compile rungs: at least theirs)")
    p.add_argument("--bench", action="store_true", help="time the R7 eager step instead")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--quick-exit", action="store_true", help="end without exit handlers once the JSON is written")
    a = p.parse_args(argv)
    if a.bench:
        rc = bench(a.device, a.steps, a.warmup, a.out)
    else:
        rc = run_ladder([n.strip().upper() for n in a.rungs.split(",") if n.strip()], a.device, a.out, a.resume, a.rung_timeout)
    if a.quick_exit:         # every result is written: a hang in the libraries' teardown must not eat the step's time
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
