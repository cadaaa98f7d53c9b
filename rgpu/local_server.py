"""A local ``rgpu serve`` child for when no server is named: started on first use, ended with us.

It lives beside the ``rgpu`` command, not in the transport: it starts a process, which no transport
does. Below the routes in the layers (tools/house/layers.py) so that ``transport.client.connect`` can
use it where ``RGPU_SERVER`` is unset; it imports only ``rgpu.errors``.
"""
from __future__ import annotations

import atexit
import os
import re
import secrets
import subprocess
import sys
import threading

from rgpu.errors import ConnectError

_lock = threading.Lock()
_server: "LocalServer | None" = None
_LISTENING = re.compile(r"listening on (\S+):(\d+)")


class LocalServer:
    def __init__(self, token: str, extra_args: list[str] | None = None, env: dict | None = None,
                 cpus: set[int] | None = None):
        self.token = token
        child_env = dict(os.environ if env is None else env)
        child_env["RGPU_TOKEN"] = token
        for name in ("RGPU_SERVER", "RGPU_TLS", "RGPU_TLS_CERT", "RGPU_TLS_KEY"):  # loopback, plain
            child_env.pop(name, None)
        cmd = [sys.executable, "-m", "rgpu", "serve", "--host", "127.0.0.1", "--port", "0",
               "--exit-with-parent", str(os.getpid()), *(extra_args or [])]
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None  # benchmarks pin client and server apart
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, stdin=subprocess.DEVNULL,
                                     env=child_env, text=True, preexec_fn=pin)
        lines = []
        for line in self.proc.stdout:
            lines.append(line)
            m = _LISTENING.search(line)
            if m:
                self.host, self.port = m.group(1), int(m.group(2))
                break
        else:
            self.proc.wait()
            raise ConnectError(f"the local rgpu server did not start (status {self.proc.returncode}): {''.join(lines)}")
        # keep draining its stdout so the child never blocks on a full pipe
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def shared(settings) -> LocalServer:
    """The process-wide local server, started once (and announced once on stderr)."""
    global _server
    with _lock:
        if _server is None or _server.proc.poll() is not None:
            token = settings.token or secrets.token_urlsafe(32)
            _server = LocalServer(token, ["--spare-workers", "0"])   # one program: no spare warming beside it
            atexit.register(_server.stop)
            print(f"rgpu: RGPU_SERVER is not set; started a local server on {_server.address} "
                  f"(pid {_server.proc.pid}), ending with this process", file=sys.stderr, flush=True)
        return _server
