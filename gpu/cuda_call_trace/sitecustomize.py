"""A driver-call trace of a program run through rgpu, for the GPU checks (gpu/check_cuda_static.sh).

    PYTHONPATH=gpu/cuda_call_trace rgpu intercept run -- PROGRAM 2> trace.txt

The interpreter inside rgpu's libcuda.so.1 imports this as ``sitecustomize``: one line on stderr for every
driver call Python answers (``call`` name, arguments, CUresult), every message sent to the server (``send``
op, context, arguments; byte buffers by size and first bytes) with its ``reply`` (code, value, failures of
earlier posts) and every launch record C queued (``launch``
function, context, stream, grid, block, shared bytes, argument bytes in hex). Calls C answers alone (the
context stack, device attributes) do not show. The launcher process imports it too and sends nothing.
"""
import sys

from rgpu.cuda_intercept import client, registry
from rgpu.protocol.cuda import LAUNCH, LAUNCH_KIND, RECORD_HEAD


def _say(text: str) -> None:
    sys.stderr.write(f"rgpu-trace {text[:600]}\n")


def _short(x):
    if isinstance(x, (str, int, float, list, dict, tuple)) or x is None:
        return x
    try:
        view = memoryview(x).cast("B")
    except TypeError:
        return repr(x)
    return f"<{view.nbytes} bytes {bytes(view[:16]).hex()}>"


class _Reply:
    """A request's future, saying the reply (code, value, deferred failures) when it comes."""

    def __init__(self, op, fut):
        self._op, self._fut = op, fut

    def __getattr__(self, name):
        return getattr(self._fut, name)

    def result(self, *a, **k):
        reply = self._fut.result(*a, **k)
        _say(f"reply {self._op} {reply.meta!r}")
        return reply


def _records(buf) -> None:
    data, pos = bytes(buf), 0
    while pos + RECORD_HEAD.size <= len(data):
        size, kind = RECORD_HEAD.unpack_from(data, pos)
        if kind == LAUNCH_KIND and pos + LAUNCH.size <= len(data):
            _, _, func, ctx, stream, gx, gy, gz, bx, by, bz, shared, nargs = LAUNCH.unpack_from(data, pos)
            args = data[pos + LAUNCH.size:pos + LAUNCH.size + nargs]
            _say(f"launch func={func:#x} ctx={ctx:#x} stream={stream:#x} grid=({gx},{gy},{gz}) "
                 f"block=({bx},{by},{bz}) shared={shared} arg_bytes={nargs} args={args.hex()}")
        else:
            _say(f"record kind={kind} size={size}")
        if size <= 0:
            break
        pos += size


class _Traced:
    """The client's connection, saying what it sends."""

    def __init__(self, conn):
        self._conn = conn

    def __getattr__(self, name):
        return getattr(self._conn, name)

    def _show(self, verb, meta, buffers):
        if meta and meta[0] == "launches" and buffers:
            _records(buffers[0])
        else:
            _say(f"send {verb} {[_short(m) for m in meta]} buffers={[_short(b) for b in buffers or ()]}")

    def post(self, meta, buffers=(), *a, **k):
        self._show("post", meta, buffers)
        return self._conn.post(meta, buffers, *a, **k)

    def request(self, meta, buffers=(), *a, **k):
        self._show("request", meta, buffers)
        return _Reply(meta[0] if meta else "?", self._conn.request(meta, buffers, *a, **k))


_connection = client.Client.connection


def connection(self):
    conn = _connection(self)
    if not isinstance(conn, _Traced):
        conn = self.conn = _Traced(conn)
    return conn


client.Client.connection = connection
_guard = registry._guard


def traced_guard(name, impl):
    inner = _guard(name, impl)

    def call(*args):
        rc = inner(*args)
        _say(f"call {name}{tuple(args)!r} -> {rc}")
        return rc
    call.__name__ = name
    return call


registry._guard = traced_guard
