"""``rgpu bench train``: the nanoGPT-class training step on rgpu beside the same step native, same run.

    rgpu bench train --json      (harness)    python -m rgpu.bench.train --json [--quick] [--profile FILE]
    rgpu bench train --compile [reduce-overhead] --sim-rtt 1,10,30 --json

``--compile``: the same step with the model under ``torch.compile(backend="rgpu")``
(forward and backward shipped once, one message each per step), interleaved with
the others. ``--sim-rtt MS,...``: each step again behind a delay line of that
round trip (``RGPU_SIM_RTT_MS``, switched on the live connection), against the
step at 0 ms plus one round trip, the two interleaved.

Model: 6 layers, 6 heads, 384 wide, block 256, batch 64, character vocabulary,
dropout 0, fp32, TF32 as ``RGPU_TF32`` on both sides, AdamW (foreach),
``loss.item()`` every step; ``--quick`` uses the example's small preset (CI).
Native = the same model code on this host's own device (CUDA on a GPU host,
else the CPU), in a child process that never imports rgpu (``native_step``:
CUDA autograd fails in a process where the rgpu device is registered). Blocks
of steps alternate between the two; each figure is the median over blocks,
``spread`` [min, max]. Also: round trips, messages
and bytes per step, where an rgpu step's time goes (enqueue vs wait), and its steps
back to back after the blocks (native's process gone).
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

NANOGPT = Path(__file__).resolve().parents[1] / "examples" / "nanogpt"
PRESETS = {"bench": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch=64),
           "small": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch=12)}


def _setup(device: str, p: dict, vocab: int):
    import torch

    sys.path.insert(0, str(NANOGPT))
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=vocab, block_size=p["block_size"], n_layer=p["n_layer"], n_head=p["n_head"],
                    n_embd=p["n_embd"], dropout=0.0)
    model = GPT(cfg).to(device)
    return model, model.configure_optimizer(3e-4)


def _step(model, opt, x, y, device, timings=None, mark=contextlib.nullcontext):
    """One training step; ``mark(name)``: a span around each phase (``--trace``: record_function)."""
    t0 = time.perf_counter()
    with mark("step: upload"):
        x, y = x.to(device), y.to(device)
    with mark("step: forward"):
        _, loss = model(x, y)
    with mark("step: backward"):
        opt.zero_grad(set_to_none=True)
        loss.backward()
    with mark("step: optimizer"):
        opt.step()
    t1 = time.perf_counter()
    with mark("step: item"):
        value = loss.item()
    if timings is not None:
        timings.append((t1 - t0, time.perf_counter() - t1))
    return value


def rows(args=None, profile: str | None = None) -> list[dict]:
    import torch

    import rgpu
    from rgpu import config

    rgpu.register()  # the rgpu command loaded rgpu as a parent, which registers nothing
    quick = getattr(args, "quick", False)
    p = PRESETS["small" if quick else "bench"]
    if getattr(args, "pin", False):
        _pin_apart()
    blocks = 3 if quick else max(3, getattr(args, "repeats", 5) or 5)
    steps = 5 if quick else 10
    native = "cuda" if torch.cuda.is_available() else "cpu"
    tf32 = config.settings().tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    vocab = 97
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, vocab, (p["batch"], p["block_size"]), generator=gen),) * 2 for _ in range(4)]
    # native runs in a process that never imports rgpu: with PrivateUse1 registered here, CUDA autograd
    # in this process fails (torch issue #161129); same model code, init and batches there (native_step)
    from rgpu.bench.native_step import Native

    native_run = Native(native, p, vocab, tf32)
    runs = {"rgpu": _setup("rgpu", p, vocab)}
    mode = getattr(args, "compile", None)
    natives = {native: native_run}
    if mode:  # the same step, the model under torch.compile(backend="rgpu")
        model, opt = _setup("rgpu", p, vocab)
        runs[COMPILED] = (torch.compile(model, backend="rgpu", mode=None if mode == "default" else mode), opt)
        if native == "cuda":  # what Inductor does natively with the same step: the floor of the compiled figure
            natives[NATIVE_COMPILED] = Native(native, p, vocab, tf32, compile=mode)
    warm = {}  # the same init and batches everywhere: the warm-up losses double as a correctness check
    for dev, (model, opt) in runs.items():  # warm: kernels, allocator, op definitions, meta cache (and compile)
        warm[dev] = [_step(model, opt, *b, _device(dev)) for b in batches[:3]]
    for key, run in natives.items():
        warm[key] = run.warm(3)
    per_step = {dev: [] for dev in (*runs, *natives)}
    for _ in range(blocks):
        for dev, (model, opt) in runs.items():
            t0 = time.perf_counter()
            for i in range(steps):
                _step(model, opt, *batches[i % 4], _device(dev))
            per_step[dev].append((time.perf_counter() - t0) / steps * 1e3)
        for key, run in natives.items():
            per_step[key].append(run.block(steps))
    trace = getattr(args, "trace", None)  # native's GPU time beside the server's trace
    native_traces = {key: run.trace(steps) for key, run in natives.items()} if trace and native == "cuda" else {}
    for run in natives.values():
        run.close()
    model, opt = runs["rgpu"]
    timings: list = []
    rgpu.stats(reset=True)
    for i in range(steps):
        _step(model, opt, *batches[i % 4], "rgpu", timings)
    counts = rgpu.stats()
    if profile:
        _profile(profile, lambda: [_step(model, opt, *batches[i % 4], "rgpu") for i in range(steps)])
    med = {dev: statistics.median(v) for dev, v in per_step.items()}
    size = f"{p['n_layer']}L/{p['n_embd']}w/block {p['block_size']}/batch {p['batch']}"
    base = f"{native} eager (same host, same code)"
    t = counts["transport"]
    enqueue = statistics.median(a for a, _ in timings) * 1e3
    wait = statistics.median(b for _, b in timings) * 1e3
    back = [(a + b) * 1e3 for a, b in timings]

    def row(metric, unit, value, baseline_name=None, baseline=None, spread=None):
        return {"bench": "train", "transport": t, "metric": metric, "unit": unit, "size": size, "value": value,
                "baseline_name": baseline_name, "baseline": baseline,
                "ratio": value / baseline if baseline else None, "spread": spread}

    out = [
        row("training step", "ms", med["rgpu"], base, med[native], [min(per_step["rgpu"]), max(per_step["rgpu"])]),
        row("round trips per step", "count", counts["round_trips"] / steps, "expected", 1),
        row(f"messages per step (the server runs ops through {_op_path()})", "count", counts["messages"] / steps),
        row("bytes out per step", "B", counts["bytes_out"] / steps),
        row("client time to enqueue a step (forward, backward, AdamW)", "ms", enqueue, base + " step", med[native]),
        row("wait at loss.item()", "ms", wait),
        # the same steps with no native block between them (native's process has ended): on some GPU
        # instances rgpu's blocks ran slower after native's than after an idle gap (docs/perf/fast_path.md)
        row("a step back to back after the blocks (enqueue + wait)", "ms", statistics.median(back), base,
            med[native], [min(back), max(back)]),
    ]
    out.append(row("max |loss - native loss| over 3 warm-up steps", "abs", _max_diff(warm["rgpu"], warm[native])))
    if COMPILED in runs:
        out += _compiled_rows(runs[COMPILED], batches, steps, per_step, med[native], base, row)
        if NATIVE_COMPILED in per_step:
            ms = per_step[NATIVE_COMPILED]
            out.append(row("native CUDA step under torch.compile (Inductor), for reference", "ms",
                           statistics.median(ms), base, med[native], [min(ms), max(ms)]))
        out.append(row("max |loss - native loss| over 3 warm-up steps, compiled", "abs",
                       _max_diff(warm[COMPILED], warm[native])))
    if trace:
        for key, (model, opt) in runs.items():
            out += _trace_rows(trace + (".compiled" if key == COMPILED else ""), key,
                               lambda mark: [_step(model, opt, *batches[i % 4], "rgpu", mark=mark)
                                             for i in range(steps)], row)
        for key, figures in native_traces.items():
            out += [row(f"{key} step under torch.profiler, for reference: {name}", "ms", figures[name])
                    for name in ("wall", "gpu_busy")]
    for ms in _rtts(getattr(args, "sim_rtt", None)):
        for key in ("rgpu", COMPILED):
            if key in runs:
                out.append(_sim_rtt_row(runs[key], key, ms, batches, steps, blocks, t, size))
    return out


COMPILED = "rgpu, torch.compile(backend='rgpu')"
NATIVE_COMPILED = "cuda, torch.compile"


def _device(key: str) -> str:
    return "rgpu" if key.startswith("rgpu") else key


def _max_diff(a: list, b: list) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def _rtts(text) -> list[float]:
    if not text:
        return []
    return [float(v) for v in str(text).split(",") if v.strip()]


def _compiled_rows(run, batches, steps, per_step, native_ms, base, row) -> list[dict]:
    import rgpu
    from rgpu.device_backend import compile as rcompile

    model, opt = run
    timings: list = []
    rgpu.stats(reset=True)
    for i in range(steps):
        _step(model, opt, *batches[i % 4], "rgpu", timings)
    counts = rgpu.stats()
    ms = per_step[COMPILED]
    graphs = [i for i in rcompile.info() if i.get("runs")]
    backends = sorted({i.get("backend") or "?" for i in graphs})
    errors = sorted({i["error"][:300] for i in rcompile.info() if i.get("error")})
    return [
        row("training step, torch.compile(backend='rgpu')", "ms", statistics.median(ms), base, native_ms,
            [min(ms), max(ms)]),
        row("round trips per compiled step", "count", counts["round_trips"] / steps, "expected", 1),
        row("messages per compiled step", "count", counts["messages"] / steps),
        row("client time to enqueue a compiled step", "ms", statistics.median(a for a, _ in timings) * 1e3),
        row("wait at loss.item(), compiled", "ms", statistics.median(b for _, b in timings) * 1e3),
        row("server time per compiled step in its graphs (inputs, launches, outputs; not GPU time)", "ms",
            sum(i.get("run_ms", 0.0) for i in graphs)),
        row("graph outputs copied per compiled step (layout differed from the client's trace)", "count",
            sum(i.get("copies_per_run", 0.0) for i in graphs)),
        row("graphs shipped; server backend: " + ", ".join(backends) + (
            f"; compile errors: {' | '.join(errors)}" if errors else ""), "count",
            rcompile.stats()["graphs_shipped"]),
    ] + [  # rgpu's own CUDA graphs on the server (reduce-overhead): captures, replays, outputs moved aside
        row(f"CUDA graphs of graph {k} ({i['nodes']} nodes): " + ", ".join(f"{n} {v}" for n, v in
            i["cuda_graphs"].items()), "count", i["cuda_graphs"]["replays"])
        for k, i in enumerate(graphs) if i.get("cuda_graphs")
    ]


def _op_path() -> str:
    """What the server runs this session's ops through: C++, or Python and why (the ops route's welcome)."""
    from rgpu.device_backend import session

    return (session.get().conn.welcome.get("info") or {}).get("op_path") or "an older server's Python"


def _sim_rtt_row(run, key, ms, batches, steps, blocks, transport, size) -> dict:
    """Steps behind a delay line of ``ms`` against steps with none plus ``ms``, interleaved."""
    from rgpu.bench import harness
    from rgpu.device_backend import session
    from rgpu.transport.delay import set_rtt

    model, opt = run
    conn = session.get().conn

    def steps_at(rtt):
        def run_steps():
            set_rtt(conn, rtt)
            try:
                t0 = time.perf_counter()
                for i in range(steps):
                    _step(model, opt, *batches[i % 4], "rgpu")
                return (time.perf_counter() - t0) / steps * 1e3
            finally:
                set_rtt(conn, 0)
        return run_steps

    at_zero = steps_at(0)
    result = harness.compare(steps_at(ms), lambda: at_zero() + ms, repeats=blocks)
    what = "compiled step" if key == COMPILED else "training step"
    return harness.row("train", transport, f"{what} at a simulated {ms:g} ms round trip", size, result,
                       f"{what} at 0 ms + 1 round trip", unit="ms")


def _pin_apart() -> None:
    """``--pin``: this process (and the native reference it starts) and a local server of its own on
    different physical cores (``harness.cpu_split``), as two hosts would be; with RGPU_SERVER set, only
    this process. Before the session starts: it reads RGPU_SERVER and RGPU_TOKEN from the environment."""
    import atexit
    import os

    from rgpu.bench import harness

    split = harness.cpu_split()
    if split is None:
        return
    client, server = split
    if not os.environ.get("RGPU_SERVER"):  # the server's settings (RGPU_TF32, ...) as this process has them
        env = {k: v for k, v in os.environ.items()
               if k.startswith("RGPU_") and k not in ("RGPU_TOKEN", "RGPU_TOKEN_FILE")}
        local = harness.LocalServer(cpus=server, env=env)
        atexit.register(local.stop)
        os.environ.update(RGPU_SERVER=local.address, RGPU_TOKEN=local.token)
        os.environ.pop("RGPU_TOKEN_FILE", None)
    harness.pin_self(client)


def _profile(path: str, run) -> None:
    """cProfile of ``run`` on the client (``path``) and of the same steps in the server's executor (``path.server``)."""
    import cProfile
    import pstats

    from rgpu.device_backend import session
    from rgpu.protocol.ops import Msg

    s = session.get()
    s.post([Msg.PROFILE, "start"])
    prof = cProfile.Profile()
    prof.runcall(run)
    server = s.request([Msg.PROFILE, "stop", 40])
    with open(path, "w") as f:
        pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
    Path(path + ".server").write_text(server)


