"""Stock CUDA torch's cuDNN calls through rgpu against the fake server: cudnn-frontend's real call sequence.

``lib_programs/cudnn_torch.py`` runs under a CUDA build of torch (2.11+cu130: its Conv_v8.cpp and MHA.cpp
over the cudnn-frontend it bundles) through ``rgpu intercept run`` against ``rgpu serve --cuda-driver
fake``. Its convolutions (heuristics, engine configs, notes and knobs queried as the frontend queries
them, plans, executions) must give the CPU's values; its cuDNN attention must get through the graph API
to an execution (its by-value scale carried), which the fake refuses by name, without crashing.

CI's torch is CPU-only, so this runs where ``RGPU_TEST_CUDA_TORCH`` names a Python with a CUDA build of
torch (``pip install torch --index-url https://download.pytorch.org/whl/cu130`` in a venv; no GPU needed).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from test_cuda_programs import run
from test_cuda_support import build_shim_or_skip

PROGRAM = Path(__file__).parent / "lib_programs" / "cudnn_torch.py"


@pytest.fixture(scope="module")
def cuda_torch() -> str:
    python = os.environ.get("RGPU_TEST_CUDA_TORCH")
    if not python:
        pytest.skip("needs a CUDA build of stock torch: set RGPU_TEST_CUDA_TORCH to its python (CI's torch is CPU-only)")
    probe = subprocess.run([python, "-c", "import torch; print(torch.version.cuda)"], capture_output=True, text=True,
                           timeout=120)
    if probe.returncode or probe.stdout.strip() in ("", "None"):
        pytest.skip(f"RGPU_TEST_CUDA_TORCH={python} has no CUDA build of torch: {probe.stderr.strip()[-300:]}")
    build_shim_or_skip()
    return python


@pytest.fixture(scope="module")
def traced_fake_server(tmp_path_factory):
    from conftest import RunningServer
    server = RunningServer(tmp_path_factory.mktemp("rgpu-cudnn-torch"), ("--cuda-driver", "fake"),
                           env={"RGPU_CUDA_LIB_TRACE": "1"})
    yield server
    server.stop()


def test_stock_torchs_convolutions_and_cudnn_attention_go_through_the_frontend_without_a_fault(
        cuda_torch, traced_fake_server):
    done = run([cuda_torch, PROGRAM], traced_fake_server, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    got = {line.split()[0]: line.split(None, 1)[1] for line in done.stdout.splitlines() if " " in line}
    # forward, data and filter gradients against the CPU's double, rounded once to the dtype: the same values
    assert float(got["conv_fp32"]) <= 1e-6, done.stdout
    assert float(got["conv_bf16"]) <= 1e-2, done.stdout
    assert "not supported over rgpu" not in done.stderr, done.stderr[-3000:]
    # attention: the graph was built, planned and executed (the scale travelled by value); the fake says no
    assert got["sdpa_cudnn"].startswith("error"), done.stdout
    assert "the fake cuDNN runs a graph of one convolution" in done.stderr, done.stderr[-3000:]
    trace = traced_fake_server.stderr
    execs = [line for line in trace.splitlines() if line.startswith("rgpu lib: cudnnBackendExecute")]
    assert any(" +0B -> 0" in line for line in execs), execs                 # the convolutions ran
    assert any(" +0B" not in line and "one convolution" in line for line in execs), execs   # bytes came along
    assert "GetAttribute answered" in trace and "name=1303" not in trace     # the notes were answered on the client
