"""The transport contract: move whole frames between two ends; a few verbs and a declared record.

A ``Transport`` sends whole frames (``send``) and receives one frame into buffers
the caller owns (``into``) or leases from a pool (``recv_frame``); ``readable``,
``close`` and ``abort`` complete it. What a transport can do beyond that it declares
once in its ``capabilities`` (a ``Capabilities``), so callers choose from the record
and never probe for attributes. Queues, batching, replies and handshakes live above
it (``connection.py``, ``handshake.py``); the server's frame loop is the server's.
"""
from __future__ import annotations

import os
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

from . import wire
from .wire import BufferPool, Frame, Limits, copied, encode_prefix


# How long a waiting end polls before it sleeps (shm's waits, tcp's reads) when its session does not say:
# on a machine of SPIN_CORES cores or more, long enough to span the waits of a training step (GPU host,
# eager nanoGPT step over shm, docs/perf/transport-history.md, run9: every write to
# a sleeping end cost a wake-up, and a client woken from its wait at loss.item() ran cold). CUDA's own
# synchronize keeps its core likewise where there are more cores than GPUs. On small machines a
# spinning end takes the core its peer needs: the transport's own short spin there. Never longer than
# MAX_SPIN_S: a spinning end notices a dead peer only once it sleeps.
SPIN_CORES, LONG_SPIN_S, MAX_SPIN_S = 8, 0.02, 0.05


def spin_seconds(spin_us: float | None, short_s: float) -> float:
    """A waiting end's poll before it sleeps: ``spin_us`` (a setting; capped), else the machine's default."""
    if spin_us is not None:
        return min(max(spin_us, 0.0) * 1e-6, MAX_SPIN_S)
    return LONG_SPIN_S if (os.cpu_count() or 1) >= SPIN_CORES else short_s


