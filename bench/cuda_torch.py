"""``rgpu bench cuda --torch``: stock CUDA PyTorch's training steps through rgpu, beside the same script native.

    rgpu bench cuda --torch [--quick] [--repeats N] [--json]     (python -m rgpu.bench.cuda --torch ...)
    PYTHON bench/cuda_torch.py --child [--quick] [--cases ...]   one side's figures as one JSON line

The steps (``cuda_ladder_rungs.py``'s models): the nanoGPT-class eager step (forward, backward, AdamW,
``loss.item()``) at 4 layers/128 wide and 6 layers/384 wide, the CNN's SGD step, and the small GPT's
whole step captured once with ``torch.cuda.graph`` and replayed. Each side is a child process of the
torch Python (``TORCH_PYTHON``, else ``RGPU_TEST_CUDA_TORCH_PYTHON``, else this one): natively with no
rgpu library nor ``RGPU_*`` variable in its environment, and through ``rgpu intercept run``; the
runs alternate (rgpu, native, rgpu, ...), so drift hits both alike.

Rows (foundation schema, ``bench/harness.py``): each step's median time beside native (``ratio``: the
median of the per-run ratios; the issue's targets: <= 1.10x, <= 1.05x, the CNN <= 1.15x, the replay
within 2%); its waits per step (answered calls, counted by the client: target 1); the first step's
synchronous calls (the GPT: <= 60); the small GPT's eager step under ``RGPU_SIM_RTT_MS=30`` beside
native + 1.5 round trips; the largest |loss difference| of the eager steps (a reference check, not a
timing). ``--quick``: tiny shapes, 3 steps, one run each, against whatever server is named or a local one
(``rgpu serve --cuda-driver fake`` where there is no GPU: the route alone, no baseline).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    import cuda_ladder_rungs as rungs           # the child: run as a file by the torch Python
    sys.path.pop(0)                            # this folder's cuda.py would shadow cuda-python, which torch imports
else:
    rungs = None

CASES = ("gpt_4x128", "gpt_6x384", "cnn", "gpt_4x128_graph")
RTT_MS = 30.0
SHAPES = {"gpt_4x128": dict(layers=4, d=128, heads=4), "gpt_6x384": dict(layers=6, d=384, heads=6)}
QUICK = dict(layers=1, d=32, heads=2, block=16, batch=2)


# ---- the child: one side's steps -------------------------------------------------------------------

def _waits() -> int | None:
    """Answered calls (round trips) so far when rgpu's libcuda.so.1 runs in this process, else None.
    Looked up, never imported (importing rgpu's client here would load it natively too)."""
    client = sys.modules.get("rgpu.cuda_intercept.client")
    c = getattr(client, "_client", None)
    return sum(c.waits.values()) if c is not None else None


def _by_name() -> dict:
    client = sys.modules.get("rgpu.cuda_intercept.client")
    c = getattr(client, "_client", None)
    return dict(c.waits) if c is not None else {}


def _gpt(dev, name, quick, capturable=False):
    shape = dict(SHAPES[name.removesuffix("_graph")])
    shape.update(QUICK if quick else {})
    model, opt, batches = rungs.gpt_setup(dev, capturable=capturable, **shape)
    return model, opt, batches


def _cnn(dev, quick):
    torch, F = rungs.torch, rungs.F
    _, cnn = rungs._models()
    torch.manual_seed(9)
    model = cnn().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.003, momentum=0.9)
    gen = torch.Generator().manual_seed(9)
    n = 2 if quick else 16
    data = [(torch.randn(n, 3, 32, 32, generator=gen).to(dev), torch.randint(0, 10, (n,), generator=gen).to(dev))
            for _ in range(4)]

    def step(i):
        x, y = data[i % 4]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()
    return step


def _graph_step(dev, quick):
    """The small GPT's whole step (forward, backward, capturable AdamW) captured once; a step is a copy of
    the next batch into the captured input, a replay and ``loss.item()``."""
    torch = rungs.torch
    model, opt, batches = _gpt(dev, "gpt_4x128", quick, capturable=True)
    x, y = (t.clone() for t in batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):                     # warm-up off the capture, as torch's docs require
            rungs.train_step(model, opt, x, y, dev)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        loss = model(x, y)
        loss.backward()
        opt.step()

    def step(i):
        bx, by = batches[i % len(batches)]
        x.copy_(bx), y.copy_(by)
        g.replay()
        return loss.item()
    return step


class Skipped(Exception):
    """A case that cannot run on this device: recorded as skipped, not failed."""


