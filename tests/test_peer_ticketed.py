"""The peer port's tickets, in process: a replayed, an unclaimed or a doubled ticket is refused in words, a
stranger who stalls is dropped in a few seconds, never holding the worker; the ticketed listener both the
peer port and the tcp streams' offer stand on (``transport/ticketed.py``)."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from rgpu import config
from rgpu.errors import ConfigError
from rgpu.server.ops.peer import PeerError, Peers
from rgpu.transport import handshake, tcp, tcp_streams_setup, ticketed, tls
from rgpu.transport.tcp import TcpTransport
from rgpu.transport.tcp_streams import StripedTcp
from rgpu.transport.wire import MsgKind


def _push(dst: Peers, ticket: bytes, src: torch.Tensor, fingerprint=None, source_cert=None):
    """``src`` sent to ``dst``'s port from another Peers (a TLS one with ``source_cert``), in a thread;
    (thread, errors)."""
    source, errors = Peers("127.0.0.1", 5.0, source_cert), []

    def send():
        try:
            source.send(ticket, "127.0.0.1", dst.port, src, fingerprint)
        except Exception as exc:  # seen by the test
            errors.append(exc)
        finally:
            source.close()
    t = threading.Thread(target=send)
    t.start()
    return t, errors


def _stranger(port: int, first: bytes) -> tuple[threading.Thread, list]:
    """A raw connection that says ``first`` and reads what the port answers (until it closes)."""
    said: list = []

    def run():
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(first)
            data = b""
            try:
                while chunk := s.recv(4096):
                    data += chunk
            except ConnectionResetError:   # it closed on bytes it never read: what it said came first
                pass
            said.append(data)
    t = threading.Thread(target=run)
    t.start()
    return t, said


def test_a_replayed_ticket_is_refused_naming_it_and_writes_nothing():
    dst = Peers("127.0.0.1", 2.0)
    try:
        values = torch.arange(8.0)
        t, errors = _push(dst, b"a" * 32, values)
        got = torch.zeros(8)
        dst.receive(b"a" * 32, got)
        t.join(5)
        assert not errors and torch.equal(got, values)
        # the same ticket again, with other bytes: refused at once, even while another copy waits
        replay, said = _stranger(dst.port, b"a" * 32 + b"B" + (32).to_bytes(8, "big") + b"\xff" * 32)
        time.sleep(0.2)
        t, errors = _push(dst, b"b" * 32, values * 2)
        dst.receive(b"b" * 32, got)
        t.join(5), replay.join(5)
        assert not errors and torch.equal(got, values * 2)
        assert said[0].startswith(b"-") and b"used already" in said[0], said
        t, errors = _push(dst, b"a" * 32, values)                 # a source told to reuse one hears why
        with pytest.raises(PeerError, match="within 2 s"):
            dst.receive(b"c" * 32, got)
        t.join(5)
        assert "refused the transfer: this ticket was used already" in str(errors[0]), errors
        assert torch.equal(got, values * 2)
    finally:
        dst.close()


def test_a_ticket_no_copy_claims_is_refused_after_the_peer_timeout_and_at_the_session_end():
    dst = Peers("127.0.0.1", 0.5)
    try:
        wrong, said = _stranger(dst.port, b"w" * 32)
        with pytest.raises(PeerError, match=r"within 0.5 s \(RGPU_PEER_TIMEOUT\)"):
            dst.receive(b"r" * 32, torch.zeros(2))             # holds the stranger's ticket (a later copy's?)
        assert not said
        time.sleep(0.1)
        with pytest.raises(PeerError, match="RGPU_PEER_TIMEOUT"):
            dst.receive(b"r" * 32, torch.zeros(2))             # its time is up: refused first
        wrong.join(5)
        assert b"no copy of this session claimed this ticket within 0.5 s" in said[0], said
        late, said = _stranger(dst.port, b"z" * 32)
        with pytest.raises(PeerError):
            dst.receive(b"q" * 32, torch.zeros(2))
    finally:
        dst.close()
    late.join(5)
    assert b"the session ended before a copy of it claimed this ticket" in said[0], said


def test_a_ticket_presented_twice_is_taken_once_and_the_second_refused():
    dst = Peers("127.0.0.1", 5.0)
    try:
        first, said_first = _stranger(dst.port, b"d" * 32)
        time.sleep(0.2)
        second, said_second = _stranger(dst.port, b"d" * 32)
        time.sleep(0.2)
        t, errors = _push(dst, b"e" * 32, torch.ones(3))
        got = torch.zeros(3)
        dst.receive(b"e" * 32, got)
        t.join(5), second.join(5)
        assert not errors and torch.equal(got, torch.ones(3))
        assert b"another connection presented this ticket first" in said_second[0]
    finally:
        dst.close()
    first.join(5)


def test_a_stranger_who_stalls_is_dropped_within_its_few_seconds_not_the_peer_timeout(monkeypatch):
    monkeypatch.setattr(ticketed, "STRANGER_S", 0.3)
    dst = Peers("127.0.0.1", 30.0)
    try:
        stall = socket.create_connection(("127.0.0.1", dst.port))   # says nothing
        time.sleep(0.1)
        values = torch.linspace(-1, 1, 5)
        t, errors = _push(dst, b"s" * 32, values)
        got, start = torch.zeros(5), time.monotonic()
        dst.receive(b"s" * 32, got)
        took = time.monotonic() - start
        t.join(5)
        assert not errors and torch.equal(got, values)
        assert took < 10, took    # the stalled stranger held the worker its 0.3 s, not the 30 s peer timeout
        stall.close()
    finally:
        dst.close()


def test_tickets_compare_only_as_bytes_of_their_length():
    ours = ticketed.new_ticket()
    assert len(ours) == ticketed.TICKET_BYTES and ours != ticketed.new_ticket()
    assert ticketed.same(bytes(ours), ours) and ticketed.same(bytearray(ours), ours)
    assert not ticketed.same(ours[:-1], ours) and not ticketed.same(ours + b"x", ours)
    assert not ticketed.same(None, ours) and not ticketed.same(ours.hex(), ours)


def test_a_spent_ticket_is_remembered_for_the_latest_thousands():
    listener = ticketed.Listener("127.0.0.1", backlog=1)
    try:
        for i in range(ticketed.SPENT_KEPT + 1):
            listener.spend(i.to_bytes(32, "big"))
        assert not listener.is_spent((0).to_bytes(32, "big"))     # the oldest forgotten
        assert listener.is_spent((1).to_bytes(32, "big"))
        assert listener.is_spent(ticketed.SPENT_KEPT.to_bytes(32, "big"))
    finally:
        listener.close()


def test_a_listener_says_none_came_by_its_deadline_and_closes():
    listener = ticketed.Listener("127.0.0.1", backlog=1)
    assert listener.accept(time.monotonic() + 0.05) is None
    port = listener.port
    listener.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1)


def test_a_tls_streams_offer_refuses_a_plain_stream_in_the_main_ports_words_and_attaches_a_tls_one(tmp_path):
    tls.generate_self_signed(tmp_path / "c.pem", tmp_path / "k.pem")
    cert = {"cert": str(tmp_path / "c.pem"), "key": str(tmp_path / "k.pem")}
    listener = tcp.listen("127.0.0.1", 0)
    client_main = tcp.connect("127.0.0.1", listener.getsockname()[1], 5)
    server_main, _ = listener.accept()
    listener.close()
    token = b"t" * 32
    settings = config.settings(environ={}, tcp_streams=4, connect_timeout=5.0,
                               tls_fingerprint=tls.file_fingerprint(cert["cert"]))
    hello = handshake.Hello(route="echo", session="s1", versions={}, transports=[], options={"streams": 4})
    made = tcp_streams_setup.ServerOffer.make(server_main, hello, settings, token, cert)
    result: dict = {}

    def attach():
        try:
            result["t"] = made.attach(TcpTransport(server_main))
        except BaseException as exc:
            result["error"] = exc
    thread = threading.Thread(target=attach, daemon=True)
    thread.start()
    try:
        port, mine = made.details()["port"], handshake.Hello(route="echo", session="s1", versions={}, transports=[])
        with pytest.raises(ConfigError, match="requires TLS"):   # the ticket in plain never reaches the handshake
            tcp_streams_setup._dial("127.0.0.1", port, token, mine, settings, False, 1, made.ticket)
        good = tcp_streams_setup._dial("127.0.0.1", port, token, mine, settings, True, 1, made.ticket)
        main = TcpTransport(client_main)
        main.send(main.frame_parts(MsgKind.UPGRADE, 0, 0, {"transport": "tcp", "streams": [1]}, []))
        thread.join(10)
        assert isinstance(result.get("t"), StripedTcp) and result["t"].stream_count == 2, result
        assert result["t"].streams[0].version() is not None    # the extra stream is a TLS socket
        result["t"].close()
        good.close()
    finally:
        client_main.close()
        server_main.close()


def test_a_ticket_never_begins_as_a_tls_hello_so_a_plain_port_takes_every_one(monkeypatch):
    # a plain port tells TLS by the first byte, which is the ticket's: 1 in 256 random tickets was refused
    draws = iter([bytes([tls.TLS_HANDSHAKE_RECORD]) + b"t" * 31, b"u" * 32])
    monkeypatch.setattr(ticketed.os, "urandom", lambda n: next(draws))
    ticket = ticketed.new_ticket()
    assert ticket == b"u" * 32                  # the draw that began as a TLS record was drawn again
    monkeypatch.undo()
    assert all(ticketed.new_ticket()[0] != tls.TLS_HANDSHAKE_RECORD for _ in range(4096))
    dst = Peers("127.0.0.1", 10.0)
    try:
        values = torch.arange(6.0)
        t, errors = _push(dst, ticket, values)
        got = torch.zeros(6)
        dst.receive(ticket, got)
        t.join(5)
        assert not errors and torch.equal(got, values)
    finally:
        dst.close()
