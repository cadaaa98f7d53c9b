"""Every setting rgpu reads, in one table; nothing is read from the environment at import.

``settings()`` reads the environment when called and returns a frozen ``Settings``;
``rgpu config`` (and the README's table) is generated from ``TABLE``.
"""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, make_dataclass, replace
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
    group: str = "tuning"  # "user": the README's table; "limits", "tuning", "testing": docs/config.md
    why: str = ""          # why one would change it (docs/config.md)


# field, environment variable, default, parser, command-line flag, meaning
TABLE: tuple[Setting, ...] = (
    Setting("server", "RGPU_SERVER", None, _optional(str), "rgpu run --server", "host:port of the server a client uses, or a comma list of several (`hostA:9713,hostB:9713`: their devices are rgpu:0..N-1 in that order, docs/scale_out.md); unset: start a local server on first use", group="user"),
    Setting("host", "RGPU_HOST", "127.0.0.1", str, "rgpu serve --host", "address the server binds (loopback unless you say otherwise)", group="user"),
    Setting("port", "RGPU_PORT", 9713, int, "rgpu serve --port", "the one port both routes share", group="user"),
    Setting("token", "RGPU_TOKEN", None, _optional(str), "", "the shared secret; wins over the token file", group="user"),
    Setting("token_file", "RGPU_TOKEN_FILE", "~/.config/rgpu/token", str, "rgpu serve --token-file", "where the token lives (created 0600 by the first `rgpu serve`)", group="user"),
    Setting("transport", "RGPU_TRANSPORT", "auto", _choice("auto", "tcp", "shm", "ucx"), "rgpu bench transport --transport", "auto = shm on one host, ucx where RDMA is, else tcp", group="user"),
    Setting("native", "RGPU_NATIVE", "auto", _choice("auto", "off"), "", "auto: the C and C++ twins (shm's hot path, the server's op path, the device's fast path) where they build (`rgpu build` builds them ahead; else first use does); off: every Python reference path (the device's own C++ part still loads)", group="tuning", why="off to rule the C and C++ twins out when one misbehaves, or to compare a twin with its Python reference"),
    Setting("shm_spin_us", "RGPU_SHM_SPIN_US", None, _optional(float), "", "how long a waiting shm end polls before it sleeps (µs, at most 50000); unset: 20000 on a machine of 8 cores or more (as CUDA's own synchronize keeps its core there), else 100", group="tuning", why="lower it where cores are scarce and a waiting end should give its core back sooner; raise it for the lowest latency on a host with cores to spare"),
    Setting("tcp_spin_us", "RGPU_TCP_SPIN_US", None, _optional(float), "", "how long a tcp end polls its socket (without the GIL) before it sleeps in a read (µs, at most 50000); unset: 20000 on a machine of 8 cores or more, else 0", group="tuning", why="as RGPU_SHM_SPIN_US, for tcp: 0 on a busy client, higher on a latency-bound one with a core to spare"),
    Setting("tcp_streams", "RGPU_TCP_STREAMS", None, _optional(int), "", "tcp sockets a session uses in all (1 to 16; the fewer of the client's and the server's): a frame of 2 MiB or more has its bytes striped over them in parallel, each stream authenticated as the main one; unset: 4 on a machine of 8 cores or more, else 1", group="tuning", why="1 where the server's own ports cannot be reached beyond its one port (an SSH tunnel, a firewall); more on a fast link where one stream's copy (or TLS) tops out on one core"),
    Setting("tls", "RGPU_TLS", False, _bool, "rgpu serve --tls", "require TLS on the tcp transport", group="user"),
    Setting("tls_cert", "RGPU_TLS_CERT", None, _optional(str), "rgpu serve --tls-cert", "server certificate (PEM); unset: a self-signed one beside the token", group="user"),
    Setting("tls_key", "RGPU_TLS_KEY", None, _optional(str), "rgpu serve --tls-key", "server private key (PEM)", group="user"),
    Setting("tls_ca", "RGPU_TLS_CA", None, _optional(str), "", "client: CA bundle to trust for the server certificate", group="user"),
    Setting("tls_fingerprint", "RGPU_TLS_FINGERPRINT", None, _optional(str), "", "client: SHA-256 fingerprint of the server certificate to pin", group="user"),
    Setting("device", "RGPU_DEVICE", "auto", _choice("auto", "cuda", "cpu"), "rgpu serve --device", "where the server runs ops: cuda when there is a GPU, else cpu", group="user"),
    Setting("devices", "RGPU_DEVICES", 1, int, "rgpu serve --devices", "number of CPU devices the cpu executor exposes (rgpu:0..N-1)", group="testing", why="several CPU devices let multi-device code (rgpu:0..N-1) run in CI without GPUs"),
    Setting("cuda_driver", "RGPU_CUDA_DRIVER", "auto", _choice("auto", "real", "fake"), "rgpu serve --cuda-driver", "driver behind the cuda route: real on a GPU host, else fake", group="user"),
    Setting("tf32", "RGPU_TF32", False, _bool, "", "allow TF32 matmuls on the server (off so results match a CPU reference)", group="user"),
    Setting("sim_rtt_ms", "RGPU_SIM_RTT_MS", 0.0, float, "rgpu bench train --sim-rtt", "simulated round-trip time added by the transport (tests, benchmarks)", group="testing", why="to see how a program behaves over a distant link while both ends are on one host"),
    Setting("post_batch_count", "RGPU_POST_BATCH_COUNT", 512, int, "", "most posted frames written in one batch", group="tuning", why="lower it to bound how late a post reaches the server; raise it for many tiny ops"),
    Setting("post_batch_bytes", "RGPU_POST_BATCH_BYTES", 4 * MiB, _size, "", "most bytes written in one batch of posts", group="tuning", why="raise it on a fast link with large uploads; lower it to bound one write's latency"),
    Setting("post_copy_bytes", "RGPU_POST_COPY_BYTES", 256 << 10, _size, "", "posted buffers up to this size are copied so post() returns at once; larger ones are written before post() returns", group="tuning", why="raise it when mid-sized uploads should not wait for the wire; lower it to save client memory"),
    Setting("queue_max_bytes", "RGPU_QUEUE_MAX_BYTES", 256 * MiB, _size, "", "posted bytes waiting to be written before post() blocks (backpressure)", group="limits", why="lower it to bound the client's memory on a slow link; raise it when posts block a fast producer"),
    Setting("connect_timeout", "RGPU_CONNECT_TIMEOUT", 10.0, float, "", "seconds to connect and finish the handshake", group="user"),
    Setting("peer_copy", "RGPU_PEER_COPY", "servers", _choice("servers", "client"), "", "how a copy between two servers' devices travels: servers = server to server, never through this process; client = down to this process and up to the other server (`rgpu run --ssh` of several hosts sets it: servers behind SSH tunnels cannot reach each other)", group="tuning", why="client where the servers cannot connect to each other at the addresses this client uses for them (SSH tunnels, firewalls between them)"),
    Setting("peer_timeout", "RGPU_PEER_TIMEOUT", 60.0, float, "", "server: seconds a copy between two servers' devices waits for the other server (to connect, or to be reached); then the copy fails, naming it", group="limits", why="raise it where one server may run far behind the other (a long queue of ops before the copy)"),
    Setting("collective_timeout", "RGPU_COLLECTIVE_TIMEOUT", 300.0, float, "", "seconds a collective of the rgpu torch.distributed backend (or its init) waits on the servers for the other ranks; then it fails, naming the rank's server (init_process_group's own timeout wins when shorter)", group="limits", why="raise it where ranks may run far apart (a long first step on one rank)"),
    Setting("request_timeout", "RGPU_TIMEOUT", 0.0, float, "", "seconds to wait for an answer; 0 waits as long as the connection lives", group="user"),
    Setting("max_frame_bytes", "RGPU_MAX_FRAME", 2 * GiB, _size, "rgpu serve --max-frame", "largest frame either side accepts", group="limits", why="raise it for single tensors over 2 GiB; lower it on a server exposed to less trusted clients"),
    Setting("max_meta_bytes", "RGPU_MAX_META", 64 * MiB, _size, "", "largest metadata block in a frame", group="limits", why="raise it only for graphs whose metadata is that large; it bounds what a malformed frame can make a peer allocate"),
    Setting("max_buffers", "RGPU_MAX_BUFFERS", 65536, int, "", "most raw buffers in one frame", group="limits", why="as RGPU_MAX_META, for the count of buffers in one frame"),
    Setting("max_sessions", "RGPU_MAX_SESSIONS", 32, int, "rgpu serve --max-sessions", "sessions the server runs at once", group="user"),
    Setting("spare_workers", "RGPU_SPARE_WORKERS", 1, int, "rgpu serve --spare-workers", "worker processes kept started so a new session begins at once", group="tuning", why="0 on a server that should hold no idle process; more where many sessions start at once"),
    Setting("auth_timeout", "RGPU_AUTH_TIMEOUT", 5.0, float, "", "server: seconds a connection has from its accept to proving the token; then it is dropped", group="limits", why="raise it over a very slow link; lower it on a server probed by strangers"),
    Setting("max_unauth", "RGPU_MAX_UNAUTH", 512, int, "", "server: connections not yet authenticated held at once (over it the one that got least far goes, oldest first)", group="limits", why="lower it on a small server exposed to a network; raise it behind a proxy that funnels many clients"),
    Setting("max_unauth_per_source", "RGPU_MAX_UNAUTH_PER_SOURCE", 64, int, "", "server: the same from one address", group="limits", why="raise it behind NAT, where many clients share one address"),
    Setting("cuda_image_cache", "RGPU_CUDA_IMAGE_CACHE", 4 * GiB, _size, "", "server: most bytes of module images (fatbins, cubins, PTX) the cuda route keeps on disk by sha256 under $XDG_CACHE_HOME/rgpu/server/images, shared by sessions, least recently used dropped first; 0: none kept", group="limits", why="lower it on a server with little disk; 0 makes every session upload its images again"),
    Setting("cuda_lib_dir", "RGPU_CUDA_LIB_DIR", None, _optional(str), "", "server: a folder holding the libcublas.so.13, libcublasLt.so.13 and libcudnn.so.9 the cuda route loads, looked in first; unset: NVIDIA's wheels in the server's Python, torch's lib folder, then the dynamic linker's path", group="limits", why="points the server at libraries installed outside its Python (a CUDA toolkit, a version of your choosing), or at a stand-in (bench/cuda_lib_records.py)"),
    Setting("session_grace", "RGPU_SESSION_GRACE", 120.0, float, "rgpu serve --session-grace", "server: seconds a session whose tcp connection dropped (plain or TLS) is kept for its client to reconnect and resume it, the client retrying that long; a client that exits, even by an exception or SIGTERM, says goodbye and its session ends at once; only a vanished one's (killed, its network gone) is held, its memory counted against the quotas meanwhile; 0: a dropped connection ends the session at once, as over shm", group="limits", why="0 where a killed client's memory must come back at once; longer over a link that stays down for minutes"),
    Setting("replay_bytes", "RGPU_REPLAY_BYTES", 64 * MiB, _size, "", "most bytes of sent frames the client keeps until the server acknowledges them (the server keeps as much of its recent answers), to replay after a resumed drop; past it a drop ends the session (SessionLost)", group="limits", why="raise it when large uploads stream past the server's acknowledgements over a slow link; lower it to bound the client's and server's memory"),
    Setting("max_session_bytes", "RGPU_MAX_SESSION_BYTES", None, _optional(_size), "", "server: device memory one session may hold (the ops route's storages, the cuda route's allocations); unset: no bound", group="limits", why="set it on a shared GPU so one session cannot take every other session's memory"),
    Setting("max_sessions_per_token", "RGPU_MAX_SESSIONS_PER_TOKEN", None, _optional(int), "", "server: sessions one token may hold at once, those waiting for a resume included; over it a new session is refused, naming the setting, and the others go on; unset: only RGPU_MAX_SESSIONS", group="limits", why="set it on a server whose token is shared, so one user's runaway launcher cannot take every session"),
    Setting("max_frames_in_flight", "RGPU_MAX_FRAMES_IN_FLIGHT", None, _optional(int), "", "server: frames a session may post in a row without waiting for an answer (a request); past it each post fails with an error naming the setting, raised at the client's next wait, and the session goes on; unset: no bound", group="limits", why="set it on a shared GPU so one tenant cannot queue unbounded work ahead of the others"),
    Setting("debug", "RGPU_DEBUG", False, _bool, "", "debug logging (the hot path is quiet otherwise)", group="user"),
    Setting("cuda_lib_trace", "RGPU_CUDA_LIB_TRACE", False, _bool, "", "server: one line on stderr for every forwarded cuBLAS, cuBLASLt and cuDNN call it runs, with its fields and status", group="user", why="names the math-library call that fails when a program works natively but not through rgpu"),
    Setting("cuda_lib_record", "RGPU_CUDA_LIB_RECORD", None, _optional(str), "gpu/check_cuda_libs.sh RECORD=1", "server: into this folder, one file per session, every forwarded cuBLAS, cuBLASLt and cuDNN call with the GEMMs' input and output bytes (a trace tests/test_lib_trace_replay.py replays against the fake libraries; slow: each GEMM waits)", group="testing", why="records a GPU host's calls and values so CI, without a GPU, checks the fake libraries against them"),
    Setting("cuda_lazy_libraries", "RGPU_CUDA_LAZY_LIBRARIES", False, _bool, "", "cuda route: cuLibraryLoadData only notes the image; it is sent (by sha256, as always) and loaded at the library's first use, so a static CUDA runtime that loads every image at startup costs no round trip for the images it never uses; an image the server refuses then fails at that first use, not at the load", group="tuning", why="on for nvcc-built (static runtime) or CuPy programs with many images, of which a run uses a few"),
    Setting("cuda_queue_bytes", "RGPU_CUDA_QUEUE_BYTES", 64 << 10, _size, "", "cuda route, client: the queued launches, copies and library calls are posted once they hold this many bytes (and at every call that waits)", group="tuning", why="the server runs nothing of a step's work before its first post: at 256 KiB a GPT 6x384 eager step was 1.124 of native, at 64 KiB 0.945 on the same H200 host (docs/perf/cuda_route.md); smaller still costs the client a post each time"),
    Setting("cuda_queue_first_bytes", "RGPU_CUDA_QUEUE_FIRST_BYTES", None, _optional(_size), "", "cuda route, client: after a call that waits, the queue is first posted once it holds this many bytes, then at twice that each post, up to RGPU_CUDA_QUEUE_BYTES; unset: RGPU_CUDA_QUEUE_BYTES (every post at that size)", group="tuning", why="after a wait the server's GPU is idle until the first post: a smaller first post starts it sooner, the later ones keep the posts few; on a slow H200 host 4K, 8K and 16K were no faster than the fixed 64 KiB (docs/perf/cuda_route.md, run24), so it is off until a fast host shows a gain"),
    Setting("cuda_wait_report", "RGPU_CUDA_WAIT_REPORT", False, _bool, "", "cuda route: at exit, say which calls waited for the server (round trips) and how often; set on the server, each cuda session says it on the server's stderr when it ends (a C program's count)", group="user", why="finds the call behind a step's extra round trips"),
)

