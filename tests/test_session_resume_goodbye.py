"""Resume is on by default, so a client that is done says goodbye: a client that exits (normally, by an
exception, by SIGTERM) ends its session at once; only one that vanishes (SIGKILL) leaves it held for the grace,
counted against the token's sessions meanwhile; a raw client that cannot resume is never held."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from rgpu.errors import ConnectError
from rgpu.transport import handshake, tcp
from rgpu.transport.tcp import TcpTransport
from rgpu.transport.wire import Limits

from conftest import clean_env, wait_until
from device_helpers import ROOT

CLIENT = r'''
import sys, time
from rgpu.transport.client import connect
conn = connect("echo")
conn.call({"op": "sizes"})
print("up", flush=True)
how = sys.argv[1]
if how == "raise":
    raise RuntimeError("the program failed")
if how == "exit":
    sys.exit(0)
time.sleep(60)     # SIGTERM or SIGKILL comes
'''


def _workers(server) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server.proc.pid)], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def _client(server, how: str) -> subprocess.Popen:
    env = clean_env(RGPU_SERVER=server.address, RGPU_TOKEN=server.token, RGPU_TRANSPORT="tcp")
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, how], env=env, cwd=str(ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    assert proc.stdout.readline().startswith(b"up")
    return proc


@pytest.fixture
def server(start_server):
    return start_server("--spare-workers", "1")       # the default grace: 120 s


def test_resume_is_offered_by_default_for_the_issues_two_minutes(server):
    conn = server.connect("echo")
    assert conn.welcome["resume"]["grace_s"] == 120


@pytest.mark.parametrize("how", ["exit", "raise", "sigterm"])
def test_a_client_that_exits_ends_its_session_at_once_however_it_exits(server, how):
    baseline = _workers(server)
    proc = _client(server, how)
    wait_until(lambda: len(_workers(server)) > len(baseline), 10, "the session's worker")
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 128 + signal.SIGTERM      # SIGTERM still ends the program, with its status
    proc.wait(10)
    started = time.monotonic()      # its worker goes far sooner than the 120 s grace: the goodbye was heard
    wait_until(lambda: len(_workers(server)) <= len(baseline), 15, f"the session to end ({how})")
    assert time.monotonic() - started < 15


def test_a_vanished_clients_session_is_held_for_the_grace_and_counts_against_the_tokens_sessions(start_server):
    server = start_server("--spare-workers", "1", "--session-grace", "3",
                          env={"RGPU_MAX_SESSIONS_PER_TOKEN": "2"})
    mine = server.connect("echo")
    proc = _client(server, "sleep")
    proc.send_signal(signal.SIGKILL)                   # vanished: no goodbye
    proc.wait()
    with pytest.raises(ConnectError, match="RGPU_MAX_SESSIONS_PER_TOKEN.*2 sessions.*quota of 2"):
        server.connect("echo")                         # the held session still counts
    assert mine.call({"op": "sizes"}).meta["sizes"] == []    # and the others go on
    time.sleep(3.5)                                    # past its grace it ends: room for a new one
    wait_until(lambda: _try(server), 15, "a session past the grace")


def _try(server) -> bool:
    try:
        server.connect("echo").close()
        return True
    except ConnectError:
        return False


def test_a_raw_client_that_cannot_resume_is_offered_no_resume_and_never_held(server):
    t = TcpTransport(tcp.connect(server.host, server.port, 5.0))
    hello = handshake.Hello(route="echo", session="raw", versions={}, transports=[], options={})
    welcome = handshake.client_handshake(t, server.token.encode(), hello, Limits())
    assert "resume" not in welcome
    t.close()
