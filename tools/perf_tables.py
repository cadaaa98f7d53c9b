"""The "current figures" table atop each docs/perf/ page, generated from the raw run it cites.

    python tools/perf_tables.py transport           print one page's table (tools/check_house.py compares it)
    python tools/perf_tables.py --write             rewrite every page's table (and the plots whose data is here)

Each figure names the file of docs/perf/gpu/ it is read from (a tarball's member as ``a.tar.gz:member``,
nested as deep as the checks pack them), the row's transport, metric and size, and its target. A new run:
put its files under docs/perf/gpu/runN/, point PAGES' sources at them, remove the runs no table reads (git keeps them).
"""
from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "docs" / "perf" / "gpu"
H200 = "one NVIDIA H200, 16 cores, torch 2.11.0+cu130, Python 3.12"

# the runs the tables read: folder -> (date, machine)
RUNS = {"run24": ("2026-12-03", H200), "run23": ("2026-12-03", H200), "run22": ("2026-12-03", H200), "run21": ("2026-12-03", H200), "run20": ("2026-12-02", H200), "run19": ("2026-12-02", H200), "run14": ("2026-12-01", H200), "run12": ("2026-11-30", H200), "run3": ("2026-11-30", H200)}

T20 = "run20/call4-transports.tar.gz:transports/"
FP20 = "run20/call2-fast_path.tar.gz:fast_path/"
R24 = "run24/call1-regress.tar.gz:regress/regress.tar.gz:"   # gpu/check_regress.sh, the C++ small downloads on both ends
U24 = "run24/call3-upload.tar.gz:upload/upload.tar.gz:"   # gpu/check_upload.sh: 7 runs, where regress gives 3
L22 = "run22/call3-cuda_libs.tar.gz:cuda_libs/cuda_libs.tar.gz:torch_bench.json"   # rgpu bench cuda --torch
S22 = "run22/call1-transports.tar.gz:transports/streams.json"                     # rgpu bench streams --tls   # gpu/check_regress.sh: the figures a change must not move
MiB = 1 << 20
B19 = "run19/callA-baseline.tar.gz:a/bench_cuda.json"

