"""``rgpu bench streams``: big transfers over tcp on one stream and on several (RGPU_TCP_STREAMS), beside a raw socket.

    rgpu bench streams [--json] [--quick] [--sizes 16M,256M,1G] [--streams 4] [--tls] [--no-pin]
    python -m rgpu.bench.streams [same flags]

Rows, each the transport suite's bandwidth rows (upload: a ``checksum`` request; download: ``fill``
received into a preallocated buffer; ``rgpu.bench.transport``), interleaved with their baseline:

- ``tcp x1``: one stream, beside the raw socket (a Python socket pair in two processes);
- ``tcp xN``: N streams (``--streams``, default 4), beside the same raw socket;
- with ``--tls``: ``tcp+tls xN``, TLS on each of the N streams, beside plain ``tcp xN``; and the same TLS
  session beside one whose ends read records in Python (``RGPU_SHM_C=0``: ``tls_fast.py``'s C reads off);
- ``rtt``: the 64 B round trip on N streams beside one (what striping costs a call that is not striped).

Each rgpu row has its own local ``rgpu serve`` started with ``RGPU_TCP_STREAMS`` set to its count, its
client asking as many; servers pinned apart from the client as the transport suite pins them. On a
machine of few cores expect little from more streams: each one's copy wants a core of its own.
"""
from __future__ import annotations

from pathlib import Path

from . import harness
from . import transport as suite

SIZES = (4 << 20, 64 << 20, 256 << 20)
QUICK_SIZES = (4 << 20, 64 << 20)


class RgpuStreams(suite.RgpuEcho):
    """The echo route over tcp on ``streams`` streams (and TLS, the certificate pinned, with ``fingerprint``)."""

    def __init__(self, address: str, token: str, streams: int, fingerprint: str | None = None, use_c: bool = True):
        from rgpu import config
        from rgpu.transport.client import connect

        self.name = f"rgpu tcp{'+tls' if fingerprint else ''} x{streams}{'' if use_c else ' (Python reads)'}"
        extra = {"tls_fingerprint": fingerprint} if fingerprint else {}
        if not use_c:
            extra["shm_c"] = False
        self.conn = connect("echo", settings=config.settings(environ={}, server=address, token=token, transport="tcp",
                                                             tcp_streams=streams, **extra))
        got = getattr(self.conn.transport, "_inner", self.conn.transport)
        have = getattr(got, "stream_count", 1)
        if have != streams:
            raise RuntimeError(f"asked for {streams} tcp streams, the session has {have}")
        self._out = [suite.np.arange(suite.PING_BYTES, dtype=suite.np.uint8)]
        self._back = [memoryview(bytearray(suite.PING_BYTES))]


def _backend(ctx: suite.Context, streams: int, tls: bool = False, use_c: bool = True) -> RgpuStreams:
    from rgpu.transport.tls import CERT_NAME, file_fingerprint

    env = {"RGPU_TCP_STREAMS": str(streams), **({} if use_c else {"RGPU_SHM_C": "0"})}
    server = harness.LocalServer(["--tls"] if tls else [], cpus=ctx.server_cpus, env=env)
    ctx._closers.append(server.stop)
    pin = file_fingerprint(Path(server.folder) / CERT_NAME) if tls else None
    return ctx.own(RgpuStreams(server.address, server.token, streams, pin, use_c))


def rows(args=None) -> list[dict]:
    args = args or parse_args([])
    quick = getattr(args, "quick", False)
    sizes = harness.parse_sizes(getattr(args, "sizes", None), QUICK_SIZES if quick else SIZES)
    repeats = harness.repeats_of(args, 3)
    budget = suite.RUN_SECONDS / 3 if quick else suite.RUN_SECONDS
    n = max(2, int(getattr(args, "streams", 4)))   # (`rgpu bench streams` has no --streams: this module's own CLI does)
    out = []
    with suite.Context(args) as ctx, harness.pinned(ctx.client_cpus):
        raw = ctx.own(suite.RawSocket(*ctx.raw_server()))
        one, many = _backend(ctx, 1), _backend(ctx, n)
        pairs = [("tcp x1", one, raw), (f"tcp x{n}", many, raw)]
        if getattr(args, "tls", False):
            tls = _backend(ctx, n, tls=True)
            pairs += [(f"tcp+tls x{n}", tls, many),
                      (f"tcp+tls x{n} C reads", tls, _backend(ctx, n, tls=True, use_c=False))]
        # what the streams cost a small call (every send looks at its size): the 64 B round trip, N beside 1
        out += suite.transport_rows(f"tcp x{n}", {"rtt": (many, one)}, [], repeats, budget)
        for name, rgpu, base in pairs:
            out += suite.transport_rows(name, {"bandwidth": (rgpu, base), "download": (rgpu, base)}, sizes, repeats,
                                        budget)
    return out


FLAGS = {
    "--sizes": {"help": "comma list of sizes, e.g. 16M,256M,1G"},
    "--streams": {"default": 4, "type": int, "help": "streams of the many-stream rows (default 4)"},
    "--tls": {"action": "store_true", "help": "also TLS over those streams, beside plain tcp on as many"},
    "--no-pin": {"dest": "pin", "action": "store_false", "help": "leave the processes where the scheduler puts them"},
}


def parse_args(argv):
    return harness.parser(__doc__, repeats=3, flags=FLAGS, prog="python -m rgpu.bench.streams").parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    return harness.show(harness.run_suite("streams", args), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
