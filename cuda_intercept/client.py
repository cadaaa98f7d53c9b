"""The interceptor's client: one connection to the cuda route, the order calls go in, and the errors that come back.

Everything leaves through ``post`` (no answer) or ``call`` (waits); both first
post the launch records queued in C, under one lock, so the server runs calls
in exactly the order the program made them.  Failures of posted calls come
back with the next answer and are returned by the next synchronising call.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter

from rgpu.protocol.cuda import NO_STREAM

from .registry import CUDA_SUCCESS, CudaCallError, say_once

API_VERSION = 13000      # the driver API this interceptor implements (cuda.h's CUDA_VERSION)
_client: "Client | None" = None


def get() -> "Client":
    if _client is None:
        raise CudaCallError(3, "the interceptor is not attached")
    return _client


def attach(ffi, lib, connect=None) -> "Client":
    """Make the process's client (``connect``: a factory of connections; tests pass a loopback)."""
    global _client
    _client = Client(ffi, lib, connect)
    return _client


class Client:
    def __init__(self, ffi, lib, connect=None):
        self.ffi, self.lib = ffi, lib
        self._connect = connect
        self.conn = None
        self.lock = threading.RLock()
        self.pending = CUDA_SUCCESS          # first failure of a posted call, for the next sync
        self.init_info: dict | None = None
        self.server_version = API_VERSION
        self.keep: dict[str, dict] = {}      # cffi memory handed to the program, by kind and address
        self.waits: Counter = Counter()       # answered calls (round trips) by name: RGPU_CUDA_WAIT_REPORT
        self.sent = threading.local()         # .gen: the generation this thread's last call went out at (C's proofs)

    # ---- connection ------------------------------------------------------------------
    def connection(self):
        if self.conn is None:
            with self.lock:
                if self.conn is None:
                    if self._connect is not None:
                        self.conn = self._connect()
                    else:
                        with self._without_us():
                            from rgpu.transport import fastcopy
                            from rgpu.transport.client import connect
                            # we live inside the program: no numba compile in a background thread here
                            # (it holds the GIL against every driver call, 5 ms each; fastcopy.memcpy_only)
                            fastcopy.memcpy_only()
                            self.conn = connect("cuda", options={"api": API_VERSION})
        return self.conn

    @contextlib.contextmanager
    def _without_us(self):
        """The environment without our library folder while connecting (LD_LIBRARY_PATH, LD_AUDIT,
        LD_PRELOAD, RGPU_LIBRARY_DIR, TRITON_LIBCUDA_PATH): a local server started now must load the
        real driver (and torch's libraries), never this interceptor."""
        from .libraries import LIBRARY_DIR, without
        ours = os.path.dirname(self.ffi.string(self.lib.rgpu_self_path()).decode())
        env = dict(os.environ)
        for folder in {ours, env.get(LIBRARY_DIR, "")} - {""}:
            env = without(folder, env)
        # only the variables that change, so other threads never see an emptied environment
        saved = {k: v for k, v in os.environ.items() if env.get(k) != v}
        for k in saved:
            if k in env:
                os.environ[k] = env[k]
            else:
                del os.environ[k]
        try:
            yield
        finally:
            os.environ.update(saved)

    def close(self) -> None:
        with self.lock:
            if self.conn is not None:
                try:
                    self.drain()
                    self.conn.close()
                finally:
                    self.conn = None

    # ---- sending ---------------------------------------------------------------------
    def ctx(self) -> int:
        return self.lib.rgpu_ctx_current()

    def drain(self) -> None:
        """Post the launch records queued in C (call with the lock held)."""
        n = self.ffi.new("size_t[2]")
        q = self.lib.rgpu_queue_take(n, n + 1)
        if q == self.ffi.NULL:
            return
        try:
            if n[0]:
                self.conn.post(["launches", 0], [self.ffi.buffer(q, n[0])])
        finally:
            self.lib.rgpu_queue_free(q)

    def post(self, op: str, *args, buffers=(), ctx: int | None = None) -> None:
        conn = self.connection()
        with self.lock:
            self.drain()
            self.lib.rgpu_work_note()         # new work may follow: no stream is known idle (shim_queue.c)
            conn.post([op, self.ctx() if ctx is None else ctx, *args], buffers)

    def call(self, op: str, *args, buffers=(), into=None, sync: bool = False, ctx: int | None = None):
        """Run ``op`` and wait: returns (value, reply buffers); raises CudaCallError for a failed call.

        ``sync``: this call synchronises, so an earlier posted failure is its result.
        ``ctx``: the context to run it in (default: the calling thread's current one).
        """
        conn = self.connection()
        if op != "lib_call":                  # calls_libs counts those by the library call's name
            self.waits[op] += 1
        # the lock keeps the queue's records and this call in order: held until the call is written (sent()),
        # not while its answer comes, so other threads' calls go on meanwhile. The connection's lone call (no
        # future: shm's is one C call) halves an idle .item() on the GPU host (docs/perf/cuda_route.md)
        lock = self.lock
        lock.acquire()
        held = [True]

        def sent():
            held[0] = False
            lock.release()
        try:
            self.drain()
            self.sent.gen = self.lib.rgpu_work_note()
            reply = conn.call([op, self.ctx() if ctx is None else ctx, *args], buffers, reply_into=into, sent=sent)
        finally:
            if held[0]:
                lock.release()
        code, value, deferred = reply.meta
        bufs = reply.buffers
        self._note_deferred(deferred)
        if code:
            reply.release()
            raise CudaCallError(code, "" if code in (600,) else str(value))
        if sync and self.pending:
            code, self.pending = self.pending, CUDA_SUCCESS
            reply.release()
            raise CudaCallError(code)
        if not bufs:
            reply.release()
            return value, []
        return value, (bufs, reply)

    def _note_deferred(self, deferred) -> None:
        for op, code, message in deferred or ():
            say_once(f"{op} failed on the server (reported at the next synchronisation): {message}")
            if not self.pending:
                self.pending = code

    def idle(self, stream: int | None, ctx: int | None = None) -> None:
        """The reply to this thread's last call showed ``stream`` (None: the whole context) idle: C may answer
        the next synchronisation of it while nothing new is sent (shim_queue.c says the rule)."""
        if not self.pending:
            self.lib.rgpu_idle_note(self.ctx() if ctx is None else ctx,
                                    NO_STREAM if stream is None else stream, self.sent.gen)

    def sync_point(self) -> None:
        """For synchronising calls answered locally: report a pending failure."""
        if self.pending:
            code, self.pending = self.pending, CUDA_SUCCESS
            raise CudaCallError(code)
