"""The ucx transport: UCXX tag messages between worker-address endpoints, for hosts with RDMA.

A frame is one tag message holding its prefix (header, lengths, metadata), then
one per non-empty buffer, all on one tag so that UCX delivers them in order. The
receiver probes for the prefix, then posts receives straight into the caller's
buffers or pool leases; UCX's rendezvous moves big ones without a staging copy.

Endpoints come from worker addresses without error handling: listener endpoints
always take UCX's tcp on one host, and its shared-memory and RDMA paths need
error handling off. So UCX would not tell us of a dead peer: the tcp connection
that carried the upgrade stays open, and every wait watches it.

``rgpu[ucx]`` is ``ucxx-cu12==0.52.*`` (runs without a GPU); imported only when used.
"""
from __future__ import annotations

import os
import select
import socket
import threading
import time
from typing import Sequence

from rgpu.errors import ConnectError, ConnectionLost, ProtocolError, RgpuError

from .base import Into, Transport
from .wire import HEADER, MAGIC, BufferPool, Frame, Limits, as_bytes_view, decode_header, decode_lengths, unpack_meta

TAG = 0x5247505501          # every message of a connection: one tag keeps them in order
RDMA_KINDS = ("rc", "dc", "ud")
SPIN_S = 50e-6
ACTIVE_S = 0.25         # polling for a transfer of ours in flight (64 MiB at 2 GB/s: 32 ms)
LOOK_S = 0.005          # while polling, look at the carrier (and on_block) this often
BACKSTOP_S = 0.01

_lock = threading.Lock()
_lib = None
_context = None
_rdma: list[str] | None = None


def _ucxx():
    """(libucxx, Array), imported on first use; UCX's warning about variables it ignores is silenced."""
    global _lib
    if _lib is None:
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        try:
            import ucxx._lib.libucxx as lib
            from ucxx._lib.arr import Array
        except ImportError as exc:
            raise ConnectError(f"UCXX is not installed here (pip install 'rgpu[ucx]'): {exc}") from None
        _lib = (lib, Array)
    return _lib


def context():
    """The process's UCX context (tag matching and wake-ups), made once."""
    global _context
    with _lock:
        if _context is None:
            lib, _ = _ucxx()
            try:
                _context = lib.UCXContext(feature_flags=(lib.Feature.TAG, lib.Feature.WAKEUP))
            except Exception as exc:
                raise ConnectError(f"UCX: cannot create a context: {exc}") from None
        return _context


def transports_of(info: str) -> list[str]:
    """Transport names in a UCX context's resource list ("resource 3 : md 2 dev 1 flags -- rc_mlx5/mlx5_0:1")."""
    names = []
    for line in info.splitlines():
        if "resource" in line and "--" in line:
            name = line.rsplit("--", 1)[1].strip().split("/", 1)[0]
            if name and name not in names:
                names.append(name)
    return names


def rdma_transports() -> list[str]:
    """This end's RDMA-capable UCX transports (rc, dc, ud verbs); [] without an InfiniBand/RoCE device."""
    global _rdma
    if _rdma is None:
        try:
            devices = os.listdir("/sys/class/infiniband")
        except OSError:
            devices = []
        # no verbs device: no rc/dc/ud, and no need to load UCX to know it
        _rdma = [n for n in transports_of(context().info) if n.split("_")[0] in RDMA_KINDS] if devices else []
    return list(_rdma)


def _translate(exc: BaseException, where: str) -> RgpuError:
    if isinstance(exc, RgpuError):
        return exc
    return ConnectionLost(f"ucx {where}: {type(exc).__name__}: {exc}")


