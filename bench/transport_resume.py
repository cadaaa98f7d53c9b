"""What resuming costs on tcp: a resumable session's 64 B round trip beside a plain one's, same run, interleaved.

    rgpu bench transport --transport tcp,tcp-resume [--quick] [--repeats 9]
    python -m rgpu.bench.transport --transport tcp-resume --sizes 64

Registers the transport ``tcp-resume`` with ``rgpu.bench.transport`` (its ``EXTRA_MODULES``): the rgpu
backend is an echo-route connection to a local ``rgpu serve`` with the default grace (the session is
resumable: every frame kept until acknowledged, both ends), the baseline the same connection to a
local ``rgpu serve`` with ``RGPU_SESSION_GRACE=0`` (a plain tcp session); both servers pinned apart
from the client as the transport suite pins its own. Only the round trip: big frames are never kept
(docs/perf/transport.md), so their bandwidth rows are tcp's. The ``tcp`` row of the same run puts
the resumable session beside the raw socket.
"""
from __future__ import annotations

from . import harness
from . import transport as suite

NAME = "tcp-resume"


def _session(ctx: suite.Context, grace: str | None, name: str, resumable: bool) -> suite.RgpuEcho:
    server = harness.LocalServer(cpus=ctx.server_cpus, env={"RGPU_SESSION_GRACE": grace} if grace else None)
    ctx._closers.append(server.stop)
    from rgpu.transport.resume import ResumingTransport

    backend = ctx.own(suite.RgpuEcho("tcp", server.address, server.token))
    if isinstance(backend.conn.transport, ResumingTransport) != resumable:   # the row would mean nothing
        raise RuntimeError(f"{name}: the session is {'' if not resumable else 'not '}resumable")
    backend.name = name
    return backend


def resume_pairs(ctx: suite.Context) -> dict:
    """The round trip of a resumable session (the default) beside a plain one (RGPU_SESSION_GRACE=0)."""
    resumable = _session(ctx, None, "rgpu tcp (resumable)", True)
    plain = _session(ctx, "0", "rgpu tcp (RGPU_SESSION_GRACE=0)", False)
    return {"rtt": (resumable, plain)}


suite.register(NAME, resume_pairs)
