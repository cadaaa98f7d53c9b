"""``rgpu run --ssh HOST1,HOST2``: a server on each host, each behind its own tunnel, all set up at once.

Each host goes through what one host does (``remote._over_ssh``: the tunnel, the
token read over ssh, the probe, ``--start-server``) on a thread of its own. The
command then gets ``RGPU_SERVER`` = the tunnels' local ends in host order, so
``rgpu:0..`` are the first host's devices, then the next one's. A host that
fails ends the others' setup at once (its ssh children are ended), everything
started is torn down, and the error names the host and what it said.

Why a thread lives until teardown: an ssh child is started with
PR_SET_PDEATHSIG (it dies with rgpu run, even by SIGKILL), and Linux sends that
signal when the *thread* that started it ends.
"""
from __future__ import annotations

import argparse
import os
import queue
import sys
import threading

from . import ssh
from .errors import ConfigError, ConnectError, RgpuError


def ports(text: str) -> list[int]:
    """``--remote-port``: one port for every host, or a comma list, one per host."""
    try:
        out = [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a port or a comma list of ports") from None
    if not all(0 < p < 65536 for p in out):
        raise argparse.ArgumentTypeError(f"{text!r}: a port is between 1 and 65535")
    return out


def over_ssh(args, s, cleanup: list) -> dict:
    """The command's environment for ``--ssh`` of one host or several; what ends it goes into ``cleanup``."""
    from .remote import _over_ssh

    hosts = [h.strip() for h in args.ssh.split(",")]
    remote_ports = args.remote_port if isinstance(args.remote_port, list) else [args.remote_port]
    if not all(hosts):
        raise ConfigError(f"--ssh {args.ssh!r}: an empty host (expected USER@HOST or USER@HOST,USER@HOST)")
    if len(remote_ports) not in (1, len(hosts)):
        raise ConfigError(f"--remote-port names {len(remote_ports)} ports for {len(hosts)} hosts: give one for "
                          "every host, or one port per host in the same order")
    remote_ports = remote_ports * len(hosts) if len(remote_ports) == 1 else remote_ports
    per_host = [argparse.Namespace(**{**vars(args), "ssh": h, "remote_port": p}) for h, p in zip(hosts, remote_ports)]
    if len(hosts) == 1:
        return _over_ssh(per_host[0], s, cleanup)
    pairs = list(zip(hosts, remote_ports))
    if len(set(pairs)) != len(pairs):
        raise ConfigError(f"--ssh {args.ssh}: a server is named twice (the same host and --remote-port); give "
                          "the same host twice only with a port each (--remote-port 9713,9714)")
    print(f"rgpu run: setting up {len(hosts)} hosts at once: {', '.join(hosts)}", file=sys.stderr, flush=True)
    group = Hosts(per_host, lambda a, steps: _over_ssh(a, s, steps))
    cleanup.append(group.close)
    envs = group.start()
    return merged(hosts, envs)


def merged(hosts: list[str], envs: list[dict]) -> dict:
    """One environment for the command: every tunnel in RGPU_SERVER; the token and pin, which must be the same."""
    for key, what in (("RGPU_TOKEN", "token"), ("RGPU_TLS_FINGERPRINT", "TLS certificate")):
        values = [env.get(key) for env in envs]
        if len(set(values)) > 1:
            differ = next(h for h, v in zip(hosts, values) if v != values[0])
            raise ConfigError(f"{hosts[0]} and {differ} have a different {what}: a session of several servers uses "
                              f"one (copy {hosts[0]}'s token file, and for --tls its certificate and key, to the "
                              "other hosts, or start each `rgpu serve` with the same RGPU_TOKEN)")
    env = dict(envs[0])
    env["RGPU_SERVER"] = ",".join(e["RGPU_SERVER"] for e in envs)
    # servers behind SSH tunnels cannot reach each other's peer ports: their copies go through the command
    env["RGPU_PEER_COPY"] = os.environ.get("RGPU_PEER_COPY", "client")
    print(f"rgpu run: RGPU_SERVER={env['RGPU_SERVER']} ({len(hosts)} hosts, in the order given)", file=sys.stderr,
          flush=True)
    return env


class Host(threading.Thread):
    """One host's setup, then a wait for teardown, then its own teardown (same thread: see the module's doc)."""

    def __init__(self, index: int, args, setup, results: queue.Queue, release: threading.Event):
        super().__init__(name=f"rgpu-ssh-{args.ssh}", daemon=True)
        self.index, self.args, self.setup, self.results, self.release = index, args, setup, results, release
        self.steps: list = []          # what ends this host's tunnel and server, in the order made
        self.lock = threading.Lock()
        self.finished = False

    def run(self) -> None:
        try:
            out = (self.setup(self.args, self.steps), None)
        except BaseException as exc:   # reported to the main thread, which names the host
            out = (None, exc)
        with self.lock:
            self.finished = True
        self.results.put((self.index, *out))
        self.release.wait()
        for step in reversed(self.steps):
            try:
                step()
            except Exception:   # the rest still ends
                pass
        ssh.forget(threading.get_ident())

    def stop_setup(self) -> None:
        """Cut a setup still under way short: its ssh children end, it starts no new one."""
        with self.lock:
            if not self.finished and self.ident is not None:
                ssh.cancel(self.ident)


class Hosts:
    """Every host's ``Host`` thread: ``start()`` returns their environments in host order, or raises naming one."""

    def __init__(self, per_host: list, setup):
        self.results: queue.Queue = queue.Queue()
        self.release = threading.Event()
        self.threads = [Host(i, a, setup, self.results, self.release) for i, a in enumerate(per_host)]

    def start(self) -> list[dict]:
        for t in self.threads:
            t.start()
        envs: dict[int, dict] = {}
        try:
            while len(envs) < len(self.threads):
                try:
                    i, env, exc = self.results.get(timeout=0.2)   # a timeout: ^C reaches this thread meanwhile
                except queue.Empty:
                    continue
                if exc is not None:
                    raise self._failed(i, exc)
                envs[i] = env
        except BaseException:
            self.close()
            raise
        return [envs[i] for i in range(len(self.threads))]

    def _failed(self, i: int, exc: BaseException) -> BaseException:
        host, n = self.threads[i].args.ssh, len(self.threads)
        if not isinstance(exc, RgpuError):
            return exc
        others = ", ".join(t.args.ssh for t in self.threads if t.index != i)
        message = f"--ssh host {i + 1} of {n}, {host}: {exc}; the other hosts' tunnels and servers ({others}) were ended"
        try:
            return type(exc)(message)
        except TypeError:   # an error class that wants more than a message
            return ConnectError(message)

    def close(self) -> None:
        """Cut short every setup under way, then let each thread end what it started; idempotent."""
        for t in self.threads:
            t.stop_setup()
        self.release.set()
        for t in self.threads:
            if t.is_alive():
                t.join(60)
