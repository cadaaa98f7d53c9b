"""``rgpu run`` and ``rgpu doctor``: reach a GPU host in one command, and check that everything works.

    rgpu run [--ssh USER@HOST[,USER@HOST...] [--ssh-port N] [-i KEY] [--remote-port N] [--start-server] | --server HOST:PORT] -- CMD ARGS

With ``--ssh``: a tunnel from a free local port to the server's loopback port,
the token (and, for a ``--tls`` server, its certificate's fingerprint) read over
the same ssh login when ``RGPU_TOKEN`` is unset, a check that an rgpu server
answers through it, then CMD with ``RGPU_SERVER`` and the token in its
environment. CMD's exit status is rgpu run's (128+N when a signal N ended it);
the tunnel, and a server that ``--start-server`` started, always end with it.
With neither flag: ``RGPU_SERVER`` if set, else one local server for CMD and
everything it starts. ``--ssh`` of several hosts: one tunnel (and server) per host,
set up at once, ``RGPU_SERVER`` every tunnel in host order; one host failing ends all.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

from . import config
from .errors import AuthenticationError, ConfigError, ConnectError, ConnectionLost

PROBE_ROUTE = "echo"


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run a command against a server: over ssh, at an address, or a local one",
                       description=__doc__.split("\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--ssh", metavar="USER@HOST", help="tunnel to the server on this host over ssh, or to the "
                       "servers of several (comma list: rgpu:0.. are the first host's devices, then the next's)")
    where.add_argument("--server", metavar="HOST:PORT", help="a server reachable directly, or a comma list of several (sets RGPU_SERVER)")
    p.add_argument("--ssh-port", type=int, metavar="N", help="the ssh server's port (default: ssh's own)")
    p.add_argument("-i", "--identity", metavar="KEY", help="ssh private key file")
    p.add_argument("-o", "--ssh-option", action="append", default=[], metavar="OPT",
                   help="an ssh -o option, e.g. -o ProxyJump=bastion (repeatable)")
    from .ssh_hosts import ports
    p.add_argument("--remote-port", type=ports, default=9713, metavar="N",
                   help="the server's port on the remote host's loopback (default 9713); several hosts: one "
                        "for all, or a comma list, one per host")
    p.add_argument("--remote-token-file", metavar="PATH",
                   help="the token file on the remote host (default: its RGPU_TOKEN_FILE or ~/.config/rgpu/token)")
    p.add_argument("--start-server", action="store_true",
                   help="start `rgpu serve` on the remote host when nothing answers, and stop it after")
    p.add_argument("--remote-rgpu", default="rgpu", metavar="CMD",
                   help="how to run rgpu on the remote host for --start-server (default: rgpu)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS (a first *.py runs with this Python)")
    p.set_defaults(func=run)

    p = sub.add_parser("doctor", help="check the server, token, versions, transport, speed, devices and TLS")
    p.add_argument("--server", metavar="HOST:PORT", help="the server to check (default: RGPU_SERVER)")
    p.add_argument("--json", action="store_true", help="print the checks as one JSON object")
    p.set_defaults(func=_doctor)


def _doctor(args) -> int:
    from . import doctor
    return doctor.main(args)


def command_line(words: list[str]) -> list[str]:
    if words and words[0] == "--":
        words = words[1:]
    if not words:
        raise ConfigError("nothing to run: rgpu run [--ssh USER@HOST | --server HOST:PORT] -- CMD ARGS")
    if words[0].endswith(".py"):
        return [sys.executable, *words]
    return list(words)


class _Interrupts:
    """SIGINT: stops the setup; once CMD runs, Ctrl-C is CMD's to handle and we wait for it, then tear down."""

    def __init__(self):
        self.child_running = False

    def __call__(self, signum, frame) -> None:
        if not self.child_running:
            raise KeyboardInterrupt


def run(args) -> int:
    cmd = command_line(args.command)
    s = config.settings()
    env = dict(os.environ)
    cleanup: list = []
    interrupts = _Interrupts()
    previous = signal.signal(signal.SIGINT, interrupts)
    try:
        if args.ssh:
            from . import ssh_hosts
            env.update(ssh_hosts.over_ssh(args, s, cleanup))   # one host (_over_ssh), or several at once
        elif args.server:
            config.parse_addresses(args.server, "--server")  # one host:port, or several (comma list)
            env["RGPU_SERVER"] = args.server
        elif not s.server:
            env.update(_local_server(s, cleanup))
        interrupts.child_running = True
        return run_child(cmd, env)
    finally:
        for step in reversed(cleanup):
            step()
        signal.signal(signal.SIGINT, previous)


