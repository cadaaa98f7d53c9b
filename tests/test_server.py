"""``rgpu serve``: a worker per session, isolation, malformed frames, limits, the token file, shutdown."""
from __future__ import annotations

import io
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading

import msgpack
import pytest

from rgpu import config
from rgpu.errors import ConnectError, ConnectionLost, ProtocolError, RemoteError, SessionLost
from rgpu.server.route import Executor
from rgpu.transport.client import connect
from rgpu.transport.tcp import TcpTransport
from rgpu.transport.wire import HEADER, MAGIC, PROTOCOL_VERSION, BufferPool, Limits, MsgKind, encode_frame

from conftest import pid_gone, wait_until
from in_process import session_on_a_thread


def header(kind=MsgKind.POST, meta_len=0, nbufs=0, flags=0, magic=MAGIC):
    return HEADER.pack(magic, PROTOCOL_VERSION, int(kind), flags, 1, 0, meta_len, nbufs)


def with_meta(meta: bytes) -> bytes:
    return header(meta_len=len(meta)) + meta


# what a client sends after an honest handshake, and the field the server must name
MALFORMED = {
    "wrong magic": (header(magic=b"XXXX") + b"\0" * 64, "magic"),
    "unknown kind": (header(kind=77), "kind"),
    "unknown flags": (header(flags=1 << 20), "flags"),
    "absurd metadata length": (header(meta_len=2**31), "meta_len"),
    "absurd buffer count": (header(nbufs=2**31), "nbufs"),
    "absurd buffer length": (header(nbufs=1) + struct.pack("<Q", 2**60), "buffer lengths"),
    "bad metadata": (with_meta(b"\xc1"), "metadata"),
    "an extension type in metadata": (with_meta(b"\xd6\x05abcd"), "metadata"),
    "a timestamp in metadata": (with_meta(msgpack.packb(msgpack.Timestamp(5))), "metadata"),
    "a reply from the client": (encode_frame(MsgKind.REPLY, 1, {}), "kind"),
    "a second hello": (encode_frame(MsgKind.HELLO, 1, {}), "kind"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_frame_closes_that_session_with_its_field_named_and_others_go_on(rgpu_server, echo_conn, case):
    data, field = MALFORMED[case]
    conn = rgpu_server.connect("echo")
    pid = conn.welcome["info"]["pid"]
    conn.transport.send([data])
    bye = conn.transport.recv_frame(Limits(), BufferPool())
    assert bye.kind == MsgKind.BYE and bye.meta["error"] == "ProtocolError"
    assert f"protocol error: {field}" in bye.meta["reason"]
    with pytest.raises(ConnectionLost):
        conn.transport.recv_frame(Limits(), BufferPool())   # then the server hangs up
    wait_until(lambda: pid_gone(pid), 10, "the session's worker to exit")
    assert echo_conn.call({"op": "sizes"}, [b"ok"]).meta["sizes"] == [2]


def test_the_client_raises_protocol_error_naming_the_field_the_server_refused(rgpu_server):
    conn = rgpu_server.connect("echo")
    conn.transport.send([header(kind=77)])
    with pytest.raises(ProtocolError, match="kind: unknown message kind 77"):
        conn.call({"op": "sizes"}, timeout=10)


def test_a_frame_over_the_servers_limit_is_refused_and_the_client_is_told_why(start_server):
    server = start_server("--max-frame", "1M")
    conn = server.connect("echo")
    assert conn.call({"op": "sizes"}, [b"x" * 1000]).meta["sizes"] == [1000]
    with pytest.raises(ProtocolError, match="buffer lengths: frame of .* exceeds the limit of 1048576"):
        conn.call({"op": "sizes"}, [b"x" * (4 << 20)], timeout=10)


def test_garbage_instead_of_a_hello_is_refused_naming_the_field(rgpu_server):
    sock = socket.create_connection((rgpu_server.host, rgpu_server.port), timeout=10)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 64)
    refused = TcpTransport(sock).recv_frame(Limits(), BufferPool())
    assert refused.kind == MsgKind.REFUSED and refused.meta["code"] == "protocol"
    assert refused.meta["message"].startswith("magic")
    sock.close()


def _spare_pids(server) -> set[int]:
    """The server's worker processes (children of the acceptor)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server.proc.pid)], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


@pytest.mark.parametrize("how", ["half a header, then gone", "nothing at all, then a stall", "a hello, then a stall"])
def test_a_client_that_stops_in_the_handshake_never_takes_a_worker_and_is_dropped(start_server, how):
    server = start_server(env={"RGPU_AUTH_TIMEOUT": "0.5"})
    before = _spare_pids(server)
    sock = socket.create_connection((server.host, server.port), timeout=10)
    if how.startswith("half"):
        sock.sendall(header(kind=MsgKind.HELLO)[:10])
        sock.close()
    elif how.startswith("a hello"):
        sock.sendall(encode_frame(MsgKind.HELLO, 0, {"proto": PROTOCOL_VERSION, "versions": {}, "route": "echo",
                                                     "session": "s", "transports": [], "nonce": b"n" * 32,
                                                     "options": {}}))
        challenge = TcpTransport(sock).recv_frame(Limits(), BufferPool())
        assert challenge.kind == MsgKind.CHALLENGE
    if not how.endswith("gone"):   # the acceptor hangs up on it once RGPU_AUTH_TIMEOUT is past
        sock.settimeout(10)
        assert sock.recv(1) == b""
    sock.close()
    assert _spare_pids(server) == before and all(not pid_gone(p) for p in before)   # the spare never took it
    conn = server.connect("echo")
    assert conn.call({"op": "sizes"}).meta["sizes"] == []


# ---- isolation ----------------------------------------------------------------------------------

def test_each_session_has_its_own_worker_process(rgpu_server, echo_conn):
    other = rgpu_server.connect("echo")
    pids = {echo_conn.welcome["info"]["pid"], other.welcome["info"]["pid"], rgpu_server.proc.pid}
    assert len(pids) == 3


def test_sessions_run_at_the_same_time(rgpu_server, echo_conn):
    slow = rgpu_server.connect("echo")
    fut = slow.request({"op": "sleep", "s": 1.5})
    assert echo_conn.call({"op": "sizes"}, [b"quick"], timeout=30).meta["sizes"] == [5]
    assert not fut.done   # answered while the other session still sleeps
    fut.result(timeout=30)


def test_one_sessions_worker_crashing_ends_only_that_session(rgpu_server, echo_conn):
    victim = rgpu_server.connect("echo")
    pid = victim.welcome["info"]["pid"]
    echo_conn.post({"op": "note", "v": "before"})
    with pytest.raises(ConnectionLost):
        victim.call({"op": "crash"}, timeout=30)
    wait_until(lambda: pid_gone(pid), 10, "the crashed worker to be gone")
    echo_conn.post({"op": "note", "v": "after"})
    assert echo_conn.call({"op": "notes"}).meta["notes"] == ["before", "after"]
    assert rgpu_server.connect("echo").call({"op": "sizes"}).meta["sizes"] == []  # new sessions start


def test_a_client_dying_mid_frame_ends_its_session_promptly_and_no_other(start_server):
    # a killed client's session is held for the grace in case it resumes: a short one, as this test checks it ends
    server = start_server("--session-grace", "0.5")
    echo_conn, conn = server.connect("echo"), server.connect("echo")
    pid = conn.welcome["info"]["pid"]
    frame = encode_frame(MsgKind.REQUEST, 5, {"op": "echo"}, [b"d" * 1_000_000])
    conn.transport.sock.sendall(frame[:500_000])
    conn.transport.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.transport.close()  # as a killed process would: reset, no BYE
    wait_until(lambda: pid_gone(pid), 10, "the worker of the dead client to exit")
    assert echo_conn.call({"op": "sizes"}).meta["sizes"] == []


# ---- limits -------------------------------------------------------------------------------------

def test_sessions_past_the_limit_are_refused_as_busy_until_one_ends(start_server):
    server = start_server("--max-sessions", "1")
    first = server.connect("echo")
    with pytest.raises(ConnectError, match="busy"):
        server.connect("echo")
    pid = first.welcome["info"]["pid"]
    first.close()
    wait_until(lambda: pid_gone(pid), 10, "the first session to end")
    wait_until(lambda: _try_connect(server), 10, "a free session slot")


def _try_connect(server) -> bool:
    try:
        server.connect("echo").close()
        return True
    except ConnectError:
        return False


# ---- the executor contract (in process) ----------------------------------------------------------

class Recording(Executor):
    closed = threading.Event()

    def handle(self, meta, buffers, reply):
        import numpy as np
        import torch
        if meta == "unencodable":
            return {"x": {1, 2}}, []
        if meta == "arrays":
            return {}, [np.arange(4, dtype=np.int16), torch.ones(2, 3).t(), b"raw"]
        if meta == "bug":
            raise KeyError("executor bug")
        return None

    def close(self):
        Recording.closed.set()


@pytest.fixture
def in_process_session(monkeypatch):
    """serve_session on a thread with the ``Recording`` executor; yields the client's TcpTransport."""
    Recording.closed = threading.Event()
    with session_on_a_thread(monkeypatch, Recording) as (client, _):
        yield client


def _ask(client, meta, seq=1):
    client.send([encode_frame(MsgKind.REQUEST, seq, meta)])
    return client.recv_frame(Limits(), BufferPool())


def test_a_reply_the_executor_cannot_encode_is_an_error_frame_and_the_session_goes_on(in_process_session):
    err = _ask(in_process_session, "unencodable")
    assert err.kind == MsgKind.ERROR and "cannot be sent" in err.meta["message"] and err.seq == 1
    assert _ask(in_process_session, "ok", seq=2).kind == MsgKind.REPLY


def test_an_executor_may_reply_with_arrays_and_tensors_of_any_layout(in_process_session):
    reply = _ask(in_process_session, "arrays")
    assert [b.nbytes for b in reply.buffers] == [8, 24, 3]


def test_an_exception_in_an_op_names_its_type_and_the_session_goes_on(in_process_session):
    err = _ask(in_process_session, "bug")
    assert (err.meta["type"], err.meta["message"]) == ("KeyError", "'executor bug'")
    assert _ask(in_process_session, "ok", seq=2).kind == MsgKind.REPLY


@pytest.mark.parametrize("ending", ["bye", "hang up", "protocol error"])
def test_the_executor_is_closed_however_the_session_ends(in_process_session, ending):
    client = in_process_session
    if ending == "bye":
        client.send([encode_frame(MsgKind.BYE, 9)])
    elif ending == "protocol error":
        client.send([header(kind=99)])
    else:
        client.abort()
    assert Recording.closed.wait(10)


# ---- the process ----------------------------------------------------------------------------------

def test_the_first_start_creates_a_private_token_file_and_says_where(start_server, tmp_path):
    server = start_server(token=None)
    mode = stat.S_IMODE(os.stat(server.token_file).st_mode)
    assert mode == 0o600 and len(server.token) >= 32
    assert f"token file {server.token_file} (created now" in server.stdout
    s = config.settings(environ={"RGPU_TOKEN_FILE": str(server.token_file)}, server=server.address, transport="tcp")
    conn = connect("echo", settings=s)
    assert conn.call({"op": "sizes"}).meta["sizes"] == []
    conn.close()
    again = start_server(env={"RGPU_TOKEN_FILE": str(server.token_file)}, token=None)
    assert "created now" not in again.stdout and again.token == server.token


def test_a_non_loopback_address_without_tls_prints_a_loud_warning(capsys, tmp_path):
    from rgpu.server.serve import Server, is_loopback
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    s = config.settings(environ={"RGPU_TOKEN": "t"}, host="0.0.0.0", port=0)
    server = Server(s, out=io.StringIO())
    try:
        server.announce()
    finally:
        server.listener.close()
    assert "WARNING: listening on 0.0.0.0, not loopback, without TLS" in capsys.readouterr().err


def test_the_acceptor_never_imports_torch():
    code = "import sys, rgpu.server.serve, rgpu.server.worker; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_sigterm_ends_the_server_and_its_sessions(start_server):
    server = start_server()
    conn = server.connect("echo")
    pid = conn.welcome["info"]["pid"]
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(15) == 0
    wait_until(lambda: pid_gone(pid), 10, "the session's worker to end with the server")
    with pytest.raises((ConnectionLost, SessionLost)):
        conn.call({"op": "sizes"}, timeout=10)


def test_a_port_in_use_is_a_one_line_config_error_from_the_cli(rgpu_server):
    out = subprocess.run([sys.executable, "-m", "rgpu", "serve", "--port", str(rgpu_server.port), "--preload", ""],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "RGPU_TOKEN": "t"})
    assert out.returncode == 2
    assert out.stderr.startswith("rgpu: ConfigError: cannot listen on 127.0.0.1:") and "Traceback" not in out.stderr


def test_an_unknown_route_is_a_remote_error_naming_the_routes_there_are(rgpu_server):
    with pytest.raises(RemoteError, match="unknown route 'nope'.*echo"):
        connect("nope", settings=rgpu_server.settings())


def test_a_parent_that_exited_but_is_not_reaped_counts_as_gone():
    import time
    from types import SimpleNamespace

    from rgpu.server import serve

    child = subprocess.Popen([sys.executable, "-c", "pass"])     # exits at once; we do not reap it yet
    try:
        deadline = time.monotonic() + 30
        while not serve._is_zombie(child.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert serve._is_zombie(child.pid)
        assert serve.Server._parent_gone(SimpleNamespace(parent_pid=child.pid))
    finally:
        child.wait()
    assert not serve._is_zombie(os.getpid())
    assert not serve.Server._parent_gone(SimpleNamespace(parent_pid=os.getpid()))
