"""The eager step's timeline as client and server see it, and when the GPU starved, without a profiler.

The server (a local one, on cores of its own) records for each message it handles when it came
and went (``perf_counter``, the same clock as the client's on one host), its kind, how many events
it carried, and whether its GPU stream had run dry when it came (``torch.cuda.current_stream()
.query()``: a microsecond or two). The client records each phase of the bench's step. Per step:
the client's phases, the server's time on each kind of message, the gap from the client's step
start to the server's first op, and the messages that found the GPU idle (the GPU waited for
the server then: a lower bound of its idle time is the server's time on them). One JSON object.

    python tools/diag/diag_server_step.py [--steps 10] [--quick]       (rgpu installed; RGPU_TRANSPORT picks)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

RECORDER = '''
import atexit, json, os, time
import torch
from rgpu.server.ops import executor as ops
_handle, _close, _log = ops.Executor.handle, ops.Executor.close, []
def handle(self, meta, buffers, reply):
    t0 = time.perf_counter()
    idle = torch.cuda.current_stream().query() if self.kind == "cuda" else None
    try:
        return _handle(self, meta, buffers, reply)
    finally:
        _log.append((t0, time.perf_counter(), meta[0], len(meta[1]) if len(meta) > 1 and type(meta[1]) is list else 0,
                     idle))
def close(self):
    with open(os.environ["RGPU_DIAG_TIMES"], "w") as f:
        json.dump(_log, f)
    return _close(self)
ops.Executor.handle, ops.Executor.close = handle, close
'''

PHASES = ("upload", "forward", "backward", "optimizer", "item")


def _summary(client: list, server: list) -> dict:
    from rgpu.protocol.ops import Msg

    names = {int(m): m.name for m in Msg}
    steps = []
    for marks in client:
        t_start, t_end = marks[0], marks[-1]
        msgs = [m for m in server if t_start <= m[0] < t_end]
        if not msgs:
            continue
        by_kind: dict = {}
        for t0, t1, kind, _, _ in msgs:
            k = names.get(kind, str(kind))
            n, s = by_kind.get(k, (0, 0.0))
            by_kind[k] = (n + 1, s + (t1 - t0) * 1e3)
        op_msgs = [m for m in msgs if m[2] == Msg.OP]
        idle = [m for m in msgs if m[4]]
        busy = sum(t1 - t0 for t0, t1, *_ in msgs)
        steps.append({
            "client_phases_ms": {p: (b - a) * 1e3 for p, a, b in zip(PHASES, marks, marks[1:])},
            "step_ms": (t_end - t_start) * 1e3,
            "server_busy_ms": busy * 1e3,
            "server_ms_by_kind": {k: [n, round(s, 3)] for k, (n, s) in by_kind.items()},
            "first_message_after_start_ms": (msgs[0][0] - t_start) * 1e3,
            "first_op_after_start_ms": (op_msgs[0][0] - t_start) * 1e3 if op_msgs else None,
            "first_op_done_after_start_ms": (op_msgs[0][1] - t_start) * 1e3 if op_msgs else None,
            "last_op_done_before_end_ms": (t_end - op_msgs[-1][1]) * 1e3 if op_msgs else None,
            "first_messages": [[names.get(k, str(k)), round((a - t_start) * 1e3, 3), round((b - t_start) * 1e3, 3),
                                gpu_idle] for a, b, k, _, gpu_idle in msgs[:6]],
            "events_carried": sum(m[3] for m in msgs),
            "events_on_first_message": msgs[0][3],
            "messages": len(msgs),
            "found_gpu_idle": len(idle),
            "found_gpu_idle_by_phase": _by_phase(idle, marks),
            "server_ms_on_idle_gpu": sum(t1 - t0 for t0, t1, *_ in idle) * 1e3,
            "server_lag_at_client_phase_ends_ms": [_lag(msgs, t) for t in marks[1:-1]],
        })
    keys = [k for k, v in steps[0].items() if isinstance(v, (int, float))] if steps else []
    return {"median": {k: statistics.median(s[k] for s in steps if s[k] is not None) for k in keys},
            "steps": steps}


def _by_phase(msgs: list, marks: list) -> dict:
    out = {p: 0 for p in PHASES}
    for m in msgs:
        for p, a, b in zip(PHASES, marks, marks[1:]):
            if a <= m[0] < b:
                out[p] += 1
    return out


def _lag(msgs: list, t: float) -> float:
    """How long after ``t`` (a client mark) the server finished what came before it: its backlog then."""
    before = [m for m in msgs if m[0] < t]
    return max(0.0, (before[-1][1] - t) * 1e3) if before else 0.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="rgpu-diag-")
    times = str(Path(folder, "times.json"))
    Path(folder, "sitecustomize.py").write_text("import rgpu.server.ops.executor\nexec(open(%r).read())\n"
                                                % str(Path(folder, "recorder.py")))
    Path(folder, "recorder.py").write_text(RECORDER)
    from rgpu.bench import harness

    split = harness.cpu_split()
    server = harness.LocalServer(cpus=split[1] if split else None, env={
        "PYTHONPATH": os.pathsep.join([folder, os.environ.get("PYTHONPATH", "")]), "RGPU_DIAG_TIMES": times,
        "RGPU_TF32": os.environ.get("RGPU_TF32", "0")})
    harness.pin_self(split[0] if split else None)
    os.environ.update(RGPU_SERVER=server.address, RGPU_TOKEN=server.token)
    import torch

    import rgpu
    from rgpu.bench import train

    p = train.PRESETS["small" if args.quick else "bench"]
    model, opt = train._setup("rgpu", p, 97)
    x = torch.randint(0, 97, (p["batch"], p["block_size"]), generator=torch.Generator().manual_seed(1))
    client = []
    for i in range(5 + args.steps):
        marks = [time.perf_counter()]
        xx, yy = x.to("rgpu"), x.to("rgpu")
        marks.append(time.perf_counter())
        _, loss = model(xx, yy)
        marks.append(time.perf_counter())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        marks.append(time.perf_counter())
        opt.step()
        marks.append(time.perf_counter())
        loss.item()
        marks.append(time.perf_counter())
        if i >= 5:
            client.append(marks)
    transport = rgpu.stats()["transport"]
    from rgpu.device_backend import session

    session.current().close()
    server.stop()
    for _ in range(100):  # the worker writes its record when its session closes
        if os.path.exists(times) and os.path.getsize(times):
            break
        time.sleep(0.1)
    out = {"transport": transport, **_summary(client, json.load(open(times)))}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
