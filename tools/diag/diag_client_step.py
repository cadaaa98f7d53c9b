"""Where the client's time goes in the bench's eager step, rgpu beside native, phase by phase.

    python tools/diag/diag_client_step.py [--steps 10] [--profile] [--preset bench|small] [--batch N]

Per phase of a step (upload, forward, backward, optimizer, item): wall time, the main thread's
CPU and the whole process's CPU (autograd's device thread runs the backward); the CPU of each
of the process's threads over the steps (``/proc/self/task``); for rgpu, the C++ fast path's
hits, misses and passes per step and the messages per step. ``--profile``: the main thread's
cProfile of the same steps (top 30 by own time). rgpu runs with ``--pin``'s placement (a local
server of its own on other cores); native runs after it in a child process that never imports
rgpu (``--side native``), pinned to the same client cores. One JSON object on stdout:
{"rgpu": ..., "native": ...}. A diagnosis, not a target.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

PHASES = ("upload", "forward", "backward", "optimizer", "item")


def _threads() -> dict[str, float]:
    """CPU seconds of each live thread of this process, by Python's name or else the kernel's, with its id."""
    import threading

    named = {t.native_id: t.name for t in threading.enumerate()}
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                head, rest = f.read().rsplit(b")", 1)
            name = named.get(int(tid)) or head.split(b"(", 1)[1].decode(errors="replace")
            name = f"{name} {tid}"
            fields = rest.split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", choices=("rgpu", "native"), default="rgpu")
    ap.add_argument("--cpus", default="", help="native: the CPUs to run on (comma-separated)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--batch", type=int)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "nanogpt"))
    import torch
    from model import GPT, GPTConfig

    if args.side == "rgpu":
        import rgpu
        from rgpu.bench.train import PRESETS, _pin_apart

        p = dict(PRESETS[args.preset], batch=args.batch or PRESETS[args.preset]["batch"])
        _pin_apart()
        dev = "rgpu"
    else:  # never import rgpu here (CUDA autograd fails where the PrivateUse1 device is registered)
        p = json.loads(args.preset)
        if args.cpus:
            os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    tf32 = os.environ.get("RGPU_TF32", "") not in ("", "0")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=97, block_size=p["block_size"], n_layer=p["n_layer"], n_head=p["n_head"],
                    n_embd=p["n_embd"], dropout=0.0)
    model = GPT(cfg).to(dev)
    opt = model.configure_optimizer(3e-4)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 97, (p["batch"], p["block_size"]), generator=gen)
    clocks = (time.perf_counter, time.thread_time, time.process_time)

    def step(record):
        marks = [tuple(c() for c in clocks)]
        xx, yy = x.to(dev), x.to(dev)
        marks.append(tuple(c() for c in clocks))
        _, loss = model(xx, yy)
        marks.append(tuple(c() for c in clocks))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        marks.append(tuple(c() for c in clocks))
        opt.step()
        marks.append(tuple(c() for c in clocks))
        loss.item()
        marks.append(tuple(c() for c in clocks))
        if record is not None:
            record.append([[(b[i] - a[i]) * 1e3 for i in range(3)] for a, b in zip(marks, marks[1:])])

    fast = None
    if dev == "rgpu":
        from rgpu.device_backend import session

        fast = session.current().C.fast_path_stats
    for _ in range(3):
        step(None)
    if fast:
        fast(True)
        rgpu.stats(reset=True)
    threads0 = _threads()
    record: list = []
    for _ in range(args.steps):
        step(record)
    threads1 = _threads()
    out = {"side": args.side, "device": dev, "preset": p, "steps": args.steps, "phases": {}}
    for k, name in enumerate(PHASES):
        vals = [r[k] for r in record]
        out["phases"][name] = {c: sorted(v[i] for v in vals)[len(vals) // 2]
                               for i, c in enumerate(("wall_ms", "main_cpu_ms", "process_cpu_ms"))}
    out["per_step_ms"] = [round(sum(ph[0] for ph in r), 3) for r in record]
    out["threads_cpu_ms_per_step"] = {n: round((threads1.get(n, 0) - threads0.get(n, 0)) * 1e3 / args.steps, 3)
                                      for n in threads1 if threads1.get(n, 0) - threads0.get(n, 0) > 0}
    if fast:
        out["fast_path_per_step"] = {k: [x / args.steps for x in v] if isinstance(v, list) else v / args.steps
                                     for k, v in fast(True).items()}   # (posts: one count per server)
        out["messages_per_step"] = rgpu.stats()["messages"] / args.steps
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3):
            step(None)
        prof.disable()
        stats = pstats.Stats(prof, stream=io.StringIO()).stats  # {(file, line, fn): (cc, nc, tt, ct, callers)}
        top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:30]
        out["profile_us_per_step"] = [[f"{Path(f).name}:{line}({fn})", nc / 3, round(tt * 1e6 / 3, 1),
                                       round(ct * 1e6 / 3, 1)] for (f, line, fn), (_, nc, tt, ct, _) in top]
    if args.side == "native":
        print(json.dumps(out))
        return 0
    import subprocess

    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    native = subprocess.run([sys.executable, __file__, "--side", "native", "--cpus", cpus, "--preset", json.dumps(p),
                             "--steps", str(args.steps)] + ["--profile"] * args.profile,
                            capture_output=True, text=True, check=True).stdout
    print(json.dumps({"rgpu": out, "native": json.loads(native)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
