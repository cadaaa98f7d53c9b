"""``rgpu run``: through a real OpenSSH server on loopback (throwaway host key, key-only auth), and locally."""
from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import RunningServer, clean_env, wait_until

SSHD = shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if os.path.exists(p)), None)
needs_sshd = pytest.mark.skipif(SSHD is None or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None,
                                reason="OpenSSH (sshd, ssh, ssh-keygen) is not installed: "
                                       "apt-get install openssh-server openssh-client")

SCRIPT = """
import os, sys
from rgpu.transport.client import connect
conn = connect("echo")
reply = conn.call({"op": "echo"}, [b"through the tunnel"])
tls = getattr(conn.transport, "tls", False)
print("child:", os.environ["RGPU_SERVER"], bytes(reply.buffers[0]).decode(), "tls" if tls else "plain",
      "streams", os.environ.get("RGPU_TCP_STREAMS"), flush=True)
conn.close()
if len(sys.argv) > 1 and sys.argv[1] == "sleep":
    print("ready", flush=True)
    import time; time.sleep(60)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 0)
"""

TRAIN = """
import torch, rgpu
torch.manual_seed(0)
x, y = torch.randn(64, 4), torch.randn(64, 1)
model = torch.nn.Linear(4, 1)
ref = torch.nn.Linear(4, 1); ref.load_state_dict(model.state_dict())
model.to("rgpu")
for m, xs, ys in ((model, x.to("rgpu"), y.to("rgpu")), (ref, x, y)):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(5):
        opt.zero_grad(); torch.nn.functional.mse_loss(m(xs), ys).backward(); opt.step()
assert torch.allclose(model.weight.cpu(), ref.weight, atol=1e-6), (model.weight.cpu(), ref.weight)
print("trained on rgpu", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sshd:
    """``sshd -D`` on a free loopback port: a throwaway host key, one authorized throwaway key, nothing else."""

    def __init__(self, folder: Path):
        self.folder, self.port = folder, free_port()
        for name in ("host_key", "user_key", "wrong_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True)
        (folder / "authorized_keys").write_text((folder / "user_key.pub").read_text())
        (folder / "authorized_keys").chmod(0o600)
        (folder / "sshd_config").write_text(f"""