class UcxTransport(Transport):
    name = "ucx"

    def __init__(self, carrier):
        """A worker of our own; ``carrier`` is the tcp transport kept open to notice a dead peer."""
        lib, self._Array = _ucxx()
        try:
            self._worker = lib.UCXWorker(context())
            self._worker.init_blocking_progress_mode()
            self.address = self._worker.address.tobytes()
        except RgpuError:
            raise
        except Exception as exc:
            raise ConnectError(f"UCX: cannot create a worker: {exc}") from None
        self._lib = lib
        self._tag = lib.UCXXTag(TAG)
        self._efd = self._worker.epoll_file_descriptor
        self._carrier = carrier
        self._sock = carrier.sock
        self._ep = None
        self._ucx_lock = threading.RLock()       # every call into the worker
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._closed = False

    def connect(self, peer_address: bytes) -> None:
        try:
            addr = self._lib.UCXAddress.create_from_buffer(peer_address)
            with self._ucx_lock:
                self._ep = self._worker.create_endpoint_from_worker_address(addr, False)
        except Exception as exc:
            raise ConnectError(f"UCX: cannot reach the peer's worker address: {exc}") from None

    # ---- moving frames -------------------------------------------------------------

    def send(self, parts: Sequence) -> None:
        with self._send_lock:
            if self._closed or self._ep is None:
                raise ConnectionLost("connection closed")
            keep, reqs = [], []
            try:
                with self._ucx_lock:
                    for part in _messages(parts):
                        arr = self._Array(part)
                        keep.append(arr)
                        reqs.append(self._ep.tag_send(arr, self._tag))
                self._wait(lambda: all(r.completed for r in reqs), blocked=self.on_block, active=True)
                for r in reqs:
                    r.check_error()
            except Exception as exc:
                raise _translate(exc, "sending") from None

    def recv_frame(self, limits: Limits, pool: BufferPool, into: Into | None = None) -> Frame:
        with self._recv_lock:
            try:
                return self._recv(limits, pool, into)
            except Exception as exc:
                raise _translate(exc, "receiving") from None

    def _recv(self, limits: Limits, pool: BufferPool, into: Into | None) -> Frame:
        probe = []

        def arrived():
            with self._ucx_lock:
                got = self._worker.tag_probe(self._tag, remove=True)
            if got.matched:
                probe.append(got)
            return bool(probe)
        self._wait(arrived)
        got = probe[0]
        most = HEADER.size + 8 * limits.max_buffers + limits.max_meta_bytes
        if got.length > most:
            raise ProtocolError(f"ucx: a frame prefix of {got.length} bytes exceeds the limit of {most}")
        prefix = bytearray(got.length)
        self._receive([self._worker.tag_recv_with_handle(self._Array(prefix), got)])
        h = decode_header(prefix, limits)
        p = HEADER.size + 8 * h.nbufs
        if p + h.meta_len != len(prefix):
            raise ProtocolError(f"ucx: prefix of {len(prefix)} bytes, its header says {p + h.meta_len}")
        lengths = decode_lengths(memoryview(prefix)[HEADER.size:p], h.nbufs, h.meta_len, limits)
        meta = unpack_meta(memoryview(prefix)[p:], limits)
        targets = into(h.kind, h.seq, lengths) if (into is not None and lengths) else None
        if targets is not None:
            targets = [as_bytes_view(v) for v in targets]
            if [v.nbytes for v in targets] != lengths:
                targets = None  # not the reply the caller prepared for (an error, say): use the pool
        bufs, tokens, posts = [], [], []
        for i, n in enumerate(lengths):
            if targets is not None:
                dest = targets[i]
            else:
                dest, token = pool.lease(n)
                tokens.append(token)
            bufs.append(dest)
            if n:
                posts.append(dest)
        if posts:
            with self._ucx_lock:
                reqs = [self._worker.tag_recv(self._Array(d), self._tag) for d in posts]
            self._receive(reqs)
        releaser = (lambda: [pool.release(t) for t in tokens]) if tokens else None
        return Frame(h.kind, h.seq, h.ack, meta, bufs, releaser)

    def _receive(self, reqs: list) -> None:
        self._wait(lambda: all(r.completed for r in reqs), active=True)
        for r in reqs:
            r.check_error()

    def _wait(self, done, deadline: float | None = None, blocked=None, active: bool = False) -> bool:
        """Progress the worker until ``done()``; poll while anything moves, then sleep on its event fd and the carrier.

        ``active``: our own transfer is in flight (a send, a posted receive): poll up to
        ``ACTIVE_S``; UCX's completion events (the receiver's acknowledgement of a rendezvous
        over shared memory, say) do not always wake a sleeper, and a missed one cost a backstop.
        ``blocked`` (a send's ``on_block``) may read frames meanwhile: a big send completes
        only once the peer receives it, and the peer may itself be blocked sending us a reply.
        """
        now = time.perf_counter()
        spin_end = now + (ACTIVE_S if active else SPIN_S)
        look = now + LOOK_S
        poller = None
        while True:
            with self._ucx_lock:
                moved = self._worker.progress_once()
            if done():
                return True
            if self._closed:
                raise ConnectionLost("connection closed")
            now = time.perf_counter()
            if moved:
                # bytes are moving: keep polling. Over shared memory a rendezvous is copied inside
                # progress calls, and no event wakes a sleeper for the next piece
                spin_end = max(spin_end, now + SPIN_S)
            if now < spin_end:
                if now > look:               # while polling: is the peer still there, is a reply due?
                    look = now + LOOK_S
                    self._look_at_carrier()
                    if blocked is not None:
                        blocked()
                    if deadline is not None and time.monotonic() > deadline:
                        return False
                continue
            wait = BACKSTOP_S if deadline is None else min(BACKSTOP_S, deadline - time.monotonic())
            if wait <= 0:
                return False
            if blocked is not None and blocked() is not None:
                wait = min(wait, 0.002)
            with self._ucx_lock:
                armed = self._worker.arm()       # False: events are pending, progress again
            if not armed:
                continue
            if poller is None:     # one per wait: a poll object may not be shared between threads
                poller = select.poll()     # and not select(): descriptors past FD_SETSIZE
                poller.register(self._efd, select.POLLIN)
                poller.register(self._sock, select.POLLIN)
            for fd, _ in poller.poll(wait * 1000):
                if fd == self._sock.fileno():
                    self._check_carrier()

    def _look_at_carrier(self) -> None:
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        if poller.poll(0):
            self._check_carrier()

    def _check_carrier(self) -> None:
        if self._closed:
            raise ConnectionLost("connection closed")
        try:
            self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except (OSError, ValueError):   # reset, or a TLS socket that cannot peek: either way it moved
            pass
        # nothing is sent on the carrier after the upgrade: whatever makes it readable is its end
        raise ConnectionLost("the peer went away (its tcp connection closed)")

    def readable(self, timeout: float) -> bool:
        def arrived():
            with self._ucx_lock:
                return self._worker.tag_probe(self._tag, remove=False).matched
        try:
            return self._wait(arrived, time.monotonic() + max(0.0, timeout))
        except Exception as exc:
            raise _translate(exc, "receiving") from None

    # ---- closing -------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._close_when_idle(self._end_ucx)      # the peer sees its carrier close
        finally:
            self._carrier.close()

    def _end_ucx(self) -> None:
        with self._ucx_lock:
            if self._ep is not None:
                try:
                    self._ep.close()
                    self._worker.progress()
                except Exception:
                    pass
            self._ep = None
            self._worker = None


def _messages(parts: Sequence):
    """The tag messages of ``parts`` (whole frames as ``frame_parts`` makes them): each prefix, each buffer."""
    i, n = 0, len(parts)
    while i < n:
        prefix = parts[i]
        if bytes(memoryview(prefix)[:4]) != MAGIC:
            raise TypeError("ucx sends whole frames: build the parts with frame_parts")
        nbufs = HEADER.unpack_from(prefix)[7]
        yield prefix
        for v in parts[i + 1:i + 1 + nbufs]:
            v = as_bytes_view(v)
            if v.nbytes:
                yield v
        i += 1 + nbufs