def _stand_in(dev, name):
    """The fake driver runs none of torch's own kernels (only copies and the math libraries, on the CPU): there
    a step is a chain of GEMMs (the GPTs), of bias-free convolutions (the CNN), captured and replayed (the graph)
    ending in one ``.item()``, so the route's plumbing, waits and rows are what a quick run checks (the graph
    case is skipped)."""
    torch, F = rungs.torch, rungs.F
    gen = torch.Generator().manual_seed(3)
    if name == "cnn":
        x, w = torch.randn(2, 3, 8, 8, generator=gen).to(dev), (torch.randn(3, 3, 3, 3, generator=gen) / 9).to(dev)
        return lambda i: F.conv2d(F.conv2d(x, w, padding=1), w, padding=1)[0, 0, 0, 0].item()
    x, w = torch.randn(16, 32, generator=gen).to(dev), (torch.randn(32, 32, generator=gen) / 32).to(dev)

    def chain():
        y = x
        for _ in range(4):
            y = y @ w
        return y
    if name.endswith("_graph"):
        raise Skipped("not on the fake driver: torch.cuda.graph's capture_begin launches a kernel of torch's own")
    return lambda i: chain()[0, 0].item()


def _steps(dev, name, quick):
    if "fake" in torch_device_name(dev):
        return _stand_in(dev, name)
    if name == "cnn":
        return _cnn(dev, quick)
    if name.endswith("_graph"):
        return _graph_step(dev, quick)
    model, opt, batches = _gpt(dev, name, quick)
    return lambda i: rungs.train_step(model, opt, *batches[i % len(batches)], dev)


def torch_device_name(dev) -> str:
    return rungs.torch.cuda.get_device_name(dev)


def child(cases, steps: int, warmup: int, quick: bool) -> dict:
    """Each case's step times, waits per step, losses; the first step's (this process's first) waits."""
    torch = rungs.load_torch()
    torch.utils.deterministic.fill_uninitialized_memory = False   # a NaN fill kernel per new tensor is no step's work
    dev = torch.device("cuda")
    out = {"cases": {}, "rgpu": _waits() is not None or "rgpu" in os.environ.get("LD_AUDIT", ""),
           "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
           "stand_in": "fake" in torch.cuda.get_device_name(0)}
    for name in cases:
        rec = out["cases"][name] = {}
        try:
            w0, t0 = _waits(), time.perf_counter()
            step = _steps(dev, name, quick)
            rec["setup_s"], w1 = time.perf_counter() - t0, _waits()
            rec["setup_waits"] = None if w0 is None else w1 - w0
            times, waits, losses = [], [], []
            for i in range(warmup + steps):
                before, t = _waits(), time.perf_counter()
                losses.append(step(i))
                ms, after = (time.perf_counter() - t) * 1e3, _waits()
                if i == 0:
                    rec["first_step_ms"] = ms
                    rec["first_step_waits"] = None if before is None else after - before
                if i >= warmup:
                    times.append(ms)
                    if before is not None:
                        waits.append(after - before)
                if i == warmup + steps - 2:
                    names_before = _by_name()
                if i == warmup + steps - 1 and before is not None:
                    now = _by_name()
                    rec["last_step_waits_by_name"] = {k: v - names_before.get(k, 0) for k, v in now.items()
                                                      if v != names_before.get(k, 0)}
            rec.update(step_ms=times, waits=waits, losses=losses)
        except Skipped as exc:
            rec["skipped"] = str(exc)
        except Exception as exc:               # the parent's rows show it in place of the figures
            import traceback
            where = "".join(traceback.format_tb(exc.__traceback__)[-2:])[-600:]
            rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:400]} at {where}"
    return out


# ---- the parent: interleaved runs, rows -------------------------------------------------------------

def torch_python() -> str | None:
    """A Python whose torch has CUDA (a stock CUDA build), or None."""
    probe = "import torch, sys; sys.exit(0 if torch.version.cuda else 1)"
    for p in (os.environ.get("TORCH_PYTHON"), os.environ.get("RGPU_TEST_CUDA_TORCH_PYTHON"), sys.executable):
        if p and subprocess.run([p, "-c", probe], capture_output=True, timeout=120).returncode == 0:
            return p
    return None