Port {self.port}
ListenAddress 127.0.0.1
HostKey {folder / 'host_key'}
AuthorizedKeysFile {folder / 'authorized_keys'}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PermitRootLogin prohibit-password
AllowTcpForwarding local
PidFile {folder / 'sshd.pid'}
""")
        self.log = open(folder / "sshd.log", "w")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(folder / "sshd_config")], stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.skip(f"sshd did not start: {(folder / 'sshd.log').read_text()[-500:]}")
                time.sleep(0.05)

    def args(self, key: str = "user_key", dest: str | None = None) -> list[str]:
        """``--ssh`` this sshd as this user (or ``dest``: a comma list of hosts, a wrong user) with the test's key."""
        return ["--ssh", dest or f"{getpass.getuser()}@127.0.0.1", "--ssh-port", str(self.port),
                "-i", str(self.folder / key), "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no",
                "-o", f"UserKnownHostsFile={self.folder / 'known_hosts'}", "-o", "LogLevel=ERROR"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    if SSHD is None or shutil.which("ssh-keygen") is None:
        pytest.skip("OpenSSH is not installed: apt-get install openssh-server openssh-client")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    elif not os.path.isdir("/run/sshd"):
        pytest.skip("sshd needs /run/sshd, which only root can make")
    server = Sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    return path


def run_env(**extra) -> dict:
    """No RGPU_* of the caller, no ssh-agent; tcp, as between two hosts (here both ends could share memory)."""
    env = clean_env(RGPU_TRANSPORT="tcp", **extra)
    env.pop("SSH_AUTH_SOCK", None)
    return env


def rgpu_run(*args, env=None, timeout=120) -> subprocess.CompletedProcess:
    """``rgpu run ...``; the timeout only guards against a hang, it measures nothing."""
    return subprocess.run([sys.executable, "-m", "rgpu", "run", *map(str, args)], capture_output=True, text=True,
                          env=run_env(**(env or {})), stdin=subprocess.DEVNULL, timeout=timeout)


def processes_mentioning(*needles: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if state != "Z" and all(n in cmdline for n in needles):
            found.append(f"{proc.name}: {cmdline}")
    return found


def no_tunnel_left(sshd) -> bool:
    return not processes_mentioning("ExitOnForwardFailure=yes", str(sshd.port))


@pytest.fixture
def remote_server(tmp_path):
    """An ``rgpu serve`` with its own token file and no RGPU_TOKEN: the token must be read over ssh."""
    server = RunningServer(tmp_path / "remote", token=None)
    yield server
    server.stop()


@needs_sshd
def test_a_script_runs_through_the_tunnel_with_the_token_read_over_ssh(sshd, remote_server, script):
    done = rgpu_run(*sshd.args(), "--remote-port", remote_server.port, "--remote-token-file",
                    remote_server.token_file, "--", script, 7)
    assert done.returncode == 7, done.stderr
    assert "through the tunnel plain" in done.stdout
    assert "streams 1" in done.stdout   # one ssh channel: a worker's stream port is not inside the tunnel
    assert f"127.0.0.1:{remote_server.port} " not in done.stdout  # the command saw the tunnel's port, not the server's
    wait_until(lambda: no_tunnel_left(sshd), what="the tunnel to end")


@needs_sshd
def test_a_wrong_key_is_a_clear_error_at_once_with_no_process_left(sshd, remote_server, script):
    done = rgpu_run(*sshd.args("wrong_key"), "--remote-port", remote_server.port, "--remote-token-file",
                    remote_server.token_file, "--", script)
    assert done.returncode == 2
    assert "Permission denied" in done.stderr and "-i KEY" in done.stderr
    assert "child:" not in done.stdout
    wait_until(lambda: no_tunnel_left(sshd), what="no ssh left")


@needs_sshd
def test_nothing_answering_there_is_a_clear_error_that_names_start_server(sshd, script, tmp_path):
    done = rgpu_run(*sshd.args(), "--remote-port", free_port(), "--remote-token-file", tmp_path / "none", "--", script)
    assert done.returncode == 2
    assert "nothing answers" in done.stderr and "--start-server" in done.stderr
    wait_until(lambda: no_tunnel_left(sshd), what="the tunnel to end")


@needs_sshd
def test_start_server_starts_rgpu_serve_there_and_stops_it_after(sshd, script, tmp_path):
    port = free_port()
    done = rgpu_run(*sshd.args(), "--remote-port", port, "--remote-token-file", tmp_path / "fresh" / "token",
                    "--start-server", "--remote-rgpu", f"{sys.executable} -m rgpu", "--", script)
    assert done.returncode == 0, done.stderr
    assert "started `rgpu serve`" in done.stderr and "through the tunnel" in done.stdout
    assert (tmp_path / "fresh" / "token").exists()
    wait_until(lambda: not processes_mentioning("rgpu", "serve", "--port", str(port)), what="the server to stop")
    wait_until(lambda: no_tunnel_left(sshd), what="the tunnel to end")


@needs_sshd
def test_ctrl_c_reaches_the_command_and_everything_is_torn_down(sshd, remote_server, script):
    proc = subprocess.Popen([sys.executable, "-m", "rgpu", "run", *sshd.args(), "--remote-port",
                             str(remote_server.port), "--remote-token-file", str(remote_server.token_file),
                             "--", str(script), "sleep"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=run_env(),
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.strip() == "ready":
                break
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        assert proc.wait(60) == 128 + signal.SIGINT
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wait_until(lambda: no_tunnel_left(sshd), what="the tunnel to end")


@needs_sshd
def test_a_tls_server_is_pinned_with_the_fingerprint_read_over_ssh(sshd, script, tmp_path):
    server = RunningServer(tmp_path / "tls", ["--tls"], token=None)
    try:
        done = rgpu_run(*sshd.args(), "--remote-port", server.port, "--remote-token-file", server.token_file,
                        "--", script)
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr
    assert "through the tunnel tls" in done.stdout and "TLS inside the tunnel" in done.stderr


@needs_sshd
def test_doctor_runs_through_the_tunnel_and_passes(sshd, remote_server):
    done = rgpu_run(*sshd.args(), "--remote-port", remote_server.port, "--remote-token-file",
                    remote_server.token_file, "--", sys.executable, "-m", "rgpu", "doctor")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all checks pass" in done.stderr and "loopback" in done.stdout


@needs_sshd
def test_a_short_training_script_runs_on_the_rgpu_device_through_the_tunnel(sshd, remote_server, tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    direct = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300,
                            env=clean_env(RGPU_SERVER=remote_server.address, RGPU_TOKEN=remote_server.token))
    if direct.returncode != 0:  # this test is about the tunnel: the device must first work without one
        last = (direct.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"the training script fails on the rgpu device even without a tunnel: {last}")
    done = rgpu_run(*sshd.args(), "--remote-port", remote_server.port, "--remote-token-file",
                    remote_server.token_file, "--", path)
    assert done.returncode == 0, done.stderr
    assert "trained on rgpu" in done.stdout


# ---- without ssh -------------------------------------------------------------------------------


def test_without_a_server_one_local_server_serves_the_command_and_ends_with_it(script):
    done = rgpu_run("--", script, 3)
    assert done.returncode == 3, done.stderr
    assert "started a local server" in done.stderr and "through the tunnel plain" in done.stdout


def test_server_flag_points_the_command_at_that_server_and_a_py_file_runs_with_this_python(rgpu_server, script):
    done = rgpu_run("--server", rgpu_server.address, script, env={"RGPU_TOKEN": rgpu_server.token})
    assert done.returncode == 0, done.stderr
    assert f"child: {rgpu_server.address} " in done.stdout


def test_a_command_killed_by_a_signal_exits_128_plus_the_signal(rgpu_server):
    done = rgpu_run("--server", rgpu_server.address, "--", sys.executable, "-c",
                    "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert done.returncode == 128 + signal.SIGTERM


def test_nothing_to_run_is_a_clear_error():
    done = rgpu_run("--server", "127.0.0.1:1")
    assert done.returncode == 2 and "nothing to run" in done.stderr