# into(kind, seq, lengths) -> caller-owned views of exactly those lengths, or None for pool leases
Into = Callable[[int, int, list], "Sequence[memoryview] | None"]


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do beyond the verbs, declared once by its class (callers read, never probe).

    A transport class sets its own as a class attribute (``capabilities = Capabilities(...)``), the same
    for every instance; each field's default is what a transport without that capability declares.

    ``writes_inline`` (bool): a write is a memory copy, no syscall, so a connection writes posts on the
        caller's thread rather than handing them to its I/O thread. shm: True.
    ``batch_window_s`` (float seconds, or None): a write is a syscall, so small posts gather up to this
        long and go in one write (tcp: 200 µs); None: no gathering.
    ``names_shared_memory`` (bool): buffers in memory the peer maps are named, not copied, once the layer
        above says where such memory is (``share_memory``, ``names``, ``settle``). shm: True.
    ``resumable`` (bool): a plain byte stream the client can dial again, so a session may outlive a drop
        (``resume.py``). tcp: True.
    """
    writes_inline: bool = False
    batch_window_s: float | None = None
    names_shared_memory: bool = False
    resumable: bool = False


# find(address, nbytes) -> (memfd, base, size) of host memory holding that range that the peer may map, or None
FindShared = Callable[[int, int], "tuple[int, int, int] | None"]


class Transport(ABC):
    """One connected end. ``send`` may be called from one thread while another receives.

    Errors: every verb raises ``ConnectionLost`` once the connection is gone (closed, the peer went away,
    a write or read failed) and ``ProtocolError`` for a frame that breaks the wire format or ``Limits``;
    nothing else of theirs escapes (an ``OSError`` is translated, naming what failed). A resuming
    transport (``resume.py``) hides a drop it can resume, and raises ``SessionLost`` (a ``ConnectionLost``)
    naming why when it cannot. ``TypeError`` is the caller's mistake (parts that are not whole frames).
    """

    name: ClassVar[str]
    capabilities: Capabilities = Capabilities()
    # Called by ``send`` when the peer stops reading (the socket is full). The peer may be
    # blocked writing us a reply that nobody reads, so a connection reads replies here:
    # it returns True (waiting for input too), False (another thread reads; wait to write)
    # or None (no reply can come: block as usual). Transports that cannot fill up ignore it.
    on_block: Callable[[], "bool | None"] | None = None
    # lone_call(parts: exchange.LoneParts) -> lone: the connection's exchange state (exchange.py's
    # face) that is also its whole call() of a lone request in one call, lone(meta, buffers, reply_into)
    # -> Reply or None (None: nothing sent, the connection's request() does it); it raises what call()
    # raises (RemoteError, ConnectionLost, ProtocolError). Set by a transport that has one (shm's C path,
    # shm_lone.c); None elsewhere.
    lone_call: Callable | None = None
    # serve(handle, applied, limits) -> (why, applied, detail): a server's frame loop in C where the
    # transport has one (shm's: shm_native.NativeCalls.serve says what why and detail are), each POST and
    # REQUEST through handle(meta, buffers, wants_reply), until Python is needed; ConnectionLost once
    # closed. The worker runs the frames it leaves for the usual way (server/worker.py). None elsewhere.
    serve: Callable | None = None

    # Set by a resuming transport's user (the connection): called when its replay log fills, to read
    # the acknowledgements that have arrived. Other transports never call it.
    on_acks: Callable[[], None] | None = None

    @abstractmethod
    def send(self, parts: Sequence) -> None:
        """Write one or more whole frames, in order, in one go where the transport can.

        ``parts``: each frame's parts back to back, either plain (a prefix from ``wire.encode_prefix``, then
        one bytes-like part per buffer: every transport takes these) or what this transport's
        ``frame_parts`` made. Returns None once every frame is written (shm: in the ring, tcp: to the socket,
        or gathered by the layer above). The caller may reuse every buffer once this returns, except memory
        named by ``names_shared_memory`` (left alone until the peer lets the frame go: ``settle``). May block
        while the peer does not read (calling ``on_block`` meanwhile). Raises ``ConnectionLost`` (closed,
        the peer went away, the write failed); ``TypeError`` for parts that are not whole frames (shm, ucx).
        """

    @abstractmethod
    def recv_frame(self, limits: Limits, pool: BufferPool, into: Into | None = None) -> Frame:
        """Read one frame, waiting as long as it takes; buffers go where ``into(kind, seq, lengths)`` says
        (caller-owned views of exactly those lengths; a different answer, or None, and they go to the
        pool), else into leases from ``pool``.

        ``limits``: the bounds a frame must keep (metadata bytes, buffer count, frame bytes). Returns a
        ``wire.Frame`` (kind, seq, ack, metadata, buffers); its buffers stay valid until
        ``Frame.release()`` (shm: views into the sender's memory, handed back at release or when the last
        view goes). Raises ``ConnectionLost`` (EOF, closed, the peer went away) or ``ProtocolError``
        (malformed, over ``limits``: the message names the field); after either, the connection is done."""

    @property
    def tls(self) -> bool:
        """Whether the bytes cross the wire TLS-encrypted (tcp with ``RGPU_TLS``)."""
        return False

    def readable(self, timeout: float) -> bool:
        """Whether a frame (or the end of the connection) can be read within ``timeout`` seconds (0: now),
        waiting at most that long. A transport that cannot tell says True: its ``recv_frame`` then waits.
        An end the peer closed reads as True (``recv_frame`` then raises ``ConnectionLost``); shm raises
        ``ConnectionLost`` for a wait that itself failed."""
        return True

    def tune_reads(self, spin_us: float | None, use_c: bool = True) -> None:
        """How this end reads from now on, called once the handshake is over: a read polls ``spin_us`` before
        it sleeps (``RGPU_TCP_SPIN_US``; None: the machine's default, ``spin_seconds``); ``use_c``: its reads
        in C where they build (tcp's poll; TLS: a frame's big buffers). A transport whose waits are its own
        (shm's spin, ucx's progress) ignores it. Raises nothing."""
        return None

    def share_memory(self, find: FindShared) -> bool:
        """Let this transport name buffers that lie in memory ``find`` places (the peer maps it), not copy
        them. ``find(address, nbytes)`` -> (memfd, base, size) of such memory holding that range, or None.
        Returns True where it will (``capabilities.names_shared_memory``), else False and it copies all."""
        return False

    def names(self, address: int, nbytes: int) -> bool:
        """Whether a buffer at ``address`` of ``nbytes`` would be named rather than copied (see share_memory):
        the layer above then leaves that memory alone until ``settle``."""
        return False

    def settle(self) -> None:
        """The peer is done with every frame sent so far (a reply came after them): memory named in them
        may be reused. Nothing to do where nothing is named."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Orderly close: the peer sees the end, our own waiters wake with ``ConnectionLost``, and every
        later verb raises it. Safe to call twice; raises nothing."""

    def abort(self) -> None:
        """Close at once, waking any thread blocked in send or receive (they raise ``ConnectionLost``).
        Raises nothing; a resuming client first says goodbye (a BYE, when one can go at once)."""
        self.close()

    def _close_when_idle(self, release: Callable[[], None]) -> None:
        """Shut ``_sock`` (waking our own waiters, telling the peer), then ``release()`` once no thread is
        inside send or receive (``_send_lock``, ``_recv_lock``): an fd closed under a poll could be reused
        by an unrelated open. For transports with those three attributes (shm, ucx)."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        got_send = self._send_lock.acquire(timeout=2)
        got_recv = self._recv_lock.acquire(timeout=2)
        try:
            if got_send and got_recv:
                release()
        finally:
            if got_recv:
                self._recv_lock.release()
            if got_send:
                self._send_lock.release()

    def send_meta(self, kind: int, seq: int, meta: bytes, buffers: Sequence = ()) -> None:
        """``send`` of one frame with packed metadata (a transport may write it more directly): ``kind`` (a
        ``MsgKind``), ``seq``, ``meta`` (``wire.pack_meta``'s bytes), ``buffers`` (bytes-like). The buffers
        are copied before it returns, never named (the caller may change them at once): here at the call,
        since a wrapping transport may hold the parts (the delay line). Raises what ``send`` raises."""
        views = copied(buffers) if buffers else ()
        self.send([encode_prefix(kind, seq, 0, meta, [v.nbytes for v in views]), *views])

    # the parts of one frame for ``send`` (wire.frame_parts says what each is); shm makes its own
    frame_parts = staticmethod(wire.frame_parts)
