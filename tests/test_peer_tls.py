"""The peer port under TLS: servers that serve ``--tls`` copy between their devices over TLS, the destination's
certificate pinned by the fingerprint its session said; a plain, a mis-pinned or a replayed connection is
refused, named. Two CPU servers on loopback; values against the CPU's."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import TOKEN, RunningServer, clean_env
from test_peer_ticketed import _push

from rgpu.server.ops.peer import PeerError, Peers
from rgpu.transport import tls

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pair(folder) -> dict:
    cert, key = folder / "cert.pem", folder / "key.pem"
    tls.generate_self_signed(cert, key)
    return {"cert": str(cert), "key": str(key)}


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return [_pair(tmp_path_factory.mktemp(f"cert{i}")) for i in range(2)]


# ---- in process: one TLS peer port, sources pinned right, wrong, or plain --------------------------------


def test_a_tls_peer_port_takes_a_pinned_transfer_value_by_value(certs):
    dst = Peers("127.0.0.1", 5.0, certs[0])
    try:
        assert dst.fingerprint == tls.file_fingerprint(certs[0]["cert"])
        values = torch.randn(1 << 16, generator=torch.Generator().manual_seed(4)).to(torch.float64)
        t, errors = _push(dst, b"t" * 32, values, dst.fingerprint, certs[1])   # the source's own cert is another
        got = torch.zeros_like(values)
        dst.receive(b"t" * 32, got)
        t.join(5)
        assert not errors and torch.equal(got, values)
    finally:
        dst.close()


def test_a_source_pinning_another_certificate_sends_nothing_and_says_so(certs):
    dst = Peers("127.0.0.1", 1.0, certs[0])
    try:
        t, errors = _push(dst, b"p" * 32, torch.ones(4), tls.file_fingerprint(certs[1]["cert"]))
        got = torch.zeros(4)
        with pytest.raises(PeerError, match="within 1 s"):   # the ticket never crossed: no transfer came
            dst.receive(b"p" * 32, got)
        t.join(5)
        assert "not the destination session's: someone may be in between" in str(errors[0]), errors
        assert torch.equal(got, torch.zeros(4))
    finally:
        dst.close()


def test_a_plain_source_to_a_tls_peer_port_is_refused_naming_tls(certs):
    dst = Peers("127.0.0.1", 1.0, certs[0])
    try:
        t, errors = _push(dst, b"q" * 32, torch.ones(4), None)   # a ticket it might have sniffed, in plain
        got = torch.zeros(4)
        with pytest.raises(PeerError, match="within 1 s"):
            dst.receive(b"q" * 32, got)
        t.join(5)
        assert "refused the transfer: this server's peer port takes TLS only" in str(errors[0]), errors
        assert torch.equal(got, torch.zeros(4))
    finally:
        dst.close()


def test_a_tls_source_to_a_plain_peer_port_is_told_it_does_not_speak_tls(certs):
    dst = Peers("127.0.0.1", 1.0)
    try:
        t, errors = _push(dst, b"u" * 32, torch.ones(4), tls.file_fingerprint(certs[0]["cert"]))
        with pytest.raises(PeerError, match="within 1 s"):
            dst.receive(b"u" * 32, torch.zeros(4))
        t.join(5)
        assert "does not speak TLS" in str(errors[0]), errors
    finally:
        dst.close()


# ---- two TLS servers and one client: copies across them, and strangers at the peer port -------------------

CLIENT = r"""
import json, os, socket, ssl, threading, time, types, torch, rgpu
from rgpu.device_backend import session
from rgpu.transport import ticketed

