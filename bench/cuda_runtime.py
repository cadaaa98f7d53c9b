"""``rgpu bench cuda``'s runtime rows: programs on rgpu's libcudart.so.13 beside the same programs native.

    rgpu bench cuda [--json] [--repeats N]        (the rows below are added where the runtime builds)

Rows:
- hot calls answered in C (``cuda_hot_calls.cu``: ``cudaGetDevice``, ``cudaGetLastError``,
  ``cudaStreamIsCapturing``; ns per call) and a launch's enqueue;
- stock CUDA PyTorch's own kernels (``cuda_torch_loop.py``: 1,000 small adds ending in one
  ``.cpu()``), its round trips per loop and the bytes sent at first use (the fatbins) — only where
  this Python's torch has CUDA (a GPU host).
Baseline: the same binary or script natively in the same run, interleaved, median of the runs; none
where this host has no GPU (rgpu's figures then come from the fake driver and measure the route alone).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
HOT_CALLS = 200_000
HOT_METRICS = (("cudaGetDevice_ns", "cudaGetDevice (answered in C)", "ns"),
               ("cudaGetLastError_ns", "cudaGetLastError (answered in C)", "ns"),
               ("cudaStreamIsCapturing_ns", "cudaStreamIsCapturing (answered in C)", "ns"),
               ("launch_enqueue_ns", "<<<>>> launch enqueue (queued in C)", "ns"))


def build_hot_calls(folder: str) -> str | None:
    """``cuda_hot_calls`` built with nvcc against the shared runtime, or None without nvcc."""
    nvcc = shutil.which("nvcc") or (shutil.which("nvcc", path="/usr/local/cuda/bin"))
    if not nvcc:
        return None
    exe = os.path.join(folder, "cuda_hot_calls")
    # PTX for sm_90 (the fake driver reads layouts from PTX) and the host's own cubin where nvcc knows it
    cmd = [nvcc, "-O2", "-cudart", "shared", "-gencode", "arch=compute_90,code=compute_90",
           "-no-compress", str(HERE / "cuda_hot_calls.cu"), "-o", exe]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:     # an nvcc without -no-compress: plain build
        cmd = [c for c in cmd if c != "-no-compress"]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nvcc failed: {done.stderr.strip()[-1500:]}")
    return exe


def _run(cmd: list[str], env: dict) -> dict:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[-3:])} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _through_rgpu(cmd: list[str]) -> list[str]:
    return [sys.executable, "-m", "rgpu", "intercept", "run", "--", *cmd]


def _torch_has_cuda() -> bool:
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def _row(metric, unit, vals, base_vals, baseline_name, size=0) -> dict:
    """A row; ``baseline_name`` None: a count with no native figure (not "no GPU here", which says a GPU was missing)."""
    value = statistics.median(vals)
    base = statistics.median(base_vals) if base_vals else None
    name = baseline_name if base_vals else ("none (no GPU here)" if baseline_name else "none (rgpu's own count)")
    return {"bench": "cuda", "transport": os.environ.get("RGPU_TRANSPORT", "auto"), "metric": metric,
            "unit": unit, "size": size, "value": value, "baseline_name": name, "baseline": base,
            "ratio": value / base if base else None,
            "spread": [min(vals), max(vals)]}


def rows(args, env: dict, native: bool) -> list[dict]:
    """The runtime's rows; ``env`` reaches the server (RGPU_SERVER, RGPU_TOKEN), ``native``: a GPU here."""
    repeats = 3 if getattr(args, "quick", False) else getattr(args, "repeats", 5) or 5
    out: list[dict] = []
    folder = tempfile.mkdtemp(prefix="rgpu-bench-cudart-")
    exe = build_hot_calls(folder)
    if exe:
        got: dict = {"rgpu": [], "native": []}
        for _ in range(repeats):
            got["rgpu"].append(_run(_through_rgpu([exe, str(HOT_CALLS)]), env))
            if native:
                got["native"].append(_run([exe, str(HOT_CALLS)], dict(os.environ)))
        for key, metric, unit in HOT_METRICS:
            out.append(_row(metric, unit, [g[key] for g in got["rgpu"]], [g[key] for g in got["native"]],
                            "stock libcudart.so.13, same binary", HOT_CALLS))
    if native and _torch_has_cuda():
        script = [sys.executable, "-m", "rgpu.bench.cuda_torch_loop", "--ops", "1000"]
        got = {"rgpu": [], "native": []}
        for _ in range(repeats):
            got["rgpu"].append(_run(_through_rgpu(script), env))
            got["native"].append(_run(script, dict(os.environ)))
        base = "stock CUDA PyTorch, same script"
        out.append(_row("torch: 1000 small adds + .cpu()", "ms", [g["loop_ms"] for g in got["rgpu"]],
                        [g["loop_ms"] for g in got["native"]], base, 1000))
        rts = [g["round_trips_per_loop"] for g in got["rgpu"] if g["round_trips_per_loop"] is not None]
        if rts:
            out.append(_row("torch: round trips per loop", "count", rts, [], None))
        images = [g["images_at_first_use"] for g in got["rgpu"] if g.get("images_at_first_use")]
        if images:
            # the server's image store is warm after the first run: the first run is what a new server costs
            out.append(_row("torch: MB of module images uploaded at first use (new server)", "MB",
                            [images[0]["bytes_uploaded"] / 1e6], [], None))
            out.append(_row("torch: MB of module images before trimming to the server's GPU", "MB",
                            [images[0]["bytes_before_trim"] / 1e6], [], None))
        sent = [g["bytes_out_at_first_use"] / 1e6 for g in got["rgpu"] if g["bytes_out_at_first_use"] is not None]
        if sent:
            out.append(_row("torch: MB sent at first use (images + data)", "MB", sent, [], None))
    return out