# Each native twin's own switch, before RGPU_NATIVE (deprecated, read for one release): field -> variable.
# The fields stay, for tests and diagnostics that run one twin each way: on where RGPU_NATIVE is auto.
TWINS = {"shm_c": "RGPU_SHM_C", "server_c": "RGPU_SERVER_C", "fast_path": "RGPU_FAST_PATH"}
_warned: set[str] = set()


class _SettingsFace:
    """What every ``Settings`` can do; its fields are ``TABLE``'s (and ``TWINS``'), made below."""

    def with_(self, **changes: Any) -> "Settings":
        return replace(self, **changes)

    @property
    def token_path(self) -> Path:
        return Path(os.path.expanduser(self.token_file))

    def server_address(self) -> tuple[str, int] | None:
        """``RGPU_SERVER`` split into (host, port) (the first, of a list), or None when unset."""
        return self.server_addresses()[0] if self.server else None

    def server_addresses(self) -> list[tuple[str, int]]:
        """Every server of ``RGPU_SERVER`` (``host:port,host:port``) as (host, port), in order; [] when unset."""
        return parse_addresses(self.server, "RGPU_SERVER") if self.server else []


# One field per row of TABLE, in its order, then TWINS' (never copied by hand: a row added is a field)
Settings = make_dataclass(
    "Settings",
    [(s.field, type(s.default) if s.default is not None else Any) for s in TABLE] + [(t, bool) for t in TWINS],
    bases=(_SettingsFace,), frozen=True)