# page -> (the command that measured it, [(label, source, transport, metric, size, direction, target)])
PAGES: dict[str, tuple[str, list[tuple]]] = {
    "transport": ("run20: `bash gpu/run_all.sh transports rtt` (`gpu/check_transports.sh`: `rgpu bench transport "
                  "--json`); run24: the round trips of `bash gpu/run_all.sh regress`; run22: `rgpu bench streams "
                  "--tls --sizes 256M,1G --repeats 3` (`bash gpu/run_all.sh transports`)", [
        ("tcp on 4 streams, 1 GiB upload / one raw socket", S22, "tcp x4", "bandwidth", 1 << 30, "", ""),
        ("TLS on 4 streams, 1 GiB upload / plain tcp on 4", S22, "tcp+tls x4", "bandwidth", 1 << 30, "", ">= 0.5"),
        ("TLS on 4 streams, 1 GiB download / plain tcp on 4", S22, "tcp+tls x4", "bandwidth", 1 << 30, "download",
         ">= 0.5"),
        ("tcp round trip, 64 B", R24 + "rtt.json", "tcp", "rtt", 64, "", "<= 1.5"),
        ("tcp upload, 64 MiB", T20 + "transport_tcp.json", "tcp", "bandwidth", 64 * MiB, "", ">= 0.90"),
        ("tcp download, 64 MiB", T20 + "transport_tcp.json", "tcp", "bandwidth", 64 * MiB, "download", ""),
        ("shm round trip (the lone call), 64 B", R24 + "rtt.json", "shm", "rtt", 64, "", "<= 0.20"),
        ("shm upload, 64 MiB", T20 + "transport_shm.json", "shm", "bandwidth", 64 * MiB, "", ">= 0.80"),
        ("shm upload, 256 MiB", T20 + "transport_shm.json", "shm", "bandwidth", 256 * MiB, "", ""),
        ("shm download, 64 MiB", T20 + "transport_shm.json", "shm", "bandwidth", 64 * MiB, "download", ""),
    ]),
    "fast_path": ("run24: `bash gpu/run_all.sh regress` (`gpu/check_regress.sh`, the short form; call 1), the "
                  "pinned upload from `bash gpu/run_all.sh upload` (`gpu/check_upload.sh`, 7 runs; call 3); "
                  "run20: `bash gpu/run_all.sh fast_path` (`gpu/check_fast_path.sh`: `rgpu bench train`, `ops`, "
                  "`upload`, `train --compile` over tcp, `train --sim-rtt 1,10,30`); run12: the compiled step in "
                  "reduce-overhead mode (`gpu/check_compiled.sh`)", [
        ("eager step / native eager, shm", R24 + "train.json", "shm", "training step", None, "", "<= 1.05"),
        ("eager step / native eager, tcp", R24 + "train_tcp.json", "tcp", "training step", None, "", "<= 1.05"),
        ("compiled step / native eager, tcp", FP20 + "train_compiled.json", "tcp",
         "training step, torch.compile(backend='rgpu')", None, "", ""),
        ("compiled step (reduce-overhead) / native eager, shm", "run12/call5_shm.json", "shm",
         "training step, torch.compile(backend='rgpu')", None, "", "<= 0.90"),
        ("compiled step (reduce-overhead) / native eager, tcp", "run12/call5_tcp.json", "tcp",
         "training step, torch.compile(backend='rgpu')", None, "", "<= 0.90"),
        ("client cost per streamed op / native enqueue, shm", R24 + "ops.json", "shm",
         "client cost per streamed op (add, 4 elements)", None, "", "<= 1.0"),
        ("chain of 1000 adds ending in .cpu() / native", R24 + "ops.json", "shm",
         "chain of 1000 adds ending in .cpu() (server: cuda)", None, "", "<= 1.5"),
        ("1 GiB upload from pinned memory / pinned copy, shm", U24 + "upload.json", "shm",
         "upload from pinned memory", None, "", ">= 0.85"),
        ("step at a simulated 30 ms round trip / (0 ms + 1 RTT)", FP20 + "train_rtt.json", "shm",
         "training step at a simulated 30 ms round trip", None, "", "<= 1.10"),
    ]),
    "device_route": ("run24: `bash gpu/run_all.sh regress` (`gpu/check_regress.sh`, call 1: `rgpu bench train`, over "
                     "tcp the same, `rgpu bench generate --repeats 3`)", [
        ("eager nanoGPT step, shm", R24 + "train.json", "shm", "training step", None, "", "<= 1.05"),
        ("eager nanoGPT step, tcp", R24 + "train_tcp.json", "tcp", "training step", None, "", "<= 1.05"),
        ("round trips per step, shm", R24 + "train.json", "shm", "round trips per step", None, "", "1"),
        ("max |loss - native loss|, 3 warm-up steps, shm", R24 + "train.json", "shm",
         "max |loss - native loss| over 3 warm-up steps", None, "", ""),
        ("greedy generation, GPT-2 small, batch 1, tokens/s", R24 + "generate.json", "shm",
         "greedy generation, batch 1 (gpt2-small)", None, "", ">= 0.8"),
        ("greedy generation, GPT-2 small, batch 8, tokens/s", R24 + "generate.json", "shm",
         "greedy generation, batch 8 (gpt2-small)", None, "", ">= 0.8"),
    ]),
    "cuda_route": ("run19: `rgpu bench cuda --json --repeats 3` (`docs/perf/gpu/run19/README.md`; "
                   "`gpu/check_cuda_route.sh` runs the same); run22: `rgpu bench cuda --torch --repeats 2` "
                   "(`RUNGS=R4,R7,R9,R12 bash gpu/run_all.sh cuda_libs`)", [
        ("stock torch: GPT 4x128 eager step", L22, "auto", "GPT 4 layers/128 wide eager step", None, "", "<= 1.10"),
        ("stock torch: GPT 6x384 eager step", L22, "auto", "GPT 6 layers/384 wide eager step", None, "", "<= 1.05"),
        ("stock torch: CNN SGD step", L22, "auto", "CNN SGD step", None, "", "<= 1.15"),
        ("stock torch: GPT 4x128 step captured by torch.cuda.graph, replayed", L22, "auto",
         "GPT 4x128 step captured by torch.cuda.graph, replayed", None, "", "<= 1.02"),
        ("stock torch: waits per GPT 6x384 step", L22, "auto", "GPT 6 layers/384 wide eager step: waits per step",
         None, "", "1"),
        ("stock torch: the first step's synchronous calls", L22, "auto",
         "GPT 4x128: the process's first step's synchronous calls", None, "", "<= 60"),
        ("round-trip call (cuMemGetInfo)", B19, "auto", "round-trip call (cuMemGetInfo)", None, "", ""),
        ("2000 launches + synchronise", B19, "auto", "2000 launches + synchronise", None, "", ""),
        ("64 MiB host-to-device copy (pageable)", B19, "auto", "64 MiB host-to-device copy (pageable)", None, "", ""),
        ("cudaGetDevice, answered in C (vs stock libcudart)", B19, "auto", "cudaGetDevice (answered in C)", None, "",
         "<= 200 ns"),
        ("stock torch: 1,000 small adds + .cpu()", B19, "auto", "torch: 1000 small adds + .cpu()", None, "", "<= 1.5"),
        ("stock torch: round trips per loop", B19, "auto", "torch: round trips per loop", None, "",
         "the syncing calls"),
        ("stock torch: MB sent at first use (images + data)", B19, "auto",
         "torch: MB of module images uploaded at first use (new server)", None, "", "<= 25 MB"),
    ]),
}