def _trace(path: str, run) -> dict:
    """The server's timeline of ``run(mark)`` (torch.profiler, its CPU and GPU) gzipped to ``path``, its op
    table to ``path.txt``, and this process's (its CPU, each step's phases marked) to ``path.client``;
    returns ``timeline.steps`` of the first and ``timeline.boundary`` of both (where each step's time went)."""
    import gzip

    import torch

    from rgpu.bench import timeline
    from rgpu.device_backend import session
    from rgpu.protocol.ops import Msg

    s = session.get()
    s.post([Msg.PROFILE, "start", "trace"])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as client:
        run(torch.profiler.record_function)
    client_data = gzip.compress(timeline.export(client), compresslevel=3)   # on the server's clock (one host)
    Path(path + ".client").write_bytes(client_data)
    with s.lock:
        fut = s.conn.request([Msg.PROFILE, "stop", 40])
    reply = fut.result()
    try:
        data = bytes(reply.buffers[0])
        Path(path + ".txt").write_text(reply.meta)
    finally:
        reply.release()
    Path(path).write_bytes(data)
    server_events = timeline.load(data)
    return {**timeline.steps(server_events), **timeline.boundary(server_events, timeline.load(client_data))}


def _trace_rows(path: str, key: str, run, row) -> list[dict]:
    """Rows of where a traced step's time went, on the server and around each step's end (``--trace``)."""
    from rgpu.bench import timeline

    figures = _trace(path, run)
    what = "compiled step" if key == COMPILED else "step"
    return [row(f"{what} (traced, median of {figures.get('steps', 0)} steps): {name}", "ms", figures[name])
            for name in (*timeline.STEP_FIGURES, *timeline.BOUNDARY_FIGURES) if name in figures]


FLAGS = {
    "--profile": {"help": "write a cProfile of rgpu steps (client side) here"},
    "--compile": {"nargs": "?", "const": "default",
                  "help": "also the step under torch.compile(backend='rgpu') [mode, e.g. reduce-overhead]"},
    "--sim-rtt": {"help": "comma list of simulated round trips in ms, e.g. 1,10,30"},
    "--pin": {"action": "store_true",
              "help": "client and a local server of its own on different physical cores (harness.cpu_split)"},
    "--trace": {"help": "write the server's timeline of rgpu steps here (gzipped Chrome trace; this process's "
                        "beside it as FILE.client; with --compile also FILE.compiled[.client]) and report "
                        "where each step's time went"},
}


def main(argv=None) -> int:
    from rgpu.bench import harness

    return harness.main(lambda args: rows(args, args.profile), argv, __doc__, flags=FLAGS)


if __name__ == "__main__":
    raise SystemExit(main())