def run_child(cmd: list[str], env: dict) -> int:
    """Run CMD to its end; SIGTERM and SIGHUP are passed on; a signal's death is 128+N."""
    try:
        proc = subprocess.Popen(cmd, env=env)
    except OSError as exc:
        raise ConfigError(f"cannot run {cmd[0]!r}: {exc.strerror or exc}") from None
    forwarded = {sig: signal.signal(sig, lambda n, f: proc.send_signal(n)) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in forwarded.items():
            signal.signal(sig, handler)
    return code if code >= 0 else 128 - code


def _local_server(s, cleanup: list) -> dict:
    """One local server for CMD and every process it starts (instead of one each)."""
    import secrets

    from rgpu.local_server import LocalServer

    token = s.token or secrets.token_urlsafe(32)
    server = LocalServer(token)
    cleanup.append(server.stop)
    print(f"rgpu run: RGPU_SERVER is not set; started a local server on {server.address}", file=sys.stderr,
          flush=True)
    return {"RGPU_SERVER": server.address, "RGPU_TOKEN": token}


def _over_ssh(args, s, cleanup: list) -> dict:
    from . import ssh

    target = ssh.SshTarget(args.ssh, args.ssh_port, args.identity, list(args.ssh_option))
    tunnel = ssh.Tunnel(target, args.remote_port)
    cleanup.append(tunnel.close)
    tunnel.open()
    address = f"127.0.0.1:{tunnel.local_port}"
    found = _RemoteSecrets(target, args, s)
    try:
        fingerprint = _probe(s, address, found, args)
    except ConnectionLost:  # ssh accepted, then found nothing listening on the remote port
        if not args.start_server:
            raise _nothing_answers(args, tunnel) from None
        server = ssh.RemoteServer(target, args.remote_port, args.remote_rgpu, args.remote_token_file)
        cleanup.append(server.stop)
        print(f"rgpu run: started `rgpu serve` on {args.ssh} (port {args.remote_port}); it stops after the command",
              file=sys.stderr, flush=True)
        found = _RemoteSecrets(target, args, s)  # a first start makes the token file
        fingerprint = _probe(s, address, found, args)
    token = found.token()
    env = {"RGPU_SERVER": address, "RGPU_TOKEN": token}
    # one ssh channel carries everything, and a worker's stream port is not inside the tunnel
    env["RGPU_TCP_STREAMS"] = os.environ.get("RGPU_TCP_STREAMS", "1")
    if fingerprint is not None:
        env["RGPU_TLS_FINGERPRINT"] = fingerprint
    tls_note = " (TLS inside the tunnel)" if fingerprint or s.tls or s.tls_ca else ""
    print(f"rgpu run: RGPU_SERVER={address} -> {args.ssh} port {args.remote_port} over ssh{tls_note}",
          file=sys.stderr, flush=True)
    return env


class _RemoteSecrets:
    """The token and certificate fingerprint: the local settings' where set, else read over ssh once, when needed."""

    def __init__(self, target, args, s):
        self.target, self.args, self.s = target, args, s
        self._read: tuple | None = None

    def _remote(self) -> tuple[str | None, str | None]:
        if self._read is None:
            from .ssh import read_secrets
            self._read = read_secrets(self.target, self.args.remote_token_file)
        return self._read

    def token(self, required: bool = True) -> str | None:
        token = self.s.token or self._remote()[0]
        if token is None and required:
            raise ConfigError(f"no token: RGPU_TOKEN is unset and there is no token file on {self.args.ssh} "
                              f"({self.args.remote_token_file or '~/.config/rgpu/token'}); start `rgpu serve` there "
                              "once (it makes one), pass --remote-token-file, or add --start-server")
        return token

    def fingerprint(self) -> str | None:
        return self.s.tls_fingerprint or self._remote()[1]


def _probe(s, address: str, found: _RemoteSecrets, args) -> str | None:
    """Open one echo session through the tunnel: proves the tunnel, the server, the token and TLS.

    Returns the fingerprint CMD must pin (None for a plain server). A plain try
    that a ``--tls`` server refuses is repeated with the fingerprint read over
    ssh: an authenticated channel, so pinning what it gave is sound.
    """
    from rgpu.transport import tls
    from rgpu.transport.client import connect

    token = found.token(required=False)
    # no token file there yet: a stand-in token still tells "nothing answers" (ConnectionLost) from "no token"
    base = s.with_(server=address, token=token or "no-token-" + os.urandom(8).hex())
    if token is None:
        try:
            connect(PROBE_ROUTE, settings=base.with_(tls_fingerprint=found.fingerprint() if tls.wanted(s) else None))
        except (AuthenticationError, ConfigError):
            pass
        found.token()  # raises: the server answers but we have no token
    fp = found.fingerprint() if tls.wanted(s) else None
    try:
        connect(PROBE_ROUTE, settings=base.with_(tls_fingerprint=fp)).close()
        return fp
    except ConfigError as exc:
        if "requires TLS" not in str(exc) or fp is not None:
            raise
    fp = found.fingerprint()
    if fp is None:
        raise ConfigError(f"the server on {args.ssh} requires TLS and no certificate was found beside its token: "
                          "set RGPU_TLS_FINGERPRINT to the fingerprint `rgpu serve --tls` printed")
    connect(PROBE_ROUTE, settings=base.with_(tls_fingerprint=fp)).close()
    return fp


def _nothing_answers(args, tunnel) -> ConnectError:
    said = [line.strip() for line in tunnel.stderr().splitlines() if "open failed" in line]
    detail = f" (ssh: {said[-1]})" if said else ""
    return ConnectError(f"nothing answers on {args.ssh}'s port {args.remote_port}{detail}: start `rgpu serve` "
                        "there, pass --remote-port if it listens elsewhere, or add --start-server")
