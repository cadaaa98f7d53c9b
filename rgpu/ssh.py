"""OpenSSH for ``rgpu run --ssh``: a local tunnel to the server's port, and short commands over the same login.

Every ssh here runs with ``BatchMode=yes`` in its own session: it never prompts
(use keys and ssh-agent), a terminal's Ctrl-C reaches the user's command and not
the tunnel, and a refused key is an error at once rather than a hang.
"""
from __future__ import annotations

import errno
import os
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from .errors import ConfigError, ConnectError, Timeout

DEFAULT_TOKEN_FILE = "${RGPU_TOKEN_FILE:-$HOME/.config/rgpu/token}"   # as the remote shell expands it
HINTS = (  # what ssh says -> what to do about it
    ("Permission denied", "the key was refused: pass the right one with -i KEY, or add it to ssh-agent"),
    ("Host key verification failed", "the host key is unknown or changed: run `ssh {dest}` once by hand to check "
                                     "and accept it"),
    ("Could not resolve hostname", "check the host name"),
    ("Connection refused", "no ssh server answers there: check the host and --ssh-port"),
    ("Connection timed out", "the host does not answer: check the address, the network and --ssh-port"),
    ("Address already in use", "the local port was taken meanwhile; try again"),
)


def _set_pdeathsig():  # Linux: the tunnel ends when rgpu run dies, even by SIGKILL
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        return lambda: libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return None


_PREEXEC = _set_pdeathsig() if sys.platform.startswith("linux") else None


_HANDED: set[int] = set()   # ports free_port gave out: tunnels opened in parallel never share one
_LOCK = threading.Lock()


def free_port() -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with _LOCK:
            if port not in _HANDED:
                _HANDED.add(port)
                return port
    raise ConnectError("no free local port for a tunnel (100 tries)")


# Children by the thread that started them: hosts set up in parallel (rgpu/ssh_hosts.py) end one host's at once.
_SPAWNED: dict[int, list[subprocess.Popen]] = {}
_CANCELLED: set[int] = set()


def cancel(thread_id: int) -> None:
    """End every ssh that thread started and refuse it new ones: its setup fails at its next step."""
    with _LOCK:
        _CANCELLED.add(thread_id)
        procs = list(_SPAWNED.get(thread_id, ()))
    for proc in procs:
        _end(proc)


def forget(thread_id: int) -> None:
    """That thread has ended its children: drop what was kept for it (a thread id can be used again)."""
    with _LOCK:
        _SPAWNED.pop(thread_id, None)
        _CANCELLED.discard(thread_id)


def _refuse_if_cancelled() -> None:
    if threading.get_ident() in _CANCELLED:
        raise ConnectError("stopped: another host failed, or the setup was interrupted")


