"""``rgpu bench cuda --torch`` (bench/cuda_torch.py): stock CUDA PyTorch's steps through rgpu beside native.

The rows are made from the children's JSON lines (checked here from made-up figures: the ratio is the
median of the interleaved pairs, the round-trip row's baseline native + 1.5 RTT); without a CUDA torch
the command says so; with one (``RGPU_TEST_CUDA_TORCH_PYTHON``: stock torch 2.11+cu130, no GPU needed)
``--quick`` runs against ``rgpu serve --cuda-driver fake``, where the steps are GEMM and convolution
stand-ins (the fake runs none of torch's own kernels) and the waits per step are counted by the client.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import clean_env


def _side(ms, waits=1, first=40, losses=(5.5, 5.4), error=None):
    case = {"step_ms": ms, "waits": [waits] * len(ms), "first_step_waits": first, "setup_waits": 7,
            "losses": list(losses), "last_step_waits_by_name": {"memcpy_dtoh": waits}}
    cases = {name: dict(case) for name in ("gpt_4x128", "gpt_6x384", "cnn", "gpt_4x128_graph")}
    if error:
        cases["cnn"] = {"error": error}
    return {"cases": cases, "rgpu": True, "stand_in": False}


def test_rows_pair_each_run_with_its_native_neighbour_and_count_waits():
    from rgpu.bench import cuda_torch
    ours = [_side([11.0, 12.0, 13.0], waits=2), _side([22.0, 22.0, 22.0], waits=2, error="AcceleratorError: boom")]
    natives = [_side([10.0, 10.0, 10.0], losses=(5.5, 5.3)), _side([20.0, 20.0, 20.0])]
    rtt = [_side([80.0, 81.0, 82.0])]
    rows = {r["metric"]: r for r in cuda_torch.make_rows(ours, natives, rtt, quick=False)}
    step = rows["GPT 4 layers/128 wide eager step"]
    assert step["value"] == 17.0 and step["baseline"] == 15.0
    assert step["ratio"] == pytest.approx(1.15) and step["ratio_spread"] == [pytest.approx(1.1), pytest.approx(1.2)]
    assert step["target_ratio"] == 1.10 and step["spread"] == [12.0, 22.0]
    assert rows["GPT 4 layers/128 wide eager step: waits per step"]["value"] == 2
    assert rows["GPT 4x128: the process's first step's synchronous calls"]["value"] == 40
    assert rows["GPT 4 layers/128 wide eager step: max |loss - native loss|"]["value"] == pytest.approx(0.05)
    assert "AcceleratorError: boom" in rows["CNN SGD step"]["errors"][0]
    over = rows["GPT 4x128 eager step over RGPU_SIM_RTT_MS=30"]
    assert over["value"] == 81.0 and over["baseline"] == 15.0 + 45.0
    for r in rows.values():                                  # the foundation schema
        assert {"bench", "transport", "metric", "unit", "size", "value", "baseline_name", "baseline", "ratio",
                "spread"} <= set(r)


def test_queue_rows_run_each_size_beside_a_native_run_and_pass_the_size_to_the_rgpu_side(monkeypatch):
    from rgpu.bench import cuda_torch
    calls = []

    def child(cmd, env, timeout):
        q = env.get("RGPU_CUDA_QUEUE_BYTES") if "intercept" in cmd else None
        calls.append(q)
        return _side({None: [10.0] * 3, "262144": [12.0] * 3, "16384": [11.0] * 3}[q])
    monkeypatch.setattr(cuda_torch, "torch_python", lambda: sys.executable)
    monkeypatch.setattr(cuda_torch, "_run_child", child)
    args = type("Args", (), {"queue_bytes": "256K,16K", "repeats": 2, "steps": 5})()
    rows = {r["metric"]: r for r in cuda_torch.queue_rows(args, {"RGPU_SERVER": "x:1"})}
    assert calls == [None, "262144", "16384"] * 2                 # interleaved: native, then each size
    big = rows["GPT 6 layers/384 wide eager step, RGPU_CUDA_QUEUE_BYTES=262144"]
    small = rows["GPT 6 layers/384 wide eager step, RGPU_CUDA_QUEUE_BYTES=16384"]
    assert big["ratio"] == pytest.approx(1.2) and small["ratio"] == pytest.approx(1.1) and small["size"] == 16384
    assert "GPT 4 layers/128 wide eager step, RGPU_CUDA_QUEUE_BYTES=16384" in rows


def test_a_queue_entry_first_colon_limit_sets_the_first_posts_size_too(monkeypatch):
    from rgpu.bench import cuda_torch
    seen = []

    def child(cmd, env, timeout):
        if "intercept" in cmd:
            seen.append((env.get("RGPU_CUDA_QUEUE_FIRST_BYTES"), env["RGPU_CUDA_QUEUE_BYTES"]))
            return _side([9.0] * 3 if env.get("RGPU_CUDA_QUEUE_FIRST_BYTES") == "8192" else [12.0] * 3)
        return _side([10.0] * 3)
    monkeypatch.setattr(cuda_torch, "torch_python", lambda: sys.executable)
    monkeypatch.setattr(cuda_torch, "_run_child", child)
    monkeypatch.delenv("RGPU_CUDA_QUEUE_FIRST_BYTES", raising=False)
    args = type("Args", (), {"queue_bytes": "64K:64K,8K:64K", "repeats": 1, "steps": 5})()
    rows = {r["metric"]: r for r in cuda_torch.queue_rows(args, {"RGPU_SERVER": "x:1"})}
    assert seen == [("65536", "65536"), ("8192", "65536")]
    fixed = rows["GPT 6 layers/384 wide eager step, RGPU_CUDA_QUEUE_BYTES=65536, RGPU_CUDA_QUEUE_FIRST_BYTES=65536"]
    ramp = rows["GPT 6 layers/384 wide eager step, RGPU_CUDA_QUEUE_BYTES=65536, RGPU_CUDA_QUEUE_FIRST_BYTES=8192"]
    assert fixed["ratio"] == pytest.approx(1.2) and ramp["ratio"] == pytest.approx(0.9) and ramp["size"] == 65536


def test_without_a_cuda_torch_it_says_so(monkeypatch):
    from rgpu.bench import cuda_torch
    from rgpu.errors import ConfigError
    monkeypatch.setattr(cuda_torch, "torch_python", lambda: None)
    with pytest.raises(ConfigError, match="no CUDA torch here"):
        cuda_torch.rows(None, {})


def test_the_native_side_gets_no_rgpu_variable_nor_library_path(monkeypatch):
    from rgpu.bench import cuda_torch
    monkeypatch.setenv("RGPU_SERVER", "x:1")
    monkeypatch.setenv("LD_AUDIT", "/x/librgpu_redirect.so")
    env = cuda_torch.native_env()
    assert "RGPU_SERVER" not in env and "LD_AUDIT" not in env and env["PATH"] == os.environ["PATH"]


def test_quick_runs_stock_cuda_torch_against_the_fake_server():
    python = os.environ.get("RGPU_TEST_CUDA_TORCH_PYTHON")
    if not python:
        pytest.skip("set RGPU_TEST_CUDA_TORCH_PYTHON to a Python with stock torch 2.11+cu130 and rgpu importable")
    done = subprocess.run([sys.executable, "-m", "rgpu", "bench", "cuda", "--torch", "--quick", "--json"],
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
                          env=clean_env(TORCH_PYTHON=python))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["metric"].split(" (")[0]: r for r in json.loads(done.stdout)}
    for name in ("GPT 4 layers/128 wide eager step", "GPT 6 layers/384 wide eager step", "CNN SGD step"):
        assert rows[name]["value"] > 0 and "errors" not in rows[name], rows[name]
        assert rows[name + ": waits per step"]["value"] >= 1      # the .item(): counted, not assumed
    assert "capture_begin" in rows["GPT 4x128 step captured by torch.cuda.graph, replayed"]["skipped"]
    assert rows["GPT 4x128: the process's first step's synchronous calls"]["value"] >= 1
    assert rows["GPT 4x128 eager step over RGPU_SIM_RTT_MS=30"]["value"] >= 30.0   # at least its one wait
