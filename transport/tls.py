"""TLS for the tcp transport: the server's certificate, the client's pin or CA, and telling TLS from plain.

Who uses TLS is decided by configuration, never guessed from the peer: a client
speaks TLS when ``RGPU_TLS=1``, ``RGPU_TLS_FINGERPRINT`` or ``RGPU_TLS_CA`` is set
(and never to the embedded local server); a server when started with ``--tls``.
The server's worker peeks at the first byte of each connection (a TLS ClientHello
starts with 0x16, an rgpu frame with ``R``), so both mismatches end with a clear
error before any handshake, and nothing runs:

    plain client, TLS server   the server answers a plain REFUSED {code: "tls"}: ConfigError
    TLS client, plain server   the server answers a plain REFUSED; the client's TLS
                               stack reads a non-TLS record: ConfigError
    certificate not trusted    (wrong pin, expired, wrong CA or host name): AuthenticationError

The self-signed certificate and its key live beside the token file
(``tls-cert.pem``, ``tls-key.pem``, the key 0600), made on first start with the
``cryptography`` package when it is installed, else the ``openssl`` command.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rgpu.errors import AuthenticationError, ConfigError, ConnectError, ConnectionLost, SessionLost, translate_os_error

TLS_HANDSHAKE_RECORD = 0x16          # first byte of every TLS ClientHello
CERT_NAME, KEY_NAME = "tls-cert.pem", "tls-key.pem"
SELF_SIGNED_DAYS = 3650
# OpenSSL's reasons for "the peer's bytes are not TLS records"
NOT_TLS_REASONS = {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "UNKNOWN_PROTOCOL",
                   "HTTP_REQUEST", "UNEXPECTED_RECORD", "RECORD_LENGTH_MISMATCH", "WRONG_SSL_VERSION"}
PIN_HINT = "pin the fingerprint `rgpu serve --tls` printed at start in RGPU_TLS_FINGERPRINT"


# ---- certificates --------------------------------------------------------------------------


def fingerprint(der: bytes) -> str:
    """SHA-256 of a DER certificate as ``AB:CD:...`` (what ``openssl x509 -fingerprint -sha256`` prints)."""
    return ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())


def normalize_fingerprint(text: str) -> str:
    """A pin as 64 lower-case hex digits; accepts colons, spaces and an ``sha256:`` / ``SHA256 Fingerprint=`` prefix."""
    t = text.strip()
    for prefix in ("sha256 fingerprint=", "sha256:", "sha256="):
        if t.lower().startswith(prefix):
            t = t[len(prefix):]
    t = t.replace(":", "").replace(" ", "").lower()
    if len(t) != 64 or any(c not in "0123456789abcdef" for c in t):
        raise ConfigError(f"RGPU_TLS_FINGERPRINT={text!r}: expected a SHA-256 fingerprint "
                          "(64 hex digits, colons allowed)")
    return t


def file_fingerprint(path: str | Path) -> str:
    return fingerprint(ssl.PEM_cert_to_DER_cert(Path(path).read_text()))


def not_after(der: bytes) -> dt.datetime | None:
    """When a DER certificate expires (UTC), or None when nothing here can parse it."""
    try:
        from cryptography import x509
        return x509.load_der_x509_certificate(der).not_valid_after_utc
    except ImportError:
        pass
    with tempfile.NamedTemporaryFile("w", suffix=".pem") as f:  # the stdlib only decodes certificate files
        f.write(ssl.DER_cert_to_PEM_cert(der))
        f.flush()
        try:
            text = ssl._ssl._test_decode_cert(f.name)["notAfter"]
        except (AttributeError, KeyError, ssl.SSLError):
            return None
    return dt.datetime.fromtimestamp(ssl.cert_time_to_seconds(text), dt.timezone.utc)


def _hostnames() -> list[str]:
    return sorted({"localhost", socket.gethostname()})


def _generate_with_cryptography(cert: Path, key: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    pkey = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"rgpu {socket.gethostname()}")])
    now = dt.datetime.now(dt.timezone.utc)
    sans = [x509.DNSName(h) for h in _hostnames()]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "::1")]
    built = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(pkey.public_key())
             .serial_number(x509.random_serial_number())
             .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=SELF_SIGNED_DAYS))
             .add_extension(x509.SubjectAlternativeName(sans), critical=False)
             .sign(pkey, hashes.SHA256()))
    key_pem = pkey.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
    with os.fdopen(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(key_pem)
    cert.write_bytes(built.public_bytes(serialization.Encoding.PEM))


def _generate_with_openssl(cert: Path, key: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise ConfigError("--tls without --tls-cert needs the `cryptography` package or the `openssl` command "
                          "to make a self-signed certificate; install one, or pass --tls-cert and --tls-key")
    os.close(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))  # openssl keeps the mode of what exists
    sans = ",".join([f"DNS:{h}" for h in _hostnames()] + ["IP:127.0.0.1", "IP:::1"])
    cmd = [exe, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
           "-keyout", str(key), "-out", str(cert), "-days", str(SELF_SIGNED_DAYS),
           "-subj", f"/CN=rgpu {socket.gethostname()}", "-addext", f"subjectAltName={sans}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"openssl could not make a self-signed certificate: {done.stderr.strip()}")


def generate_self_signed(cert: Path, key: Path, method: str = "auto") -> str:
    """Write a self-signed EC P-256 certificate and its key (0600); returns the tool used."""
    if method == "auto":
        try:
            import cryptography  # noqa: F401
            method = "cryptography"
        except ImportError:
            method = "openssl"
    cert.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # written under temporary names and renamed, so two servers starting at once never mix halves
    tmp_cert, tmp_key = cert.with_name(f".{cert.name}.{os.getpid()}"), key.with_name(f".{key.name}.{os.getpid()}")
    try:
        (_generate_with_cryptography if method == "cryptography" else _generate_with_openssl)(tmp_cert, tmp_key)
        os.replace(tmp_key, key)
        os.replace(tmp_cert, cert)
    finally:
        for p in (tmp_cert, tmp_key):
            p.unlink(missing_ok=True)
    return method


@dataclass(frozen=True)
class ServerCertificate:
    """The certificate a TLS server presents: files, fingerprint, expiry, and whether it was made now."""
    cert: str
    key: str
    fingerprint: str
    expires: dt.datetime | None
    generated_by: str | None = None      # "cryptography" or "openssl" when made on this start

    @classmethod
    def prepare(cls, settings) -> "ServerCertificate":
        """``--tls-cert/--tls-key``, or the self-signed pair beside the token file (made when absent)."""
        made = None
        if settings.tls_cert or settings.tls_key:
            if not (settings.tls_cert and settings.tls_key):
                raise ConfigError("--tls-cert and --tls-key go together (RGPU_TLS_CERT, RGPU_TLS_KEY)")
            cert, key = Path(settings.tls_cert).expanduser(), Path(settings.tls_key).expanduser()
        else:
            folder = settings.token_path.parent
            cert, key = folder / CERT_NAME, folder / KEY_NAME
            if not (cert.exists() and key.exists()):
                made = generate_self_signed(cert, key)
        server_context(str(cert), str(key))  # a wrong path or a key of another certificate fails at start
        der = ssl.PEM_cert_to_DER_cert(cert.read_text())
        return cls(str(cert), str(key), fingerprint(der), not_after(der), made)

    @property
    def expired(self) -> bool:
        return self.expires is not None and self.expires < dt.datetime.now(dt.timezone.utc)


# ---- contexts ------------------------------------------------------------------------------


def server_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # no session tickets: nothing is resumed, and no record arrives after the handshake uninvited
    ctx.num_tickets = 0
    try:
        ctx.load_cert_chain(cert, key)
    except FileNotFoundError as exc:
        raise ConfigError(f"TLS: cannot read {exc.filename}: {exc.strerror}") from None
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise ConfigError(f"TLS: the key {key} does not belong to the certificate {cert}") from None
        raise ConfigError(f"TLS: cannot load the certificate {cert} and key {key}: {exc}") from None
    return ctx


def wanted(settings) -> bool:
    """Whether a client speaks TLS: asked for, or a pin or CA given."""
    return bool(settings.tls or settings.tls_fingerprint or settings.tls_ca)


def client_context(settings) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if settings.tls_ca:
        try:
            ctx.load_verify_locations(cafile=os.path.expanduser(settings.tls_ca))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"RGPU_TLS_CA={settings.tls_ca!r}: cannot load it: {exc}") from None
    elif settings.tls_fingerprint:
        ctx.check_hostname = False           # the pin names the one certificate we accept
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx.load_default_certs()
    return ctx


# ---- the two ends ---------------------------------------------------------------------------


def wrap_client(sock: socket.socket, settings, host: str, port: int) -> ssl.SSLSocket:
    """The TLS handshake on a connected socket, then the pin and expiry checks; closes ``sock`` on failure."""
    where = f"{host}:{port}"
    try:
        pin = normalize_fingerprint(settings.tls_fingerprint) if settings.tls_fingerprint else None
        ctx = client_context(settings)
        try:
            ssock = ctx.wrap_socket(sock, server_hostname=host)
        except ssl.SSLCertVerificationError as exc:
            raise AuthenticationError(_verify_failure(where, exc, settings)) from None
        except ssl.SSLError as exc:
            if exc.reason in NOT_TLS_REASONS:
                raise ConfigError(
                    f"{where} does not speak TLS (it was started without --tls): unset RGPU_TLS, "
                    "RGPU_TLS_FINGERPRINT and RGPU_TLS_CA to connect in plain, or restart it with "
                    f"`rgpu serve --tls` [{exc.reason}]") from None
            raise ConnectError(f"TLS handshake with {where} failed: {exc.reason or exc}") from None
        except OSError as exc:
            if isinstance(exc, (socket.timeout, TimeoutError)):
                raise translate_os_error(exc, where=f"TLS handshake with {where}") from None
            raise ConnectionLost(f"{where} closed the connection during the TLS handshake ({exc}); "
                                 "is it an rgpu server?") from None
    except BaseException:
        sock.close()
        raise
    try:
        der = ssock.getpeercert(binary_form=True) or b""
        if pin is not None:
            got = fingerprint(der)
            if not hmac.compare_digest(got.replace(":", "").lower(), pin):
                raise AuthenticationError(
                    f"the TLS certificate of {where} has fingerprint {got}, not the pinned RGPU_TLS_FINGERPRINT: "
                    "someone may be in between, or the server's certificate changed (re-pin from `rgpu serve`'s "
                    "output or `rgpu doctor` on the server host)")
            if not settings.tls_ca:
                expires = not_after(der)
                if expires is not None and expires < dt.datetime.now(dt.timezone.utc):
                    raise AuthenticationError(
                        f"the TLS certificate of {where} expired on {expires:%Y-%m-%d}: renew it (a self-signed one "
                        f"is renewed by deleting {CERT_NAME} and {KEY_NAME} beside the server's token and restarting "
                        "`rgpu serve --tls`), then pin the new fingerprint")
    except BaseException:
        ssock.close()
        raise
    return ssock


def _verify_failure(where: str, exc: ssl.SSLCertVerificationError, settings) -> str:
    what = exc.verify_message or str(exc)
    head = f"the TLS certificate of {where} is not trusted: {what}"
    if exc.verify_code == 10:   # X509_V_ERR_CERT_HAS_EXPIRED
        return f"{head}; renew the server's certificate"
    if exc.verify_code in (18, 19, 20, 21) and not settings.tls_ca:  # self-signed or unknown issuer
        return f"{head}; {PIN_HINT}, or set RGPU_TLS_CA to the CA that signed it"
    if exc.verify_code in (18, 19, 20, 21):
        return f"{head}; RGPU_TLS_CA={settings.tls_ca} did not sign it"
    if "hostname" in what.lower() or "ip address" in what.lower():
        return f"{head}; connect by a name the certificate lists, or {PIN_HINT}"
    return head


def accept(sock: socket.socket, cert: dict | None) -> socket.socket:
    """Server side, in the worker: peek at the first byte and refuse the wrong kind; TLS handshake if ours.

    ``cert`` is {"cert": path, "key": path} for a TLS server, None for a plain one.
    Raises ConfigError after refusing a mismatch, ConnectionLost when the client goes away.
    """
    from . import handshake
    from .tcp import TcpTransport

    try:
        first = sock.recv(1, socket.MSG_PEEK)
    except OSError as exc:
        raise translate_os_error(exc, where="waiting for the client's first bytes") from None
    if not first:
        raise ConnectionLost("the client closed the connection before saying anything")
    is_tls = first[0] == TLS_HANDSHAKE_RECORD
    if cert is None:
        if is_tls:
            handshake.refuse(TcpTransport(sock), "tls", "this server does not use TLS (started without --tls)")
            raise ConfigError("a TLS client reached this plain server; refused")
        return sock
    if not is_tls:
        handshake.refuse(TcpTransport(sock), "tls",
                         "this server requires TLS (started with --tls): set RGPU_TLS=1 and " + PIN_HINT +
                         ", or set RGPU_TLS_CA; or reach it with `rgpu run --ssh`")
        raise ConfigError("a plain client reached this TLS server; refused")
    try:
        return server_context(cert["cert"], cert["key"]).wrap_socket(sock, server_side=True)
    except ssl.SSLError as exc:
        raise AuthenticationError(f"TLS handshake failed: {exc.reason or exc}") from None
    except OSError as exc:
        raise translate_os_error(exc, where="TLS handshake") from None


# ---- resuming a session over TLS ---------------------------------------------------------------------
# The acceptor cannot read inside TLS, so a client resuming a TLS session first says, in plain, the resume
# id its WELCOME gave: the acceptor hands the raw connection to that session's worker, which answers "+"
# and does the TLS handshake and the token's proof itself (the acceptor answers "-": no such session). The
# id only routes the connection; the worker takes it over the live one only once the token is proved.
RESUME_PREAMBLE = b"RGPR"
RESUME_GO, RESUME_GONE = b"+", b"-"


def resume_preamble(rid: str) -> bytes:
    raw = rid.encode()[:255]
    return RESUME_PREAMBLE + bytes([len(raw)]) + raw


def parse_resume_preamble(data: bytes) -> tuple[str | None, int]:
    """(the id, the preamble's length) once it has all arrived, else (None, 0)."""
    if len(data) < 5 or len(data) < 5 + data[4]:
        return None, 0
    return data[5:5 + data[4]].decode("ascii", "replace"), 5 + data[4]


def client_resume(sock: socket.socket, rid: str, settings, host: str, port: int) -> ssl.SSLSocket:
    """The client's resumed TLS connection: the preamble, the worker's go-ahead, then the TLS handshake."""
    try:
        sock.sendall(resume_preamble(rid))
        answer = sock.recv(1)
    except OSError as exc:
        sock.close()
        raise translate_os_error(exc, where=f"resuming the session at {host}:{port}") from None
    if answer != RESUME_GO:
        sock.close()
        if answer == RESUME_GONE:
            raise SessionLost(f"the server at {host}:{port} would not resume the session: no session under that id "
                              "(it ended, its grace passed, or the server restarted)")
        raise ConnectionLost(f"{host}:{port} closed the connection before resuming the session")
    return wrap_client(sock, settings, host, port)