def port_listening(port: int) -> bool:
    """Whether something listens on 127.0.0.1:port; found by binding it, so nothing connects through."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
        return False


def remote_path(path: str | None) -> str:
    """A remote file name for ``sh``: ``~/`` becomes ``$HOME/``, the rest is quoted; None is the token default."""
    if path is None:
        return f'"{DEFAULT_TOKEN_FILE}"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


@dataclass
class SshTarget:
    """Where and how to log in: ``ssh [-p N] [-i KEY] [-o OPT...] DEST``."""
    dest: str
    port: int | None = None
    identity: str | None = None
    options: list[str] = field(default_factory=list)

    def argv(self, *extra: str) -> list[str]:
        exe = shutil.which("ssh")
        if exe is None:
            raise ConfigError("rgpu run --ssh needs the OpenSSH client (`ssh`) on PATH")
        cmd = [exe, "-o", "BatchMode=yes", "-o", "ConnectTimeout=15", "-o", "ServerAliveInterval=15",
               "-o", "ServerAliveCountMax=3"]
        if self.port:
            cmd += ["-p", str(self.port)]
        if self.identity:
            cmd += ["-i", os.path.expanduser(self.identity)]
        for opt in self.options:
            cmd += ["-o", opt]
        return [*cmd, *extra]

    def hint(self, message: str) -> str:
        for needle, fix in HINTS:
            if needle in message:
                return fix.format(dest=self.dest)
        return ""

    def failure(self, what: str, status: int | None, stderr: str) -> ConnectError:
        said = " | ".join(line for line in stderr.strip().splitlines() if line.strip()) or "no message"
        fix = self.hint(stderr)
        return ConnectError(f"{what}: ssh {self.dest} failed (status {status}): {said}" + (f"; {fix}" if fix else ""))

    def run(self, command: str, timeout: float = 60.0) -> str:
        """Run ``sh -c COMMAND`` there; its stdout, or ConnectError with ssh's own message."""
        _refuse_if_cancelled()
        try:
            done = subprocess.run(self.argv(self.dest, "sh -c " + shlex.quote(command)), capture_output=True,
                                  text=True, stdin=subprocess.DEVNULL, timeout=timeout, start_new_session=True)
        except subprocess.TimeoutExpired:
            raise Timeout(f"ssh {self.dest} did not finish within {timeout:g} s") from None
        if done.returncode != 0:
            raise self.failure("running a command", done.returncode, done.stderr)
        return done.stdout

    def spawn(self, *args: str) -> subprocess.Popen:
        _refuse_if_cancelled()
        proc = subprocess.Popen(self.argv(*args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_PREEXEC)
        with _LOCK:
            _SPAWNED.setdefault(threading.get_ident(), []).append(proc)
        return proc


class _Drain:
    """Reads a child's pipe on a thread so it never blocks; keeps the lines."""

    def __init__(self, pipe):
        self.lines: list[str] = []
        self.closed = False
        self._cv = threading.Condition()
        threading.Thread(target=self._run, args=(pipe,), daemon=True).start()

    def _run(self, pipe) -> None:
        for line in pipe:
            with self._cv:
                self.lines.append(line)
                self._cv.notify_all()
        with self._cv:
            self.closed = True
            self._cv.notify_all()

    def wait_for(self, needle: str, timeout: float) -> bool:
        """Whether a line containing ``needle`` arrived before the pipe closed and within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not any(needle in line for line in self.lines):
                left = deadline - time.monotonic()
                if self.closed or left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def text(self) -> str:
        with self._cv:
            return "".join(self.lines)


def _end(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)   # its own session: the group is ssh alone
        proc.wait(5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


class Tunnel:
    """``ssh -N -L 127.0.0.1:LOCAL:127.0.0.1:REMOTE``; ``open()`` returns once ssh listens on LOCAL."""

    def __init__(self, target: SshTarget, remote_port: int, timeout: float = 30.0):
        self.target, self.remote_port, self.timeout = target, remote_port, timeout
        self.proc: subprocess.Popen | None = None
        self.local_port = 0
        self._stderr: _Drain | None = None

    def open(self) -> int:
        for attempt in range(3):
            self.local_port = free_port()
            spec = f"127.0.0.1:{self.local_port}:127.0.0.1:{self.remote_port}"
            self.proc = self.target.spawn("-N", "-o", "ExitOnForwardFailure=yes", "-L", spec, self.target.dest)
            self._stderr = _Drain(self.proc.stderr)
            deadline = time.monotonic() + self.timeout
            while self.proc.poll() is None:
                if port_listening(self.local_port):
                    return self.local_port
                if time.monotonic() > deadline:
                    self.close()
                    raise Timeout(f"ssh {self.target.dest} did not open the tunnel within {self.timeout:g} s: "
                                  f"{self.stderr().strip() or 'no message'}")
                time.sleep(0.02)
            self.proc.wait()
            time.sleep(0.05)  # let the reader thread take ssh's last words
            if "Address already in use" in self.stderr() and attempt < 2:
                continue
            raise self.target.failure("opening the tunnel", self.proc.returncode, self.stderr())
        raise AssertionError("unreachable")

    def stderr(self) -> str:
        return self._stderr.text() if self._stderr else ""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        _end(self.proc)


def read_secrets(target: SshTarget, token_file: str | None) -> tuple[str | None, str | None]:
    """(token, TLS fingerprint) from the remote host's files, each None where absent; one ssh login."""
    path = remote_path(token_file)
    script = (f'f={path}; echo "==token"; cat "$f" 2>/dev/null; echo; echo "==cert"; '
              f'cat "$(dirname "$f")/tls-cert.pem" 2>/dev/null; echo "==end"')
    out = target.run(script)
    token_part, _, rest = out.partition("==cert\n")
    token = token_part.replace("==token\n", "", 1).strip() or None
    pem = rest.partition("==end")[0].strip()
    fp = None
    if "BEGIN CERTIFICATE" in pem:
        from rgpu.transport.tls import fingerprint
        try:
            fp = fingerprint(ssl.PEM_cert_to_DER_cert(pem))
        except ValueError:
            fp = None
    return token, fp


class RemoteServer:
    """``rgpu serve`` started over ssh for ``--start-server``, stopped by ``stop()``."""

    def __init__(self, target: SshTarget, port: int, rgpu_command: str, token_file: str | None,
                 timeout: float = 60.0):
        self.target = target
        flags = f" --token-file {remote_path(token_file)}" if token_file else ""
        # $$ is the shell that execs the server: the pid to stop it by; $PPID, the ssh session: the server ends
        # with it too, should this end die before it can stop the server
        script = f'echo "rgpu-pid $$"; exec {rgpu_command} serve --port {int(port)}{flags} --exit-with-parent $PPID'
        self.proc = target.spawn(target.dest, "sh -c " + shlex.quote(script))
        self._stdout, self._stderr = _Drain(self.proc.stdout), _Drain(self.proc.stderr)
        started = self._stdout.wait_for("listening on", timeout)
        pids = [line.split()[1] for line in self._stdout.lines if line.startswith("rgpu-pid ")]
        self.pid = int(pids[0]) if pids else None
        if not started:
            status = self.proc.poll()
            self.stop()
            said = (self._stderr.text() + self._stdout.text()).strip() or "no message"
            raise ConnectError(f"--start-server: `{rgpu_command} serve` did not start on {target.dest} "
                               f"(status {status}): {said}; say how to run rgpu there with --remote-rgpu "
                               "(e.g. '~/venv/bin/rgpu' or 'python3 -m rgpu')")

    def stop(self) -> None:
        if self.pid is not None and self.proc.poll() is None:
            try:
                self.target.run(f"kill {self.pid} 2>/dev/null; true", timeout=20)
            except (ConnectError, Timeout):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        _end(self.proc)