made = []   # the copies' tickets, seen here
session.ticketed = types.SimpleNamespace(new_ticket=lambda: made.append(ticketed.new_ticket()) or made[-1])
out = {}
src = torch.randn(1 << 18, generator=torch.Generator().manual_seed(7))   # 1 MiB
a = torch.linspace(-2, 2, 24).reshape(4, 6)
x0 = src.to("rgpu:0")
x2 = x0.to("rgpu:2")                       # rgpu:0 -> rgpu:2: server to server, over TLS
back = (x2 * 2).to("rgpu:1")               # and back
half = x2.to(torch.float16).to("rgpu:0")
dst = torch.zeros(3, 4, device="rgpu:3").t()
dst.copy_(a.to("rgpu:0")[:, 1::2])
out["equal"] = [torch.equal(x2.cpu(), src), torch.equal(back.cpu(), src * 2), torch.equal(half.cpu(), src.half()),
                torch.equal(dst.cpu(), a[:, 1::2])]
second = session.current().servers.all[1]
info = second.conn.welcome["info"]
out["peer_tls"] = info["peer_tls"]
port, used = info["peer_port"], made[0]     # the destination's peer port, the first copy's ticket (spent)

def stranger(first, wrap, said):
    raw = socket.create_connection((second.host, port), timeout=30)
    if wrap:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        raw = ctx.wrap_socket(raw)
    raw.sendall(first)
    data = b""
    try:
        while chunk := raw.recv(4096):
            data += chunk
    except OSError:
        pass
    said.append(data[3:].decode(errors="replace"))

said = {k: [] for k in ("plain", "replay", "wrong")}
threads = [threading.Thread(target=stranger, args=(used, False, said["plain"])),      # sniffed, sent in plain
           threading.Thread(target=stranger, args=(used, True, said["replay"])),      # replayed inside TLS
           threading.Thread(target=stranger, args=(b"w" * 32, True, said["wrong"]))]  # no copy's
for t in threads:
    t.start()
time.sleep(0.5)
y = torch.arange(10.0)
y2 = y.to("rgpu:0").to("rgpu:2")           # the destination meets the strangers while it takes this copy
torch.rgpu.synchronize()
time.sleep(float(os.environ["RGPU_PEER_TIMEOUT"]) + 0.5)
z2 = (y + 1).to("rgpu:0").to("rgpu:2")     # the wrong ticket's time is up
torch.rgpu.synchronize()
for t in threads:
    t.join(30)
out["after"] = [torch.equal(y2.cpu(), y), torch.equal(z2.cpu(), y + 1), torch.equal(x2.cpu(), src)]
out["said"] = said
print(json.dumps(out))
"""


def test_two_tls_servers_copy_across_over_tls_and_refuse_plain_replayed_and_wrong_tickets(tmp_path, certs):
    flags = ("--device", "cpu", "--devices", "2", "--session-grace", "0", "--tls",
             "--tls-cert", certs[0]["cert"], "--tls-key", certs[0]["key"])
    env = {"RGPU_PEER_TIMEOUT": "3"}
    started = [RunningServer(tmp_path / f"s{i}", flags, env=env) for i in range(2)]
    try:
        fp = tls.file_fingerprint(certs[0]["cert"])
        full = clean_env(RGPU_SERVER=",".join(s.address for s in started), RGPU_TOKEN=TOKEN, RGPU_TRANSPORT="tcp",
                         RGPU_TLS_FINGERPRINT=fp, RGPU_TCP_STREAMS="1", **env)
        done = subprocess.run([sys.executable, "-c", CLIENT], capture_output=True, text=True, timeout=240, env=full,
                              cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
        got = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        for s in started:
            s.stop()
    assert got["equal"] == [True] * 4 and got["after"] == [True] * 3
    assert got["peer_tls"] == fp
    said = got["said"]
    assert said["plain"] == ["this server's peer port takes TLS only (it serves --tls): the source server connects "
                             "with TLS when the client passes the destination's certificate fingerprint along with "
                             "the ticket (a client and servers of one rgpu version do)"], said
    assert said["replay"] == ["this ticket was used already (a replayed transfer)"], said
    assert said["wrong"] == ["no copy of this session claimed this ticket within 3 s (RGPU_PEER_TIMEOUT)"], said
