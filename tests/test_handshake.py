"""The handshake: mutual HMAC over the token, versions on both sides, refusals that say what happened."""
from __future__ import annotations

import socket
import threading

import pytest

from rgpu import config
from rgpu.errors import (
    AuthenticationError, ConnectError, ConnectionLost, ProtocolError, RemoteError, RgpuError, Timeout, VersionMismatch,
)
from rgpu.transport import handshake, tcp, wire
from rgpu.transport.client import connect
from rgpu.transport.tcp import TcpTransport
from rgpu.transport.wire import HEADER, MAGIC, BufferPool, Limits, MsgKind, encode_frame

from conftest import TOKEN

LIMITS = Limits()
ROUTES = {"echo", "ops"}


@pytest.fixture
def pair():
    listener = tcp.listen("127.0.0.1", 0)
    a = tcp.connect("127.0.0.1", listener.getsockname()[1], timeout=10)
    b, _ = listener.accept()
    b.settimeout(10)
    listener.close()
    ta, tb = TcpTransport(a), TcpTransport(b)
    yield ta, tb
    ta.close()
    tb.close()


def hello(route="echo", session="s1") -> handshake.Hello:
    return handshake.Hello(route=route, session=session, versions=handshake.software_versions(), transports=["tcp"])


def both_sides(pair, client_token=TOKEN, server_token=TOKEN, client_hello=None, routes=ROUTES):
    """Run client and server handshakes at once; returns (client outcome, server outcome), each a value or an error."""
    client, server = pair
    out = {}

    def serve():
        try:
            h = handshake.server_handshake(server, server_token.encode(), LIMITS, routes)
            handshake.welcome(server, h.session, ["tcp"], {"hi": 1})
            out["server"] = h
        except RgpuError as exc:
            out["server"] = exc
            server.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        out["client"] = handshake.client_handshake(client, client_token.encode(), client_hello or hello(), LIMITS)
    except RgpuError as exc:
        out["client"] = exc
        client.close()
    t.join(10)
    assert not t.is_alive(), "the server side of the handshake hung"
    return out["client"], out["server"]


def server_in_thread(server) -> tuple[threading.Thread, dict]:
    """The server's handshake on a thread, as the test plays the client by hand; ``out["server"]``: its error."""
    out = {}

    def serve():
        try:
            handshake.server_handshake(server, TOKEN.encode(), LIMITS, ROUTES)
        except RgpuError as exc:
            out["server"] = exc

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t, out


def raw_hello(**change) -> dict:
    """A HELLO's metadata as a client writes it by hand, with ``change`` applied."""
    return {"proto": wire.PROTOCOL_VERSION, "versions": {}, "route": "echo", "session": "x", "transports": [],
            "nonce": b"n" * 32, "options": {}, **change}


def test_a_shared_token_opens_a_session_and_each_side_learns_the_others_versions(pair):
    welcome, h = both_sides(pair)
    assert welcome["session"] == "s1" and welcome["info"] == {"hi": 1}
    assert welcome["server_versions"]["rgpu"] == h.versions["rgpu"]
    assert (h.route, h.session, h.transports) == ("echo", "s1", ["tcp"])


def test_a_client_with_a_wrong_token_refuses_the_server_and_proves_nothing(pair):
    client, server = both_sides(pair, client_token="wrong")
    assert isinstance(client, AuthenticationError) and "does not know our token" in str(client)
    # it sends no proof, only its refusal: the server's log says "wrong token", not that the client hung up
    assert isinstance(server, AuthenticationError) and "wrong token" in str(server)


def test_a_client_that_fakes_its_proof_is_refused_with_nothing_run(pair):
    client, server = pair
    t, result = server_in_thread(server)
    # the attacker sends a HELLO, reads the challenge, answers with a made-up proof
    handshake._send(client, MsgKind.HELLO, raw_hello())
    handshake._recv(client, LIMITS, MsgKind.CHALLENGE)
    handshake._send(client, MsgKind.PROOF, {"proof": b"\0" * 32})
    with pytest.raises(AuthenticationError, match="refused our token"):
        handshake._recv(client, LIMITS, MsgKind.WELCOME)
    t.join(10)
    assert isinstance(result["server"], AuthenticationError)


def test_a_proof_for_another_session_does_not_open_this_one(pair):
    # proofs bind the session id: a replayed proof from session "a" fails for "b"
    token = TOKEN.encode()
    assert handshake._proof(token, b"client", b"s" * 32, b"c" * 32, "a") != \
        handshake._proof(token, b"client", b"s" * 32, b"c" * 32, "b")
    assert handshake._proof(token, b"client", b"x" * 32, b"y" * 32, "a") != \
        handshake._proof(token, b"server", b"y" * 32, b"x" * 32, "a")  # no reflecting the server's proof


def test_a_client_of_a_newer_protocol_gets_version_mismatch_and_so_does_the_server(pair, monkeypatch):
    client, server = pair
    t, out = server_in_thread(server)
    # the client writes frames of protocol 2 (the server thread decodes with the real version check)
    head = wire.HEADER.pack(MAGIC, wire.PROTOCOL_VERSION + 1, MsgKind.HELLO, 0, 0, 0, 0, 0)
    client.send([head])
    t.join(10)
    assert isinstance(out["server"], VersionMismatch)
    refused = client.recv_frame(LIMITS, BufferPool())
    assert refused.kind == MsgKind.REFUSED and refused.meta["code"] == "version"


