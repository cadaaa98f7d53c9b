"""TLS on the tcp transport: pinning, CAs, expired and mismatched certificates, plain against TLS both ways."""
from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest
from conftest import RunningServer, clean_env, wait_until

from rgpu.errors import AuthenticationError, ConfigError
from rgpu.transport import tls
from rgpu.transport.client import connect

try:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
except ImportError:
    x509 = None
needs_cryptography = pytest.mark.skipif(x509 is None, reason="making test certificates (expired, CA-signed, "
                                        "mismatched) needs the cryptography package: pip install cryptography")


def fingerprint_printed(server: RunningServer) -> str:
    wait_until(lambda: "RGPU_TLS_FINGERPRINT=" in server.stdout, what="the fingerprint line")
    return re.search(r"RGPU_TLS_FINGERPRINT=(\S+)", server.stdout).group(1)


def write_pair(folder, name, *, hosts=("127.0.0.1",), days=(-1, 30), issuer=None, ca=False):
    """A certificate (self-signed, or signed by ``issuer`` = (cert, key)) and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    sans = [x509.IPAddress(ipaddress.ip_address(h)) if h[0].isdigit() else x509.DNSName(h) for h in hosts]
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer[0].subject if issuer else subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now + dt.timedelta(days=days[0])).not_valid_after(now + dt.timedelta(days=days[1]))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert, key, cert_path, key_path


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    server = RunningServer(tmp_path_factory.mktemp("tls-server"), ["--tls"])
    yield server
    server.stop()


def test_a_pinned_client_runs_calls_over_tls_large_buffers_included(tls_server):
    pin = fingerprint_printed(tls_server)
    conn = connect("echo", settings=tls_server.settings(tls_fingerprint=pin, transport="tcp"))  # shm needs no TLS
    try:
        assert conn.transport.tls and conn.transport.sock.version() in ("TLSv1.2", "TLSv1.3")
        big = np.arange(3 << 20, dtype=np.uint8)
        for _ in range(20):
            conn.post({"op": "sizes"}, [b"x" * 1000])
        reply = conn.call({"op": "echo"}, [big, b"tail"])
        assert bytes(reply.buffers[0]) == big.tobytes() and bytes(reply.buffers[1]) == b"tail"
        assert reply.meta["posts"] == 20
        reply.release()
    finally:
        conn.close()


def test_a_wrong_fingerprint_is_refused_before_any_rgpu_message(tls_server):
    wrong = "AB:" * 31 + "CD"
    with pytest.raises(AuthenticationError, match="not the pinned RGPU_TLS_FINGERPRINT"):
        connect("echo", settings=tls_server.settings(tls_fingerprint=wrong))
    # the worker saw no HELLO: the client hung up right after the TLS handshake
    wait_until(lambda: "peer closed the connection" in tls_server.stderr, what="the worker's refusal")


def test_a_plain_client_against_a_tls_server_gets_a_clear_error(tls_server):
    with pytest.raises(ConfigError, match="requires TLS.*RGPU_TLS_FINGERPRINT"):
        connect("echo", settings=tls_server.settings())
    wait_until(lambda: "a plain client reached this TLS server" in tls_server.stderr, what="the refusal")


def test_a_tls_client_against_a_plain_server_gets_a_clear_error(rgpu_server):
    with pytest.raises(ConfigError, match="does not speak TLS.*unset RGPU_TLS"):
        connect("echo", settings=rgpu_server.settings(tls=True))
    wait_until(lambda: "a TLS client reached this plain server" in rgpu_server.stderr, what="the refusal")


def test_an_unpinned_self_signed_certificate_is_not_trusted_and_the_error_says_to_pin(tls_server):
    with pytest.raises(AuthenticationError, match="self-signed certificate.*RGPU_TLS_FINGERPRINT"):
        connect("echo", settings=tls_server.settings(tls=True))


def test_the_self_signed_certificate_can_also_serve_as_its_own_ca(tls_server):
    ca = str(tls_server.workdir / tls.CERT_NAME)
    conn = connect("echo", settings=tls_server.settings(tls_ca=ca, transport="tcp"))
    assert conn.transport.tls
    conn.close()


def test_the_self_signed_pair_lives_beside_the_token_and_is_reused(tls_server, tmp_path):
    cert, key = tls_server.workdir / tls.CERT_NAME, tls_server.workdir / tls.KEY_NAME
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert fingerprint_printed(tls_server) == tls.file_fingerprint(cert)
    again = RunningServer(tmp_path / "again", ["--tls", "--token-file", str(tls_server.workdir / "token")])
    try:
        assert fingerprint_printed(again) == fingerprint_printed(tls_server)
        assert "made now" not in again.stdout
    finally:
        again.stop()


@needs_cryptography
def test_an_expired_certificate_is_refused_pinned_or_through_a_ca(start_server, tmp_path):
    _, _, cert, key = write_pair(tmp_path, "old", days=(-60, -1))
    server = start_server("--tls", "--tls-cert", str(cert), "--tls-key", str(key))
    wait_until(lambda: "expired" in server.stderr, what="the server's warning")
    with pytest.raises(AuthenticationError, match="expired"):
        connect("echo", settings=server.settings(tls_fingerprint=tls.file_fingerprint(cert)))
    with pytest.raises(AuthenticationError, match="expired"):
        connect("echo", settings=server.settings(tls_ca=str(cert)))


@needs_cryptography
def test_a_ca_signed_certificate_is_trusted_for_its_host_and_refused_for_another(start_server, tmp_path):
    ca = write_pair(tmp_path, "ca", ca=True, days=(-1, 30))
    _, _, good_cert, good_key = write_pair(tmp_path, "here", hosts=("127.0.0.1",), issuer=ca[:2])
    _, _, other_cert, other_key = write_pair(tmp_path, "elsewhere", hosts=("gpu.example",), issuer=ca[:2])
    good = start_server("--tls", "--tls-cert", str(good_cert), "--tls-key", str(good_key))
    conn = connect("echo", settings=good.settings(tls_ca=str(ca[2])))
    assert conn.call({"op": "sizes"}, [b"abc"]).meta["sizes"] == [3]
    conn.close()
    other = start_server("--tls", "--tls-cert", str(other_cert), "--tls-key", str(other_key))
    with pytest.raises(AuthenticationError, match="not trusted.*(IP address|hostname) mismatch"):
        connect("echo", settings=other.settings(tls_ca=str(ca[2])))
    stranger = write_pair(tmp_path, "stranger-ca", ca=True)
    with pytest.raises(AuthenticationError, match="did not sign it"):
        connect("echo", settings=good.settings(tls_ca=str(stranger[2])))


@needs_cryptography
def test_a_key_of_another_certificate_stops_the_server_at_start(tmp_path):
    _, _, cert, _ = write_pair(tmp_path, "one")
    _, _, _, other_key = write_pair(tmp_path, "two")
    done = subprocess.run([sys.executable, "-m", "rgpu", "serve", "--port", "0", "--preload", "", "--tls",
                           "--tls-cert", str(cert), "--tls-key", str(other_key)], capture_output=True, text=True,
                          env=clean_env(RGPU_TOKEN="t", RGPU_TOKEN_FILE=str(tmp_path / "token")), timeout=60)
    assert done.returncode == 2
    assert "does not belong to the certificate" in done.stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command is not installed")
def test_the_openssl_command_makes_the_pair_when_cryptography_is_absent(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    assert tls.generate_self_signed(cert, key, method="openssl") == "openssl"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    made = tls.ServerCertificate.prepare(type("S", (), {"tls_cert": str(cert), "tls_key": str(key)})())
    assert made.fingerprint == tls.file_fingerprint(cert) and not made.expired
    assert not list(tmp_path.glob(".*"))  # no temporary files left behind


def test_fingerprints_are_accepted_in_the_usual_spellings():
    hexed = "ab" * 32
    for spelling in (hexed, hexed.upper(), ":".join(["AB"] * 32), "sha256:" + hexed,
                     "SHA256 Fingerprint=" + ":".join(["AB"] * 32)):
        assert tls.normalize_fingerprint(spelling) == hexed
    with pytest.raises(ConfigError, match="64 hex digits"):
        tls.normalize_fingerprint("abcd")


def test_the_local_server_child_never_inherits_tls_settings(monkeypatch):
    captured = {}

    class FakePopen:
        def __init__(self, cmd, env, **kw):
            captured.update(env)
            raise OSError("stop here")

    monkeypatch.setenv("RGPU_TLS", "1")
    monkeypatch.setattr("rgpu.local_server.subprocess.Popen", FakePopen)
    from rgpu.local_server import LocalServer
    with pytest.raises(OSError):
        LocalServer("token")
    assert "RGPU_TLS" not in captured and captured["RGPU_TOKEN"] == "token"
    assert os.environ["RGPU_TLS"] == "1"
