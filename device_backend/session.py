"""The client's session with the server's ops route: started on first use of the device.

Owns the connection, the op index (each op's name and schema sent once, then
an integer), the allocator's event log that rides along with every message,
and the bulk transfers (``transfers.py``). ``use()`` swaps in another connection (tests run the executor in-process).
"""
from __future__ import annotations

import atexit
import sys
import threading

import torch

from rgpu.ops_protocol import Msg

from . import build
from .transfers import Transfers

_lock = threading.RLock()
_session: "Session | None" = None


class Session:
    def __init__(self, conn, C):
        self.conn, self.C = conn, C
        self.lock = threading.RLock()  # ops come from the main thread and autograd's device threads
        self.ops: dict = {}
        w = (conn.welcome or {}).get("info") or {}  # what the ops executor's welcome() said
        self.kind = w.get("device", "cpu")
        self.names = list(w.get("names", ["rgpu"]))
        self.count = int(w.get("device_count", len(self.names)))
        self.server_torch = w.get("torch")
        self.devtype = torch._C._get_privateuse1_backend_name()
        C.set_device_count(self.count)
        self.transfers = Transfers(self)   # uploads and downloads of tensors' bytes

    def _index(self, op) -> int:
        idx = self.ops.get(op)
        if idx is None:
            idx = self.ops[op] = len(self.ops) + 1
            name = f"{op._schema.name[6:]}.{op._overloadname}"
            self.conn.post([Msg.DEFINE, idx, name, str(op._schema)])
        return idx

    def post_op(self, op, args, kwargs, outs) -> None:
        with self.lock:
            self.conn.post([Msg.OP, self.C.drain_events(), self._index(op), args, kwargs, outs])

    def call_op(self, op, args, kwargs, first_id: int, count: int):
        with self.lock:
            fut = self.conn.request([Msg.CALL, self.C.drain_events(), self._index(op), args, kwargs, first_id, count])
        reply = fut.result()
        reply.release()
        return reply.meta[0]

    def post(self, meta: list) -> None:
        with self.lock:
            self.conn.post(meta)

    def request(self, meta: list):
        with self.lock:
            fut = self.conn.request(meta)
        reply = fut.result()
        reply.release()
        return reply.meta

    def flush_events(self) -> None:
        with self.lock:
            events = self.C.drain_events()
            if events:
                self.conn.post([Msg.EVENTS, events])

    def close(self) -> None:
        try:
            self.flush_events()
            self.conn.close()
        except Exception:  # the server may already be gone at exit
            pass


def current() -> Session | None:
    return _session


def get() -> Session:
    """The session, started (C++ part loaded, server connected) on first use."""
    s = _session
    if s is not None:
        return s
    with _lock:
        if _session is None:
            C = build.load()
            from rgpu.transport.client import connect

            use(connect("ops", options={"torch": torch.__version__, "python": sys.version.split()[0]}), C)
        return _session


def use(conn, C=None) -> Session:
    """Make ``conn`` the session's connection (closing the previous one)."""
    global _session
    from . import registration

    with _lock:
        old, _session = _session, Session(conn, C or build.load())
        fast = fast_path()
        registration.fast_path(_session, fast)
        if old is not None:
            old.close()
            from . import meta

            meta.clear()
        else:
            registration.claim_composites(_session.C, fast)
            atexit.register(lambda: _session is not None and _session.close())
            atexit.register(registration.settle_autograd_at_exit)  # runs first (last in, first out)
        from . import torch_rgpu

        torch_rgpu.send_pending_seeds(_session)
    return _session


def fast_path() -> bool:
    """Whether ops whose plan is known stream from C++ (``RGPU_FAST_PATH``, read when a session starts)."""
    from rgpu import config

    return config.settings().fast_path


def stats(reset: bool = False) -> dict:
    """transport, messages, round_trips, bytes_out, bytes_in since import (or the last reset)."""
    s = _session
    counts = dict(s.conn.stats) if s is not None else {"messages": 0, "round_trips": 0, "bytes_out": 0, "bytes_in": 0}
    base = _baseline.get(id(s), {})
    out = {"transport": getattr(s.conn, "transport_name", None) if s is not None else None}
    out.update({k: v - base.get(k, 0) for k, v in counts.items()})
    if reset:
        _baseline.clear()
        _baseline[id(s)] = counts
    return out


_baseline: dict = {}
