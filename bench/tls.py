"""What TLS costs on the tcp transport: rgpu over TLS beside rgpu over plain tcp, same run, interleaved.

    rgpu bench transport --tls [--quick] [--sizes ...]   the transport suite's rows, plus "tcp+tls" rows
    rgpu bench tls [--json] [--quick]                    the "tcp+tls" rows alone, plus small posts

Registers the transport ``tcp+tls`` with ``rgpu.bench.transport``: the rgpu
backend is an echo-route connection to a local ``rgpu serve --tls`` (its
self-signed certificate pinned), the baseline the same connection to a plain
local ``rgpu serve``; both forced to tcp, servers pinned apart from the client
as the transport suite does. Every figure: round trip, upload and download
bandwidth by size, and here also the cost of one small post (64 B, batched by
the I/O thread), where joining a batch's parts into one TLS write matters.
"""
from __future__ import annotations

import time
from pathlib import Path

from . import harness
from . import transport as suite

NAME = "tcp+tls"
POSTS = 2000


class RgpuTls(suite.RgpuEcho):
    """The echo route over TLS, the server's certificate pinned."""

    def __init__(self, address: str, token: str, fingerprint: str):
        from rgpu import config
        from rgpu.transport.client import connect

        self.name = "rgpu tcp+tls"
        self.conn = connect("echo", settings=config.settings(environ={}, server=address, token=token,
                                                             transport="tcp", tls_fingerprint=fingerprint))
        assert self.conn.transport.tls
        self._out = [suite.np.arange(suite.PING_BYTES, dtype=suite.np.uint8)]   # one part, as RgpuEcho sends
        self._back = [memoryview(bytearray(suite.PING_BYTES))]


def _servers(ctx: suite.Context) -> tuple[suite.RgpuEcho, RgpuTls]:
    """(plain, TLS) backends on two local servers of this run (``--server`` is not used: both must be alike)."""
    from rgpu.transport.tls import CERT_NAME, file_fingerprint

    plain_server = harness.LocalServer(cpus=ctx.server_cpus)
    ctx._closers.append(plain_server.stop)
    tls_server = harness.LocalServer(["--tls"], cpus=ctx.server_cpus)
    ctx._closers.append(tls_server.stop)
    plain = ctx.own(suite.RgpuEcho("tcp", plain_server.address, plain_server.token))
    plain.name = "rgpu tcp (plain)"
    pin = file_fingerprint(Path(tls_server.folder) / CERT_NAME)  # made beside the server's token file
    return plain, ctx.own(RgpuTls(tls_server.address, tls_server.token, pin))


def tls_pairs(ctx: suite.Context) -> dict:
    plain, secure = _servers(ctx)
    return {"bandwidth": (secure, plain), "download": (secure, plain), "rtt": (secure, plain)}


suite.register(NAME, tls_pairs)


def _posts_fn(backend, n: int = POSTS):
    small = b"x" * 64

    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            backend.conn.post({"op": "sizes"}, [small])
        backend.conn.call({"op": "sizes"})
        return (time.perf_counter() - t0) / n * 1e6
    return run


def rows(args=None) -> list[dict]:
    """``rgpu bench tls``: the ``tcp+tls`` transport rows, then the small-post row."""
    args = args or suite.parse_args([])
    args.transport = NAME
    out = suite.rows(args)
    ctx = suite.Context(args)
    try:
        plain, secure = _servers(ctx)
        for b in (plain, secure):
            _posts_fn(b, 200)()
        result = harness.compare(_posts_fn(secure), _posts_fn(plain), harness.repeats_of(args))
        out.append(harness.row("transport", NAME, "small post", 64, result, plain.name, unit="us"))
    finally:
        ctx.close()
    return out
