"""Sessions outlive a dropped TLS connection: the client reconnects, routes the connection to its session's
worker by a plain preamble, does the TLS handshake and proves the token again there, and resumes; a proxy
cuts the encrypted stream at byte offsets while a model trains, and the weights match an uncut run's."""
from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

from rgpu.errors import AuthenticationError, ConnectionLost, SessionLost
from rgpu.protocol.ops import DTYPES, Msg
from rgpu.transport import handshake, tcp, tls
from rgpu.transport.resume import ResumingTransport
from rgpu.transport.tcp import TcpTransport
from rgpu.transport.wire import Limits

from session_proxy import Cut, CuttingProxy
from test_session_resume import SERVE, _run
from test_tls import fingerprint_printed


@pytest.fixture
def tls_server(start_server):
    server = start_server("--tls", *SERVE, env={"RGPU_SESSION_GRACE": "30"})
    server.pin = fingerprint_printed(server)
    return server


def _settings(server, **overrides):
    return server.settings(tls_fingerprint=server.pin, **overrides)


def test_a_tls_session_trains_through_cuts_of_its_encrypted_stream_to_the_weights_of_an_uncut_run(tls_server):
    from rgpu.transport.client import connect

    uncut = _run(connect("ops", settings=_settings(tls_server)))
    cuts = {0: Cut("up", at=6000), 1: Cut("down", at=9000), 2: Cut("up", at=2500)}   # mid-record
    proxy = CuttingProxy((tls_server.host, tls_server.port), cuts)
    try:
        conn = connect("ops", settings=_settings(tls_server).with_(server=proxy.address))
        assert isinstance(conn.transport, ResumingTransport) and conn.transport.tls
        cut = _run(conn)
        assert conn.transport.resumes == len(proxy.cuts_done) == 3, proxy.cuts_done
        assert conn.transport.sock.version() in ("TLSv1.2", "TLSv1.3")      # still TLS after the resumes
        assert len(cut) == len(uncut) and all(torch.equal(a, b) for a, b in zip(cut, uncut))
        conn.close()
    finally:
        proxy.close()
    assert "Traceback" not in tls_server.stderr


def test_a_tls_resume_under_an_unknown_id_is_session_lost_at_once(tls_server):
    sock = tcp.connect(tls_server.host, tls_server.port, 5.0)
    with pytest.raises(SessionLost, match="no session under that id"):
        tls.client_resume(sock, "no-such-session-" + "x" * 20, _settings(tls_server), tls_server.host, tls_server.port)


def test_the_resume_id_alone_cannot_take_over_a_live_tls_session(tls_server):
    from rgpu.transport.client import connect

    conn = connect("ops", settings=_settings(tls_server))
    rid = conn.welcome["resume"]["id"]
    sock = tcp.connect(tls_server.host, tls_server.port, 5.0)   # someone who saw the id in plain, not the token
    ssock = tls.client_resume(sock, rid, _settings(tls_server), tls_server.host, tls_server.port)
    hello = handshake.Hello(route="ops", session="stolen", versions={}, transports=[],
                            options={"resume": rid, "received": 0})
    with pytest.raises((AuthenticationError, ConnectionLost)):   # the worker finds the proof wrong
        handshake.client_handshake(TcpTransport(ssock), b"another-token", hello, Limits())
    ssock.close()
    chunk = np.ones(256, dtype=np.float32)
    conn.post([Msg.UPLOAD, [], [7, chunk.nbytes, DTYPES.index("float32"), [chunk.size], [1], 0, 0]], [chunk])
    assert conn.call([Msg.MEMORY, 0]).meta[0] == chunk.nbytes and conn.transport.resumes == 0
    conn.close()


def test_a_plain_client_on_a_tls_server_is_still_refused_with_the_reason(tls_server):
    sock = socket.create_connection((tls_server.host, tls_server.port), 5.0)   # a plain frame starts "R" too
    sock.sendall(b"RGPU" + bytes(32))
    sock.settimeout(5.0)
    assert b"requires TLS" in sock.recv(4096)
    sock.close()