def native_env() -> dict:
    """What check_cuda_libs.sh gives the native side: no rgpu library in the loader's paths, no RGPU_*."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("RGPU_") and k not in ("LD_LIBRARY_PATH", "LD_AUDIT", "LD_PRELOAD")}


def _run_child(cmd, env, timeout) -> dict:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL)
    lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd[-6:])} failed ({done.returncode}): {done.stderr.strip()[-2500:]}")
    return json.loads(lines[-1])


def _row(metric, unit, vals, base_vals, baseline_name, size=0, ratios=None, **extra) -> dict:
    vals = [v for v in vals if v is not None]
    base_vals = [v for v in base_vals if v is not None]
    value = statistics.median(vals) if vals else None
    base = statistics.median(base_vals) if base_vals else None
    ratios = [r for r in (ratios or []) if r is not None]
    row = {"bench": "cuda", "transport": os.environ.get("RGPU_TRANSPORT", "auto"), "metric": metric, "unit": unit,
           "size": size, "value": value, "baseline_name": baseline_name if base_vals else "none (no GPU here)",
           "baseline": base, "ratio": statistics.median(ratios) if ratios else (value / base if value and base else None),
           "spread": [min(vals), max(vals)] if vals else None, "runs": len(vals), **extra}
    if base_vals:
        row["baseline_spread"] = [min(base_vals), max(base_vals)]
    if ratios:
        row["ratio_spread"] = [min(ratios), max(ratios)]
    return row


def _median(xs):
    xs = [x for x in xs or [] if x is not None]
    return statistics.median(xs) if xs else None


LABELS = {"gpt_4x128": "GPT 4 layers/128 wide eager step", "gpt_6x384": "GPT 6 layers/384 wide eager step",
          "cnn": "CNN SGD step", "gpt_4x128_graph": "GPT 4x128 step captured by torch.cuda.graph, replayed"}
TARGETS = {"gpt_4x128": 1.10, "gpt_6x384": 1.05, "cnn": 1.15, "gpt_4x128_graph": 1.02}


def make_rows(ours: list[dict], natives: list[dict], rtt: list[dict], quick: bool) -> list[dict]:
    base = "stock CUDA PyTorch natively, same script, same host"
    out = []
    for name in CASES:
        r = [o["cases"].get(name, {}) for o in ours]
        n = [o["cases"].get(name, {}) for o in natives]
        errors = [x["error"] for x in r + n if "error" in x]
        skipped = next((x["skipped"] for x in r + n if "skipped" in x), None)
        rm, nm = [_median(x.get("step_ms")) for x in r], [_median(x.get("step_ms")) for x in n]
        pairs = [a / b for a, b in zip(rm, nm) if a and b]
        stand_in = any(o.get("stand_in") for o in ours)
        label = LABELS[name] + (" (fake driver: GEMM/conv stand-ins)" if stand_in else " (quick: tiny shapes)" if quick else "")
        out.append(_row(label, "ms", rm, nm, base, ratios=pairs, target_ratio=TARGETS[name],
                        **({"errors": errors[:3]} if errors else {}), **({"skipped": skipped} if skipped else {})))
        out.append(_row(f"{LABELS[name]}: waits per step", "count", [_median(x.get("waits")) for x in r], [],
                        "expected 1", target=1,
                        last_step_waits_by_name=next((x.get("last_step_waits_by_name") for x in r if x), None)))
        if name == "gpt_4x128":
            out.append(_row("GPT 4x128: the process's first step's synchronous calls", "count",
                            [x.get("first_step_waits") for x in r], [], "target <= 60", target=60,
                            setup_waits=_median([x.get("setup_waits") for x in r])))
        if not name.endswith("_graph"):
            diffs = [max((abs(a - b) for a, b in zip(x.get("losses", []), y.get("losses", []))), default=None)
                     for x, y in zip(r, n)]
            if any(d is not None for d in diffs):
                out.append(_row(f"{LABELS[name]}: max |loss - native loss|", "abs", diffs, [], "native losses"))
    if rtt:
        ms = [_median(o["cases"].get("gpt_4x128", {}).get("step_ms")) for o in rtt]
        native = _median([_median(o["cases"].get("gpt_4x128", {}).get("step_ms")) for o in natives])
        errs = [o["cases"].get("gpt_4x128", {}).get("error") for o in rtt]
        out.append(_row(f"GPT 4x128 eager step over RGPU_SIM_RTT_MS={RTT_MS:g}", "ms", ms,
                        [native + 1.5 * RTT_MS] if native else [], f"native + 1.5 x {RTT_MS:g} ms round trip",
                        rtt_ms=RTT_MS, waits_per_step=_median([_median(o["cases"].get("gpt_4x128", {}).get("waits"))
                                                               for o in rtt]),
                        **({"errors": [e for e in errs if e][:3]} if any(errs) else {})))
    return out


def _sides(server_env: dict, what: str) -> tuple[str, list, dict]:
    """What both benches' children need: the CUDA torch's Python, the command that runs a child through rgpu,
    and the rgpu side's environment (``server_env``: RGPU_SERVER, RGPU_TOKEN; no simulated round trip).
    ``ConfigError`` naming ``what`` where there is no CUDA torch."""
    from rgpu.errors import ConfigError
    tpy = torch_python()
    if tpy is None:
        raise ConfigError(f"no CUDA torch here: {what} needs a Python whose torch is a CUDA build "
                          "(set TORCH_PYTHON=/path/to/python; pip install torch from the cu130 index)")
    env = dict(os.environ, **server_env)
    env.pop("RGPU_SIM_RTT_MS", None)
    return tpy, [sys.executable, "-m", "rgpu", "intercept", "run", "--"], env


def rows(args, server_env: dict, native: bool | None = None) -> list[dict]:
    """The rows; ``server_env`` names the server the rgpu side talks to (RGPU_SERVER, RGPU_TOKEN)."""
    tpy, through, env = _sides(server_env, "rgpu bench cuda --torch")
    quick = bool(getattr(args, "quick", False))
    repeats = 1 if quick else max(1, getattr(args, "repeats", 3) or 3)
    steps, warmup = (3, 1) if quick else (getattr(args, "steps", None) or 20, 3)
    clean = native_env()
    if native is None:
        native = subprocess.run([tpy, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"],
                                env=clean, capture_output=True, timeout=300).returncode == 0
    script = [tpy, str(Path(__file__).resolve()), "--child", "--steps", str(steps), "--warmup", str(warmup),
              *(["--quick"] if quick else [])]
    ours, natives, rtt = [], [], []
    limit = 600
    for _ in range(repeats):                   # interleaved: drift hits both sides alike
        ours.append(_run_child(through + script, env, limit))
        if native:
            natives.append(_run_child(script, clean, limit))
    few = script if quick else [*script, "--steps", "8", "--warmup", "2"]    # each wait costs 30 ms there
    rtt.append(_run_child(through + few + ["--cases", "gpt_4x128"], dict(env, RGPU_SIM_RTT_MS=str(RTT_MS)), limit))
    return make_rows(ours, natives, rtt, quick)


def queue_rows(args, server_env: dict) -> list[dict]:
    """``--queue-bytes 256K,64K,16K``: the eager steps through rgpu with ``RGPU_CUDA_QUEUE_BYTES`` at each
    size, every run beside a native run (interleaved: native, then each size): how soon the client posts
    a step's queued work decides how much of it the server runs beside the client rather than after it.
    An entry ``FIRST:LIMIT`` sets ``RGPU_CUDA_QUEUE_FIRST_BYTES`` too (``64K:64K``: a fixed size, no ramp)."""
    from rgpu.config import _size
    tpy, through, env = _sides(server_env, "--queue-bytes")
    sizes = [t.strip() for t in str(args.queue_bytes).split(",") if t.strip()]
    queue_env = {t: _queue_env(t, _size) for t in sizes}
    cases = ["gpt_6x384", "gpt_4x128"]
    script = [tpy, str(Path(__file__).resolve()), "--child", "--steps", str(getattr(args, "steps", None) or 20),
              "--warmup", "3", "--cases", ",".join(cases)]
    natives, ours = [], {q: [] for q in sizes}
    for _ in range(max(1, getattr(args, "repeats", 3) or 3)):
        natives.append(_run_child(script, native_env(), 600))
        for q in sizes:
            ours[q].append(_run_child(through + script, dict(env, **queue_env[q]), 600))
    out = []
    for name in cases:
        nm = [_median(o["cases"].get(name, {}).get("step_ms")) for o in natives]
        for q in sizes:
            rm = [_median(o["cases"].get(name, {}).get("step_ms")) for o in ours[q]]
            errors = [o["cases"][name]["error"] for o in ours[q] if "error" in o["cases"].get(name, {})]
            label = ", ".join(f"{k}={v}" for k, v in sorted(queue_env[q].items()))
            out.append(_row(f"{LABELS[name]}, {label}", "ms", rm, nm,
                            "stock CUDA PyTorch natively, same script, same host",
                            size=int(queue_env[q]["RGPU_CUDA_QUEUE_BYTES"]),
                            ratios=[a / b for a, b in zip(rm, nm) if a and b], target_ratio=TARGETS[name],
                            **({"errors": errors[:3]} if errors else {})))
    return out


def _queue_env(entry: str, size) -> dict:
    """``LIMIT`` or ``FIRST:LIMIT`` (sizes as the settings read them) -> the child's queue variables."""
    first, _, limit = entry.rpartition(":")
    env = {"RGPU_CUDA_QUEUE_BYTES": str(size(limit))}
    if first:
        env["RGPU_CUDA_QUEUE_FIRST_BYTES"] = str(size(first))
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help="run the steps here and print one JSON line")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if not a.child:
        from rgpu.bench import cuda
        return cuda.main(["--torch", *(["--quick"] if a.quick else [])])
    print(json.dumps(child([c for c in a.cases.split(",") if c], a.steps, a.warmup, a.quick)), flush=True)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)                                # every figure is printed: a hang in the libraries' teardown costs nothing


if __name__ == "__main__":
    sys.exit(main())
