"""The one measurement harness: interleaved runs of rgpu beside its baseline, rows, a table, a plot.

A suite is a module ``rgpu.bench.<name>`` with ``rows(args) -> list[dict]``; ``rgpu bench <name>``
calls ``run_suite`` and prints ``format_table`` (or the rows as JSON); ``python -m rgpu.bench.<name>``
runs the suite's ``main``, one call of ``main`` here with the suite's own flags. Every row:

    bench, transport, metric, unit, size, value, baseline_name, baseline, ratio, spread
    (+ baseline_spread, ratio_spread, runs)

While a suite runs (``progress``: what ``rgpu bench`` opens) a tqdm line on stderr counts the runs
``compare`` has made and the time gone; stdout (the table, or ``--json``) is untouched.

``compare`` runs ``rgpu, baseline, rgpu, baseline, ...`` (``repeats`` pairs, at least 5 by
default, each run optionally cut into alternating slices), so drift on a shared machine hits
both alike; ``value`` and ``baseline`` are the
medians, ``ratio`` the median of the per-pair ratios, ``spread`` ``[min, max]`` of the rgpu
runs (``baseline_spread`` and ``ratio_spread`` likewise).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
from typing import Callable, Sequence

from rgpu import local_server

METRIC_UNITS = {"bandwidth": "GB/s", "rtt": "us", "time": "ms"}


def label(n: int | None) -> str:
    """A size as people read it: 64 B, 16 KiB, 64 MiB."""
    if n is None:
        return ""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def parse_sizes(text: str | None, default: Sequence[int]) -> list[int]:
    """``--sizes 64,1M,64M`` as byte counts (binary suffixes)."""
    if not text:
        return list(default)
    from rgpu.config import _size
    return [_size(part) for part in text.split(",") if part.strip()]


def repeats_of(args, default: int = 5) -> int:
    return max(1, int(getattr(args, "repeats", None) or default))


_bar: list = []   # the running suite's progress line (``progress``), ticked by each run ``compare`` makes


@contextlib.contextmanager
def progress(what: str):
    """A tqdm line on stderr for the block: the runs made so far and the time gone, redrawn every second
    (also while one long run, a training step in another process, say, goes on)."""
    from tqdm import tqdm

    bar = tqdm(desc=what, unit="run", file=sys.stderr, leave=False, dynamic_ncols=True, mininterval=0.5)
    done = threading.Event()

    def redraw():
        while not done.wait(1.0):
            bar.refresh()

    threading.Thread(target=redraw, daemon=True).start()
    _bar.append(bar)
    try:
        yield bar
    finally:
        _bar.remove(bar)
        done.set()
        bar.close()


def _tick() -> None:
    if _bar:
        _bar[-1].update(1)


def compare(measure: Callable[[], float], baseline: Callable[[], float], repeats: int = 5, slices: int = 1,
            abba: bool = False) -> dict:
    """Interleave ``measure`` and ``baseline`` ``repeats`` times each; medians, per-pair ratio, spreads.

    With ``slices`` > 1 a run is that many alternating calls of each (measure, baseline,
    measure, ...) and its figure their median: load that comes and goes within a run
    then lands on both sides of the pair. ``abba``: every other pair runs the baseline first (two processes
    taking turns, where whoever goes second finds the machine as the first left it).
    """
    values, bases, ratios = [], [], []
    gc_was = gc.isenabled()
    gc.disable()  # a collection inside one run of a pair and not the other is noise
    try:
        for _ in range(repeats):
            vs, bs = [], []
            for _ in range(slices):
                if abba and len(values) % 2:
                    bs.append(baseline())
                    vs.append(measure())
                else:
                    vs.append(measure())
                    bs.append(baseline())
                _tick()
            v, b = statistics.median(vs), statistics.median(bs)
            values.append(v)
            bases.append(b)
            ratios.append(v / b if b else float("nan"))
            gc.collect()
    finally:
        if gc_was:
            gc.enable()
    return {"value": statistics.median(values), "baseline": statistics.median(bases),
            "ratio": statistics.median(ratios), "spread": [min(values), max(values)],
            "baseline_spread": [min(bases), max(bases)], "ratio_spread": [min(ratios), max(ratios)],
            "runs": repeats}


def row(bench: str, transport: str | None, metric: str, size: int | None, result: dict, baseline_name: str,
        unit: str | None = None, **extra) -> dict:
    """One row of the schema from a ``compare`` result."""
    return {"bench": bench, "transport": transport, "metric": metric, "unit": unit or METRIC_UNITS[metric],
            "size": size, "value": result["value"], "baseline_name": baseline_name, "baseline": result["baseline"],
            "ratio": result["ratio"], "spread": result["spread"],
            **{k: result[k] for k in ("baseline_spread", "ratio_spread", "runs") if k in result}, **extra}


def run_suite(name: str, args) -> list[dict]:
    """``rgpu bench <name>``: the suite's rows (and its plot, with ``--plot``)."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
        from rgpu.errors import ConfigError
        raise ConfigError(f"no benchmark suite named {name!r}")
    try:
        suite = importlib.import_module(f"rgpu.bench.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"rgpu.bench.{name}":
            raise
        from rgpu.errors import ConfigError
        raise ConfigError(f"no benchmark suite named {name!r} (rgpu/bench/{name}.py)") from None
    rows = suite.rows(args)
    path = getattr(args, "plot", None)
    if path:
        plot_bandwidth(rows, path, title=f"rgpu bench {name}")
    return rows


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def format_table(rows: list[dict]) -> str:
    """The rows as an aligned text table, one line each."""
    head = ["bench", "transport", "metric", "size", "value", "unit", "baseline", "baseline_name", "ratio", "spread"]
    lines = [head]
    for r in rows:
        spread = r.get("spread")
        spread_text = f"[{_num(spread[0])}, {_num(spread[1])}]" if isinstance(spread, (list, tuple)) else _num(spread)
        metric = str(r.get("metric", "")) + (f" ({r['direction']})" if r.get("direction") else "")
        lines.append([str(r.get("bench", "")), str(r.get("transport") or ""), metric,
                      label(r.get("size")) if isinstance(r.get("size"), int) else _num(r.get("size")),
                      _num(r.get("value")), str(r.get("unit", "")), _num(r.get("baseline")),
                      str(r.get("baseline_name") or ""), _num(r.get("ratio")), spread_text])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


# ---- a suite's command line: python -m rgpu.bench.<name> ------------------------------------------

def parser(doc: str, repeats: int | None = 5, flags: dict | None = None, prog: str | None = None):
    """``--json``, ``--quick``, ``--repeats`` (the suite's default) and the suite's own ``flags``, given as
    data: ``{"--sim-rtt": {"default": "1,10"}}``, each flag's ``add_argument`` keywords. ``doc``: the
    suite's docstring (its first line is the description)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON array of rows")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    p.add_argument("--repeats", type=int, default=repeats, help="interleaved runs per figure (median reported)")
    for flag, keywords in (flags or {}).items():
        p.add_argument(flag, **keywords)
    return p


def show(rows: list[dict], as_json: bool, text: Callable[[list[dict]], str] | None = None) -> int:
    """Print the rows as JSON or as text (``format_table`` unless the suite has its own); 0, the exit status."""
    print(json.dumps(rows, indent=1) if as_json else (text or format_table)(rows))
    return 0


def main(rows: Callable, argv: Sequence[str] | None, doc: str, repeats: int | None = 5, flags: dict | None = None,
         text: Callable[[list[dict]], str] | None = None) -> int:
    """A suite's ``main``: parse the common flags and ``flags`` (see ``parser``), print ``rows(args)``."""
    args = parser(doc, repeats, flags).parse_args(argv)
    return show(rows(args), args.json, text)


def plot_bandwidth(rows: list[dict], path: str, title: str = "bandwidth against size") -> str | None:
    """A PNG: bandwidth against size (log-log; one line per transport and direction, dashed for the
    baselines) above the ratio of each to its baseline."""
    series: dict[str, list[tuple[int, float]]] = {}
    ratios: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r.get("metric") != "bandwidth" or not isinstance(r.get("size"), int):
            continue
        direction = f" {r['direction']}" if r.get("direction") else ""
        name = f"rgpu {r['transport']}{direction}"
        series.setdefault(name, []).append((r["size"], r["value"]))
        series.setdefault(f"baseline: {r['baseline_name']}{direction}", []).append((r["size"], r["baseline"]))
        if r.get("ratio") is not None:
            ratios.setdefault(f"{name} / {r['baseline_name']}", []).append((r["size"], r["ratio"]))
    if not series:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    for name, points in series.items():
        points = sorted(set(points))
        top.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name,
                 linestyle="--" if name.startswith("baseline") else "-")
    for name, points in ratios.items():
        points = sorted(set(points))
        bottom.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    bottom.axhline(1.0, color="grey", linewidth=0.8)
    top.set_xscale("log", base=2)
    top.set_yscale("log")
    ticks = sorted({p[0] for pts in series.values() for p in pts})
    bottom.set_xticks(ticks, [label(t) for t in ticks], rotation=45)
    bottom.set_xlabel("message size")
    top.set_ylabel("GB/s (median of interleaved runs)")
    bottom.set_ylabel("ratio to baseline")
    top.set_title(title)
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- processes: a local server, pinned apart from the client ------------------------------------

