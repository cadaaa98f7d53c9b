"""A TCP proxy for the resume tests: forwards a port here to the server, and cuts chosen connections.

    proxy = CuttingProxy(("127.0.0.1", port), {0: Cut("up", offset=5000), 1: Cut("down", kind=12)})
    proxy.address                      "127.0.0.1:NNNN", for RGPU_SERVER
    proxy.refusing = True              later connections are closed at once (a server out of reach)
    proxy.cuts_done                    [(connection index, direction, offset in that direction's stream)]

A cut is made on connection ``i`` (counted from 0, in accept order) in one direction: ``up`` (client to
server) or ``down``; at byte ``offset`` of that direction's stream past the handshake (the end of its PROOF
up, of its WELCOME down), or inside the ``nth``
frame of message ``kind`` (at least ``min_bytes`` long) at ``fraction`` of its length (0: before its first
byte), or (``at``) at that byte of the direction's whole stream, for TLS. Both sockets of the pair are then shut, so each end sees its connection drop (``silent``: only the
client's, so the server's end hears nothing, as over a link that died).
"""
from __future__ import annotations

import socket
import struct
import threading
from dataclasses import dataclass

HEADER = struct.Struct("<4sHHIQQII")


@dataclass
class Cut:
    direction: str
    offset: int | None = None
    kind: int | None = None
    nth: int = 1
    min_bytes: int = 0
    fraction: float = 0.0
    silent: bool = False      # only the client's side is shut: the server's stays open, as a dead link leaves it
    at: int | None = None     # at this byte of the direction's stream, from its first, nothing parsed (TLS)
    reset: bool = False       # both sides reset (RST), as a crashed middlebox does: a blocked send fails at once


class _Walker:
    """Frame boundaries in one direction's byte stream; where ``cut`` says to cut, once known."""

    def __init__(self, cut: Cut | None):
        self.cut, self.pos, self.hdr, self.left, self.seen = cut, 0, bytearray(), 0, 0
        self.cut_at = None

    def feed(self, data: bytes) -> None:
        if self.cut is not None and self.cut.at is not None:   # ciphertext: no frames to walk
            self.cut_at, self.pos = self.cut.at, self.pos + len(data)
            return
        i, n = 0, len(data)
        while i < n:
            if self.left:
                step = min(self.left, n - i)
                self.left -= step
                i += step
                continue
            if len(self.hdr) < HEADER.size:
                need = HEADER.size - len(self.hdr)
            else:
                need = HEADER.size + 8 * self._nbufs() - len(self.hdr)
            take = data[i:i + need]
            self.hdr += take
            i += len(take)
            if len(self.hdr) < HEADER.size or len(self.hdr) < HEADER.size + 8 * self._nbufs():
                continue
            _, _, kind, _, _, _, meta_len, nbufs = HEADER.unpack_from(self.hdr)
            lengths = struct.unpack_from(f"<{nbufs}Q", self.hdr, HEADER.size) if nbufs else ()
            total = len(self.hdr) + meta_len + sum(lengths)
            start = self.pos + i - len(self.hdr)
            self.left = total - len(self.hdr)
            self.hdr = bytearray()
            c = self.cut
            if c is not None and c.offset is not None and kind in (3, 4):   # PROOF, WELCOME: the handshake's end
                self.cut_at = start + total + c.offset
            if c is not None and c.kind == kind and total >= c.min_bytes and self.cut_at is None:
                self.seen += 1
                if self.seen == c.nth:
                    self.cut_at = start + int(c.fraction * total)
        self.pos += n

    def _nbufs(self) -> int:
        return HEADER.unpack_from(self.hdr)[7] if len(self.hdr) >= HEADER.size else 0


class CuttingProxy:
    def __init__(self, target: tuple[str, int], cuts: dict | None = None):
        self.target, self.cuts = target, dict(cuts or {})
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.count, self.cuts_done, self.refusing = 0, [], False
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            index, self.count = self.count, self.count + 1
            if self.refusing:
                client.close()
                continue
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            cut = self.cuts.get(index)
            pair = (client, server)
            for src, dst, direction in ((client, server, "up"), (server, client, "down")):
                mine = cut if cut is not None and cut.direction == direction else None
                threading.Thread(target=self._pump, args=(src, dst, _Walker(mine), pair, index, direction),
                                 daemon=True).start()

    def _pump(self, src, dst, walker: _Walker, pair, index: int, direction: str) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                start = walker.pos
                walker.feed(data)
                if walker.cut_at is not None and walker.cut_at < start + len(data):
                    dst.sendall(data[:max(0, walker.cut_at - start)])
                    self.cuts_done.append((index, direction, walker.cut_at))
                    break
                dst.sendall(data)
        except OSError:
            pass
        cut = self.cuts.get(index)
        if cut is not None and cut.silent and walker.cut_at is not None:
            pair = pair[:1]                  # the client's side only; the server's is left hanging
        elif cut is not None and cut.silent and self.cuts_done and self.cuts_done[-1][0] == index:
            return                           # the other direction's pump of a silent cut: leave it
        for s in pair:
            try:
                s.shutdown(socket.SHUT_RDWR)
                if cut is not None and cut.reset and walker.cut_at is not None:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    s.close()
            except OSError:
                pass

    def close(self) -> None:
        self._stop = True
        self.listener.close()
