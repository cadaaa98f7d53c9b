"""Every setting rgpu reads, in one table; nothing is read from the environment at import.

``settings()`` reads the environment when called and returns a frozen ``Settings``;
``rgpu config`` (and the README's table) is generated from ``TABLE``.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

from .errors import ConfigError

MiB = 1 << 20
GiB = 1 << 30


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 1/0, true/false, yes/no or on/off, got {text!r}")


def _choice(*names: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in names:
            raise ValueError(f"expected one of {', '.join(names)}, got {text!r}")
        return text
    return parse


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of two)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": MiB, "G": GiB}.get(t[-1:], 1)
    value = int(float(t[:-1] if scale > 1 else t) * scale)
    if value < 0:
        raise ValueError(f"a size cannot be negative: {text!r}")
    return value


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    return lambda text: None if text == "" else parse(text)


@dataclass(frozen=True)
class Setting:
    field: str
    env: str
    default: Any
    parse: Callable[[str], Any]
    flag: str
    doc: str


# field, environment variable, default, parser, command-line flag, meaning
TABLE: tuple[Setting, ...] = (
    Setting("server", "RGPU_SERVER", None, _optional(str), "rgpu run --server", "host:port of the server a client uses; unset: start a local server on first use"),
    Setting("host", "RGPU_HOST", "127.0.0.1", str, "rgpu serve --host", "address the server binds (loopback unless you say otherwise)"),
    Setting("port", "RGPU_PORT", 9713, int, "rgpu serve --port", "the one port both routes share"),
    Setting("token", "RGPU_TOKEN", None, _optional(str), "", "the shared secret; wins over the token file"),
    Setting("token_file", "RGPU_TOKEN_FILE", "~/.config/rgpu/token", str, "rgpu serve --token-file", "where the token lives (created 0600 by the first `rgpu serve`)"),
    Setting("transport", "RGPU_TRANSPORT", "auto", _choice("auto", "tcp", "shm", "ucx"), "rgpu bench transport --transport", "auto = shm on one host, ucx where RDMA is, else tcp"),
    Setting("native", "RGPU_NATIVE", "auto", _choice("auto", "off"), "", "auto: the C and C++ twins (shm's hot path, the server's op path, the device's fast path) where they build (`rgpu build` builds them ahead; else first use does); off: every Python reference path (the device's own C++ part still loads)"),
    Setting("shm_spin_us", "RGPU_SHM_SPIN_US", None, _optional(float), "", "how long a waiting shm end polls before it sleeps (µs, at most 50000); unset: 20000 on a machine of 8 cores or more (as CUDA's own synchronize keeps its core there), else 100"),
    Setting("tcp_spin_us", "RGPU_TCP_SPIN_US", None, _optional(float), "", "how long a tcp end polls its socket (without the GIL) before it sleeps in a read (µs, at most 50000); unset: 20000 on a machine of 8 cores or more, else 0"),
    Setting("tls", "RGPU_TLS", False, _bool, "rgpu serve --tls", "require TLS on the tcp transport"),
    Setting("tls_cert", "RGPU_TLS_CERT", None, _optional(str), "rgpu serve --tls-cert", "server certificate (PEM); unset: a self-signed one beside the token"),
    Setting("tls_key", "RGPU_TLS_KEY", None, _optional(str), "rgpu serve --tls-key", "server private key (PEM)"),
    Setting("tls_ca", "RGPU_TLS_CA", None, _optional(str), "", "client: CA bundle to trust for the server certificate"),
    Setting("tls_fingerprint", "RGPU_TLS_FINGERPRINT", None, _optional(str), "", "client: SHA-256 fingerprint of the server certificate to pin"),
    Setting("device", "RGPU_DEVICE", "auto", _choice("auto", "cuda", "cpu"), "rgpu serve --device", "where the server runs ops: cuda when there is a GPU, else cpu"),
    Setting("devices", "RGPU_DEVICES", 1, int, "rgpu serve --devices", "number of CPU devices the cpu executor exposes (rgpu:0..N-1)"),
    Setting("cuda_driver", "RGPU_CUDA_DRIVER", "auto", _choice("auto", "real", "fake"), "rgpu serve --cuda-driver", "driver behind the cuda route: real on a GPU host, else fake"),
    Setting("tf32", "RGPU_TF32", False, _bool, "", "allow TF32 matmuls on the server (off so results match a CPU reference)"),
    Setting("sim_rtt_ms", "RGPU_SIM_RTT_MS", 0.0, float, "rgpu bench train --sim-rtt", "simulated round-trip time added by the transport (tests, benchmarks)"),
    Setting("post_batch_count", "RGPU_POST_BATCH_COUNT", 512, int, "", "most posted frames written in one batch"),
    Setting("post_batch_bytes", "RGPU_POST_BATCH_BYTES", 4 * MiB, _size, "", "most bytes written in one batch of posts"),
    Setting("post_copy_bytes", "RGPU_POST_COPY_BYTES", 256 << 10, _size, "", "posted buffers up to this size are copied so post() returns at once; larger ones are written before post() returns"),
    Setting("queue_max_bytes", "RGPU_QUEUE_MAX_BYTES", 256 * MiB, _size, "", "posted bytes waiting to be written before post() blocks (backpressure)"),
    Setting("connect_timeout", "RGPU_CONNECT_TIMEOUT", 10.0, float, "", "seconds to connect and finish the handshake"),
    Setting("request_timeout", "RGPU_TIMEOUT", 0.0, float, "", "seconds to wait for an answer; 0 waits as long as the connection lives"),
    Setting("max_frame_bytes", "RGPU_MAX_FRAME", 2 * GiB, _size, "rgpu serve --max-frame", "largest frame either side accepts"),
    Setting("max_meta_bytes", "RGPU_MAX_META", 64 * MiB, _size, "", "largest metadata block in a frame"),
    Setting("max_buffers", "RGPU_MAX_BUFFERS", 65536, int, "", "most raw buffers in one frame"),
    Setting("max_sessions", "RGPU_MAX_SESSIONS", 32, int, "rgpu serve --max-sessions", "sessions the server runs at once"),
    Setting("spare_workers", "RGPU_SPARE_WORKERS", 1, int, "rgpu serve --spare-workers", "worker processes kept started so a new session begins at once"),
    Setting("debug", "RGPU_DEBUG", False, _bool, "", "debug logging (the hot path is quiet otherwise)"),
)

# Each native twin's own switch, before RGPU_NATIVE (deprecated, read for one release): field -> variable.
# The fields stay, for tests and diagnostics that run one twin each way: on where RGPU_NATIVE is auto.
TWINS = {"shm_c": "RGPU_SHM_C", "server_c": "RGPU_SERVER_C", "fast_path": "RGPU_FAST_PATH"}
_warned: set[str] = set()


@dataclass(frozen=True)
class Settings:
    server: str | None
    host: str
    port: int
    token: str | None
    token_file: str
    transport: str
    tls: bool
    tls_cert: str | None
    tls_key: str | None
    tls_ca: str | None
    tls_fingerprint: str | None
    device: str
    devices: int
    cuda_driver: str
    tf32: bool
    native: str
    shm_c: bool
    shm_spin_us: float | None
    tcp_spin_us: float | None
    server_c: bool
    sim_rtt_ms: float
    post_batch_count: int
    post_batch_bytes: int
    post_copy_bytes: int
    queue_max_bytes: int
    connect_timeout: float
    request_timeout: float
    max_frame_bytes: int
    max_meta_bytes: int
    max_buffers: int
    max_sessions: int
    spare_workers: int
    debug: bool
    fast_path: bool

    def with_(self, **changes: Any) -> "Settings":
        return replace(self, **changes)

    @property
    def token_path(self) -> Path:
        return Path(os.path.expanduser(self.token_file))

    def server_address(self) -> tuple[str, int] | None:
        """``RGPU_SERVER`` split into (host, port), or None when unset."""
        return parse_address(self.server, "RGPU_SERVER") if self.server else None


def parse_address(text: str, what: str = "address", default_port: int = 9713) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, str(default_port)
    host = host.strip("[]") or "127.0.0.1"
    try:
        return host, int(port)
    except ValueError:
        raise ConfigError(f"{what}={text!r}: expected host:port") from None


def settings(environ: dict[str, str] | None = None, **overrides: Any) -> Settings:
    """Read every setting from ``environ`` (default ``os.environ``); keyword overrides win."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for s in TABLE:
        raw = env.get(s.env)
        if raw is None:
            values[s.field] = s.default
            continue
        try:
            values[s.field] = s.parse(raw)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{s.env}={raw!r}: {exc}") from None
    for name, var in TWINS.items():
        values[name] = values["native"] != "off" and _deprecated_twin(env, var)
    values.update({k: v for k, v in overrides.items() if v is not None})
    assert {f.name for f in fields(Settings)} == set(values), "TABLE and Settings disagree"
    return Settings(**values)


def _deprecated_twin(env, var: str) -> bool:
    raw = env.get(var)
    if raw is None:
        return True
    if var not in _warned:
        _warned.add(var)
        warnings.warn(f"{var} is deprecated: RGPU_NATIVE=off turns every native twin off", FutureWarning,
                      stacklevel=3)
    try:
        return _bool(raw)
    except ValueError as exc:
        raise ConfigError(f"{var}={raw!r}: {exc}") from None


def markdown_table() -> str:
    """The README's configuration table, generated from ``TABLE``."""
    rows = ["| variable | flag | default | meaning |", "|---|---|---|---|"]
    for s in TABLE:
        flag = f"`{s.flag}`" if s.flag else ""
        rows.append(f"| `{s.env}` | {flag} | `{s.default}` | {s.doc} |")
    return "\n".join(rows)
