"""The handshake: versions, route and session, then mutual HMAC-SHA256 over the shared token.

    client                                   server
    HELLO {proto, versions, route, session,
           transports, nonce=cn, options} ->
                                          <- CHALLENGE {versions, nonce=sn, proof=H("server"|cn|sn|session)}
    checks the server knows the token
    PROOF {proof=H("client"|sn|cn|session)} ->
                                             checks it (constant time); nothing runs before this
                                          <- WAIT {message, waited_s, every_s}  every few s while no worker is warm
                                          <- WELCOME {session, transports, info, resume?}  or REFUSED {code, message}

A HELLO whose options carry ``resume`` (an id a WELCOME gave) and ``received`` resumes that session on
this connection (``transport/resume.py``): WELCOME then says ``resumed: {applied}``, or REFUSED ``resume``.

A client that finds the server's proof wrong says so (REFUSED auth) before it hangs up, so the
server's log reads "wrong token" rather than a closed connection.

Either side refuses a protocol version it does not speak (VersionMismatch on both).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import platform
import socket
from dataclasses import dataclass, field

from rgpu.errors import (
    AuthenticationError, ConfigError, ConnectError, ProtocolError, RemoteError, RgpuError, SessionLost,
    VersionMismatch,
)

from .base import Transport
from .wire import PROTOCOL_VERSION, BufferPool, Limits, MsgKind

NONCE_BYTES = 32
# Handshake frames are read before anyone is authenticated: small metadata, no buffers,
# whatever the session limits allow later.
HANDSHAKE_LIMITS = Limits(max_frame_bytes=1 << 20, max_meta_bytes=1 << 20, max_buffers=0)
_pool = BufferPool(keep_bytes=0)


def software_versions() -> dict:
    """What this end runs; torch only when it is already imported (the server's acceptor never imports it)."""
    import sys

    from rgpu import __version__
    versions = {"rgpu": __version__, "python": platform.python_version()}
    torch = sys.modules.get("torch")
    if torch is not None:
        versions["torch"] = torch.__version__
    return versions


def _proof(token: bytes, label: bytes, first: bytes, second: bytes, session: str) -> bytes:
    return hmac.new(token, label + first + second + session.encode(), hashlib.sha256).digest()


@dataclass
class Hello:
    route: str
    session: str
    versions: dict
    transports: list
    options: dict = field(default_factory=dict)
    nonce: bytes = b""


def _send(t: Transport, kind: MsgKind, meta) -> None:
    t.send(t.frame_parts(kind, 0, 0, meta, []))


def _recv(t: Transport, limits: Limits, expected: MsgKind, on_wait=None):
    limits = Limits(min(limits.max_frame_bytes, HANDSHAKE_LIMITS.max_frame_bytes),
                    min(limits.max_meta_bytes, HANDSHAKE_LIMITS.max_meta_bytes), 0)
    frame = t.recv_frame(limits, _pool)
    while frame.kind == MsgKind.WAIT:   # the server warms up: each WAIT re-arms our timeout
        if on_wait is not None:
            on_wait(frame.meta if isinstance(frame.meta, dict) else {})
        frame = t.recv_frame(limits, _pool)
    if frame.kind == MsgKind.REFUSED:
        meta = frame.meta if isinstance(frame.meta, dict) else {}
        code, message = meta.get("code"), str(meta.get("message", "refused"))
        if code == "auth":
            raise AuthenticationError(f"the server refused our token: {message}")
        if code == "version":
            raise VersionMismatch(message)
        if code == "protocol":
            raise ProtocolError(f"the server refused our handshake: {message}")
        if code == "busy":
            raise ConnectError(f"the server is busy: {message}")
        if code == "route":
            raise RemoteError(message, op="route", remote_type="refused")
        if code == "resume":
            raise SessionLost(f"the server would not resume the session: {message}")
        if code == "tls":
            raise ConfigError(f"the server refused the session: {message}")
        raise RgpuError(f"the server refused the session: {message}")
    if frame.kind != expected or not isinstance(frame.meta, dict):
        raise ProtocolError(f"handshake: expected {expected.name}, got {frame.kind.name}")
    return frame.meta


def _field(meta: dict, name: str, kind: type):
    value = meta.get(name)
    if not isinstance(value, kind):
        raise ProtocolError(f"handshake: field {name!r} missing or not {kind.__name__}")
    return value


def client_handshake(t: Transport, token: bytes, hello: Hello, limits: Limits, on_wait=None) -> dict:
    """Run the client side; returns the WELCOME dict (plus the server's versions). ``on_wait(meta)`` is called
    for each WAIT the server sends while it warms up (without it, a WAIT is a protocol error)."""
    cn = os.urandom(NONCE_BYTES)
    _send(t, MsgKind.HELLO, {"proto": PROTOCOL_VERSION, "versions": hello.versions, "route": hello.route,
                             "session": hello.session, "transports": hello.transports, "nonce": cn,
                             "options": hello.options})
    challenge = _recv(t, limits, MsgKind.CHALLENGE)
    sn = _field(challenge, "nonce", bytes)
    if not hmac.compare_digest(_field(challenge, "proof", bytes), _proof(token, b"server", cn, sn, hello.session)):
        refuse(t, "auth", "wrong token: the client holds a different token (the server's proof did not match it)")
        raise AuthenticationError("the server does not know our token (wrong RGPU_TOKEN, or not the server you meant)")
    _send(t, MsgKind.PROOF, {"proof": _proof(token, b"client", sn, cn, hello.session)})
    welcome = _recv(t, limits, MsgKind.WELCOME, on_wait)
    welcome["server_versions"] = challenge.get("versions", {})
    return welcome


def refuse(t: Transport, code: str, message: str) -> None:
    try:
        _send(t, MsgKind.REFUSED, {"code": code, "message": message})
    except RgpuError:
        pass


def server_handshake(t: Transport, token: bytes, limits: Limits, routes: set[str]) -> Hello:
    """Run the server side up to the client's proof; the caller sends WELCOME once the session exists."""
    hello, sn = server_hello(t, token, limits)
    return server_proof(t, token, limits, routes, hello, sn)


def server_hello(t: Transport, token: bytes, limits: Limits, versions: dict | None = None) -> tuple[Hello, bytes]:
    """The server's first half: read HELLO, send CHALLENGE; (the hello, the server's nonce).
    The acceptor runs the halves one frame at a time, as each arrives (``server/gate.py``)."""
    try:
        meta = _recv(t, limits, MsgKind.HELLO)
    except VersionMismatch as exc:
        refuse(t, "version", f"this server speaks rgpu protocol {PROTOCOL_VERSION}: {exc}")
        raise
    if meta.get("proto") != PROTOCOL_VERSION:
        refuse(t, "version", f"this server speaks rgpu protocol {PROTOCOL_VERSION}, the client {meta.get('proto')}")
        raise VersionMismatch(f"client speaks rgpu protocol {meta.get('proto')}")
    hello = Hello(route=_field(meta, "route", str), session=_field(meta, "session", str),
                  versions=_field(meta, "versions", dict), transports=_field(meta, "transports", list),
                  options=_field(meta, "options", dict), nonce=_field(meta, "nonce", bytes))
    if len(hello.nonce) != NONCE_BYTES or len(hello.session) > 128:
        raise ProtocolError("handshake: bad nonce or session id length")
    sn = os.urandom(NONCE_BYTES)
    _send(t, MsgKind.CHALLENGE, {"versions": versions or software_versions(), "nonce": sn,
                                 "proof": _proof(token, b"server", hello.nonce, sn, hello.session)})
    return hello, sn


def server_proof(t: Transport, token: bytes, limits: Limits, routes: set[str], hello: Hello, sn: bytes) -> Hello:
    """The server's second half: read PROOF and check it (constant time), then the route."""
    try:
        proof = _recv(t, limits, MsgKind.PROOF)
    except AuthenticationError:   # the client's REFUSED: our proof did not match its token
        raise AuthenticationError(f"client {hello.session!r}: wrong token (it holds a different one and "
                                  "refused this server's proof)") from None
    if not hmac.compare_digest(_field(proof, "proof", bytes), _proof(token, b"client", sn, hello.nonce, hello.session)):
        refuse(t, "auth", "wrong token")
        raise AuthenticationError(f"client {hello.session!r} sent a wrong token proof")
    if hello.route not in routes:
        refuse(t, "route", f"unknown route {hello.route!r}; this server has {sorted(routes)}")
        raise ProtocolError(f"handshake: unknown route {hello.route!r}")
    return hello


def welcome(t: Transport, session: str, transports: list, info: dict, **extra) -> None:
    """``extra``: ``resume`` (the id and grace a client may resume this session by) or ``resumed`` (the
    seq the server applied last, on a resumed connection; ``transport/resume.py``)."""
    _send(t, MsgKind.WELCOME, {"session": session, "transports": transports, "info": info,
                               "host": socket.gethostname(), **extra})
