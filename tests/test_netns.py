"""The fast LAN on one machine: two network namespaces and a veth pair, always removed; rgpu across it."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import clean_env
from rgpu.bench import netns

pytestmark = [pytest.mark.netns, pytest.mark.skipif(netns.unavailable() is not None,
                                                    reason=str(netns.unavailable()))]

PING = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.sendall(b"ping"); print(s.recv(4).decode())
"""
PONG = """
import socket, sys
l = socket.create_server((sys.argv[1], 0)); print(l.getsockname()[1], flush=True)
c, _ = l.accept(); c.sendall(c.recv(4).replace(b"i", b"o"))
"""


def names() -> set[str]:
    return set(netns.leftovers())


def test_a_lan_joins_two_namespaces_and_is_gone_afterwards():
    with netns.lan() as lan:
        assert {lan.ns_a, lan.ns_b} <= names()
        pong = lan.popen("b", [sys.executable, "-c", PONG, lan.addr_b], stdout=subprocess.PIPE, text=True)
        port = pong.stdout.readline().strip()
        assert lan.run("a", [sys.executable, "-c", PING, lan.addr_b, port], timeout=30).stdout.strip() == "pong"
        pong.wait(10)
        outside = subprocess.run([sys.executable, "-c", PING, lan.addr_b, port], capture_output=True, timeout=30)
        assert outside.returncode != 0                       # the root namespace has no route there
    assert not {lan.ns_a, lan.ns_b} & names()                # (other runs' namespaces may come and go)


def test_the_lan_is_removed_when_the_body_raises():
    with pytest.raises(RuntimeError, match="on purpose"):
        with netns.lan() as lan:
            made = {lan.ns_a, lan.ns_b}
            raise RuntimeError("on purpose")
    assert not made & names()
    assert subprocess.run(["ip", "link", "show", lan.dev_a], capture_output=True).returncode != 0


def test_a_rate_is_a_tbf_qdisc_on_both_ends():
    with netns.lan(rate="2gbit") as lan:
        for side, dev in (("a", lan.dev_a), ("b", lan.dev_b)):
            shown = subprocess.run(["tc", "-n", lan.ns(side), "qdisc", "show", "dev", dev], capture_output=True,
                                   text=True).stdout
            assert "tbf" in shown and "2Gbit" in shown


def test_a_bad_rate_is_refused_before_anything_is_made():
    with pytest.raises(ValueError, match="rate"):
        netns.rate_bytes("fast")


CLIENT = """
import sys
from rgpu import config
from rgpu.errors import ConnectError
from rgpu.transport.client import connect
s = config.settings(environ={}, server=sys.argv[1], token="lan-test")
conn = connect("echo", settings=s.with_(transport="auto"))
print(conn.transport_name, conn.call({"op": "sizes"}, [b"abc"]).meta["sizes"])
conn.close()
try:
    connect("echo", settings=s.with_(transport="shm"))
    print("shm: connected")
except ConnectError as exc:
    print("shm: ConnectError:", exc)
"""


def test_across_namespaces_auto_is_tcp_and_forced_shm_fails_clearly():
    """One host, two network namespaces: the server's Unix socket is out of reach, so no same-host proof."""
    env = clean_env(RGPU_TOKEN="lan-test", RGPU_TOKEN_FILE="/nonexistent/rgpu-lan-token")
    with netns.lan() as lan:
        server = lan.popen("b", [sys.executable, "-m", "rgpu", "serve", "--host", lan.addr_b, "--port", "0",
                                 "--preload", ""], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                           env=env)
        try:
            line = server.stdout.readline()
            address = line.split("listening on ")[1].split(";")[0].strip()
            done = lan.run("a", [sys.executable, "-c", CLIENT, address], env=env, timeout=120)
        finally:
            server.terminate()
            server.wait(10)
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "tcp [3]", done.stderr
    assert lines[1].startswith("shm: ConnectError:") and "not reachable" in lines[1]


def test_the_lan_benchmark_gives_tcp_rows_beside_a_raw_socket_in_the_same_namespaces(monkeypatch):
    from contextlib import contextmanager
    from types import SimpleNamespace

    from rgpu.bench import transport_lan

    made, real = [], netns.lan

    @contextmanager
    def recorded(rate=None):
        with real(rate) as lan:
            made.extend((lan.ns_a, lan.ns_b))
            yield lan
    monkeypatch.setattr(netns, "lan", recorded)
    rows = transport_lan.rows(SimpleNamespace(quick=True, repeats=1, rate="5gbit", transport="tcp", sizes="1M"))
    assert [(r["transport"], r["metric"], r.get("direction")) for r in rows] == [
        ("tcp", "rtt", None), ("tcp", "bandwidth", None), ("tcp", "bandwidth", "download")]
    assert all(r["baseline_name"].startswith("raw socket") and r["value"] > 0 and r["baseline"] > 0 for r in rows)
    assert rows[0]["lan"] == "netns veth, tbf 5gbit"
    assert len(made) == 2 and not set(made) & names()


HOLD = """
import sys, time
from rgpu.bench import netns
with netns.lan() as lan:
    print(lan.ns_a, lan.ns_b, flush=True)
    time.sleep(120)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_run_ended_by_sigterm_removes_its_namespaces_as_ctrl_c_does(sig):
    import signal

    proc = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True, env=clean_env())
    made = set(proc.stdout.readline().split())
    assert len(made) == 2 and made <= names()
    proc.send_signal(getattr(signal, sig))
    assert proc.wait(30) != 0
    assert not made & names()
