"""Where a streamed op's time goes: wall and CPU per op, split by thread and by process.

    python -m rgpu.bench.client_profile --json [--ops 5000]     (RGPU_TRANSPORT picks the transport)

A chain of small adds (as ``rgpu bench ops``), once warm. Per op: the wall time
to enqueue, the CPU time of the calling thread and of the connection's I/O
thread (``pthread_getcpuclockid``: exact, immune to other load), the server
processes' CPU (``/proc``, 10 ms ticks: use enough ops), how many writes the
transport made (ops per write = the I/O thread's batching), and how often a
writer had to wake the peer. A diagnosis tool, not a target: no baseline row.
"""
from __future__ import annotations

import os
import time

from rgpu.bench import harness

OPS = 5000  # enough for the server's 10 ms ticks; one run, so --quick and --repeats change nothing


def _cpu(thread) -> float:
    if thread is None:
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, ProcessLookupError):
        return 0.0


def _children_cpu(root: int) -> float:
    """User + system seconds of every live descendant of ``root`` (the local server and its workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    kids, total, stack = {}, 0.0, [root]
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                kids.setdefault(int(fields[1]), []).append((int(pid), int(fields[11]) + int(fields[12])))
            except (OSError, IndexError, ValueError):
                pass
    while stack:
        for pid, ticks in kids.get(stack.pop(), []):
            total += ticks / tick
            stack.append(pid)
    return total


class _Counts:
    """Counts the transport's writes and the peer wake-ups (eventfd writes) while installed."""

    def __init__(self, transport):
        self.transport, self.writes, self.frames, self.wakes = transport, 0, 0, 0
        self._send, self._wake = transport.send, os.eventfd_write if hasattr(os, "eventfd_write") else None

    def __enter__(self):
        send, wake = self._send, self._wake

        def counted_send(parts):
            self.writes += 1
            self.frames += len(parts)
            return send(parts)

        def counted_wake(fd, value):
            self.wakes += 1
            return wake(fd, value)

        self.transport.send = counted_send
        if wake is not None:
            os.eventfd_write = counted_wake
        return self

    def __exit__(self, *exc):
        del self.transport.send
        if self._wake is not None:
            os.eventfd_write = self._wake


def rows(args=None) -> list[dict]:
    import torch

    import rgpu
    from rgpu.device_backend import session

    rgpu.register()  # the rgpu command loaded rgpu as a parent, which registers nothing
    n = getattr(args, "ops", None) or OPS
    x = torch.ones(4, device="rgpu")
    y = x
    for _ in range(50):
        y = y + 1.0
    y.cpu()
    conn = session.current().conn
    io = conn._io_thread
    main_thread = __import__("threading").main_thread()
    with _Counts(conn.transport) as counts:
        torch.rgpu.synchronize()
        server0, main0, io0 = _children_cpu(os.getpid()), _cpu(main_thread), _cpu(io)
        t0 = time.perf_counter()
        y = x
        for _ in range(n):
            y = y + 1.0
        enqueued = time.perf_counter() - t0
        main1, io1 = _cpu(main_thread), _cpu(conn._io_thread)
        y.cpu()
        whole = time.perf_counter() - t0
        server1 = _children_cpu(os.getpid())
    per = 1e6 / n
    stats = rgpu.stats()
    return [{"bench": "client_profile", "transport": stats["transport"], "ops": n,
             "enqueue_us_per_op": enqueued * per, "chain_us_per_op": whole * per,
             "main_cpu_us_per_op": (main1 - main0) * per, "io_thread_cpu_us_per_op": (io1 - io0) * per,
             "server_cpu_us_per_op": (server1 - server0) * per,
             "ops_per_write": n / counts.writes if counts.writes else None,
             "frames_per_write": counts.frames / counts.writes if counts.writes else None,
             "wakes_per_op": counts.wakes / n}]


def _lines(rows: list[dict]) -> str:
    """One ``name value`` line per figure: these rows are a profile, not the harness's comparison table."""
    return "\n".join(f"{k:26s} {v:.2f}" if isinstance(v, float) else f"{k:26s} {v}" for r in rows for k, v in r.items())


def main(argv=None) -> int:
    return harness.main(rows, argv, __doc__, text=_lines,
                        flags={"--ops": {"type": int, "default": OPS, "help": "ops in the chain"}})


if __name__ == "__main__":
    raise SystemExit(main())
