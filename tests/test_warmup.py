"""A first connection: it waits for a server still warming up (saying so), or fails naming the address,
the phase and the fix; the server's log names a wrong token; ``rgpu serve`` says what its ops run on."""
from __future__ import annotations

import socket
import threading

import pytest

from conftest import wait_until

from rgpu.errors import AuthenticationError, ConnectionLost, Timeout
from rgpu.transport.client import connect

SLOW_START_S = 4.0


def test_a_first_connection_to_a_server_still_warming_up_waits_for_it_with_a_line_saying_so(
        start_server, tmp_path, capsys):
    # the spare worker's preload takes longer than the client's handshake timeout
    (tmp_path / "slow_preload.py").write_text(f"import time\ntime.sleep({SLOW_START_S})\n")
    server = start_server("--preload", "slow_preload", env={"PYTHONPATH": str(tmp_path)})
    conn = server.connect("echo", connect_timeout=1.5)
    assert conn.call({"op": "sizes"}).meta["sizes"] == []
    err = capsys.readouterr().err
    assert f"rgpu: the server at {server.address} is warming up (its worker is starting" in err
    assert f"rgpu: the server at {server.address} is ready (waited " in err


def _silent_port(answer):
    """A port that accepts connections and then does ``answer(sock)``: never speaks rgpu."""
    listener = socket.create_server(("127.0.0.1", 0))
    held = []

    def serve():
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            held.append(sock)
            answer(sock)

    threading.Thread(target=serve, daemon=True).start()
    return listener, held


def test_a_port_that_accepts_and_never_answers_times_out_naming_the_address_and_the_handshake():
    listener, held = _silent_port(lambda sock: None)
    port = listener.getsockname()[1]
    from rgpu import config

    s = config.settings(environ={}, server=f"127.0.0.1:{port}", token="t", connect_timeout=0.5)
    with pytest.raises(Timeout) as caught:
        connect("echo", settings=s)
    assert str(caught.value).startswith(f"no rgpu handshake from 127.0.0.1:{port} within 0.5 s: "
                                        "is it an rgpu server?")
    listener.close()


def test_a_port_that_hangs_up_at_once_is_said_to_close_during_the_handshake():
    from rgpu import config

    listener, _ = _silent_port(lambda sock: sock.close())
    port = listener.getsockname()[1]
    s = config.settings(environ={}, server=f"127.0.0.1:{port}", token="t", connect_timeout=5)
    with pytest.raises(ConnectionLost, match=f"127.0.0.1:{port} closed the connection during the handshake"):
        connect("echo", settings=s)
    listener.close()


def test_a_client_holding_another_token_shows_in_the_servers_log_as_a_wrong_token(start_server):
    server = start_server()
    with pytest.raises(AuthenticationError, match="does not know our token"):
        connect("echo", settings=server.settings().with_(token="another-token"))
    wait_until(lambda: "wrong token" in server.stderr, 10, "the server to log the wrong token")
    assert "closed the connection" not in server.stderr


@pytest.mark.slow
def test_rgpu_serve_says_what_its_ops_run_on_and_that_it_chose_the_cpu(start_server):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: the server runs its ops there")
    server = start_server("--preload", "torch")
    wait_until(lambda: "rgpu serve: ops run on" in server.stdout, 120, "the warm worker's device line")
    assert "rgpu serve: ops run on the CPU: --device auto found no usable CUDA device" in server.stdout


FAILING_CLIENT = """
import torch, rgpu
from rgpu.transport.client import connect

def train():
    connect("echo", server="127.0.0.1:1", token="t")

train()
"""


@pytest.mark.parametrize("debug", [False, True])
def test_an_error_that_ends_a_client_ends_in_one_clear_line_with_rgpus_frames_only_when_debugging(debug):
    import subprocess
    import sys

    from conftest import clean_env

    env = clean_env(**({"RGPU_DEBUG": "1"} if debug else {}))
    done = subprocess.run([sys.executable, "-c", FAILING_CLIENT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert ("transport/client.py" in done.stderr) is debug     # rgpu's own frames
    assert 'line 6, in train' in done.stderr                   # the program's frames stay
    if not debug:
        assert lines[-1].startswith("rgpu: ConnectError: cannot connect (127.0.0.1:1)"), lines[-1]
        assert "RGPU_DEBUG=1 shows them" in lines[0]


def _workers(server) -> set[int]:
    import subprocess

    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server.proc.pid)], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def test_with_no_spare_kept_only_the_first_sessions_worker_starts_ahead_and_a_second_session_still_runs(
        start_server):
    # the embedded local server's setting: its one program's first steps share no cores with a spare's warm-up
    server = start_server("--spare-workers", "0")
    wait_until(lambda: len(_workers(server)) == 1, 30, "the first session's worker to start with the server")
    first = server.connect("echo")
    assert first.call({"op": "sizes"}).meta["sizes"] == []
    assert len(_workers(server)) == 1                      # no spare started beside the session
    second = server.connect("echo", connect_timeout=30)   # its worker starts now; the client waits for it
    assert second.call({"op": "sizes"}).meta["sizes"] == []
    assert len(_workers(server)) == 2


def test_the_embedded_local_server_keeps_no_spare_worker(monkeypatch):
    from rgpu import config
    from rgpu import local_server

    started = []

    class Recorded:
        address, proc = "127.0.0.1:1", type("Proc", (), {"pid": 1, "poll": staticmethod(lambda: None)})

        def __init__(self, token, extra_args=None, **kw):
            started.append(extra_args)

        def stop(self):
            pass

    monkeypatch.setattr(local_server, "LocalServer", Recorded)
    monkeypatch.setattr(local_server, "_server", None)
    local_server.shared(config.settings(environ={}))
    assert started == [["--spare-workers", "0"]]