def cpu_split() -> tuple[set[int], set[int]] | None:
    """(client CPUs, server CPUs) on different physical cores, or None with fewer than two usable CPUs.

    Client and server on one core measure a same-core wake-up (4-13 us here) that no remote
    server ever gives; different cores are the honest stand-in for two hosts. Hyperthreads of one
    core count as one (a spinning sibling slows its twin), wherever the CPU list puts them.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    cores: dict[tuple, list[int]] = {}
    for cpu in cpus:
        cores.setdefault(_core_of(cpu), []).append(cpu)
    groups = list(cores.values())
    if len(groups) < 2:
        half = len(cpus) // 2
        return set(cpus[:half]), set(cpus[half:])
    half = len(groups) // 2
    return {c for g in groups[:half] for c in g}, {c for g in groups[half:] for c in g}


def _core_of(cpu: int) -> tuple:
    """(package, core) of a CPU from sysfs; the CPU itself where sysfs does not say."""
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    try:
        with open(base + "physical_package_id") as f, open(base + "core_id") as g:
            return int(f.read()), int(g.read())
    except (OSError, ValueError):
        return (-1, cpu)


def pin_self(cpus: set[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)


@contextlib.contextmanager
def pinned(cpus: set[int] | None):
    """This process on ``cpus`` (``None``: left where it is) for the block; its CPUs given back after."""
    before = os.sched_getaffinity(0)
    pin_self(cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def spawn(cmd: list[str], cpus: set[int] | None = None, env: dict | None = None, **popen) -> subprocess.Popen:
    """A child process, pinned to ``cpus`` (its own children inherit that)."""
    preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return subprocess.Popen(cmd, preexec_fn=preexec, env=env, stdin=subprocess.DEVNULL, **popen)


class LocalServer(local_server.LocalServer):
    """``rgpu serve`` on a free loopback port with its own token and folder, no preload; ``stop()`` ends it."""

    def __init__(self, flags: Sequence[str] = (), cpus: set[int] | None = None, env: dict | None = None):
        self.folder = tempfile.mkdtemp(prefix="rgpu-bench-")
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
        child_env.update(RGPU_TOKEN_FILE=os.path.join(self.folder, "token"), **(env or {}))
        super().__init__("bench-" + os.urandom(8).hex(), ["--preload", "", *flags], env=child_env, cpus=cpus)
