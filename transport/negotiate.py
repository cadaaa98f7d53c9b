"""Choosing the transport once the session is authenticated: the offers, UPGRADE, ``RGPU_TRANSPORT``.

    client                                         server
    HELLO {transports: what this end can use}  ->
                                               <-  WELCOME {transports: "tcp" + what both can use}
    when WELCOME offers more than tcp, the client's next frames are UPGRADEs (on tcp):
    UPGRADE {transport: "shm"}                 ->
                                               <-  UPGRADE {transport: "shm", ok, socket, ticket}
        the client connects to that abstract Unix socket, sends the ticket, receives the
        control memfd and eventfds (SCM_RIGHTS), maps them, reads the nonce written there
    UPGRADE {transport: "shm", proof: nonce}   ->
                                               <-  UPGRADE {transport: "shm", ok: true}     both on shm
    UPGRADE {transport: "ucx", rdma, need_rdma} ->
                                               <-  UPGRADE {transport: "ucx", ok, rdma, address}
    UPGRADE {transport: "ucx", address}        ->
                                               <-  UPGRADE {transport: "ucx", ok: true}     both on ucx
    UPGRADE {transport: "tcp"}                 ->  (no answer; both stay on tcp)

Same host is proven, never guessed from the address (through an SSH tunnel both
ends see 127.0.0.1 on different hosts): the Unix socket only exists on the
server's host (and network namespace), and only a client that mapped the memfd
can read the nonce back. A step that fails answers {ok: false, reason}; with
``auto`` the client goes on to the next (shm, then ucx where both ends have RDMA,
then tcp), with a forced transport it raises ``ConnectError``.
"""
from __future__ import annotations

import importlib.util
import logging
import select
import time

from rgpu.errors import (
    AuthenticationError, ConfigError, ConnectError, ConnectionLost, ProtocolError, RgpuError, Timeout,
)

from . import shm, shm_fast, shm_setup
from .base import Transport
from .tcp import TcpTransport
from .wire import BufferPool, Limits, MsgKind

log = logging.getLogger("rgpu.transport")
NAMES = ("tcp", "shm", "ucx")
LIMITS = Limits(max_frame_bytes=1 << 20, max_meta_bytes=1 << 20, max_buffers=0)
_pool = BufferPool(keep_bytes=0)
_logged = False


class Declined(RgpuError):
    """One transport cannot be used between these two ends (tcp still works)."""


def unavailable(name: str) -> str | None:
    """None when this end can use transport ``name``, else why not."""
    if name == "shm":
        return shm.available()
    if name == "ucx" and not has_module("ucxx"):
        return "UCXX is not installed here (pip install 'rgpu[ucx]')"
    return None


def has_module(name: str) -> bool:
    """Whether ``name`` could be imported, without importing it (UCXX takes about a second)."""
    return importlib.util.find_spec(name) is not None


def client_offer(settings, tls: bool = False) -> list[str]:
    """HELLO's ``transports``: tcp and what else this end could switch to under ``RGPU_TRANSPORT``.

    With TLS, ``auto`` leaves ucx out (its bytes would cross the network unencrypted);
    shm stays (same host, a 0600 memfd).
    """
    want = settings.transport
    if want in ("shm", "ucx"):
        why = unavailable(want)
        if why:
            raise ConfigError(f"RGPU_TRANSPORT={want}, but {why}")
        return ["tcp", want]
    if want == "tcp":
        return ["tcp"]
    return ["tcp", *[n for n in ("shm", "ucx") if unavailable(n) is None and not (tls and n == "ucx")]]


def server_offer(client_transports, settings) -> list[str]:
    """WELCOME's ``transports``: tcp, then what the client asked for that this server can do."""
    asked = client_transports if isinstance(client_transports, list) else []
    allowed = ("shm", "ucx") if settings.transport == "auto" else (settings.transport,)
    return ["tcp", *[n for n in ("shm", "ucx") if n in asked and n in allowed and unavailable(n) is None]]


def expects_upgrade(offer) -> bool:
    return len(offer) > 1


# ---- the client ----------------------------------------------------------------------

