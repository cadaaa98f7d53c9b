"""Where a step's time goes on the server, read from its trace (``rgpu bench train --trace FILE``).

The server's trace (``server/ops/trace.py``) has a span per message ("rgpu OP", "rgpu RUN", ...) and, on a
GPU, every kernel, copy and memset. A step ends where the client waits: the span of each request (the
bench's ``loss.item()`` is its only one, a CALL of ``_local_scalar_dense``). For each step:

- ``gpu_busy``: time the GPU ran anything (the union of its intervals), ``gpu_idle`` the rest of the step;
- ``server_busy``: time inside message handlers, ``server_waiting`` the rest (waiting for the client);
- ``client_gap``: from one item()'s reply to the next step's first message (the client's own time);
- ``gpu_start``: from that reply to the next step's first GPU work.

All in milliseconds, the median over the traced steps (the first is dropped: it has no start); the GPU
figures only where the trace has GPU work (a CPU server has none).

The client's trace of the same steps (``bench train`` marks each phase: "step: upload", "step: forward",
"step: backward", "step: optimizer", "step: item"; one host, one clock) splits the gap at each step's
start (``boundary``):

- ``reply_to_client``: from the server's end of the request to the end of the client's ``item()``;
- ``client_between_steps``: from there to the client's next upload (its own Python: the loop, frees);
- ``upload_to_server``: from that upload's start to the server's first message of the step;
- and each phase's length on the client: ``upload``, ``forward``, ``backward``, ``optimizer``, ``item``.
"""
from __future__ import annotations

import gzip
import json
import os
import statistics
import tempfile

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
SPAN_PREFIX = "rgpu "
STEP_ENDS = {SPAN_PREFIX + kind for kind in ("CALL", "DOWNLOAD", "SYNC")}  # the requests that wait
STEP_FIGURES = ("wall", "gpu_busy", "gpu_idle", "server_busy", "server_waiting", "client_gap", "gpu_start")
PHASES = ("upload", "forward", "backward", "optimizer", "item")  # the client's marks, "step: <phase>"
BOUNDARY_FIGURES = ("reply_to_client", "client_between_steps", "upload_to_server", *PHASES)


def load(data: bytes) -> list[dict]:
    """The trace's events from the gzipped Chrome trace the server sent."""
    return json.loads(gzip.decompress(data))["traceEvents"]


def steps(events: list[dict]) -> dict:
    """The figures above (ms) and the number of steps they are the median of; {} for fewer than 2 steps."""
    gpu, named = _gpu_spans(events), _message_spans(events)
    msgs = [(start, end) for start, end, _ in named]
    ends = [end for _, end, name in named if name in STEP_ENDS]
    rows = []
    for a, b in zip(ends, ends[1:]):
        wall = b - a
        first_msg = next((s for s, _ in msgs if s >= a), b)
        first_gpu = next((s for s, _ in gpu if s >= a), b)
        g, m = _union(gpu, a, b), _union(msgs, a, b)
        rows.append({"wall": wall, "gpu_busy": g, "gpu_idle": wall - g, "server_busy": m,
                     "server_waiting": wall - m, "client_gap": first_msg - a, "gpu_start": first_gpu - a})
    if not rows:
        return {}
    out = {k: statistics.median(r[k] for r in rows) / 1e3 for k in rows[0] if gpu or not k.startswith("gpu")}
    out["steps"] = len(rows)
    return out


def boundary(server: list[dict], client: list[dict]) -> dict:
    """The client's side of each step's start, and its phases (ms, medians; see above); {} without marks."""
    named = _message_spans(server)
    marks = {phase: sorted(_span(e) for e in client if e.get("name") == "step: " + phase and "dur" in e)
             for phase in PHASES}
    got: dict[str, list[float]] = {name: [] for name in BOUNDARY_FIGURES}
    for phase, spans in marks.items():
        got[phase] = [end - start for start, end in spans]
    ends = [end for _, end, name in named if name in STEP_ENDS]
    for a in ends:
        item_end = next((e for s, e in marks["item"] if e >= a), None)
        upload = next((s for s, _ in marks["upload"] if item_end is not None and s >= item_end), None)
        if upload is None:
            continue
        first_msg = next((s for s, _, _ in named if s >= upload), None)
        got["reply_to_client"].append(item_end - a)
        got["client_between_steps"].append(upload - item_end)
        if first_msg is not None:
            got["upload_to_server"].append(first_msg - upload)
    return {k: statistics.median(v) / 1e3 for k, v in got.items() if v}


def gpu_busy(events: list[dict]) -> float:
    """ms the GPU ran anything over the whole trace (the native reference's measure)."""
    return _union(_gpu_spans(events), float("-inf"), float("inf")) / 1e3


def export(prof) -> bytes:
    """A finished torch.profiler's Chrome trace, as the JSON bytes ``export_chrome_trace`` writes."""
    with tempfile.TemporaryDirectory(prefix="rgpu-trace-") as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as f:
            return f.read()


def _gpu_spans(events: list[dict]) -> list[tuple[float, float]]:
    """(start, end) of every kernel, copy and memset, sorted."""
    return sorted(_span(e) for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e)


def _message_spans(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start, end, name) of the server's message spans, sorted (the CPU's: "gpu_user_annotation" mirrors them)."""
    return sorted((*_span(e), e["name"]) for e in events
                  if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(SPAN_PREFIX)
                  and "dur" in e)


def _span(e: dict) -> tuple[float, float]:
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def _union(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Total length of the union of ``spans`` (sorted by start) clipped to [lo, hi] (µs)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        s, e = max(s, lo), min(e, hi)
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total
