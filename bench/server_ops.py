"""``rgpu bench server_ops``: the server's cost per op message, in-process, split into its parts.

    rgpu bench server_ops --json        python -m rgpu.bench.server_ops --json

The messages of ``rgpu bench ops``'s chain (1,000 ``y = y + 1.0`` on 4 floats, as the client
sends them: ``add.out`` with the number and an ``out=`` id, the frees of the last-but-one
result) are packed once, then fed to the ops route's executor in this process: no transport,
no client. Each run decodes every frame (msgpack, as the worker does) and handles it. Rows:
the whole cost per message on the C++ op path and on the Python one, and the C++ path's split:
decode (msgpack alone), to stack (the wire's values to the op's boxed arguments, the handle
table's views and fresh outputs included), the aten call (dispatcher and kernel launch), bind
(outputs bound to their ids, written arguments checked) and the rest (the executor's Python
around ``FastOps.op``: the message's dispatch, its frees, the op's lookup). Baseline: the
same adds in local eager on the server's device (the native dispatch + launch). Each figure
is the median of interleaved runs; ``spread`` is [min, max].
"""
from __future__ import annotations

import statistics
import time

from rgpu.bench import harness

CHAIN = 1000  # op messages per run
SIZE = 4      # elements per tensor


def messages(chain: int = CHAIN, base: int = 0) -> tuple[list[bytes], list[bytes]]:
    """The chain's frames as the client sends them (recorded from ``rgpu bench ops``), packed: the setup
    (the ops' definitions, ``x = torch.ones(4)`` at id 1) and the chain, reading x and writing fresh ids
    from ``base + 1`` on (each run its own, as a client's ids are), freeing the last-but-one result."""
    import msgpack

    from rgpu.protocol.ops import DTYPES, Event, Msg

    def desc(sid):
        return [sid, SIZE * 4, DTYPES.index("float32"), [SIZE], [1], 0, 0]
    setup = [[Msg.DEFINE, 1, "fill_.Scalar", "aten::fill_.Scalar(Tensor(a!) self, Scalar value) -> Tensor(a!)"],
             [Msg.OP, [], 1, [{"t": desc(1)}, 1.0], {}, None],
             [Msg.DEFINE, 2, "add.out",
              "aten::add.out(Tensor self, Tensor other, *, Scalar alpha=1, Tensor(a!) out) -> Tensor(a!)"]]
    ops = []
    for i in range(1, chain + 1):
        frees = [int(Event.FREE), base + i - 2] if i > 2 else []  # y's last-but-one value, freed by the client
        ops.append([Msg.OP, frees, 2, [{"t": desc(base + i - 1 if i > 1 else 1)}, 1.0],
                    {"out": {"t": desc(base + i)}}, None])
    pack = msgpack.packb
    return [pack(m, use_bin_type=True) for m in setup], [pack(m, use_bin_type=True) for m in ops]


def _executor(server_c: bool):
    from rgpu import config
    from rgpu.server.ops.executor import Executor
    from rgpu.server.route import Session

    return Executor(Session(id="bench", route="ops", settings=config.settings(environ={}, server_c=server_c)))


