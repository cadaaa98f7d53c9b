"""``rgpu serve``: one port for both routes; each connection goes to its own worker process.

The acceptor imports no torch and runs no client code: it accepts, walks each
connection through the handshake in one non-blocking loop (``gate.py``: a stranger
never holds a worker), hands an authenticated socket to a spare worker over a Unix
socket (SCM_RIGHTS), and keeps the next spare started. Over TLS the worker does the
handshake (TLS state cannot cross processes), once the client's first record is in.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import msgpack

from rgpu.errors import RgpuError
from rgpu.transport import handshake, tcp, tls, tokens
from rgpu.transport.tcp import TcpTransport

from . import route, warmup
from .gate import Admitted, Gate
from .stopping import GRACE_S

log = logging.getLogger("rgpu.server")

# what a client waiting for the first warm worker is told (warmup.py sends it every few seconds)
WARMING = ("its worker is starting: importing torch and, the first time on this machine, building its C++ "
           "parts, once; the server's log shows each build")


@dataclass
class Worker:
    proc: subprocess.Popen
    control: socket.socket
    started: float
    ready: bool = False       # warm: it said so on its control socket (warmup.py)
    resume_id: str | None = None   # its session's, while a dropped connection may resume it (control kept open)
    session: str = ""


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _is_zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and waits to be reaped (state Z in /proc/PID/stat); False where unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # "pid (comm) state ...": comm may hold spaces and parentheses, so the state follows the last ')'
    rest = stat[stat.rfind(b")") + 1:].split()
    return bool(rest) and rest[0] == b"Z"


class Server:
    """The listener. ``overrides`` are settings passed on to every worker (device, driver, limits)."""

    def __init__(self, settings, overrides: dict | None = None, preload: str = "torch",
                 parent_pid: int | None = None, out=sys.stdout):
        self.settings = settings
        self.overrides = overrides or {}
        self.preload = preload
        self.parent_pid = parent_pid
        self.out = out
        self.token, self.token_path, created = tokens.ensure_token(settings)
        self.token_created = created
        self.tls = tls.ServerCertificate.prepare(settings) if settings.tls else None
        self.listener = tcp.listen(settings.host, settings.port)
        self.address = self.listener.getsockname()[:2]
        self.sessions: list[Worker] = []
        self.spares: list[Worker] = []
        self.room = warmup.WaitingRoom()   # authenticated connections waiting for a warm worker
        self.device: str | None = None     # what the ops run on, once a warm worker said
        self.resumable: dict[str, Worker] = {}   # resume id -> the worker of that session (RGPU_SESSION_GRACE)
        self._stop = threading.Event()

    # ---- workers -------------------------------------------------------------------

    def _start_worker(self) -> Worker:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [sys.executable, "-m", "rgpu.server.worker", "--control-fd", str(theirs.fileno()),
               "--preload", self.preload, "--overrides", json.dumps(self.overrides)]
        proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        return Worker(proc, mine, time.monotonic())

    def _fill_spares(self, need: int = 0) -> None:
        """RGPU_SPARE_WORKERS spares kept started, and at least ``need``. 0 keeps none once the first session
        has its worker: the embedded local server's choice, whose one program would otherwise share its
        cores with a spare's warm-up (torch's import, numba's compile) during its first training steps."""
        while len(self.spares) < max(need, self.settings.spare_workers):
            self.spares.append(self._start_worker())

    def _poll_spares(self) -> None:
        """Each spare that is still warming up: its control message says it is warm (and what the ops run on);
        an empty read, that it died."""
        for w in list(self.spares):
            if w.ready:
                continue
            try:
                data = w.control.recv(4096, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            got = warmup.read_ready(data) if data else None
            if got is None:
                log.warning("a spare worker (pid %d) ended while warming up", w.proc.pid)
                self.spares.remove(w)
                w.control.close()
                w.proc.kill()
                self._fill_spares()
                continue
            w.ready = True
            if got.get("device") and self.device is None:
                self.device = got["device"]
                print(f"rgpu serve: ops run on {self.device}", file=self.out, flush=True)

    def _take_spare(self) -> Worker:
        worker = next((w for w in self.spares if w.ready), self.spares[0])   # (the waiting room sends none cold)
        self.spares.remove(worker)
        return worker

    def _reap(self) -> None:
        for w in list(self.sessions):
            code = w.proc.poll()
            if code is not None:
                self.sessions.remove(w)
                if w.resume_id is not None:
                    self.resumable.pop(w.resume_id, None)
                    w.control.close()
                if code not in (0, None):
                    log.warning("a session's worker (pid %d) ended with status %d", w.proc.pid, code)
        for w in list(self.spares):
            if w.proc.poll() is not None:
                self.spares.remove(w)

    def _hand_over(self, sock: socket.socket, peer, admitted: Admitted | None = None) -> None:
        self._reap()
        if len(self.sessions) >= self.settings.max_sessions:
            handshake.refuse(TcpTransport(sock), "busy", f"the server runs its limit of {self.settings.max_sessions} sessions")
            sock.close()
            return
        per_token = self.settings.max_sessions_per_token
        if per_token is not None and len(self.sessions) >= per_token:   # (one token a server: all its sessions)
            handshake.refuse(TcpTransport(sock), "busy", f"RGPU_MAX_SESSIONS_PER_TOKEN: this token holds {len(self.sessions)} "
                             f"sessions (those waiting for their client to resume included), its quota of {per_token} "
                             "on the server; end one, or ask the server's operator for more")
            sock.close()
            return
        details = {"token": self.token.decode(), "overrides": self.overrides, "peer": str(peer),
                   "tls": {"cert": self.tls.cert, "key": self.tls.key} if self.tls else None}
        if admitted is not None:   # authenticated by the gate (plain), or its TLS handshake's time left
            details["deadline_s"] = max(0.5, admitted.deadline - time.monotonic())
            if admitted.hello is not None:
                h = admitted.hello
                details["hello"] = {"route": h.route, "session": h.session, "versions": h.versions,
                                    "transports": h.transports, "options": h.options}
        # a session outlives its connection for the grace when its client can resume it (its HELLO says so:
        # a raw client's dropped session is not held). Plain tcp here; over TLS the worker decides (it reads the HELLO)
        hello = admitted.hello if admitted is not None else None
        can = hello is not None and hello.options.get("resumable") is True
        resume_id = secrets.token_urlsafe(24) if self.settings.session_grace > 0 and (can or self.tls) else None
        if resume_id is not None:
            details["resume"] = {"id": resume_id, "grace_s": self.settings.session_grace,
                                 "replay_bytes": self.settings.replay_bytes}
        try:
            for _ in range(3):  # a spare that died (a failed preload, say) gets the next one its connection
                self._fill_spares(1)
                worker = self._take_spare()
                kept = False
                try:
                    socket.send_fds(worker.control, [msgpack.packb(details)], [sock.fileno()])
                except OSError as exc:
                    log.warning("could not hand a connection to worker %d: %s", worker.proc.pid, exc)
                    worker.proc.kill()
                else:
                    self.sessions.append(worker)
                    if resume_id is not None:   # its control socket stays open: resumed connections go there
                        worker.resume_id, kept = resume_id, True
                        worker.session = admitted.hello.session if admitted and admitted.hello else ""
                        self.resumable[resume_id] = worker
                    break
                finally:
                    if not kept:
                        worker.control.close()
        finally:
            sock.close()
        self._fill_spares()

    def _resume(self, admitted: Admitted) -> None:
        """An authenticated connection that asks to resume a session: to that session's worker, or refused."""
        h = admitted.hello
        rid, received = h.options.get("resume"), h.options.get("received")
        worker = self.resumable.get(rid) if isinstance(rid, str) else None
        why = "no session to resume under that id: it ended, its grace passed, or the id is wrong"
        if worker is not None and (worker.proc.poll() is not None or worker.session != h.session):
            worker = None
        if worker is not None and isinstance(received, int):
            details = {"resume": rid, "received": received, "peer": str(admitted.peer)}
            try:
                socket.send_fds(worker.control, [msgpack.packb(details)], [admitted.sock.fileno()])
                admitted.sock.close()
                return
            except OSError as exc:   # the worker ended meanwhile, or no longer takes one (shm, ucx)
                why = f"the session's worker no longer takes a connection ({exc})"
        log.debug("refused to resume a session for %s: %s", admitted.peer, why)
        handshake.refuse(TcpTransport(admitted.sock), "resume", why)
        admitted.sock.close()

    def _resume_tls(self, admitted: Admitted) -> None:
        """A TLS session's client resuming it (its plain preamble named the id): the raw connection to that
        session's worker, which does the TLS handshake and checks the token (tls.py), or a plain "-"."""
        worker = self.resumable.get(admitted.resume_id)
        if worker is not None and worker.proc.poll() is None:
            details = {"resume": admitted.resume_id, "tls": True, "peer": str(admitted.peer),
                       "deadline_s": max(0.5, admitted.deadline - time.monotonic())}
            try:
                socket.send_fds(worker.control, [msgpack.packb(details)], [admitted.sock.fileno()])
                admitted.sock.close()
                return
            except OSError:
                pass
        try:
            admitted.sock.send(tls.RESUME_GONE)
        except OSError:
            pass
        admitted.sock.close()

    # ---- the loop ------------------------------------------------------------------

    def announce(self) -> None:
        host, port = self.address
        where = f"token file {self.token_path}" if self.token_path else "token from RGPU_TOKEN"
        if self.token_created:
            where += " (created now: copy it to your clients, or use `rgpu run --ssh`)"
        print(f"rgpu serve: listening on {host}:{port}; routes {', '.join(sorted(route.available()))}; {where}",
              file=self.out, flush=True)
        if self.tls:
            self.announce_tls()
        if not is_loopback(host) and not self.settings.tls:
            print(f"rgpu serve: WARNING: listening on {host}, not loopback, without TLS: anyone who can reach "
                  "this port can try the token and read your traffic. Use --tls, or bind 127.0.0.1 and "
                  "connect with `rgpu run --ssh`.", file=sys.stderr, flush=True)

    def announce_tls(self) -> None:
        c = self.tls
        made = f"; self-signed, made now with {c.generated_by}" if c.generated_by else ""
        expires = f"; expires {c.expires:%Y-%m-%d}" if c.expires else ""
        print(f"rgpu serve: TLS on; certificate {c.cert}{made}{expires}", file=self.out, flush=True)
        print(f"rgpu serve: TLS fingerprint (SHA-256), for clients to pin: RGPU_TLS_FINGERPRINT={c.fingerprint}",
              file=self.out, flush=True)
        if c.expired:
            print(f"rgpu serve: WARNING: the certificate {c.cert} expired on {c.expires:%Y-%m-%d}; clients will "
                  "refuse it. Renew it (for the self-signed one: delete it and its key, restart).",
                  file=sys.stderr, flush=True)

    def _parent_gone(self) -> bool:
        if self.parent_pid is None:
            return False
        try:
            os.kill(self.parent_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return _is_zombie(self.parent_pid)     # exited, not yet reaped: gone all the same

    def serve_forever(self) -> None:
        self._fill_spares(1)   # the first session's worker warms up as the server starts
        self.announce()
        tls_cert = {"cert": self.tls.cert, "key": self.tls.key} if self.tls else None
        gate = Gate(self.listener, self.token, self.settings, route.available(), tls_cert)
        try:
            while not self._stop.is_set():
                ready = gate.turn(0.1 if self.room else 0.5)
                if self._parent_gone():
                    break
                if not ready:
                    self._reap()
                self._poll_spares()
                for admitted in ready:
                    tcp.tune(admitted.sock)
                    if admitted.resume_id is not None:
                        self._resume_tls(admitted)
                    elif admitted.hello is not None and admitted.hello.options.get("resume") is not None:
                        self._resume(admitted)   # its worker waits for it: no room, no spare
                    else:
                        self.room.add(admitted)
                if self.room:
                    self._fill_spares(1)
                for admitted in self.room.leaving(sum(w.ready for w in self.spares)):
                    try:
                        self._hand_over(admitted.sock, admitted.peer, admitted)
                    except RgpuError as exc:
                        log.warning("dropped a connection from %s: %s", admitted.peer, exc)
                self.room.nudge(WARMING)
        finally:
            self.room.close()
            gate.close()
            self.shutdown()

    def stop(self) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        self.listener.close()
        for w in self.spares + [w for w in self.sessions if w.resume_id is not None]:
            w.control.close()  # a spare reads EOF and exits; a session waiting to resume, likewise
        for w in self.sessions + self.spares:
            try:
                w.proc.terminate()
            except OSError:
                pass
        # each session's worker finishes the op it runs and tells its client why it goes (stopping.py)
        deadline = time.monotonic() + (GRACE_S if self.sessions else 3)
        for w in self.sessions + self.spares:
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()


def run(settings, overrides=None, preload="torch", parent_pid=None) -> int:
    logging.basicConfig(level=logging.DEBUG if settings.debug else logging.WARNING, format="rgpu serve: %(message)s")
    server = Server(settings, overrides, preload, parent_pid)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0
