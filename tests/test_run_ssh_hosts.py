"""``rgpu run --ssh HOST1,HOST2``: several hosts through a real loopback sshd (the same host twice), and teardown.

The sshd fixture and helpers are test_run_ssh.py's; each host's server here is a CPU server of two devices.
"""
from __future__ import annotations

import getpass
import json
import os
import re
import signal
import subprocess
import sys

import pytest
from conftest import RunningServer, wait_until
from test_run_ssh import (free_port, needs_sshd, no_tunnel_left, processes_mentioning, remote_server, rgpu_run,  # noqa: F401
                          run_env, script, sshd)

SEVERAL = """
import json, os, torch, rgpu
a = torch.linspace(-2, 2, 24).reshape(4, 6)
ref = (a.relu() * 3 + 1).softmax(-1) @ a.t()
out = {"servers": os.environ["RGPU_SERVER"].split(","), "count": torch.rgpu.device_count(),
       "names": [torch.rgpu.get_device_name(d) for d in range(torch.rgpu.device_count())],
       "same": [torch.equal(((a.to(f"rgpu:{d}").relu() * 3 + 1).softmax(-1) @ a.to(f"rgpu:{d}").t()).cpu(), ref)
                for d in range(torch.rgpu.device_count())],
       # servers behind tunnels cannot reach each other: a copy across goes through this process
       "peer_copy": os.environ.get("RGPU_PEER_COPY"), "across": torch.equal(a.to("rgpu:0").to("rgpu:3").cpu(), a)}
print("several:", json.dumps(out), flush=True)
"""



@pytest.fixture
def two_remote_servers(tmp_path):
    """Two CPU servers of two devices each on the ssh host, one token file (a session of several uses one token)."""
    flags = ("--device", "cpu", "--devices", "2", "--session-grace", "0")
    first = RunningServer(tmp_path / "a", flags, token=None)
    servers = [first]
    try:
        servers.append(RunningServer(tmp_path / "b", flags, env={"RGPU_TOKEN_FILE": str(first.token_file)},
                                     token=None))
        yield servers
    finally:
        for server in servers:
            server.stop()


@needs_sshd
def test_the_same_host_twice_gives_one_session_of_both_servers_devices_rgpu_0_to_3(sshd, two_remote_servers,
                                                                                     tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "several.py"
    path.write_text(SEVERAL)
    a, b = two_remote_servers
    host = f"{getpass.getuser()}@127.0.0.1"
    done = rgpu_run(*sshd.args(dest=f"{host},{host}"), "--remote-port", f"{a.port},{b.port}",
                    "--remote-token-file", a.token_file, "--", path, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.split("several:", 1)[1])
    assert out["count"] == 4 and out["same"] == [True] * 4, out   # each device's ops against the CPU's
    assert out["peer_copy"] == "client" and out["across"], out
    assert [n[-len("device 0)"):] for n in out["names"]] == ["device 0)", "device 1)"] * 2, out["names"]
    assert len(out["servers"]) == 2 and all(s.startswith("127.0.0.1:") for s in out["servers"])
    assert not {s.rpartition(":")[2] for s in out["servers"]} & {str(a.port), str(b.port)}  # the tunnels' ends
    assert "setting up 2 hosts at once" in done.stderr
    assert done.stderr.count(f"-> {host} port") == 2, done.stderr   # a progress line for each host
    wait_until(lambda: no_tunnel_left(sshd), what="both tunnels to end")


@needs_sshd
def test_doctor_through_two_tunnels_checks_both_servers_and_numbers_their_devices(sshd, two_remote_servers):
    a, b = two_remote_servers
    host = f"{getpass.getuser()}@127.0.0.1"
    done = rgpu_run(*sshd.args(dest=f"{host},{host}"), "--remote-port", f"{a.port},{b.port}",
                    "--remote-token-file", a.token_file, "--", sys.executable, "-m", "rgpu", "doctor", timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all checks pass on 2 servers" in done.stderr
    assert re.search(r"summary: 2 servers, 4 devices rgpu:0\.\.3: rgpu:0\.\.1 on 127\.0\.0\.1:\d+, rgpu:2\.\.3 on",
                     done.stdout), done.stdout


@needs_sshd
def test_a_bad_host_among_several_is_named_with_what_ssh_said_and_the_others_are_torn_down(sshd, remote_server,
                                                                                             script):
    good = f"{getpass.getuser()}@127.0.0.1"
    done = rgpu_run(*sshd.args(dest=f"{good},nobody-here@127.0.0.1"), "--remote-port", remote_server.port,
                    "--remote-token-file", remote_server.token_file, "--", script)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "host 2 of 2, nobody-here@127.0.0.1:" in done.stderr and "Permission denied" in done.stderr, done.stderr
    assert f"({good}) were ended" in done.stderr
    assert "child:" not in done.stdout
    wait_until(lambda: no_tunnel_left(sshd), what="the good host's tunnel to end")


def _started_in_the_background(sshd, script, tmp_path, dest: str, ports: str) -> subprocess.Popen:
    """``rgpu run --start-server ... -- script sleep`` in its own process group, returned once the script runs."""
    proc = subprocess.Popen([sys.executable, "-m", "rgpu", "run", *sshd.args(dest=dest), "--remote-port", ports,
                             "--start-server", "--remote-rgpu", f"{sys.executable} -m rgpu", "--remote-token-file",
                             str(tmp_path / "fresh" / "token"), "--", str(script), "sleep"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=run_env(),
                            stdin=subprocess.DEVNULL, start_new_session=True)
    for line in proc.stdout:
        if line.strip() == "ready":
            return proc
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"the script never ran: {proc.stderr.read()}")


def no_server_left(ports) -> bool:
    return not any(processes_mentioning("rgpu", "serve", "--port", str(p)) for p in ports)


@needs_sshd
def test_ctrl_c_with_several_hosts_ends_the_command_every_tunnel_and_every_server_started(sshd, script, tmp_path):
    host, ports = f"{getpass.getuser()}@127.0.0.1", (free_port(), free_port())
    proc = _started_in_the_background(sshd, script, tmp_path, f"{host},{host}", ",".join(map(str, ports)))
    try:
        assert all(processes_mentioning("rgpu", "serve", "--port", str(p)) for p in ports)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        assert proc.wait(60) == 128 + signal.SIGINT
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wait_until(lambda: no_tunnel_left(sshd), what="both tunnels to end")
    wait_until(lambda: no_server_left(ports), what="both servers to stop")


@needs_sshd
def test_a_killed_rgpu_run_leaves_no_server_it_started_behind(sshd, script, tmp_path):
    port = free_port()
    proc = _started_in_the_background(sshd, script, tmp_path, None, str(port))
    os.killpg(proc.pid, signal.SIGKILL)   # no teardown runs: its ssh children die with it, the server with its login
    proc.wait()
    wait_until(lambda: no_tunnel_left(sshd), what="the tunnel to end")
    wait_until(lambda: no_server_left([port]), what="the server to stop with its ssh login")


def test_several_hosts_with_a_port_count_that_fits_none_or_a_server_named_twice_are_refused_before_ssh(script):
    done = rgpu_run("--ssh", "a,b", "--remote-port", "1,2,3", "--", script)
    assert done.returncode == 2 and "3 ports for 2 hosts" in done.stderr, done.stderr
    done = rgpu_run("--ssh", "a,a", "--", script)
    assert done.returncode == 2 and "a server is named twice" in done.stderr, done.stderr
    done = rgpu_run("--ssh", "a,b", "--remote-port", "9713,x", "--", script)
    assert done.returncode == 2 and "comma list of ports" in done.stderr, done.stderr
