"""Why an rgpu block measured between native blocks can be slower than the same steps run back to back.

    python tools/diag/diag_blocks.py [--idle] -- <rgpu bench train flags>

``rgpu bench train`` with every rgpu step of its interleaved blocks timed on its own: adds rows with
each block's step times (ms), so a slow first step after the native block (a cold start) tells
itself apart from steps all slower (the native process's presence). ``--idle``: the native block is
replaced by a sleep as long as the last real one took (its rows are then meaningless; a diagnosis).
"""
from __future__ import annotations

import argparse
import time

from rgpu.bench import native_step, train


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--idle", action="store_true")
    ours, rest = parser.parse_known_args()
    rest = [a for a in rest if a != "--"]
    blocks: list[list[float]] = []
    state = {"in_block": False, "native_s": 0.15, "native_blocks": 0}
    step, block, warm = train._step, native_step.Native.block, native_step.Native.warm

    def timed_step(model, opt, x, y, device, timings=None, mark=None):
        if timings is not None or device != "rgpu" or not state["in_block"]:
            return step(model, opt, x, y, device, timings, **({"mark": mark} if mark else {}))
        t0 = time.perf_counter()
        out = step(model, opt, x, y, device)
        blocks[-1].append((time.perf_counter() - t0) * 1e3)
        return out

    def native_block(self, steps):
        state["native_blocks"] += 1
        if ours.idle and state["native_blocks"] > 1:
            time.sleep(state["native_s"])
            result = state["native_ms"]
        else:
            t0 = time.perf_counter()
            result = block(self, steps)
            state["native_s"], state["native_ms"] = time.perf_counter() - t0, result
        blocks.append([])
        return result

    def native_warm(self, n):
        result = warm(self, n)
        state["in_block"] = True   # the warm-up is over: every later rgpu block is timed
        blocks.append([])
        return result

    train._step, native_step.Native.block, native_step.Native.warm = timed_step, native_block, native_warm
    rows = train.rows

    def with_blocks(args=None, profile=None):
        out = rows(args, profile)
        for i, times in enumerate(b for b in blocks if b):
            out.append({"bench": "diag_blocks", "transport": out[0]["transport"], "unit": "ms",
                        "metric": f"block {i}: " + " ".join(f"{t:.1f}" for t in times),
                        "value": times[0], "baseline": None, "ratio": None,
                        "spread": [min(times[1:] or times), max(times[1:] or times)]})
        return out

    train.rows = with_blocks
    return train.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
