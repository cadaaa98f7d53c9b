"""The nanoGPT example trains on rgpu to the CPU's numbers, and its script runs on the embedded server."""
from __future__ import annotations

import sys

import pytest
import torch
from device_helpers import NANOGPT, rgpu_device, run_python, tiny_gpt  # noqa: F401

sys.path.insert(0, str(NANOGPT))
from data import CharData  # noqa: E402

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 40


def _train(device: str, steps: int = 20) -> list[float]:
    model = tiny_gpt(seed=7).to(device)
    opt = model.configure_optimizer(3e-3)
    data, gen = CharData(TEXT), torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        x, y = data.batch("train", 4, 16, gen)
        _, loss = model(x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def test_twenty_training_steps_on_rgpu_match_the_cpu(rgpu_device):
    cpu, remote = _train("cpu"), _train("rgpu")
    assert remote[-1] < remote[0] - 0.5  # it learns
    assert max(abs(a - b) for a, b in zip(cpu, remote)) < 1e-4, (cpu, remote)


@pytest.mark.slow
def test_the_training_script_runs_on_the_embedded_server_and_resumes(tmp_path):
    args = (f"['--steps', '{{n}}', '--eval-every', '3', '--sample', '20', '--no-progress', "
            f"'--n-layer', '1', '--n-embd', '32', '--n-head', '2', '--out', {str(tmp_path)!r}{{extra}}]")
    script = "import runpy, sys; sys.argv = ['train.py'] + {}; runpy.run_path({!r}, run_name='__main__')"
    first = run_python(script.format(args.format(n=3, extra=""), str(NANOGPT / "train.py")))
    assert first.returncode == 0, first.stderr[-2000:]
    assert "started a local server" in first.stderr
    assert (tmp_path / "ckpt.pt").exists() and (tmp_path / "loss.png").exists()
    again = run_python(script.format(args.format(n=5, extra=", '--resume'"), str(NANOGPT / "train.py")))
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from" in again.stdout and "2 steps" in again.stdout