Settings.__module__, Settings.__doc__ = __name__, "Every setting's value, read by ``settings()``: one row of TABLE a field."

def parse_address(text: str, what: str = "address", default_port: int = 9713) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, str(default_port)
    host = host.strip("[]") or "127.0.0.1"
    try:
        return host, int(port)
    except ValueError:
        raise ConfigError(f"{what}={text!r}: expected host:port") from None


def parse_addresses(text: str, what: str = "address") -> list[tuple[str, int]]:
    """A comma list of ``host:port`` (one alone is a list of one); the same server twice is refused."""
    items = [part.strip() for part in text.split(",")]
    if not all(items):
        raise ConfigError(f"{what}={text!r}: expected host:port or host:port,host:port (an empty item)")
    out = [parse_address(item, what) for item in items]
    if len(set(out)) != len(out):
        raise ConfigError(f"{what}={text!r}: a server is named twice (each one's devices come once)")
    return out


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
    """The README's configuration table (what a user sets), generated from ``TABLE``."""
    rows = ["| variable | flag | default | meaning |", "|---|---|---|---|"]
    for s in (s for s in TABLE if s.group == "user"):
        flag = f"`{s.flag}`" if s.flag else ""
        rows.append(f"| `{s.env}` | {flag} | `{s.default}` | {s.doc} |")
    return "\n".join(rows)


