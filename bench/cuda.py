"""``rgpu bench cuda``: one CUDA C program (demo_vecadd.c) through rgpu's libcuda.so.1, beside the same binary native.

    rgpu bench cuda [--json] [--repeats N] [--server HOST:PORT]      python -m rgpu.bench.cuda --json
    rgpu bench cuda --torch [--quick]        stock CUDA PyTorch's training steps instead (cuda_torch.py)
    rgpu bench cuda --torch --queue-bytes 256K,64K,16K   the eager steps at each client queue size, beside native

Rows (foundation schema): a round-trip driver call (cuMemGetInfo), 2000
kernel launches plus the final cuCtxSynchronize, a 64 MiB cuMemcpyHtoD from
pageable memory.  Baseline: the same binary on the real driver in the same
run, interleaved, median of the runs; none where this host has no GPU (the
rgpu figures then come from the fake driver and measure the route alone).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile

LAUNCHES = 2000
METRICS = (("roundtrip_us", "round-trip call (cuMemGetInfo)", "us"),
           ("launches_ms", f"{LAUNCHES} launches + synchronise", "ms"),
           ("htod_64mib_ms", "64 MiB host-to-device copy (pageable)", "ms"))


def _figures(exe: str, env: dict) -> dict:
    done = subprocess.run([exe, "bench", str(LAUNCHES)], capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{exe} bench failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class _Server:
    """A private ``rgpu serve`` for the runs (a local server per run would be started each time)."""

    def __init__(self):
        self.token = secrets.token_urlsafe(16)
        env = dict(os.environ, RGPU_TOKEN=self.token)
        env.pop("RGPU_SERVER", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "rgpu", "serve", "--port", "0", "--preload", ""],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, text=True)
        for line in self.proc.stdout:
            m = re.search(r"listening on (\S+):(\d+)", line)
            if m:
                self.address = f"{m.group(1)}:{m.group(2)}"
                return
        raise RuntimeError("rgpu serve did not start")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


def _runtime_rows(args, env: dict, native: bool) -> list[dict]:
    """The translated runtime's rows (``cuda_runtime.py``), or none where it cannot run here."""
    from . import cuda_runtime
    try:
        return cuda_runtime.rows(args, env, native)
    except Exception as exc:   # no runtime built, no nvcc: the driver's rows still stand
        print(f"rgpu bench cuda: the runtime's rows skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
        return []


def _torch_rows(args) -> list[dict]:
    from . import cuda_torch
    server = None if getattr(args, "server", None) else _Server()
    try:
        env = {"RGPU_SERVER": getattr(args, "server", None) or server.address,
               **({"RGPU_TOKEN": server.token} if server else {})}
        if getattr(args, "queue_bytes", None):
            return cuda_torch.queue_rows(args, env)
        return cuda_torch.rows(args, env)
    finally:
        if server:
            server.stop()


def rows(args=None) -> list[dict]:
    if getattr(args, "torch", False):
        return _torch_rows(args)
    from rgpu.cuda_intercept.build import build
    from rgpu.cuda_intercept.cli import environment
    from rgpu.cuda_intercept.demo import build_program
    from rgpu.server.cuda import real_api

    repeats = 3 if getattr(args, "quick", False) else getattr(args, "repeats", 5) or 5
    lib = build()
    workdir = tempfile.mkdtemp(prefix="rgpu-bench-cuda-")
    exe = str(build_program(workdir, lib.parent))
    native_env = dict(os.environ)
    native = bool(real_api.candidates())
    server = None if getattr(args, "server", None) else _Server()
    rgpu_env = environment(str(lib.parent))
    rgpu_env.update(RGPU_SERVER=getattr(args, "server", None) or server.address,
                    **({"RGPU_TOKEN": server.token} if server else {}))
    got = {"rgpu": [], "native": []}
    try:
        for _ in range(repeats):                       # interleaved: drift hits both alike
            got["rgpu"].append(_figures(exe, rgpu_env))
            if native:
                got["native"].append(_figures(exe, native_env))
        runtime_rows = _runtime_rows(args, rgpu_env, native)
    finally:
        if server:
            server.stop()
    out = []
    for key, metric, unit in METRICS:
        vals = [g[key] for g in got["rgpu"]]
        base = statistics.median(g[key] for g in got["native"]) if native else None
        value = statistics.median(vals)
        out.append({"bench": "cuda", "transport": os.environ.get("RGPU_TRANSPORT", "auto"), "metric": metric,
                    "unit": unit, "size": (64 << 20) if "htod" in key else LAUNCHES if "launch" in key else 0,
                    "value": value, "baseline_name": "native driver, same binary" if native else "none (no GPU here)",
                    "baseline": base, "ratio": value / base if base else None, "spread": [min(vals), max(vals)]})
    return out + runtime_rows


def main(argv=None) -> int:
    from rgpu.bench import harness

    return harness.main(rows, argv, __doc__, flags={"--server": {"help": "host:port of a running server"},
                       "--torch": {"action": "store_true", "help": "stock CUDA PyTorch's steps (cuda_torch.py)"},
                       "--queue-bytes": {"help": "with --torch: the eager steps at each RGPU_CUDA_QUEUE_BYTES of "
                                                 "this comma list (e.g. 256K,64K,16K; FIRST:LIMIT sets "
                                                 "RGPU_CUDA_QUEUE_FIRST_BYTES too), each run beside native"}})


if __name__ == "__main__":
    raise SystemExit(main())
