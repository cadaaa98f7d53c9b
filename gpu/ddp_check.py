"""DDP through rgpu (collectives on the servers) against native DDP on the same GPUs: step times, 1 -> 2 scaling.

    python gpu/ddp_check.py [--dry-run] [--rounds 2] [--steps 20] [--warmup 5] > rows.json
    (gpu/check_scale_out.sh runs it as its ddp step, on the two-GPU host or with DRY_RUN=1)

On the two-GPU host: one ``rgpu serve --device cuda`` (both GPUs visible, as to native's ranks), rank r a
session of its own on rgpu:r through the "rgpu" backend (NCCL among the sessions' workers), against
torch's own DDP on cuda:0..1 with NCCL; each at 1 and 2 GPUs, rounds interleaved (native 1, rgpu 1, native 2, rgpu 2).
The per-rank batch is fixed (weak scaling): efficiency = step time at 1 GPU / step time at 2; the row
``scaling efficiency rgpu / native`` is the issue's target (>= 0.9). rgpu's 2-GPU losses are set beside
native's (the same seeds and data). ``--dry-run``: CPU servers, gloo natively, the small model
(what a machine without a GPU runs, to check the script). Prints bench rows (a JSON list).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
BUDGET_S = 170  # no run starts past this (check_scale_out.sh gives the step 240 s)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    env.update(NO_MULTICAST, **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``rgpu serve`` on one GPU (or the CPU), its address read from its first line."""

    def __init__(self, kind: str, token: str, work: Path):
        self.log = work / "server.log"
        devices = ["--devices", "2"] if kind == "cpu" else []  # the CPU executor's rgpu:0..1
        self.proc = subprocess.Popen([sys.executable, "-m", "rgpu", "serve", "--port", "0", "--device", kind,
                                      *devices, "--exit-with-parent", str(os.getpid())], env=_env(RGPU_TOKEN=token),
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while not (m := re.search(r"listening on (\S+):(\d+)", self.log.read_text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rgpu serve did not start:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        self.address = f"{m.group(1)}:{m.group(2)}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)


def run(route: str, world: int, args, server: Server, token: str, work: Path) -> dict:
    """One DDP run of ``world`` ranks; rank 0's results (step times, losses)."""
    kind = "cpu" if args.dry_run else "cuda"
    port, out = _free_port(), work / f"{route}{world}-{time.monotonic_ns()}.json"
    procs = []
    for r in range(world):
        extra = dict(RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if route == "rgpu":
            extra.update(RGPU_SERVER=server.address, RGPU_TOKEN=token)
        log = open(work / f"{route}{world}-rank{r}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(HERE / "ddp_rank.py"), route, kind, args.size,
                                       str(args.steps), str(args.warmup), str(out)],
                                      env=_env(**extra), stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes) or not out.exists():
        tail = (work / f"{route}{world}-rank0.log").read_text()[-3000:]
        raise RuntimeError(f"{route} with {world} ranks failed (exit {codes}):\n{tail}")
    return json.loads(out.read_text())


def rows(results: dict, args) -> list[dict]:
    """Bench rows: each configuration's median step (spread over rounds), efficiencies, rgpu/native ratios."""
    med = {k: [statistics.median(r["step_s"]) for r in v] for k, v in results.items()}
    step = {k: statistics.median(v) for k, v in med.items()}
    out = []
    for world in (1, 2):
        for route in ("native", "rgpu"):
            k = (route, world)
            if k in step:
                out.append({"metric": f"DDP step, {args.size}, {world} GPU(s), {route}", "value": step[k] * 1e3,
                            "unit": "ms", "spread": [min(med[k]) * 1e3, max(med[k]) * 1e3], "rounds": len(med[k]),
                            "ratio": step[k] / step[("native", world)] if route == "rgpu" else None})
    eff = {route: step[(route, 1)] / step[(route, 2)] for route in ("native", "rgpu")
           if (route, 1) in step and (route, 2) in step}
    for route, e in eff.items():
        out.append({"metric": f"scaling efficiency 1 -> 2 GPUs, {route}", "value": e, "unit": ""})
    if len(eff) == 2:
        out.append({"metric": "scaling efficiency rgpu / native (target >= 0.9)", "value": eff["rgpu"] / eff["native"],
                    "unit": "", "ratio": eff["rgpu"] / eff["native"]})
    if ("rgpu", 2) in results and ("native", 2) in results:
        a, b = results[("rgpu", 2)][0]["losses"], results[("native", 2)][0]["losses"]
        out.append({"metric": "losses, rgpu vs native DDP on 2 GPUs: max abs diff", "value": max(abs(x - y)
                    for x, y in zip(a, b)), "unit": "", "rgpu": a, "native": b})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU servers, gloo, the small model")
    ap.add_argument("--rounds", type=int, help="default 2 (dry run: 1)")
    ap.add_argument("--steps", type=int, help="timed steps a run, default 20 (dry run: 3)")
    ap.add_argument("--warmup", type=int, help="steps before them, default 5 (dry run: 1)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds after which no run starts")
    args = ap.parse_args()
    for name, full, dry in (("rounds", 2, 1), ("steps", 20, 3), ("warmup", 5, 1)):
        if getattr(args, name) is None:
            setattr(args, name, dry if args.dry_run else full)
    args.size = "small" if args.dry_run else "nanogpt"
    t0, token = time.monotonic(), secrets.token_hex(16)
    work = Path(tempfile.mkdtemp(prefix="rgpu-ddp-"))
    server = Server("cpu" if args.dry_run else "cuda", token, work)
    results: dict = {}
    try:
        for _ in range(args.rounds):
            for world in (1, 2):
                for route in ("native", "rgpu"):
                    if time.monotonic() - t0 > args.budget:
                        print(f"budget: {route} at {world} GPU(s) skipped", file=sys.stderr)
                        continue
                    results.setdefault((route, world), []).append(run(route, world, args, server, token, work))
    finally:
        server.stop()
    print(json.dumps(rows(results, args), indent=1))
    print(f"logs: {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
