"""Strangers on the port: a flood from another process never delays an authenticated client, never takes
a worker; the acceptor's bounds shed the connections that got least far first."""
from __future__ import annotations

import socket
import statistics
import subprocess

import pytest

from rgpu.bench.resilience import Flood, handshake_ms
from rgpu.transport.buffers import BufferPool
from rgpu.transport.tcp import TcpTransport
from rgpu.transport.wire import PROTOCOL_VERSION, Limits, MsgKind, encode_frame

from test_tls import fingerprint_printed

FLOOD = 256


def _workers(server) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server.proc.pid)], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def _hello() -> bytes:
    return encode_frame(MsgKind.HELLO, 0, {"proto": PROTOCOL_VERSION, "versions": {}, "route": "echo", "session": "s",
                                           "transports": [], "nonce": b"n" * 32, "options": {}})


def _closed_by_server(sock: socket.socket, timeout: float = 5.0) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_a_flood_of_idle_and_dribbling_strangers_from_another_process_does_not_delay_a_client(start_server):
    server = start_server()
    settings = server.settings(connect_timeout=30.0)
    handshake_ms(settings)   # warm: the client's imports
    flood = Flood(server.address, FLOOD, seconds=30)
    try:
        times = [handshake_ms(settings) for _ in range(3)]
        assert flood.proc.poll() is None   # still flooding while the client connected
    finally:
        flood.stop()
    assert statistics.median(times) < 1000, f"handshakes under the flood took {times} ms"


def test_a_flood_against_a_tls_server_does_not_delay_a_pinned_client(start_server):
    server = start_server("--tls")
    settings = server.settings(connect_timeout=30.0, tls_fingerprint=fingerprint_printed(server))
    handshake_ms(settings)
    flood = Flood(server.address, FLOOD, seconds=30, tls=True)
    try:
        times = [handshake_ms(settings) for _ in range(3)]
        assert flood.proc.poll() is None
    finally:
        flood.stop()
    assert statistics.median(times) < 1000, f"TLS handshakes under the flood took {times} ms"


def test_strangers_never_take_a_worker(start_server):
    server = start_server()
    spares = _workers(server)
    socks = [socket.create_connection((server.host, server.port), timeout=10) for _ in range(40)]
    for s in socks[:20]:
        s.sendall(_hello())   # a hello needs no token: still no worker before the proof
    for s in socks[:20]:
        assert TcpTransport(s).recv_frame(Limits(), BufferPool()).kind == MsgKind.CHALLENGE
    assert _workers(server) == spares
    for s in socks:
        s.close()
    conn = server.connect("echo")
    assert conn.call({"op": "sizes"}, [b"ok"]).meta["sizes"] == [2]


def test_over_the_per_source_bound_the_connection_that_got_least_far_goes_first(start_server):
    server = start_server(env={"RGPU_MAX_UNAUTH_PER_SOURCE": "4"})
    challenged = socket.create_connection((server.host, server.port), timeout=10)
    challenged.sendall(_hello())
    assert TcpTransport(challenged).recv_frame(Limits(), BufferPool()).kind == MsgKind.CHALLENGE
    idle = [socket.create_connection((server.host, server.port), timeout=10) for _ in range(3)]
    newcomer = socket.create_connection((server.host, server.port), timeout=10)   # the fifth: one must go
    assert _closed_by_server(idle[0])             # the oldest of those that sent nothing
    assert not _closed_by_server(challenged, 0.3)   # it had sent its hello
    assert not _closed_by_server(newcomer, 0.3)
    for s in (challenged, newcomer, *idle):
        s.close()
    conn = server.connect("echo")   # a real client still gets in, however full the bound
    assert conn.call({"op": "sizes"}).meta["sizes"] == []


@pytest.mark.parametrize("bound", ["RGPU_MAX_UNAUTH", "RGPU_MAX_UNAUTH_PER_SOURCE"])
def test_a_client_connects_while_strangers_fill_a_bound(start_server, bound):
    server = start_server(env={bound: "8"})
    strangers = [socket.create_connection((server.host, server.port), timeout=10) for _ in range(8)]
    conn = server.connect("echo")
    assert conn.call({"op": "sizes"}).meta["sizes"] == []
    assert _closed_by_server(strangers[0])
    for s in strangers:
        s.close()