def test_a_server_of_a_newer_protocol_is_a_version_mismatch_for_the_client(pair):
    client, server = pair

    def serve():
        server.recv_frame(LIMITS, BufferPool())
        server.send([HEADER.pack(MAGIC, wire.PROTOCOL_VERSION + 1, MsgKind.CHALLENGE, 0, 0, 0, 0, 0)])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    with pytest.raises(VersionMismatch, match=f"protocol {wire.PROTOCOL_VERSION + 1}"):
        handshake.client_handshake(client, TOKEN.encode(), hello(), LIMITS)
    t.join(10)


def test_a_hello_naming_another_protocol_is_refused_as_a_version_mismatch(pair):
    client, server = pair
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", pytest.raises(
        VersionMismatch, handshake.server_handshake, server, TOKEN.encode(), LIMITS, ROUTES)), daemon=True)
    t.start()
    handshake._send(client, MsgKind.HELLO, raw_hello(proto=99))
    with pytest.raises(VersionMismatch):
        handshake._recv(client, LIMITS, MsgKind.CHALLENGE)
    t.join(10)


def test_an_unknown_route_is_refused_after_authentication_as_a_remote_error(pair):
    client, server = both_sides(pair, client_hello=hello(route="nope"))
    assert isinstance(client, RemoteError) and "unknown route 'nope'" in str(client)
    assert isinstance(server, ProtocolError)


BAD_HELLOS = {
    "no route": ({"route": None}, "route"),
    "transports not a list": ({"transports": 5}, "transports"),
    "options not a dict": ({"options": [1]}, "options"),
    "versions not a dict": ({"versions": "x"}, "versions"),
    "short nonce": ({"nonce": b"n"}, "nonce"),
    "session id too long": ({"session": "s" * 1000}, "session"),
}


@pytest.mark.parametrize("case", list(BAD_HELLOS))
def test_a_malformed_hello_is_a_protocol_error_naming_the_field(pair, case):
    change, field = BAD_HELLOS[case]
    client, server = pair
    handshake._send(client, MsgKind.HELLO, raw_hello(**change))
    with pytest.raises(ProtocolError, match=field):
        handshake.server_handshake(server, TOKEN.encode(), LIMITS, ROUTES)


@pytest.mark.parametrize("frame, field", [
    (encode_frame(MsgKind.HELLO, 0, {"pad": b"x" * (2 << 20)}), "meta_len"),   # 2 MiB of metadata
    (encode_frame(MsgKind.HELLO, 0, {}, [b"buffer"]), "nbufs"),                 # any raw buffer at all
], ids=["big metadata", "a buffer"])
def test_handshake_frames_are_bounded_before_anyone_is_authenticated(pair, frame, field):
    client, server = pair

    def send():
        try:
            client.send([frame])
        except ConnectionLost:   # refused mid-frame and closed below: what this test expects of it
            pass
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    with pytest.raises(ProtocolError, match=field):
        handshake.server_handshake(server, TOKEN.encode(), LIMITS, ROUTES)
    client.abort()
    sender.join(10)
    assert not sender.is_alive()


# ---- against a real server ---------------------------------------------------------------------

def test_the_right_token_connects_and_the_welcome_names_the_route(rgpu_server):
    conn = rgpu_server.connect("echo")
    assert conn.welcome["info"]["route"] == "echo" and conn.transport_name == "tcp"
    assert conn.welcome["server_versions"]["rgpu"]


def test_a_wrong_token_is_an_authentication_error_not_a_connect_error(rgpu_server):
    with pytest.raises(AuthenticationError) as info:
        connect("echo", settings=rgpu_server.settings(), token="not-the-token")
    assert not isinstance(info.value, ConnectError)
    assert rgpu_server.connect("echo").call({"op": "sizes"}).meta["sizes"] == []  # the server goes on


def test_no_server_at_the_address_is_a_connect_error(rgpu_server):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(ConnectError):
        connect("echo", settings=rgpu_server.settings(), server=f"127.0.0.1:{port}")


def test_a_client_of_another_protocol_is_refused_by_the_real_server(rgpu_server, monkeypatch):
    monkeypatch.setattr(wire, "PROTOCOL_VERSION", wire.PROTOCOL_VERSION + 1)  # this process now speaks 2
    with pytest.raises(VersionMismatch):
        connect("echo", settings=rgpu_server.settings())


def test_a_server_that_never_answers_is_a_timeout_within_the_connect_timeout(rgpu_server):
    silent = tcp.listen("127.0.0.1", 0)  # accepts (the kernel does) but never speaks
    try:
        s = config.settings(environ={"RGPU_CONNECT_TIMEOUT": "0.5"}, server=f"127.0.0.1:{silent.getsockname()[1]}",
                            token=TOKEN)
        with pytest.raises(Timeout):
            connect("echo", settings=s)
    finally:
        silent.close()
