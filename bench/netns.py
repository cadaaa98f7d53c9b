"""Two network namespaces joined by a veth pair: a fast LAN on one machine, for tests and benchmarks.

    with netns.lan(rate="10gbit") as lan:
        server = lan.popen("b", [sys.executable, "-m", "rgpu", "serve", "--host", lan.addr_b, ...])
        out = lan.run("a", [sys.executable, "-c", "..."])      # ip netns exec <ns a> ...

Needs root and iproute2 (``ip``, ``tc``). A rate is a ``tc qdisc ... tbf`` on both
veth ends; this kernel has no ``netem``, so added delay, where wanted, comes from
the transport's own delay line (``RGPU_SIM_RTT_MS``). Everything made (both
namespaces, and with them the veth pair and the qdiscs) is deleted on exit, also
when the body raises and when the process is ended by SIGTERM as by Ctrl-C (a SIGKILL
cannot be caught: ``leftovers()`` lists what such a run left behind).
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
from contextlib import contextmanager
from dataclasses import dataclass

PREFIX = "rgpu-lan-"
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)bit$", re.IGNORECASE)


def unavailable() -> str | None:
    """None when namespaces can be made here, else why not (for skip reasons)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def rate_bytes(rate: str) -> float:
    """'10gbit' -> bytes per second."""
    m = _RATE.match(rate.strip())
    if not m:
        raise ValueError(f"rate {rate!r}: expected a number and kbit, mbit, gbit or bit, e.g. 10gbit")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]
    return float(m.group(1)) * scale / 8


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass
class Lan:
    """The two ends: namespace names, veth names and addresses of side "a" and side "b"."""
    ns_a: str
    ns_b: str
    dev_a: str
    dev_b: str
    addr_a: str
    addr_b: str
    rate: str | None = None

    def ns(self, side: str) -> str:
        return {"a": self.ns_a, "b": self.ns_b}[side]

    def command(self, side: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(side), *argv]

    def run(self, side: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.command(side, argv), **kw)

    def popen(self, side: str, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.command(side, argv), **kw)


@contextmanager
def lan(rate: str | None = None):
    """Make the pair (optionally rate limited), yield a ``Lan``, delete everything after."""
    why = unavailable()
    if why:
        raise RuntimeError(why)
    tag = secrets.token_hex(3)
    ns_a, ns_b = f"{PREFIX}{tag}-a", f"{PREFIX}{tag}-b"
    dev_a, dev_b = f"rgv{tag}a", f"rgv{tag}b"          # interface names: 15 characters at most
    net = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(256)}"
    made: list[str] = []
    previous = _exit_on_sigterm()
    try:
        for ns in (ns_a, ns_b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
        made.append(dev_a)
        for dev, ns, host in ((dev_a, ns_a, 1), (dev_b, ns_b, 2)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{net}.{host}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if rate:
                burst = max(256 << 10, int(rate_bytes(rate) / 1000))   # a millisecond's worth
                done = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                                       "burst", str(burst), "latency", "50ms"], capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"tc tbf on {dev}: {done.stderr.strip()}")
        yield Lan(ns_a, ns_b, dev_a, dev_b, f"{net}.1", f"{net}.2", rate)
    finally:
        for name in reversed(made):
            if name.startswith(PREFIX):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
            else:  # the veth pair goes with its namespaces; this is for a failure before it moved
                subprocess.run(["ip", "link", "del", name], capture_output=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _terminated(signum, frame):
    raise SystemExit(128 + signum)   # unwinds through the finally blocks above, as Ctrl-C's KeyboardInterrupt does


def _exit_on_sigterm():
    """SIGTERM made an exception for the body's duration (the main thread only); the handler it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _terminated)
        return previous
    return None    # the program has its own handler: it decides


def leftovers() -> list[str]:
    """Namespaces of ours that still exist (a run killed before it could clean up)."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.startswith(PREFIX)]
