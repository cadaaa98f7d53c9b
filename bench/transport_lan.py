"""rgpu's tcp (and ucx) across a veth LAN between two network namespaces, beside a raw socket there.

    rgpu bench transport --netns [--rate 10gbit] [--transport tcp,ucx] [--json]        (root)
    python -m rgpu.bench.transport_lan [--rate 10gbit] [--json] [--quick] [--repeats N] [--sizes 1M,64M]
    RGPU_TCP_STREAMS=4 rgpu bench transport --netns --rate 25gbit    (both ends on 4 tcp streams; rows say tcp_streams)

The server side (``rgpu serve`` and bench/transport.py's raw-socket server) runs in
namespace b, the measuring client in namespace a (``ip netns exec``), joined by a
veth pair, rate limited with ``tc ... tbf`` when ``--rate`` is given. The figures
and their pairing are bench/transport.py's (upload and download bandwidth, 64 B
round trip; rgpu and the raw socket interleaved, medians, per-pair ratios).

shm never applies here: the namespaces share a host but not a network namespace,
so the server's Unix socket is out of reach and the same-host proof fails (tested
in tests/test_netns.py). UCX is kept off shared memory (``UCX_TLS=^shm,cma``):
the LAN stands for two hosts.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from . import harness, netns

SIZES = (1 << 20, 64 << 20)
TOKEN = "bench-lan"


def client(address: str, raw: str, transports: list[str], sizes: list[int], repeats: int, quick: bool) -> list[dict]:
    """Runs in namespace a: bench/transport.py's rows for each transport, the raw socket as baseline."""
    from . import transport as tb

    host, port = raw.rsplit(":", 1)
    out = []
    for t in transports:
        rgpu, base = tb.RgpuEcho(t, address, TOKEN), tb.RawSocket(host, int(port))
        try:
            pairs = {"bandwidth": (rgpu, base), "download": (rgpu, base), "rtt": (rgpu, base)}
            inner = getattr(rgpu.conn.transport, "_inner", rgpu.conn.transport)   # (a resumable session's tcp end)
            streams = getattr(inner, "stream_count", 1)                          # RGPU_TCP_STREAMS, as it came out
            out += [{**r, "tcp_streams": streams} if t == "tcp" else r
                    for r in tb.transport_rows(t, pairs, sizes, repeats, tb.RUN_SECONDS / (3 if quick else 1))]
        finally:
            rgpu.close()
            base.close()
    return out


def _start(lan, argv: list[str], env: dict, expect: str) -> tuple[subprocess.Popen, str]:
    proc = lan.popen("b", argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                     text=True, env=env)
    line = proc.stdout.readline()
    if expect not in line:
        proc.kill()
        raise RuntimeError(f"{argv[2:5]} in namespace b did not start: {line!r}")
    return proc, line


def rows(args=None) -> list[dict]:
    why = netns.unavailable()
    if why:
        from rgpu.errors import ConfigError
        raise ConfigError(f"rgpu bench transport --netns: {why}")
    from rgpu.transport import negotiate

    quick = getattr(args, "quick", False)
    repeats = harness.repeats_of(args, 3 if quick else 5)
    sizes = harness.parse_sizes(getattr(args, "sizes", None), SIZES[1:] if quick else SIZES)
    rate = getattr(args, "rate", None)
    wanted = [t for t in (getattr(args, "transport", None) or "tcp,ucx").split(",") if t in ("tcp", "ucx")]
    transports = [t for t in wanted if negotiate.unavailable(t) is None] or ["tcp"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_") or k == "RGPU_TCP_STREAMS"}   # (both ends)
    env.update(RGPU_TOKEN=TOKEN, RGPU_TOKEN_FILE="/nonexistent/rgpu-bench-lan-token")
    env.setdefault("UCX_TLS", "^shm,cma")
    procs = []
    with netns.lan(rate) as lan:
        try:
            server, line = _start(lan, [sys.executable, "-m", "rgpu", "serve", "--host", lan.addr_b, "--port", "0",
                                        "--preload", ""], env, "listening on")
            procs.append(server)
            address = line.split("listening on ")[1].split(";")[0].strip()
            raw, line = _start(lan, [sys.executable, "-c", "import sys; from rgpu.bench.transport import raw_server; "
                                     "raw_server(sys.argv[1])", lan.addr_b], env, "raw server on")
            procs.append(raw)
            done = lan.run("a", [sys.executable, "-m", "rgpu.bench.transport_lan", "--client", address,
                                 "--raw", line.split()[-1], "--transport", ",".join(transports),
                                 "--repeats", str(repeats), "--sizes", ",".join(map(str, sizes)),
                                 *(["--quick"] if quick else [])], env=env, timeout=1200)
            if done.returncode != 0:
                raise RuntimeError(f"the client in namespace a failed:\n{done.stderr[-3000:]}")
            out = json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            for p in procs:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    for r in out:
        r["baseline_name"] = "raw socket, same namespaces"
        r["lan"] = f"netns veth{f', tbf {rate}' if rate else ''}"
    return out


FLAGS = {
    "--sizes": {"help": "comma list of sizes, e.g. 1M,64M"},
    "--rate": {"help": "tbf rate on both veth ends, e.g. 10gbit"},
    "--transport": {"help": "tcp,ucx (default: both where available)"},
    "--client": {"help": argparse.SUPPRESS},  # the measuring client, in namespace a
    "--raw": {"help": argparse.SUPPRESS},
}


def main(argv=None) -> int:
    args = harness.parser(__doc__, repeats=None, flags=FLAGS).parse_args(argv)
    if args.client:  # one line of JSON, read back by rows() in the parent
        print(json.dumps(client(args.client, args.raw, args.transport.split(","),
                                harness.parse_sizes(args.sizes, SIZES), args.repeats, args.quick)))
        return 0
    return harness.show(rows(args), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
