"""``rgpu bench rtt``: a chain of streamed ops ending in one wait, behind a simulated round trip.

    rgpu bench rtt --json [--sim-rtt 1,10,30,100] [--repeats 7]     python -m rgpu.bench.rtt --json

The chain (200 small ops, then ``.cpu()``) costs its time at 0 ms plus one round
trip, however many ops it has: only the wait crosses the line. Value: the chain
at each round trip (``RGPU_SIM_RTT_MS``, switched on the live connection);
baseline: the chain at 0 ms plus that round trip, the two interleaved.
"""
from __future__ import annotations

import time

from rgpu.bench import harness

OPS = 200
DEFAULT_RTTS = "1,10,30,100"


def rows(args=None) -> list[dict]:
    import torch

    import rgpu
    from rgpu.device_backend import session
    from rgpu.transport.delay import set_rtt

    rgpu.register()  # the rgpu command loaded rgpu as a parent, which registers nothing
    repeats = 3 if getattr(args, "quick", False) else harness.repeats_of(args, 7)
    rtts = [float(v) for v in str(getattr(args, "sim_rtt", None) or DEFAULT_RTTS).split(",") if v.strip()]
    x = torch.ones(64, device="rgpu")
    conn = session.get().conn

    def chain_at(ms):
        def run():
            set_rtt(conn, ms)
            try:
                y = x
                t0 = time.perf_counter()
                for _ in range(OPS // 2):
                    y = y * 1.01 + 0.5
                y.cpu()
                return (time.perf_counter() - t0) * 1e3
            finally:
                set_rtt(conn, 0)
        return run

    at_zero = chain_at(0)
    for _ in range(3):
        at_zero()  # warm: ops defined, meta cache filled
    out = []
    for ms in rtts:
        result = harness.compare(chain_at(ms), lambda: at_zero() + ms, repeats)
        out.append(harness.row("rtt", conn.transport_name, f"chain of {OPS} ops and one wait at {ms:g} ms", None,
                               result, "the chain at 0 ms + 1 round trip", unit="ms"))
    return out


def main(argv=None) -> int:
    return harness.main(rows, argv, __doc__, repeats=7,
                        flags={"--sim-rtt": {"default": DEFAULT_RTTS, "help": "comma list of round trips in ms"}})


if __name__ == "__main__":
    raise SystemExit(main())