def rows(args=None) -> list[dict]:
    import msgpack
    import torch

    from rgpu.server.ops import fast_op

    repeats = 3 if getattr(args, "quick", False) else getattr(args, "repeats", 5) or 5
    setup, _ = messages(0)
    runs = iter([messages(base=(k + 1) * (CHAIN + 10))[1] for k in range(2 * (repeats + 1) + 1)])
    executors = {"cpp": _executor(True), "python": _executor(False)}
    if executors["cpp"].fast is None:
        fast_op.build()  # this bench is about that path: build it now rather than measure Python twice
        executors["cpp"].close()
        executors["cpp"] = _executor(True)
    device = executors["cpp"].table.devices[0]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    unpack = msgpack.unpackb

    for ex in executors.values():
        for f in setup:
            ex.handle(unpack(f, raw=False), [], False)

    def server(ex):
        def run():
            frames = next(runs)
            t0 = time.perf_counter()
            with ex.serving():
                for f in frames:
                    ex.handle(unpack(f, raw=False), [], False)
            sync()
            return (time.perf_counter() - t0) / CHAIN * 1e6
        return run

    def decode():
        frames = setup_free
        t0 = time.perf_counter()
        for f in frames:
            unpack(f, raw=False)
        return (time.perf_counter() - t0) / CHAIN * 1e6

    setup_free = messages(base=CHAIN * 1000)[1]  # the chain's frames, only decoded
    x = torch.ones(SIZE, device=device)

    def native():
        y = x
        sync()
        t0 = time.perf_counter()
        for _ in range(CHAIN):
            y = y + 1.0
        sync()
        return (time.perf_counter() - t0) / CHAIN * 1e6

    fast = executors["cpp"].fast
    parts = {"stack": [], "table": [], "call": [], "bind": []}

    def split():  # one run of the C++ path, its counters read around it
        counters = lambda: (fast.stack_ns, fast.table_ns, fast.call_ns, fast.bind_ns)  # noqa: E731
        before, ran = counters(), fast.ran
        got = server(executors["cpp"])()
        ran = fast.ran - ran
        for key, was, now in zip(parts, before, counters()):
            parts[key].append((now - was) / max(ran, 1) / 1e3)
        parts.setdefault("ran", []).append(ran)
        return got

    for fn in (split, server(executors["python"]), native):  # warm: ops defined, allocator and caches filled
        fn()
    for v in parts.values():
        v.clear()
    got = harness_median({"cpp": split, "python": server(executors["python"]), "decode": decode, "native": native},
                         repeats)
    for ex in executors.values():
        ex.close()
    med = {k: statistics.median(v) for k, v in parts.items()}
    base, name = got["native"][0], f"{device.type} eager (this process): dispatch + launch"
    where = f"in-process executor ({device.type})"
    split_of = "of the C++ path's message"
    rest = got["cpp"][0] - got["decode"][0] - med["stack"] - med["call"] - med["bind"]
    out = [
        _row("server cost per op message, C++ op path (add.out, 4 elements)", got["cpp"], name, base, where),
        _row("server cost per op message, Python op path", got["python"], name, base, where),
        _row(f"{split_of}: decode (msgpack)", got["decode"], name, base, where),
        _row(f"{split_of}: handle table (views looked up, fresh outputs made)", (med["table"],), name, base, where),
        _row(f"{split_of}: the other values to the op's stack", (med["stack"] - med["table"],), name, base, where),
        _row(f"{split_of}: aten call (dispatcher + kernel launch)", (med["call"],), name, base, where),
        _row(f"{split_of}: bind outputs, check written arguments", (med["bind"],), name, base, where),
        _row(f"{split_of}: rest (executor's Python around FastOps.op, frees)", (rest,), name, base, where),
        {**_row("ops the C++ path ran per run", (med["ran"],), "op messages", CHAIN, where), "unit": "count"},
    ]
    return out


def harness_median(fns: dict, repeats: int) -> dict:
    """Interleave the named functions ``repeats`` times; per name: (median, min, max)."""
    got = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            got[name].append(fn())
    return {name: (statistics.median(v), min(v), max(v)) for name, v in got.items()}


def _row(metric: str, value: tuple, baseline_name: str, baseline: float, transport: str) -> dict:
    spread = [value[1], value[2]] if len(value) == 3 else None
    return {"bench": "server_ops", "transport": transport, "metric": metric, "unit": "us", "size": SIZE * 4,
            "value": value[0], "baseline_name": baseline_name, "baseline": baseline,
            "ratio": value[0] / baseline if baseline else None, "spread": spread}


def main(argv=None) -> int:
    return harness.main(rows, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
