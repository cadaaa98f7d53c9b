"""The fast path's plot: step times beside native eager, and steps behind a simulated round trip.

    python -m rgpu.bench.plot_fast_path OUT_DIR --out docs/perf/fast_path.png [--title TEXT]

``OUT_DIR`` holds what ``gpu/check_fast_path.sh`` writes (``train_compiled.json``, else
``train.json``: eager and compiled steps; ``train_rtt.json``: steps at 1, 10, 30 ms; else ``rtt.json``: the op
chain). Left: the step of each kind with its spread, native eager dashed across.
Right: the step (or chain) at each simulated round trip against the ideal, the
same at 0 ms plus one round trip.
"""
from __future__ import annotations

import json
import re
from pathlib import Path


def _rows(folder: Path, name: str) -> list[dict]:
    path = folder / f"{name}.json"
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [r for r in rows if isinstance(r, dict) and "metric" in r]


def plot(folder: str, out: str, title: str = "rgpu fast path") -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = Path(folder)
    train, rtt = _rows(d, "train_compiled") or _rows(d, "train"), _rows(d, "train_rtt")
    bars = [("rgpu compiled" if "compile" in r["metric"] else "rgpu eager", r) for r in train
            if r["metric"].startswith("training step")]
    fig, axes = plt.subplots(1, 2 if bars else 1, figsize=(11 if bars else 6, 4.5), squeeze=False)
    left, right = (axes[0][0], axes[0][1]) if bars else (None, axes[0][0])
    if bars:
        native = bars[0][1]["baseline"]
        names = ["native eager"] + [n for n, _ in bars]
        values = [native] + [r["value"] for _, r in bars]
        errs = [[0] + [r["value"] - r["spread"][0] for _, r in bars], [0] + [r["spread"][1] - r["value"] for _, r in bars]]
        left.bar(names, values, yerr=errs, capsize=4, color=["#888"] + ["#3a7"] * len(bars))
        left.axhline(native, linestyle="--", color="#888")
        for i, v in enumerate(values):
            left.text(i, v, f"{v:.1f} ms" + (f"\n{v / native:.2f}x" if i else ""), ha="center", va="bottom")
        left.set_ylim(0, max(v + e for v, e in zip(values, errs[1])) * 1.25)  # room for the labels
        left.set_ylabel("ms per training step")
        left.set_title(bars[0][1].get("size") or "training step")
    points, what = [], "rgpu eager training step"
    for r in rtt:
        m = re.match(r"training step at a simulated ([0-9.]+) ms", r["metric"])
        if m:
            points.append((float(m.group(1)), r["value"], r["baseline"], r["spread"]))
    if not points:  # no training steps behind the line: the op chain's rows (rgpu bench rtt)
        what = "chain of 200 ops and one wait"
        for r in _rows(d, "rtt"):
            m = re.match(r"chain of \d+ ops and one wait at ([0-9.]+) ms", r["metric"])
            if m:
                points.append((float(m.group(1)), r["value"], r["baseline"], r["spread"]))
    if points:
        points.sort()
        xs = [p[0] for p in points]
        right.errorbar(xs, [p[1] for p in points], yerr=[[p[1] - p[3][0] for p in points],
                                                         [p[3][1] - p[1] for p in points]],
                       marker="o", capsize=4, label=f"{what} at that round trip")
        right.plot(xs, [p[2] for p in points], linestyle="--", marker="x", label="the same at 0 ms + 1 round trip")
        right.set_xlabel("simulated round trip (ms)")
        right.set_ylabel("ms")
        right.set_title("one round trip per step, whatever it holds")
        right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--out", default="fast_path.png")
    ap.add_argument("--title", default="rgpu fast path")
    args = ap.parse_args(argv)
    print(plot(args.folder, args.out, args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
