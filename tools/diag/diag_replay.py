"""Where the server's time per message goes on this host, without a profiler in the way.

An eager training step's messages (the bench model, or the small one with ``--quick``), recorded
at a local server, are replayed into an in-process executor: on the C++ op path and on the Python
path, beside each op's aten call alone (the Python path's ``r.call``, timed), msgpack's decode of each
message, and one more pass on the C++ path split (``cpp_split``: ``FastOps.run`` timed whole, the
frees the Python table applied, a cProfile; the timing itself costs a few microseconds a message).
One JSON object on stdout.

    python tools/diag/diag_replay.py [--quick] [--steps 5]        (from the repository root; rgpu installed)
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECORDER = '''
import os, pickle
from rgpu.server.ops import executor as ops
_handle, _close, _log = ops.Executor.handle, ops.Executor.close, []
def handle(self, meta, buffers, reply):
    _log.append((meta, [bytes(b) for b in buffers], reply))
    return _handle(self, meta, buffers, reply)
def close(self):
    with open(os.environ["RGPU_DIAG_RECORD"], "wb") as f:
        pickle.dump(_log, f)
    return _close(self)
ops.Executor.handle, ops.Executor.close = handle, close
'''


def record(path: str, quick: bool, steps: int) -> None:
    """Train ``steps`` eager steps against a local server whose worker records every message it handles."""
    folder = tempfile.mkdtemp(prefix="rgpu-replay-")
    Path(folder, "sitecustomize.py").write_text("import rgpu.server.ops.executor\nexec(open(%r).read())\n"
                                                % str(Path(folder, "recorder.py")))
    Path(folder, "recorder.py").write_text(RECORDER)
    from rgpu.bench import harness

    server = harness.LocalServer(env={"PYTHONPATH": os.pathsep.join([folder, os.environ.get("PYTHONPATH", "")]),
                                      "RGPU_DIAG_RECORD": path, "RGPU_TF32": os.environ.get("RGPU_TF32", "0")})
    try:
        env = dict(os.environ, RGPU_SERVER=server.address, RGPU_TOKEN=server.token)
        code = ("import sys, torch, rgpu; sys.argv = ['x']; from rgpu.bench import train\n"
                f"p = train.PRESETS[{'small' if quick else 'bench'!r}]; model, opt = train._setup('rgpu', p, 97)\n"
                "g = torch.Generator().manual_seed(1)\n"
                f"for _ in range({steps}):\n"
                "    x = torch.randint(0, 97, (p['batch'], p['block_size']), generator=g)\n"
                "    train._step(model, opt, x, x, 'rgpu')\n")
        subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=folder)  # not the tree: ./rgpu would shadow rgpu
    finally:
        server.stop()
    for _ in range(100):  # the worker writes the record when its session closes
        if os.path.exists(path) and os.path.getsize(path):
            break
        time.sleep(0.1)


def replay(path: str, steps: int) -> dict:
    import msgpack
    import torch

    from rgpu import config
    from rgpu.protocol.ops import Msg
    from rgpu.server.ops import resolve
    from rgpu.server.route import Session
    from rgpu.server.ops.executor import Executor

    log = pickle.load(open(path, "rb"))
    names = {m[1]: m[2] for m, _, _ in log if m[0] == Msg.DEFINE}
    aten = [0]
    plain_init = resolve.Resolved.__init__

    def timed_init(self, name, op, run=None):  # the Python path's aten call, timed
        plain_init(self, name, op, run)
        call, clock = self.call, time.perf_counter_ns

        def timed(*a, **k):
            t = clock()
            try:
                return call(*a, **k)
            finally:
                aten[0] += clock() - t
        self.call = timed

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    class TimedFastOps:
        """The executor's FastOps with the time in its ``op`` counted (the C++ path's whole call)."""

        def __init__(self, fast):
            self.fast, self.run_ns = fast, 0

        def op(self, *a):
            t = time.perf_counter_ns()
            try:
                return self.fast.op(*a)
            finally:
                self.run_ns += time.perf_counter_ns() - t

        def __getattr__(self, name):
            return getattr(self.fast, name)

    def one_pass(server_c: bool, timed_aten: bool, split: bool = False) -> dict:
        """One replay; ``split``: FastOps.run and the Python frees timed apart, and a cProfile (which costs)."""
        resolve.Resolved.__init__ = timed_init if timed_aten else plain_init
        ex = Executor(Session(id="r", route="ops", settings=config.settings(environ={}, device=device, server_c=server_c)))
        if ex.fast is not None and split:
            ex.fast = TimedFastOps(ex.fast)
        events, apply_events = [0], ex.table.apply_events

        def timed_events(e):
            t = time.perf_counter_ns()
            try:
                return apply_events(e)
            finally:
                events[0] += time.perf_counter_ns() - t
        if split:
            ex.table.apply_events = timed_events
        prof = None
        if split:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        per_kind, per_op = collections.Counter(), collections.defaultdict(lambda: [0, 0])
        aten[0] = op_aten = 0
        sync()
        t0 = time.perf_counter_ns()
        with ex.serving():
            for meta, bufs, reply in log:
                before = aten[0] + (ex.fast.call_ns if ex.fast is not None else 0)
                t = time.perf_counter_ns()
                try:
                    ex.handle(meta, [memoryview(b) for b in bufs], reply)
                except Exception:
                    pass
                d = time.perf_counter_ns() - t
                per_kind[Msg(meta[0]).name] += d
                if meta[0] == Msg.OP:
                    op_aten += aten[0] + (ex.fast.call_ns if ex.fast is not None else 0) - before
                    per_op[names.get(meta[2], "?")][0] += 1
                    per_op[names.get(meta[2], "?")][1] += d
        sync()
        wall = time.perf_counter_ns() - t0
        top = None
        if prof is not None:
            import io
            import pstats
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            top = [line for line in text.getvalue().splitlines() if line.strip()][:40]
        ran = (ex.fast.ran, ex.fast.declined) if ex.fast is not None else None
        run_ns = ex.fast.run_ns if split and ex.fast is not None else None
        ex.close()
        resolve.Resolved.__init__ = plain_init
        n_op = sum(v[0] for v in per_op.values())
        return {"wall_ms_per_step": wall / steps / 1e6, "handle_ms_per_step": sum(per_kind.values()) / steps / 1e6,
                "op_messages_per_step": n_op / steps, "us_per_op_message": sum(v[1] for v in per_op.values()) / n_op / 1e3,
                # the ops' own calls: timed around r.call (Python path), around the dispatcher's call (C++ path)
                "aten_us_per_op_message": op_aten / n_op / 1e3 if timed_aten or server_c else None, "fast_ran_declined": ran,
                "ms_per_step_by_kind": {k: v / steps / 1e6 for k, v in per_kind.items()},
                # of each op message: FastOps.run's whole call (C++ path), the frees and copies it carried
                "fast_run_us_per_op_message": run_ns / n_op / 1e3 if run_ns is not None else None,
                "events_us_per_op_message": events[0] / n_op / 1e3 if split else None,
                "top_ops_us": {k: [v[0] // steps, round(v[1] / v[0] / 1e3, 2)] for k, v in
                               sorted(per_op.items(), key=lambda kv: -kv[1][1])[:20]},
                "profile": top}

    out = {"device": device, "messages": len(log), "steps": steps}
    for _ in range(3):  # the last pass of each counts: the allocator and the kernels are warm by then
        for key, server_c, timed_aten in (("cpp", True, False), ("python", False, False), ("python_aten_timed", False, True)):
            out[key] = one_pass(server_c, timed_aten)
    out["cpp_split"] = one_pass(True, False, split=True)   # where the time goes, at the cost of timing it
    t = time.perf_counter_ns()
    for meta, _, _ in log:
        msgpack.unpackb(msgpack.packb(meta, use_bin_type=True), raw=False)
    out["msgpack_pack_unpack_us_per_message"] = (time.perf_counter_ns() - t) / len(log) / 1e3
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--replay", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.replay:
        print(json.dumps(replay(args.replay, args.steps), indent=1))
        return 0
    path = os.path.join(tempfile.mkdtemp(prefix="rgpu-replay-"), "messages.pickle")
    record(path, args.quick, args.steps)
    # a process of its own: this one's server is gone, and the executor needs none of rgpu's client
    return subprocess.run([sys.executable, __file__, "--replay", path, "--steps", str(args.steps)]).returncode


if __name__ == "__main__":
    raise SystemExit(main())
