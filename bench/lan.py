"""``rgpu bench lan``: the nanoGPT-class step over a LAN made of two network namespaces, beside loopback.

    rgpu bench lan --json [--quick] [--repeats 3]        (root and iproute2; CPU server)

The LAN: a veth pair between two namespaces, 10 Gbit/s (``tc tbf``) each way,
0.1 ms of round trip from rgpu's delay line (this kernel has no ``netem``). The
client runs in namespace a; the server (``--device cpu``) in b over the LAN, or
in a on 127.0.0.1 (the baseline); tcp both times. Each run is one
``rgpu bench train`` in its own process (its rgpu step median); runs alternate
LAN, loopback, ``repeats`` pairs.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time

from rgpu.bench import harness, netns

RATE = "10gbit"
SIM_RTT_MS = 0.1


def _serve(lan, side: str, host: str, env: dict) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "rgpu", "serve", "--host", host, "--port", "0", "--device", "cpu", "--preload", ""]
    proc = lan.popen(side, cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        m = re.search(r"listening on (\S+):(\d+)", line or "")
        if m:
            return proc, f"{m.group(1)}:{m.group(2)}"
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"rgpu serve in namespace {side} did not start")


def rows(args=None) -> list[dict]:
    why = netns.unavailable()
    if why:
        raise RuntimeError(f"rgpu bench lan: {why}")
    quick = getattr(args, "quick", False)
    repeats = harness.repeats_of(args, 3)
    token = secrets.token_hex(16)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    base_env.update(RGPU_TOKEN=token, RGPU_TRANSPORT="tcp")
    train = [sys.executable, "-m", "rgpu.bench.train", "--json", "--repeats", "3"] + (["--quick"] if quick else [])
    with netns.lan(rate=RATE) as lan:
        far, far_addr = _serve(lan, "b", lan.addr_b, base_env)
        near, near_addr = _serve(lan, "a", "127.0.0.1", base_env)
        try:
            def step(server: str, extra: dict):
                def run():
                    env = dict(base_env, RGPU_SERVER=server, **extra)
                    done = lan.run("a", train, env=env, timeout=900)
                    got = json.loads(done.stdout)
                    return next(r["value"] for r in got if r["metric"] == "training step")
                return run

            result = harness.compare(step(far_addr, {"RGPU_SIM_RTT_MS": str(SIM_RTT_MS)}), step(near_addr, {}),
                                     repeats)
        finally:
            for proc in (far, near):
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    size = "4L/128w/block 64/batch 12" if quick else "6L/384w/block 256/batch 64"
    return [harness.row("lan", "tcp", f"training step over a {RATE} LAN, {SIM_RTT_MS} ms round trip (CPU server)",
                        size, result, "the same step over loopback (CPU server)", unit="ms")]


def main(argv=None) -> int:
    return harness.main(rows, argv, __doc__, repeats=3)


if __name__ == "__main__":
    raise SystemExit(main())