GROUPS = {  # docs/config.md's sections, in order
    "limits": "What one peer or session may take. Raise one when a real job hits it; lower one on a server shared "
              "with less trusted clients.",
    "tuning": "How the transport and the server trade latency, memory and cores. The defaults were measured "
              "(docs/perf/); change one when a measurement of your own says so.",
    "testing": "Aids for tests and benchmarks on one machine.",
}


def _shown(s: Setting) -> str:
    d = s.default
    if isinstance(d, int) and not isinstance(d, bool) and d >= 1 << 20 and d % (1 << 20) == 0:
        return f"{d >> 30} GiB" if d % (1 << 30) == 0 else f"{d >> 20} MiB"
    return "unset" if d is None else str(d)


def docs_page() -> str:
    """docs/config.md: every setting the README's table leaves out, grouped, generated from ``TABLE``."""
    out = ["# Settings beyond the README's table", "",
           "Generated from `TABLE` in `rgpu/config.py` (`python -m rgpu.config --docs`); the README's table holds "
           "what a user sets. Every one is an environment variable, read when it is used, never at import.", ""]
    for group, intro in GROUPS.items():
        out += [f"## {group.capitalize()}", "", intro, "", "| variable | default | what it does | why change it |",
                "|---|---|---|---|"]
        out += [f"| `{s.env}` | `{_shown(s)}` | {s.doc} | {s.why} |" for s in TABLE if s.group == group]
        out.append("")
    out += ["## Deprecated", "", "Read for one release, each turning one native twin off; `RGPU_NATIVE=off` turns "
            "them all off: " + ", ".join(f"`{v}`" for v in TWINS.values()) + ".", ""]
    return "\n".join(out)


if __name__ == "__main__":  # python -m rgpu.config --readme | --docs (tools/check_house.py compares them with the tree)
    print(markdown_table() if "--readme" in sys.argv else docs_page(), end="\n" if "--readme" in sys.argv else "")
