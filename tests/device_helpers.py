"""Shared pieces of the device tests: the rgpu session on the test server, a tiny GPT, a script runner.

Test modules import the fixture by name (``from device_helpers import rgpu_device``); a module that
imports ``op_path`` runs each of its tests on the server's C++ op path and on the Python one.
The device session is process-wide, so every device test uses this one fixture:
the first use connects it to the session's test server (never an embedded one).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NANOGPT = ROOT / "examples" / "nanogpt"


_SERVER_C = [True]  # the op path ops_settings() names: the C++ one, or all of it in Python


@pytest.fixture(autouse=True, params=[True, False], ids=["cpp", "python"])
def op_path(request):
    """Every test of a module that imports this runs on the C++ op path and on the Python one (the reference)."""
    _SERVER_C[0] = request.param
    yield request.param
    _SERVER_C[0] = True


def ops_settings(**settings):
    """Settings for an in-process CPU executor, on the op path ``op_path`` picked."""
    from rgpu import config

    return config.settings(environ={}, device="cpu", **{"server_c": _SERVER_C[0], **settings})


@pytest.fixture(scope="session")
def rgpu_device(rgpu_server):
    """The device session, connected to the test server's ops route; yields the session."""
    import torch  # noqa: F401  (registers the device through rgpu's import hook)

    from rgpu.device_backend import session, startup

    if session.current() is None:
        startup.use(rgpu_server.connect("ops"))
    return session.current()


def tiny_gpt(seed: int = 0, **overrides):
    """A GPT small enough for 2-core CI (two layers, 32 wide), built on the CPU with ``seed``."""
    import torch

    sys.path.insert(0, str(NANOGPT))
    from model import GPT, GPTConfig

    cfg = dict(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    cfg.update(overrides)
    torch.manual_seed(seed)
    return GPT(GPTConfig(**cfg))


def run_python(code: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (own device session), with RGPU_* cleared unless given."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=full, cwd=str(ROOT))
