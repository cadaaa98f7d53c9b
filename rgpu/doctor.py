"""``rgpu doctor``: check, in order, everything between this process and the server's GPU; say the fix for each failure.

Each check returns a ``Check`` (ok, warn, fail or skip, what it found, the fix).
A check that needs a connection is skipped when none could be made. The exit
status is 0 only when no check failed; ``--json`` prints the same as one object.
"""
from __future__ import annotations

import importlib.util
import ipaddress
import json
import logging
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from . import config
from .errors import AuthenticationError, ConfigError, RemoteError, RgpuError, Timeout, VersionMismatch

MiB = 1 << 20


@dataclass
class Check:
    name: str
    status: str            # ok | warn | fail | skip
    detail: str
    fix: str = ""
    data: dict = field(default_factory=dict)


class Context:
    """What the checks share: the settings, the address, the echo connection once made."""

    def __init__(self, settings, first: int | None = 0):
        self.s = settings
        self.first = first   # its first device's rgpu index in the session (None: unknown, an earlier server failed)
        self.address = settings.server_address()
        self.conn = None
        self.transport_why: str | None = None
        self.local = False   # the checks run against a local server started for them


# ---- the checks, in order -----------------------------------------------------------------


def check_server(ctx: Context) -> Check:
    from rgpu import local_server
    from rgpu.transport import tcp

    if ctx.address is None:
        local = local_server.shared(ctx.s)
        ctx.s = ctx.s.with_(server=local.address, token=local.token)
        ctx.address = (local.host, local.port)
        ctx.local = True
        return Check("server", "ok", f"RGPU_SERVER is not set: checked a local server on {local.address} "
                     "(this machine's CPU; point RGPU_SERVER at a GPU host or use `rgpu run --ssh`)",
                     data={"address": local.address, "local": True})
    host, port = ctx.address
    t0 = time.perf_counter()
    try:
        tcp.connect(host, port, ctx.s.connect_timeout).close()
    except RgpuError as exc:
        return Check("server", "fail", str(exc),
                     "start `rgpu serve` on the GPU host; it binds 127.0.0.1:9713, so from elsewhere use "
                     "`rgpu run --ssh USER@HOST -- rgpu doctor`, or fix RGPU_SERVER")
    ms = (time.perf_counter() - t0) * 1e3
    return Check("server", "ok", f"{host}:{port} accepts connections ({ms:.1f} ms to connect)",
                 data={"address": f"{host}:{port}", "connect_ms": ms})


def check_auth(ctx: Context) -> Check:
    from rgpu.transport.client import connect

    heard = _Heard()
    logger = logging.getLogger("rgpu.transport")   # the negotiation logs why auto chose what it chose
    level = logger.level
    logger.addHandler(heard)
    logger.setLevel(logging.INFO)
    try:
        ctx.conn = connect("echo", settings=ctx.s)
        ctx.transport_why = heard.why
    except AuthenticationError as exc:
        if "TLS" in str(exc):
            fix = ("pin the fingerprint the server printed at start (RGPU_TLS_FINGERPRINT) or trust its CA "
                   "(RGPU_TLS_CA); if its certificate changed on purpose, re-pin it")
        else:
            fix = ("use the server's token: copy its token file (`rgpu serve` prints where it is) to "
                   f"{ctx.s.token_path} or set RGPU_TOKEN; `rgpu run --ssh` reads it for you")
        return Check("auth", "fail", str(exc), fix)
    except VersionMismatch as exc:
        return Check("auth", "fail", f"protocol versions differ: {exc}", "install the same rgpu version on both ends")
    except ConfigError as exc:
        return Check("auth", "fail", str(exc), "make the client's RGPU_TLS settings match the server's --tls")
    except Timeout as exc:
        return Check("auth", "fail", f"{type(exc).__name__}: {exc}",
                     f"something at {ctx.address[0]}:{ctx.address[1]} accepts connections but does not speak rgpu: "
                     "point RGPU_SERVER (or --server) at the port `rgpu serve` printed")
    except RgpuError as exc:
        return Check("auth", "fail", f"{type(exc).__name__}: {exc}", "see the server's log for why it refused")
    finally:
        logger.removeHandler(heard)
        logger.setLevel(level)
    return Check("auth", "ok", "both ends proved they hold the same token (mutual HMAC); the token never crossed; "
                 f"it is {_token_source(ctx)}", data={"token": _token_source(ctx)})


def _token_source(ctx: Context) -> str:
    """Where the token came from, in words: never the token itself."""
    if ctx.local:
        return "the local server's own (made for this process)"
    if ctx.s.token is not None:
        return "set, from RGPU_TOKEN (not shown)"
    return f"set, from the token file {ctx.s.token_path} (not shown)"


