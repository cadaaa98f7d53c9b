"""Which transport a connection ends up on: RGPU_TRANSPORT, the offers, the same-host proof, clear failures."""
from __future__ import annotations

import logging
import socket

import pytest

from rgpu import config
from rgpu.errors import ConfigError, ConnectError
from rgpu.transport import handshake, negotiate, shm, shm_setup, tcp
from rgpu.transport.tcp import TcpTransport
from rgpu.transport.wire import Limits, MsgKind

pytestmark = pytest.mark.skipif(shm.available() is not None, reason=str(shm.available()))


def auto_stays_on_tcp(server, payload: bytes) -> None:
    """Under ``auto`` the connection lands on tcp, and carries a call."""
    conn = server.connect("echo", transport="auto")
    assert conn.transport_name == "tcp"
    assert conn.call({"op": "sizes"}, [payload]).meta["sizes"] == [len(payload)]


def test_auto_takes_shm_on_one_host_and_says_so(rgpu_server):
    conn = rgpu_server.connect("echo", transport="auto")
    assert conn.transport_name == "shm"
    assert conn.call({"op": "echo"}, [b"abc"]).buffers[0].tobytes() == b"abc"


def test_tcp_when_tcp_is_asked_for(rgpu_server):
    assert rgpu_server.connect("echo", transport="tcp").transport_name == "tcp"


def test_each_forced_transport_is_what_the_connection_reports(rgpu_server):
    assert rgpu_server.connect("echo", transport="shm").transport_name == "shm"


def test_a_server_that_does_not_offer_shm_is_a_clear_error_when_forced_and_tcp_under_auto(start_server):
    server = start_server(env={"RGPU_TRANSPORT": "tcp"})
    with pytest.raises(ConnectError, match="RGPU_TRANSPORT=shm.*does not offer"):
        server.connect("echo", transport="shm")
    auto_stays_on_tcp(server, b"ok")


def test_a_wrong_nonce_is_refused_and_auto_stays_on_tcp(rgpu_server, monkeypatch):
    real = shm_setup.attach

    def forged(details, timeout, *args):
        t, nonce = real(details, timeout, *args)
        return t, bytes(32)                   # mapped the memory but claims another nonce
    monkeypatch.setattr(shm_setup, "attach", forged)
    with pytest.raises(ConnectError, match="proof"):
        rgpu_server.connect("echo", transport="shm")
    auto_stays_on_tcp(rgpu_server, b"x")


def test_an_unreachable_shm_socket_is_another_host_never_a_guess_from_the_address(rgpu_server, monkeypatch):
    def elsewhere(details, timeout, *args):
        raise ConnectError("the server's shm socket is not reachable from here (another host)")
    monkeypatch.setattr(shm_setup, "attach", elsewhere)   # what a client at the far end of an SSH tunnel sees
    with pytest.raises(ConnectError, match="not reachable"):
        rgpu_server.connect("echo", transport="shm")
    auto_stays_on_tcp(rgpu_server, b"x")   # 127.0.0.1 all the same: still tcp


def test_a_stranger_on_the_unix_socket_gets_nothing_and_the_session_goes_on(rgpu_server, monkeypatch):
    real = shm_setup.attach

    def raced(details, timeout, *args):
        stranger = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        stranger.connect(details["socket"].decode())      # first in, without the ticket
        stranger.sendall(b"not the ticket")
        got = stranger.recv(64)
        stranger.close()
        assert got == b""                                 # hung up on, no descriptors
        return real(details, timeout)                     # the one connection is spent: refused
    monkeypatch.setattr(shm_setup, "attach", raced)
    auto_stays_on_tcp(rgpu_server, b"abc")


def test_auto_logs_its_choice_once(rgpu_server, monkeypatch, caplog):
    monkeypatch.setattr(negotiate, "_logged", False)
    with caplog.at_level(logging.INFO, logger="rgpu.transport"):
        rgpu_server.connect("echo", transport="auto")
        rgpu_server.connect("echo", transport="auto")
    chose = [r.getMessage() for r in caplog.records if "chose" in r.getMessage()]
    assert len(chose) == 1 and "shm" in chose[0]


def test_forcing_ucx_where_ucxx_is_missing_is_a_config_error_naming_the_extra(rgpu_server, monkeypatch):
    monkeypatch.setattr(negotiate, "has_module", lambda name: False)
    with pytest.raises(ConfigError, match=r"RGPU_TRANSPORT=ucx.*rgpu\[ucx\]"):
        rgpu_server.connect("echo", transport="ucx")


def test_an_unknown_transport_name_is_a_config_error():
    with pytest.raises(ConfigError, match="RGPU_TRANSPORT"):
        config.settings(environ={"RGPU_TRANSPORT": "carrier-pigeon"})


def test_tls_keeps_ucx_out_of_auto_but_not_shm():
    s = config.settings(environ={}, transport="auto")
    assert "ucx" not in negotiate.client_offer(s, tls=True)
    assert negotiate.client_offer(s, tls=True)[:2] == ["tcp", "shm"]
    assert negotiate.client_offer(s.with_(transport="tcp")) == ["tcp"]


def test_the_server_answers_an_upgrade_it_did_not_offer_with_a_refusal_and_carries_on(rgpu_server):
    s = rgpu_server.settings()
    t = TcpTransport(tcp.connect(rgpu_server.host, rgpu_server.port, 10))
    try:
        hello = handshake.Hello(route="echo", session="upgrade-test", versions=handshake.software_versions(),
                                transports=["tcp", "shm"], options={})
        welcome = handshake.client_handshake(t, rgpu_server.token.encode(), hello, Limits.from_settings(s))
        assert welcome["transports"] == ["tcp", "shm"]
        negotiate._send(t, {"transport": "ucx"})
        answer = negotiate._recv(t, "ucx")
        assert answer["ok"] is False and "not offered" in answer["reason"]
        negotiate._send(t, {"transport": "tcp"})                   # stay: the session runs on tcp
        t.send(t.frame_parts(MsgKind.REQUEST, 1, 0, {"op": "sizes"}, [memoryview(b"four")]))
        reply = t.recv_frame(Limits(), negotiate._pool)
        assert (reply.kind, reply.meta["sizes"]) == (MsgKind.REPLY, [4])
    finally:
        t.close()