def client_upgrade(t: Transport, welcome: dict, settings) -> Transport:
    """After WELCOME: the transport this connection goes on with (``t`` itself when tcp)."""
    offer = welcome.get("transports")
    if not isinstance(offer, list) or not all(isinstance(n, str) for n in offer):
        raise ProtocolError("handshake: WELCOME's transports is not a list of names")
    want = settings.transport
    forced = want in ("shm", "ucx")
    if not expects_upgrade(offer):
        if forced:
            raise ConnectError(f"RGPU_TRANSPORT={want}, but the server does not offer it "
                               f"(it offers {', '.join(offer) or 'nothing'}; {unavailable(want) or 'its end lacks it'})")
        _chose("tcp", "the server offers only tcp", want)
        return t
    reasons = []
    for name in ([want] if forced else ["shm", "ucx"]):
        if name not in offer:
            if forced:
                raise ConnectError(f"RGPU_TRANSPORT={want}, but the server does not offer it (it offers {offer})")
            reasons.append(f"{name}: not offered")
            continue
        try:
            got = (_client_shm if name == "shm" else _client_ucx)(t, settings, forced)
        except Declined as exc:
            if forced:
                raise ConnectError(f"RGPU_TRANSPORT={want}, but {exc}") from None
            reasons.append(f"{name}: {exc}")
            continue
        _chose(name, "same host, proven through a shared memfd" if name == "shm" else "both ends have RDMA", want)
        return got
    _send(t, {"transport": "tcp"})
    _chose("tcp", "; ".join(reasons), want)
    return t


def _chose(name: str, why: str, want: str) -> None:
    global _logged
    if want == "auto" and not _logged:
        _logged = True
        log.info("rgpu: RGPU_TRANSPORT=auto chose %s (%s)", name, why)


def _client_shm(t: Transport, settings, forced: bool) -> Transport:
    shm_fast.load(settings.shm_c)   # a first use builds the C path (a second or two): before the exchange's clocks
    _send(t, {"transport": "shm"})
    reply = _recv(t, "shm")
    if not reply.get("ok"):
        raise Declined(f"the server cannot offer shm: {reply.get('reason', 'no reason given')}")
    try:
        st, nonce = shm_setup.attach(reply, settings.connect_timeout, settings.shm_c, settings.shm_spin_us)
    except ConnectError as exc:
        _send(t, {"transport": "shm", "ok": False, "reason": str(exc)})
        raise Declined(str(exc)) from None
    try:
        _send(t, {"transport": "shm", "proof": nonce})
        done = _recv(t, "shm")
        if not done.get("ok"):
            raise Declined(f"the server did not accept the shared-memory proof: {done.get('reason')}")
    except BaseException:
        st.close()
        raise
    t.close()          # shm carries everything from here; its Unix socket tells us if the server dies
    return st


def _client_ucx(t: Transport, settings, forced: bool) -> Transport:
    from . import ucx

    rdma = ucx.rdma_transports()
    if not forced and not rdma:
        raise Declined("no RDMA-capable UCX transport (rc, dc, ud) on this end")
    _send(t, {"transport": "ucx", "rdma": rdma, "need_rdma": not forced})
    reply = _recv(t, "ucx")
    if not reply.get("ok"):
        raise Declined(f"the server cannot offer ucx: {reply.get('reason', 'no reason given')}")
    address = reply.get("address")
    if not isinstance(address, bytes):
        raise ProtocolError("ucx: the server's UPGRADE has no worker address")
    try:
        ut = ucx.UcxTransport(t)
        ut.connect(address)
    except RgpuError as exc:
        _send(t, {"transport": "ucx", "ok": False, "reason": str(exc)})
        raise Declined(str(exc)) from None
    try:
        _send(t, {"transport": "ucx", "address": ut.address})
        done = _recv(t, "ucx")
        if not done.get("ok"):
            raise Declined(f"the server could not reach this end over UCX: {done.get('reason')}")
    except BaseException:
        ut.close()
        raise
    return ut


# ---- the server ----------------------------------------------------------------------