class _Heard(logging.Handler):
    """Keeps the reason in a ``chose NAME (why)`` log line."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.why = None

    def emit(self, record: logging.LogRecord) -> None:
        m = re.search(r"chose \S+ \((.*)\)$", record.getMessage())
        if m:
            self.why = m.group(1)


def _torch_version() -> str | None:
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    if importlib.util.find_spec("torch") is None:
        return None
    import torch
    return torch.__version__


def check_versions(ctx: Context) -> Check:
    from rgpu.transport.handshake import software_versions
    from rgpu.transport.wire import PROTOCOL_VERSION

    mine = software_versions()
    mine["torch"] = _torch_version()
    theirs = ctx.conn.welcome.get("server_versions", {})
    data = {"protocol": PROTOCOL_VERSION, "client": mine, "server": theirs}
    detail = (f"protocol {PROTOCOL_VERSION}; rgpu {mine['rgpu']} here, {theirs.get('rgpu', '?')} there; "
              f"torch {mine['torch'] or 'absent'} here, {theirs.get('torch') or 'not loaded'} there; "
              f"python {mine['python']} here, {theirs.get('python', '?')} there")
    if theirs.get("rgpu") != mine["rgpu"]:
        return Check("versions", "fail", detail,
                     f"install rgpu {mine['rgpu']} on the server (or the server's version here)", data)
    a, b = mine["torch"], theirs.get("torch")
    if a and b and a.split("+")[0].split(".")[:2] != b.split("+")[0].split(".")[:2]:
        return Check("versions", "warn", detail, f"the device route expects one torch: install torch {b.split('+')[0]} "
                     "here (or match the server's to this one)", data)
    if not a:
        return Check("versions", "warn", detail, "the device route needs torch here: pip install torch", data)
    return Check("versions", "ok", detail, data=data)


def check_transport(ctx: Context) -> Check:
    conn, s = ctx.conn, ctx.s
    chosen = conn.transport_name
    offered = conn.welcome.get("transports") or []
    why = ctx.transport_why
    if not why:
        why = ("the only one this client offers" if chosen == "tcp" and s.transport in ("auto", "tcp")
               else f"RGPU_TRANSPORT={s.transport}")
    detail = f"{chosen}: {why}; RGPU_TRANSPORT={s.transport}; the server offers {', '.join(offered) or 'tcp'}"
    data = {"chosen": chosen, "requested": s.transport, "offered": offered, "why": why}
    if chosen == "shm":   # its hot path in C, or why it runs in Python (slower round trips, same results)
        from rgpu.transport import shm_fast

        c_path = conn.transport.lone_call is not None
        data["shm_c"] = c_path
        detail += ("; shm's C path built" if c_path else
                   f"; shm runs its Python path ({'RGPU_NATIVE=off' if not s.shm_c else shm_fast.why_not()})")
    if s.transport not in ("auto", chosen):
        return Check("transport", "warn", detail, f"RGPU_TRANSPORT={s.transport} was asked for but {chosen} is in "
                     "use: see the server's log for why it was not available", data)
    return Check("transport", "ok", detail, data=data)


def check_speed(ctx: Context) -> Check:
    conn = ctx.conn
    for _ in range(3):
        conn.call({"op": "sizes"})
    rtts = []
    for _ in range(30):
        t0 = time.perf_counter()
        conn.call({"op": "sizes"})
        rtts.append(time.perf_counter() - t0)
    rtt_us = statistics.median(rtts) * 1e6
    size = 1 * MiB  # a first probe sizes the real one to about a quarter second, 1-64 MiB
    first = _upload_seconds(conn, size)
    size = int(min(64, max(1, size / max(first, 1e-6) * 0.25 // MiB))) * MiB
    up = statistics.median(_upload_seconds(conn, size) for _ in range(3))
    both = statistics.median(_echo_seconds(conn, size) for _ in range(3))
    data = {"rtt_us": rtt_us, "size": size, "upload_GBps": size / up / 1e9, "echo_GBps": 2 * size / both / 1e9}
    detail = (f"round trip {rtt_us:.0f} µs (median of 30); the transport raw, {size // MiB} MiB: upload "
              f"{data['upload_GBps']:.2f} GB/s, echo {data['echo_GBps']:.2f} GB/s counting both ways")
    tensors = _tensor_speed(ctx)
    data.update(tensors)
    if "to_rgpu_GBps" in tensors:
        detail += (f"; a {TENSOR_BYTES // MiB} MiB tensor as your code moves it: .to(\"rgpu\") "
                   f"{tensors['to_rgpu_GBps']:.2f} GB/s, .cpu() {tensors['cpu_GBps']:.2f} GB/s")
    else:
        detail += f"; a tensor's .to(\"rgpu\") and .cpu() not measured: {tensors['tensor_error']}"
    return Check("speed", "ok", detail, data=data)


TENSOR_BYTES = 64 * MiB
# In a child: the device session is process-wide, and this measures what a user's own process gets.
_TENSOR_SCRIPT = r"""
import json, statistics, time, torch, rgpu
x = torch.ones(%d // 4)
y = x.to("rgpu"); y.cpu()                                          # the first use: connect, warm up
up, down = [], []
for _ in range(3):
    t0 = time.perf_counter(); y = x.to("rgpu"); torch.rgpu.synchronize(); up.append(time.perf_counter() - t0)
    t0 = time.perf_counter(); z = y.cpu(); down.append(time.perf_counter() - t0)
print(json.dumps({"to_rgpu_GBps": x.nbytes / statistics.median(up) / 1e9,
                  "cpu_GBps": x.nbytes / statistics.median(down) / 1e9}))
""" % TENSOR_BYTES


def _tensor_speed(ctx: Context) -> dict:
    """What ``x.to("rgpu")`` and ``x.cpu()`` of a 64 MiB tensor get, measured in a child process; or why not."""
    import os
    import subprocess

    if importlib.util.find_spec("torch") is None:
        return {"tensor_error": "torch is not installed here"}
    from rgpu.transport.client import resolve

    host, port, token = resolve(ctx.s)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_") or k.startswith("RGPU_TLS")}
    env.update(RGPU_SERVER=f"{host}:{port}", RGPU_TOKEN=token.decode(), RGPU_TRANSPORT=ctx.s.transport)
    try:   # (its stderr is the user's: a first use's build line shows there)
        done = subprocess.run([sys.executable, "-c", _TENSOR_SCRIPT], env=env, stdout=subprocess.PIPE, text=True,
                              timeout=900, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"tensor_error": "the measurement took longer than 900 s"}
    if done.returncode != 0:
        return {"tensor_error": f"the device route failed (exit {done.returncode}; its error is above)"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _upload_seconds(conn, size: int) -> float:
    buf = np.ones(size, np.uint8)
    t0 = time.perf_counter()
    reply = conn.call({"op": "checksum", "stride": 1 << 20}, [buf])
    if reply.meta["sums"] != [len(range(0, size, 1 << 20))]:
        raise RemoteError("the checksum of what arrived differs from what was sent", op="doctor.upload")
    return time.perf_counter() - t0


def _echo_seconds(conn, size: int) -> float:
    buf, back = np.ones(size, np.uint8), np.empty(size, np.uint8)
    t0 = time.perf_counter()
    conn.call({"op": "echo"}, [buf], reply_into=[memoryview(back)]).release()
    return time.perf_counter() - t0


def check_devices(ctx: Context) -> Check:
    from rgpu.transport.client import connect

    try:
        conn = connect("ops", settings=ctx.s)
    except RgpuError as exc:
        if "unknown route" in str(exc):
            return Check("devices", "skip", "the server has no ops route (an older rgpu): no device list")
        return Check("devices", "fail", f"the ops route did not start: {exc}",
                     "see the server's log; on a GPU host check `nvidia-smi` and the CUDA driver")
    try:
        info = conn.welcome.get("info") or {}
    finally:
        conn.close()
    devices = info.get("devices")
    if devices is None and info.get("names"):  # the ops route's welcome: device kind, names, memory where given
        memory = info.get("total_memory") or info.get("memory") or []
        devices = [{"name": n, "total_memory": memory[i] if i < len(memory) else None}
                   for i, n in enumerate(info["names"])]
    if not devices:
        return Check("devices", "fail", "the ops route answers but lists no devices",
                     "see the server's log; on a GPU host check `nvidia-smi`", data={"welcome": info})
    kind = info.get("device", "?")
    detail = f"{kind}: " + "; ".join(_describe(i, d, ctx.first) for i, d in enumerate(devices))
    data = {"device": kind, "devices": devices, "op_path": info.get("op_path")}
    if info.get("op_path"):   # the server's op path: C++, or Python and why (slower per op, same results)
        detail += f"; ops run through {info['op_path']}"
    if info.get("op_path_failed"):
        return Check("devices", "warn", detail, "the server host needs a C++ compiler (g++) for its op path: "
                     "install one and restart `rgpu serve` (ops still run, through Python, more slowly)", data)
    return Check("devices", "ok", detail, data=data)


def _describe(i: int, d, first: int | None = 0) -> str:
    def label(j: int) -> str:   # its index in the session; unknown when an earlier server of the list failed
        return f"rgpu:{first + j}" if first is not None else f"its device {j}"

    if not isinstance(d, dict):
        return f"{label(i)} {d}"
    memory = d.get("total_memory") or d.get("memory")
    mem = f", {memory / (1 << 30):.1f} GiB" if isinstance(memory, (int, float)) else ", memory not reported"
    return f"{label(d.get('index', i))} {d.get('name', '?')}{mem}"


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_tls(ctx: Context) -> Check:
    transport = ctx.conn.transport
    if transport.name == "shm":   # a report naming what it found, not a branch of behaviour
        during = "; the handshake before it ran over TLS" if ctx.s.tls or ctx.s.tls_fingerprint or ctx.s.tls_ca else ""
        return Check("tls", "ok", f"not needed: shm moves the bytes through memory on this host{during}",
                     data={"tls": False, "transport": "shm"})
    if transport.tls:
        sock = transport.sock
        from rgpu.transport.tls import fingerprint
        fp = fingerprint(sock.getpeercert(binary_form=True))
        how = "pinned" if ctx.s.tls_fingerprint else f"trusted through {ctx.s.tls_ca or 'the system CAs'}"
        return Check("tls", "ok", f"{sock.version()} {sock.cipher()[0]}; certificate {how}: {fp}",
                     data={"version": sock.version(), "cipher": sock.cipher()[0], "fingerprint": fp})
    host = ctx.address[0]
    if _loopback(host):
        return Check("tls", "ok", f"off: {host} is loopback (this machine, or an ssh tunnel that encrypts)",
                     data={"tls": False})
    return Check("tls", "warn", f"off over the network to {host}: the token is never sent, but tensors travel "
                 "in the clear and an attacker on the path could take over a session",
                 "`rgpu serve --tls` there and pin RGPU_TLS_FINGERPRINT here, or use `rgpu run --ssh`",
                 data={"tls": False})


CHECKS = (  # name, what it needs, the check
    ("server", None, check_server),
    ("auth", None, check_auth),
    ("versions", "conn", check_versions),
    ("transport", "conn", check_transport),
    ("speed", "conn", check_speed),
    ("devices", "conn", check_devices),
    ("tls", "conn", check_tls),
)


def run_checks(settings, on_result=None, first: int | None = 0) -> list[Check]:
    """Every check in order; ``on_result(check)`` as each one ends (the text report prints as it goes).

    ``first``: the rgpu index of the server's first device in the session (the devices check names them so).
    """
    ctx = Context(settings, first)
    results: list[Check] = []

    def add(c: Check) -> None:
        results.append(c)
        if on_result is not None:
            on_result(c)

    try:
        for name, needs, check in CHECKS:
            if results and results[0].status == "fail":
                add(Check(name, "skip", "no server answers"))
                continue
            if needs == "conn" and ctx.conn is None:
                add(Check(name, "skip", "needs an authenticated connection"))
                continue
            try:
                add(check(ctx))
            except RgpuError as exc:
                add(Check(name, "fail", f"{type(exc).__name__}: {exc}", "see the server's log"))
    finally:
        if ctx.conn is not None:
            ctx.conn.close()
    return results


def _print_check(c: Check) -> None:
    print(f"  {c.status.upper() if c.status in ('fail', 'warn') else c.status:5} {c.name:10} {c.detail}", flush=True)
    if c.fix:
        print(f"  {'':5} {'':10} fix: {c.fix}", flush=True)


def main(args) -> int:
    s = config.settings()
    if args.server:
        s = s.with_(server=args.server)
    if len(s.server_addresses()) > 1:   # RGPU_SERVER=a,b: each server in turn, each line naming it
        from . import doctor_servers
        return doctor_servers.main(args, s)
    results = run_checks(s, None if args.json else _print_check)   # (the text report: each line as its check ends)
    ok = not any(c.status == "fail" for c in results)
    from rgpu.cuda_intercept import libraries   # the CUDA route: what `rgpu intercept run` would load, from where
    cuda = libraries.report()
    if args.json:
        print(json.dumps({"ok": ok, "checks": [asdict(c) for c in results], "cuda_libraries": cuda}, indent=1, default=str))
    else:
        print("\n".join(f"  {line}" for line in ["", "CUDA route:", *libraries.describe(cuda)]))
        print("rgpu doctor: all checks pass" if ok else "rgpu doctor: some checks failed", file=sys.stderr)
    return 0 if ok else 1