# plots the checks drew from the same run, brought up beside the pages: docs/perf/<name> <- source
PLOTS = {"transport_gpu_tcp.png": T20 + "transport_tcp.png", "transport_gpu_shm.png": T20 + "transport_shm.png"}


def read(source: str) -> bytes:
    """A file of docs/perf/gpu/, or a member of a tarball there (``a.tar.gz:member[:member...]``)."""
    outer, *members = source.split(":")
    data = (GPU / outer).read_bytes()
    for m in members:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            names = {n.removeprefix("./"): n for n in tar.getnames()}
            data = tar.extractfile(names[m]).read()
    return data


def rows(source: str) -> list[dict]:
    doc = json.loads(read(source))
    return doc["bench"]["rows"] if isinstance(doc, dict) else doc


def _num(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def table(page: str) -> str:
    command, figures = PAGES[page]
    runs = sorted({src.split("/")[0] for _, src, *_ in figures}, reverse=True)
    out = ["## Current figures", "",
           f"Generated by `python tools/perf_tables.py {page}` from the raw runs in `docs/perf/gpu/` "
           f"({', '.join(f'{r}: {RUNS[r][0]}' for r in runs)}; {RUNS[runs[0]][1]}). Command: {command}. "
           "Each figure beside its baseline measured in the same run; median of interleaved runs.", "",
           "| figure | rgpu | baseline | ratio | target | from |", "|---|---|---|---|---|---|"]
    for label, src, transport, metric, size, direction, target in figures:
        match = [r for r in rows(src) if r.get("transport") == transport and r["metric"] == metric
                 and (size is None or r["size"] == size) and r.get("direction", "") == direction]
        if len(match) != 1:
            raise SystemExit(f"{page}: {label}: {len(match)} rows of {src} match (want 1)")
        r = match[0]
        unit = "" if r["unit"] in ("count", "abs") else " " + r["unit"]
        base = f"{_num(r['baseline'])}{unit} ({r['baseline_name']})" if r.get("baseline") is not None else "—"
        ratio = f"**{r['ratio']:.3f}**" if r.get("ratio") is not None else "—"
        out.append(f"| {label} | {_num(r['value'])}{unit} | {base} | {ratio} | {target or '—'} | "
                   f"`{src.split(':')[0]}` |".replace("|loss", "\\|loss").replace("loss|", "loss\\|"))
    return "\n".join(out) + "\n"


def write() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    from house import generated
    problems = generated.check(ROOT, write=True, only=tuple(g for g in generated.GENERATED
                                                           if g.command[1:2] == ("tools/perf_tables.py",)))
    for p in problems:
        print(p, file=sys.stderr)
    for name, source in PLOTS.items():
        (ROOT / "docs" / "perf" / name).write_bytes(read(source))


if __name__ == "__main__":
    args = sys.argv[1:]
    if args == ["--write"]:
        write()
    elif len(args) == 1 and args[0] in PAGES:
        print(table(args[0]), end="")
    else:
        raise SystemExit(__doc__)
