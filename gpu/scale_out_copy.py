"""A copy between two servers' devices through rgpu against native peer copy on the same two GPUs.

    python gpu/scale_out_copy.py [--dry-run] [--sizes 64,256,1024] [--rounds 4] [--repeats 5] > rows.json

On the two-GPU host: one ``rgpu serve --device cuda`` per GPU (CUDA_VISIBLE_DEVICES=0 and 1), a client
with ``RGPU_SERVER=a,b`` (rgpu:0 on GPU 0, rgpu:1 on GPU 1) timing ``x.to("rgpu:1")`` of ``x`` on rgpu:0
(the bytes go server to server) until both servers are done; against native ``x.to("cuda:1")`` in a
process that never imports rgpu. Rounds interleave (native, rgpu, native, ...), each its own process;
a row per size: rgpu's GB/s (median of the rounds' medians, spread over rounds), native's beside it,
the ratio (the issue's target: >= 0.8). Also: the copy's bytes equal the source's, and the client's
connections carried no tensor bytes (``rgpu.stats()``). ``--dry-run``: CPU servers, a CPU copy as the
baseline (checks the script on a machine without a GPU). NVLink multicast stays off in every process.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import statistics
import subprocess
import sys

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

RGPU = r"""
import json, sys, time, statistics, torch, rgpu
sizes, repeats = json.loads(sys.argv[1]), int(sys.argv[2])
out = {}
for mib in sizes:
    x = torch.randint(0, 255, (mib << 20,), dtype=torch.uint8).to("rgpu:0")
    y = x.to("rgpu:1"); torch.rgpu.synchronize()          # warm: the peer ports, the first transfer
    before = rgpu.stats()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter(); y = x.to("rgpu:1"); torch.rgpu.synchronize(); times.append(time.perf_counter() - t0)
    after = rgpu.stats()
    same = bool(torch.equal(y.cpu(), x.cpu())) if mib <= 256 else None
    out[mib] = {"s": statistics.median(times), "equal": same,
                "client_bytes": sum(after[k] - before[k] for k in ("bytes_out", "bytes_in")) / repeats}
from rgpu.device_backend import session
from rgpu.protocol.ops import Msg
info = session.current().request([Msg.UPLOAD_INFO], 0)
out["peer_sent"] = (info[0] if isinstance(info, list) else info).get("peer_sent")  # GPU to GPU, or tcp
print(json.dumps(out))
"""

NATIVE = r"""
import json, sys, time, statistics, torch
sizes, repeats, dev = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
src, dst = (("cuda:0", "cuda:1") if dev == "cuda" else ("cpu", "cpu"))
sync = (lambda: (torch.cuda.synchronize(0), torch.cuda.synchronize(1))) if dev == "cuda" else (lambda: None)
out = {}
for mib in sizes:
    x = torch.randint(0, 255, (mib << 20,), dtype=torch.uint8).to(src)
    y = x.to(dst, copy=True); sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter(); y = x.to(dst, copy=True); sync(); times.append(time.perf_counter() - t0)
    out[mib] = {"s": statistics.median(times)}
print(json.dumps(out))
"""


def serve(gpu: int, token: str, dry: bool):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    env.update(NO_MULTICAST, RGPU_TOKEN=token, RGPU_SESSION_GRACE="0")
    if not dry:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    cmd = [sys.executable, "-m", "rgpu", "serve", "--port", "0", "--preload", "", "--device",
           "cpu" if dry else "cuda", "--exit-with-parent", str(os.getpid())]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd="/tmp")
    line = proc.stdout.readline()
    m = re.search(r"listening on (\S+):(\d+)", line)
    if not m:
        proc.kill()
        raise SystemExit(f"rgpu serve did not start: {line!r}")
    return proc, f"{m.group(1)}:{m.group(2)}"


def run(code: str, args: list, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                         cwd="/tmp", timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"a round failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--sizes", default="64,256,1024", help="MiB, comma list")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    token = secrets.token_hex(16)
    servers = [serve(g, token, a.dry_run) for g in (0, 1)]
    base = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    base.update(NO_MULTICAST)
    client = dict(base, RGPU_SERVER=",".join(addr for _, addr in servers), RGPU_TOKEN=token, RGPU_TRANSPORT="tcp")
    rounds: dict = {"rgpu": [], "native": []}
    try:
        for _ in range(a.rounds):
            rounds["native"].append(run(NATIVE, [json.dumps(sizes), str(a.repeats), "cpu" if a.dry_run else "cuda"],
                                        base))
            rounds["rgpu"].append(run(RGPU, [json.dumps(sizes), str(a.repeats)], client))
    finally:
        for proc, _ in servers:
            proc.terminate()
    rows = []
    for mib in sizes:
        gbs = lambda r: (mib << 20) / r[str(mib)]["s"] / 1e9  # noqa: E731
        ours, native = [gbs(r) for r in rounds["rgpu"]], [gbs(r) for r in rounds["native"]]
        value, baseline = statistics.median(ours), statistics.median(native)
        rows.append({"bench": "scale_out", "transport": "tcp", "size": f"{mib} MiB",
                     "metric": "copy rgpu:0 -> rgpu:1, two servers (bytes server to server)", "value": value,
                     "unit": "GB/s", "baseline": baseline,
                     "baseline_name": "cpu copy (dry run)" if a.dry_run else "native peer copy x.to('cuda:1')",
                     "ratio": value / baseline, "spread": [min(ours), max(ours)]})
        equal = [r[str(mib)]["equal"] for r in rounds["rgpu"]]
        client_bytes = max(r[str(mib)]["client_bytes"] for r in rounds["rgpu"])
        rows.append({"bench": "scale_out", "transport": "tcp", "size": f"{mib} MiB",
                     "metric": "client bytes per copy (tensor bytes through the client; target 0)",
                     "value": client_bytes, "unit": "B", "baseline": mib << 20, "baseline_name": "the tensor's size",
                     "ratio": client_bytes / (mib << 20), "spread": None,
                     "equal": None if None in equal else all(equal)})
    rows.append({"bench": "scale_out", "metric": "how server 0 sent its copies (cuda_ipc: GPU to GPU on one host)",
                 "value": None, "unit": None, "peer_sent": [r.get("peer_sent") for r in rounds["rgpu"]]})
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
