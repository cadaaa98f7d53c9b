"""Shared fixtures: a real ``rgpu serve`` on a free port, client settings for it, hypothesis profiles.

    rgpu_server            one server for the whole test session (echo route, no preload)
    start_server(*flags)   a fresh server with extra ``rgpu serve`` flags or environment, stopped after the test
    server.settings(**kw)  client Settings pointing at that server, read from no environment (tcp unless told)
    server.connect(route, **settings)  a Connection to it, closed when the server fixture ends
    echo_conn              a fresh echo-route tcp connection to ``rgpu_server``, closed after the test
    shm_ends               a connected shm pair in this process (client, server), closed after the test

The server's C++ op path (``server/ops/fast_op.py``) is built once, before the first test.

The hypothesis profile ``rgpu-fuzz`` (10^4 cases) is what the wire fuzz tests run;
``RGPU_FUZZ_EXAMPLES`` changes the count without touching other tests' settings.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hsettings

from rgpu import config

hsettings.register_profile(
    "rgpu-fuzz", max_examples=int(os.environ.get("RGPU_FUZZ_EXAMPLES", "10000")), deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

TOKEN = "test-token-0123456789abcdef"
_LISTENING = re.compile(r"listening on (\S+):(\d+)")


def clean_env(**extra: str) -> dict:
    """The environment minus every RGPU_* variable of the caller, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    env.update(extra)
    return env


class RunningServer:
    """An ``rgpu serve`` child process; its stdout and stderr go to files in ``workdir``."""

    def __init__(self, workdir: Path, flags=(), env: dict | None = None, token: str | None = TOKEN,
                 start_timeout: float = 30.0):
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.token_file = Path((env or {}).get("RGPU_TOKEN_FILE", workdir / "token"))
        self.token = token
        extra = {"RGPU_TOKEN_FILE": str(self.token_file)}
        if token is not None:
            extra["RGPU_TOKEN"] = token
        extra.update(env or {})
        self.stdout_path, self.stderr_path = workdir / "stdout", workdir / "stderr"
        cmd = [sys.executable, "-m", "rgpu", "serve", "--port", "0", "--preload", "",
               "--exit-with-parent", str(os.getpid()), *flags]  # never outlives a killed test run
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         env=clean_env(**extra), start_new_session=True)
        deadline = time.monotonic() + start_timeout
        while True:
            m = _LISTENING.search(self.stdout_path.read_text())
            if m:
                self.host, self.port = m.group(1), int(m.group(2))
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"rgpu serve did not start:\n{self.stdout}\n{self.stderr}")
            time.sleep(0.02)
        if token is None:
            self.token = self.token_file.read_text().strip()
        self._conns: list = []

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text()

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def settings(self, **overrides) -> config.Settings:
        """Client settings for this server, independent of the environment the tests run in.

        The transport is tcp unless ``transport=`` says otherwise, on one stream unless ``tcp_streams=`` does
        (unset, a host of 8+ cores takes 4, whose stripes would go around a test's proxy): a test names what it tests.
        """
        overrides.setdefault("transport", "tcp")
        overrides.setdefault("tcp_streams", 1)
        return config.settings(environ={}, server=self.address, token=self.token, **overrides)

    def connect(self, route: str = "echo", **overrides):
        from rgpu.transport.client import connect

        conn = connect(route, settings=self.settings(**overrides))
        self._conns.append(conn)
        return conn

    def stop(self) -> None:
        for conn in self._conns:
            conn.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# ---- a watchdog: a hung test ends the run with every thread's stack, never blocks CI ----------

_pytest_config = None
_hung: list[str] = []


def pytest_configure(config):
    global _pytest_config
    _pytest_config = config


def pytest_keyboard_interrupt(excinfo):
    if _hung and _pytest_config is not None:
        writer = _pytest_config.get_terminal_writer()
        for text in _hung:
            writer.line(text, red=True)


def _fire(nodeid: str, seconds: float) -> None:
    stacks = "".join(f"\n--- thread {ident}\n" + "".join(traceback.format_stack(frame))
                     for ident, frame in sys._current_frames().items())
    _hung.append(f"{nodeid} ran longer than {seconds} s (RGPU_TEST_WATCHDOG); every thread:{stacks}")
    os.kill(os.getpid(), signal.SIGINT)  # a real signal also interrupts a blocked recv or lock wait


@pytest.fixture(autouse=True)
def _watchdog(request):
    seconds = float(os.environ.get("RGPU_TEST_WATCHDOG", "300"))
    timer = threading.Timer(seconds, _fire, (request.node.nodeid, seconds))
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()


@pytest.fixture(scope="session", autouse=True)
def _server_op_path():
    """The server's C++ op path built before any server starts: its workers load it, never build it, so
    without this the tests' servers would run ops through Python until a background build lands."""
    from rgpu.server.ops import fast_op

    fast_op.load()


@pytest.fixture(scope="session")
def rgpu_server(tmp_path_factory):
    """One ``rgpu serve --port 0 --preload ""`` for the session; tests must not crash or stop it."""
    server = RunningServer(tmp_path_factory.mktemp("rgpu-server"))
    _session_server.append(server)
    yield server
    _session_server.clear()
    server.stop()


_session_server: list = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Connections a test's body opens to the session-wide server end with it (fixtures' stay theirs): that
    server serves a bounded number of sessions (``RGPU_MAX_SESSIONS``), and tests leaving theirs open use it up."""
    server = _session_server[0] if _session_server else None
    before = len(server._conns) if server is not None else 0
    yield
    if server is not None:
        opened, server._conns[before:] = server._conns[before:], []
        for conn in opened:
            conn.close(timeout=2)


@pytest.fixture
def start_server(tmp_path):
    """Factory: ``start_server(*flags, env={...}, token=...)`` starts a server just for this test."""
    started: list[RunningServer] = []

    def start(*flags: str, env: dict | None = None, token: str | None = TOKEN) -> RunningServer:
        server = RunningServer(tmp_path / f"server{len(started)}", flags, env, token)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def shm_ends():
    """A connected shm pair in this process (client, server), both on the C path where it builds; closed after."""
    from transport_pairs import shm_pair

    client, server = shm_pair()
    yield client, server
    client.close()
    server.close()


@pytest.fixture
def echo_conn(rgpu_server):
    """A fresh echo-route connection to the session's server, closed after the test."""
    c = rgpu_server.connect("echo")
    yield c
    c.close()


def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` until true; fails the test (never hangs) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie (exited, not yet reaped by the acceptor) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
