"""The servers of one session: each its connection, its devices (``rgpu:first..``), its op index and transfers.

``RGPU_SERVER=hostA:9713,hostB:9713`` makes one session of several servers:
``rgpu:0..N-1`` are every server's devices in order, server 0's first. Each
server's worker is told the index of its first device (hello option
``device_offset``), so descriptors carry the same device index on both ends
and nothing translates it here. An op goes to the server of its device; the
allocator's events, logged once for every device, are split here: a storage's
growth goes to its device's server, a free to every server (ids are minted
once for all of them, so a server that never held one ignores it).
"""
from __future__ import annotations

from bisect import bisect_right

from rgpu.errors import ConnectionLost, SessionLost
from rgpu.protocol.ops import EVENT_FIELDS, Event, Msg

PENDING_MAX = 1 << 16  # ints of events held for one server before they are sent without an op


class Server:
    """One server: ``conn`` and what its welcome said; duck-types a session for ``Transfers``."""

    def __init__(self, conn, C, lock, first: int, where: str):
        self.conn, self.C, self.lock, self.first, self.where = conn, C, lock, first, where
        info = (conn.welcome or {}).get("info") or {}   # what the ops executor's welcome() said
        self.kind = info.get("device", "cpu")
        self.names = list(info.get("names", ["rgpu"]))
        self.count = int(info.get("device_count", len(self.names)))
        self.torch = info.get("torch")
        self.peer_port = info.get("peer_port")
        self.ops: dict = {}          # op -> this server's index for it (each server has its own DEFINEs)
        self.pending: list = []      # allocator events bound here, not sent yet (several servers)
        self.events = C.drain_events  # several servers: Servers.events_for(self), set there

    @property
    def host(self) -> str:
        return self.where.rpartition(":")[0].strip("[]")

    def devices(self) -> str:
        last = self.first + self.count - 1
        return f"rgpu:{self.first}" if last == self.first else f"rgpu:{self.first}..{last}"

    def request(self, meta: list):
        with self.lock:
            fut = self.conn.request(meta)
        reply = fut.result()
        reply.release()
        return reply.meta


class Servers:
    """Every server of the session, in device order; which one a device is on; their events; a failure."""

    def __init__(self, conns: list, C, lock, wheres: list[str]):
        self.C = C
        self.all: list[Server] = []
        first = 0
        for conn, where in zip(conns, wheres):
            server = Server(conn, C, lock, first, where)
            first += server.count
            self.all.append(server)
        self.count = first
        self.firsts = [s.first for s in self.all]
        self.failed: Exception | None = None
        if len(self.all) > 1:
            for server in self.all:
                server.events = (lambda server=server: self.events_for(server))

    def of(self, device: int | None) -> Server:
        """The server holding ``rgpu:device`` (None: the current device's)."""
        if len(self.all) == 1:
            return self.all[0]
        if self.failed is not None:
            raise self.failed
        if device is None:
            device = self.C.current_device()
        if not 0 <= device < self.count:
            raise RuntimeError(f"rgpu:{device} does not exist (the servers have {self.count} devices)")
        return self.all[bisect_right(self.firsts, device) - 1]

    def of_values(self, args, kwargs, device: int | None) -> Server:
        """The server of an op's tensors (wire form), refusing tensors on two servers, naming both."""
        server = self.of(device)
        if len(self.all) > 1:
            for dev in _devices([args, list(kwargs.values()) if kwargs else []]):
                other = self.of(dev)
                if other is not server:
                    raise RuntimeError(
                        "Expected all tensors to be on the same server, but found at least two: "
                        f"rgpu:{device} (server {server.where}) and rgpu:{dev} (server {other.where}); "
                        "copy one over first (.to(...))")
        return server

    def sender(self, server: Server):
        """``server``'s ``post_packed`` for the C++ fast path: a server gone is named as ``Session._on`` names it."""
        post = server.conn.post_packed

        def send(meta: bytes, buffers=()):
            if self.failed is not None:
                raise self.failed
            try:
                return post(meta, buffers)
            except FAILURES as exc:
                raise self.lost(server, exc) from None
        return send

    def events_for(self, target: Server) -> list:
        """The allocator's events due at ``target`` (held by the session's lock): new ones split first."""
        events = self.C.drain_events()
        i, n = 0, len(events)
        while i < n:
            kind = events[i]
            width = 1 + EVENT_FIELDS[kind]
            record = events[i:i + width]
            if kind == Event.COPY:
                self.of(record[3]).pending.extend(record)
            else:   # a free: every server (only the one holding the id has it)
                for server in self.all:
                    server.pending.extend(record)
            i += width
        out, target.pending = target.pending, []
        for server in self.all:   # a server no op goes to for long: its frees go on their own, bounded here
            if len(server.pending) > PENDING_MAX:
                events, server.pending = server.pending, []
                server.conn.post([Msg.EVENTS, events])
        return out

    def lost(self, server: Server, exc: BaseException) -> SessionLost:
        """One server failed: the others' sessions are closed, and every later use raises this error."""
        if self.failed is None:
            others = [s for s in self.all if s is not server]
            self.failed = SessionLost(
                f"server {server.where} ({server.devices()}) failed: {exc}; the session's other servers "
                f"({', '.join(s.where for s in others)}) were released")
            for other in others:
                try:
                    other.conn.close()
                except Exception:  # closing what may be gone as well
                    pass
        return self.failed

    def close(self) -> None:
        for server in self.all:
            try:
                server.conn.close()
            except Exception:  # the server may already be gone at exit
                pass


FAILURES = (ConnectionLost, OSError)  # a server gone, rather than an op of it failing


def _devices(v):
    """Device indices of the tensors in an op's wire values (descriptors: tag "t", or "j" with math bits)."""
    t = type(v)
    if t is list or t is tuple:
        for x in v:
            yield from _devices(x)
    elif t is dict:
        if "t" in v:
            yield v["t"][6]
        elif "j" in v:
            yield v["j"][0][6]
