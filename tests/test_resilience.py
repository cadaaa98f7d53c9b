"""Strangers on the port: a flood from another process never delays an authenticated client, never takes
a worker; the acceptor's bounds shed the connections that got least far first."""
from __future__ import annotations

import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import time

import pytest

from rgpu.errors import ConnectError, SessionLost

from rgpu.bench.resilience import Flood, handshake_ms
from rgpu.transport.client import connect
from rgpu.transport.tcp import TcpTransport
from rgpu.transport.wire import PROTOCOL_VERSION, BufferPool, Limits, MsgKind, encode_frame

from conftest import wait_until
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


def _handshakes(settings, n: int = 3) -> list[float]:
    """``n`` authenticated handshakes, each after a pause in which the server warms its next spare worker."""
    times = []
    for _ in range(n):
        time.sleep(1.0)
        times.append(handshake_ms(settings))
    return times


def _flooded_and_quiet(server, settings, tls: bool = False) -> tuple[list[float], list[float]]:
    handshake_ms(settings)   # warm: the client's imports
    quiet = _handshakes(settings)
    flood = Flood(server.address, FLOOD, seconds=30, tls=tls)
    try:
        flooded = _handshakes(settings)
        assert flood.proc.poll() is None   # still flooding while the client connected
    finally:
        flood.stop()
    return flooded, quiet


def test_a_flood_of_idle_and_dribbling_strangers_from_another_process_does_not_delay_a_client(start_server):
    server = start_server("--spare-workers", "2")
    flooded, quiet = _flooded_and_quiet(server, server.settings(connect_timeout=30.0))
    assert statistics.median(flooded) < statistics.median(quiet) + 1000, f"flooded {flooded} ms, quiet {quiet} ms"


def test_a_flood_against_a_tls_server_does_not_delay_a_pinned_client(start_server):
    server = start_server("--tls", "--spare-workers", "2")
    settings = server.settings(connect_timeout=30.0, tls_fingerprint=fingerprint_printed(server))
    flooded, quiet = _flooded_and_quiet(server, settings, tls=True)
    assert statistics.median(flooded) < statistics.median(quiet) + 1000, f"flooded {flooded} ms, quiet {quiet} ms"


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


def test_on_sigterm_the_server_finishes_the_op_in_flight_and_tells_each_client_why_it_goes(start_server):
    server = start_server()
    busy, idle = server.connect("echo"), server.connect("echo")
    assert idle.call({"op": "sizes"}).meta["sizes"] == []
    running = busy.request({"op": "sleep", "s": 2.0})
    time.sleep(0.3)    # the op has started
    server.proc.send_signal(signal.SIGTERM)
    assert running.result(timeout=15).meta is not None   # finished, and answered
    for conn in (busy, idle):
        with pytest.raises(SessionLost, match="the server is shutting down .*SIGTERM"):
            conn.call({"op": "sizes"}, timeout=15)
    assert server.proc.wait(15) == 0
    with pytest.raises(ConnectError):
        connect("echo", settings=server.settings(connect_timeout=2.0))


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read the server's socket timers")
def test_both_ends_of_a_session_keep_tcp_keepalive_on_so_a_silently_dead_peer_is_noticed(rgpu_server, echo_conn):
    sock = echo_conn.transport.sock
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) <= 60
    mine = sock.getsockname()[1]

    def server_end_keeps_alive() -> bool:   # the worker's socket, idle: its timer is keepalive's
        out = subprocess.run(["ss", "-tnoH", "state", "established", f"( sport = :{rgpu_server.port} and "
                              f"dport = :{mine} )"], capture_output=True, text=True).stdout
        return "keepalive" in out

    wait_until(server_end_keeps_alive, 10, "the server's end of the session to show a keepalive timer")


def test_a_tls_stranger_that_stalls_after_its_client_hello_is_dropped_within_the_auth_timeout(start_server):
    server = start_server("--tls", env={"RGPU_AUTH_TIMEOUT": "1"})
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    try:
        ctx.wrap_bio(incoming, outgoing).do_handshake()
    except ssl.SSLWantReadError:
        pass
    sock = socket.create_connection((server.host, server.port), timeout=10)
    sock.sendall(outgoing.read())   # a whole ClientHello: the worker takes it, then the client says no more
    t0 = time.monotonic()
    while sock.recv(65536):          # the server's hello and certificate, then its hang-up
        pass
    assert time.monotonic() - t0 < 8
    sock.close()
    settings = server.settings(tls_fingerprint=fingerprint_printed(server))
    assert handshake_ms(settings) < 10_000


def test_the_eager_step_bench_compares_a_resumable_session_with_a_plain_one_of_equal_losses():
    # the acknowledgements' cost row (issue 25's <= 1%): each session in a process of its own, the carriers checked
    from rgpu.bench.resilience import _training_step

    row = _training_step("small", 1)
    assert row["unit"] == "ms" and row["value"] > 0 and row["baseline"] > 0 and row["runs"] == 1
    resumable, plain = row["losses"]                         # two warm steps each, on the CPU equal bit for bit
    assert len(resumable) == 2 and resumable == plain and all(loss == loss for loss in resumable)
