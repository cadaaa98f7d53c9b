"""Where a step's time goes: the server's trace (torch.profiler, a span per message) and what the bench reads
from it (``rgpu.bench.timeline``), checked on the CPU executor and on made-up GPU timelines."""
from __future__ import annotations

import gzip
import json

import pytest
import torch
from test_device_executor import define, desc, download, executor, upload

from rgpu.bench import timeline
from rgpu.protocol.ops import Msg


def test_a_trace_names_each_message_and_comes_back_gzipped_with_the_handlers_put_back():
    ex = executor()
    before = dict(ex.handlers)
    define(ex, 1, torch.ops.aten.add.Tensor)
    upload(ex, 10, [1.0, 2.0])
    ex.handle([Msg.PROFILE, "start", "trace"], [], False)
    assert ex.handlers[Msg.OP] is not before[Msg.OP]  # spans only while the trace runs
    for _ in range(3):
        ex.handle([Msg.OP, [], 1, [{"t": desc(10, 2)}, {"t": desc(10, 2)}], {}, [desc(11, 2)]], [], False)
        assert download(ex, desc(11, 2)).tolist() == [2.0, 4.0]
    text, (data,) = ex.handle([Msg.PROFILE, "stop", 10], [], True)
    assert ex.handlers == before
    assert "aten::add" in text
    events = timeline.load(data)
    spans = [e["name"] for e in events if e.get("cat") == "user_annotation"]
    assert spans.count("rgpu OP") == 3 and spans.count("rgpu DOWNLOAD") == 3
    figures = timeline.steps(events)
    assert figures["steps"] == 2 and "gpu_busy" not in figures  # a CPU server has no GPU timeline
    assert 0 < figures["server_busy"] <= figures["wall"]


def test_a_cprofile_still_comes_as_text_and_a_second_start_or_the_session_end_stops_a_trace():
    ex = executor()
    ex.handle([Msg.PROFILE, "start"], [], False)
    upload(ex, 10, [1.0])
    text, buffers = ex.handle([Msg.PROFILE, "stop", 5], [], True)
    assert "function calls" in text and buffers == []
    before = dict(ex.handlers)
    ex.handle([Msg.PROFILE, "start", "trace"], [], False)
    ex.handle([Msg.PROFILE, "start", "trace"], [], False)
    ex.close()
    assert ex.handlers == before and ex.profiler is None


def _event(name, ts, dur, cat="user_annotation"):
    return {"name": name, "cat": cat, "ts": ts, "dur": dur}


def test_the_timeline_splits_steps_at_each_wait_and_measures_the_gpu_and_the_server_in_each():
    # two steps of 1000 us each, ending at the CALL spans (the bench's loss.item()), in microseconds
    events = [
        _event("rgpu CALL", 0, 100), _event("rgpu CALL", 0, 100, "gpu_user_annotation"),
        _event("rgpu OP", 300, 100), _event("k", 350, 200, "kernel"), _event("k", 500, 100, "kernel"),
        _event("rgpu OP", 500, 100), _event("rgpu CALL", 900, 200), _event("c", 950, 50, "gpu_memcpy"),
        _event("rgpu OP", 1400, 300), _event("k", 1500, 500, "kernel"), _event("rgpu CALL", 2000, 100),
    ]
    figures = timeline.steps(events)
    assert figures["steps"] == 2
    # step 1: 100 -> 1100; GPU 350-600 and 950-1000; server 300-400, 500-600, 900-1100
    # step 2: 1100 -> 2100; GPU 1500-2000; server 1400-1700, 2000-2100
    assert figures["wall"] == 1.0
    assert figures["gpu_busy"] == (0.3 + 0.5) / 2 and figures["gpu_idle"] == (0.7 + 0.5) / 2
    assert figures["server_busy"] == (0.4 + 0.4) / 2 and figures["server_waiting"] == 0.6
    assert figures["client_gap"] == (0.2 + 0.3) / 2 and figures["gpu_start"] == (0.25 + 0.4) / 2
    assert timeline.gpu_busy(events) == (250 + 50 + 500) / 1e3


def test_the_boundary_splits_each_steps_start_between_the_reply_the_client_and_the_upload():
    # server: requests end at 100 and 2100; the next step's first messages start at 700 and 2800
    server = [_event("rgpu CALL", 0, 100), _event("rgpu UPLOAD", 700, 50), _event("rgpu CALL", 2000, 100),
              _event("rgpu UPLOAD", 2800, 50)]
    # client: item() returns at 300 and 2400, the next uploads start at 400 and 2600
    client = [_event("step: item", -500, 800, "cpu_op"), _event("step: upload", 400, 100, "cpu_op"),
              _event("step: forward", 500, 200, "cpu_op"), _event("step: item", 1500, 900, "cpu_op"),
              _event("step: upload", 2600, 100, "cpu_op")]
    got = timeline.boundary(server, client)
    assert got["reply_to_client"] == 0.25 and got["client_between_steps"] == 0.15
    assert got["upload_to_server"] == (0.3 + 0.2) / 2
    assert got["upload"] == 0.1 and got["forward"] == 0.2 and got["item"] == pytest.approx(0.85)
    assert "backward" not in got   # a phase never marked has no figure
    assert timeline.boundary(server, []) == {}


def test_the_timeline_reads_the_servers_gzipped_chrome_trace():
    data = gzip.compress(json.dumps({"traceEvents": [_event("rgpu OP", 1, 2)]}).encode())
    assert timeline.load(data) == [_event("rgpu OP", 1, 2)]
    assert timeline.steps(timeline.load(data)) == {}  # no wait, no step


def test_bench_train_traces_its_steps_on_both_ends_pinned_apart_from_its_own_server(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    env["PYTHONPATH"] = str(root / "examples" / "nanogpt")
    trace = tmp_path / "steps.json.gz"
    out = subprocess.run([sys.executable, "-m", "rgpu.bench.train", "--quick", "--json", "--repeats", "1", "--pin",
                          "--trace", str(trace)], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["metric"]: r for r in json.loads(out.stdout)}
    assert rows["max |loss - native loss| over 3 warm-up steps"]["value"] < 1e-4
    traced = {m.split(": ")[-1]: r["value"] for m, r in rows.items() if "(traced, median" in m}
    assert set(traced) == {"wall", "server_busy", "server_waiting", "client_gap",   # a CPU server: no GPU rows
                           *timeline.BOUNDARY_FIGURES}
    assert 0 < traced["server_busy"] <= traced["wall"]
    assert traced["reply_to_client"] + traced["client_between_steps"] <= traced["client_gap"] + 1e-6
    assert timeline.steps(timeline.load(trace.read_bytes()))["steps"] >= 2
    assert "aten::" in Path(str(trace) + ".txt").read_text()
    client = timeline.load(Path(str(trace) + ".client").read_bytes())
    assert {e["name"] for e in client if e["name"].startswith("step: ")} == {f"step: {p}" for p in timeline.PHASES}
    assert "RGPU_SERVER is not set" not in out.stderr  # --pin started the bench's own server
