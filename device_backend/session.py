"""The client's session with the server's ops route: started on first use of the device.

Owns the connection, the op index (each op's name and schema sent once, then
an integer), the allocator's event log that rides along with every message,
and the bulk transfers (``transfers.py``). A leaf: ``startup`` builds the
session and installs it here (``startup.use`` swaps in another connection:
tests run the executor in-process); ``get()`` starts it through ``starter``.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

from rgpu.errors import RgpuError
from rgpu.protocol.ops import Msg

from .transfers import Transfers

lock = threading.RLock()  # held while a session starts or is swapped
starter: "Callable[[], object] | None" = None  # startup.start, set by register()
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
    """The session, started on first use (by ``starter``: ``startup.start``, which ``register()`` sets)."""
    s = _session
    if s is not None:
        return s
    with lock:
        if _session is None:
            if starter is None:
                raise RgpuError("the rgpu device is not registered: call rgpu.register() (import rgpu does)")
            starter()
        return _session


def install(s: Session) -> Session | None:
    """Make ``s`` the session (``startup.use``); the previous one, if any, is returned for closing."""
    global _session
    old, _session = _session, s
    return old


def close_current() -> None:
    """At exit: the session's last events go, its connection closes."""
    if _session is not None:
        _session.close()


def stats(reset: bool = False) -> dict:
    """transport, messages, round_trips, bytes_out, bytes_in since import (or the last reset)."""
    s = _session
    counts = dict(s.conn.stats) if s is not None else {"messages": 0, "round_trips": 0, "bytes_out": 0, "bytes_in": 0}
    base = _baseline.get(id(s), {})
    out = {"transport": s.conn.transport_name if s is not None else None}
    out.update({k: v - base.get(k, 0) for k, v in counts.items()})
    if reset:
        _baseline.clear()
        _baseline[id(s)] = counts
    return out


_baseline: dict = {}
