"""What waits on the CUDA route, by name: the R7 GPT's first and steady steps, and reduce-overhead's capture.

Run through ``rgpu intercept run -- python3 gpu/cuda_waits_probe.py`` (gpu/check_cuda_waits.sh does); prints one
JSON line: the waits (answered calls) of setup, the first step and each later step, each by call name, the losses,
40 more steady steps' times (wall and this process's CPU; natively too: run it without rgpu), and
torch.compile(mode="reduce-overhead")'s outputs beside eager's (or its error and traceback).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
import traceback

STEADY = 40


def waits() -> dict:
    c = getattr(sys.modules.get("rgpu.cuda_intercept.client"), "_client", None)
    return dict(c.waits) if c is not None else {}


def delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in sorted(after.items()) if v != before.get(k, 0)}


def main() -> None:
    from rgpu.bench import cuda_ladder_rungs as rungs
    torch = rungs.load_torch()
    torch.utils.deterministic.fill_uninitialized_memory = False
    dev = torch.device("cuda")
    out: dict = {"device": torch.cuda.get_device_name(0), "steps": []}
    try:
        w0 = waits()
        model, opt, batches = rungs.gpt_setup(dev)
        out["setup"] = delta(w0, waits())
        losses = []
        for i in range(6):
            before = waits()
            losses.append(rungs.train_step(model, opt, *batches[i], dev))
            step = delta(before, waits())
            out["steps"].append({"total": sum(step.values()), "by_name": step})
        out["losses"] = losses
        # steady steps timed (each ends in loss.item(), a wait): beside the server's report of its batches'
        # time (RGPU_CUDA_WAIT_REPORT on the server), whether the server or the client sets the step's pace
        wall, cpu = [], []
        for i in range(STEADY):
            t, c = time.perf_counter(), time.process_time()
            rungs.train_step(model, opt, *batches[i % len(batches)], dev)
            wall.append((time.perf_counter() - t) * 1e3)
            cpu.append((time.process_time() - c) * 1e3)
        out["steady_ms"] = {"steps": STEADY, "median": statistics.median(wall), "min": min(wall), "max": max(wall),
                            "client_cpu_median": statistics.median(cpu)}
    except Exception as exc:                   # the compile case still runs
        out["gpt_error"] = f"{type(exc).__name__}: {exc}"[:2000]
    try:
        m = rungs._mlp(12, dev)
        xs = [torch.randn(32, 64, generator=torch.Generator().manual_seed(i)).to(dev) for i in range(4)]
        with torch.no_grad():
            eager = [m(x).clone() for x in xs]
            c = torch.compile(m, mode="reduce-overhead")
            got = [c(x).clone() for x in xs]
        out["reduce_overhead"] = {"ok": True, "max_diff": max(float((a - b).abs().max()) for a, b in zip(eager, got))}
    except Exception as exc:
        out["reduce_overhead"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                                  "traceback": traceback.format_exc()[-4000:]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