def server_upgrade(t: TcpTransport, offer: list, settings) -> Transport:
    """Answer the client's UPGRADEs on the accepted tcp connection ``t``; returns the transport the session
    goes on with (``t`` itself when the client stays on tcp)."""
    sock = t.sock
    sock.settimeout(settings.connect_timeout)     # a client stalled mid-upgrade is dropped
    result = t
    try:
        while True:
            msg = _recv(t, None)
            name = msg.get("transport")
            if name == "tcp":
                return t
            if msg.get("ok") is False:
                continue               # the client's word that a step failed on its side: no answer due
            if name not in offer or name not in NAMES:
                _send(t, {"transport": name, "ok": False, "reason": f"not offered (the offer was {offer})"})
                continue
            got = (_server_shm if name == "shm" else _server_ucx)(t, msg, settings)
            if got is not None:
                result = got
                return got
    except Timeout as exc:
        raise ConnectionLost(f"the client stalled in the transport upgrade: {exc}") from None
    finally:
        if result is t:
            try:
                sock.settimeout(None)
            except OSError:
                pass


def _server_shm(t: Transport, msg: dict, settings) -> Transport | None:
    try:
        offer = shm_setup.ShmOffer()
    except (OSError, RgpuError) as exc:
        _send(t, {"transport": "shm", "ok": False, "reason": f"{type(exc).__name__}: {exc}"})
        return None
    try:
        _send(t, {"transport": "shm", "ok": True, **offer.details()})
        deadline = time.monotonic() + settings.connect_timeout
        while True:   # the client's Unix connection, or its word on tcp that it cannot make one
            if t.readable(0):
                _recv(t, "shm")     # {ok: false}: not on this host
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConnectionLost("the client neither connected to the shm socket nor said why")
            poller = select.poll()     # not select(): descriptors past FD_SETSIZE
            poller.register(offer.listener, select.POLLIN)
            poller.register(t.sock, select.POLLIN)
            if any(fd == offer.listener.fileno() for fd, _ in poller.poll(left * 1000)):
                try:
                    offer.accept(max(0.1, deadline - time.monotonic()))
                except (OSError, AuthenticationError) as exc:
                    # someone else took the one connection (or it broke): the client cannot get the
                    # descriptors now, and says so on tcp; that is the answer we wait for
                    log.warning("shm upgrade: %s", exc)
                break
        proof = _recv(t, "shm")
        if proof.get("ok") is False:
            return None
        if offer.conn is None or not offer.proven(proof.get("proof")):
            _send(t, {"transport": "shm", "ok": False, "reason": "the nonce read back does not match"})
            return None
        st = offer.transport(settings.shm_c, settings.shm_spin_us)
        offer = None
        _send(t, {"transport": "shm", "ok": True})
        t.close()
        return st
    except OSError as exc:
        raise ConnectionLost(f"shm upgrade: {exc}") from None
    finally:
        if offer is not None:
            offer.cancel()


def _server_ucx(t: Transport, msg: dict, settings) -> Transport | None:
    from . import ucx

    try:
        rdma = ucx.rdma_transports()
    except RgpuError as exc:
        _send(t, {"transport": "ucx", "ok": False, "reason": str(exc)})
        return None
    if msg.get("need_rdma") and not (rdma and msg.get("rdma")):
        side = "the server" if not rdma else "the client"
        _send(t, {"transport": "ucx", "ok": False, "reason": f"{side} has no RDMA-capable UCX transport"})
        return None
    try:
        ut = ucx.UcxTransport(t)
    except RgpuError as exc:
        _send(t, {"transport": "ucx", "ok": False, "reason": str(exc)})
        return None
    try:
        _send(t, {"transport": "ucx", "ok": True, "rdma": rdma, "address": ut.address})
        reply = _recv(t, "ucx")
        if reply.get("ok") is False:
            ut.close()
            return None
        address = reply.get("address")
        if not isinstance(address, bytes):
            raise ProtocolError("ucx: the client's UPGRADE has no worker address")
        ut.connect(address)
        _send(t, {"transport": "ucx", "ok": True})
        return ut
    except BaseException:
        ut.close()
        raise


# ---- UPGRADE frames ------------------------------------------------------------------

def _send(t: Transport, meta: dict) -> None:
    t.send(t.frame_parts(MsgKind.UPGRADE, 0, 0, meta, []))


def _recv(t: Transport, name: str | None) -> dict:
    frame = t.recv_frame(LIMITS, _pool)
    if frame.kind != MsgKind.UPGRADE or not isinstance(frame.meta, dict):
        raise ProtocolError(f"upgrade: expected UPGRADE, got {frame.kind.name}")
    if name is not None and frame.meta.get("transport") != name:
        raise ProtocolError(f"upgrade: expected an answer about {name}, got {frame.meta.get('transport')!r}")
    return frame.meta
