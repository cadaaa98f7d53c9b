"""A PyTorch program on ``device="rgpu"`` trains through dropped connections: a proxy cuts the tcp stream
mid-frame and between a step's ``loss.item()`` applied on the server and its reply read, and the losses are
bit-identical to an uncut run's (the program never notices; the server's RGPU_SESSION_GRACE keeps the session).
"""
from __future__ import annotations

from device_helpers import NANOGPT, run_python

from rgpu.transport.wire import MsgKind

from session_proxy import Cut, CuttingProxy

TRAIN = r'''
import sys
import rgpu, torch
sys.path.insert(0, {nanogpt!r})
from data import CharData
from model import GPT, GPTConfig
torch.manual_seed(7)
model = GPT(GPTConfig(vocab_size=97, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.0)).to("rgpu")
opt = model.configure_optimizer(3e-3)
data, gen = CharData("def add(a, b):\n    return a + b\n" * 60), torch.Generator().manual_seed(3)
for _ in range(12):
    x, y = data.batch("train", 4, 16, gen)
    _, loss = model(x.to("rgpu"), y.to("rgpu"))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    print("loss", loss.item().hex(), flush=True)
from rgpu.device_backend import session
print("resumes", getattr(session.current().conn.transport, "resumes", None), flush=True)
'''


def _losses(address: str, token: str) -> tuple[list[str], str]:
    done = run_python(TRAIN.format(nanogpt=str(NANOGPT)), env={"RGPU_SERVER": address, "RGPU_TOKEN": token,
                                                              "RGPU_TRANSPORT": "tcp"}, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split("\n")
    return [ln.split()[1] for ln in lines if ln.startswith("loss ")], next(ln for ln in lines if ln.startswith("resumes"))


def test_a_gpt_trains_through_cut_connections_to_the_losses_of_an_uncut_run(start_server):
    server = start_server("--device", "cpu", "--spare-workers", "1", "--preload", "torch",
                          env={"RGPU_SESSION_GRACE": "30", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    # one thread per worker: a CPU reduction's order then never depends on how many threads a worker got
    uncut, _ = _losses(server.address, server.token)
    cuts = {0: Cut("up", offset=150_000),                  # mid-frame, a few steps in
            1: Cut("down", kind=MsgKind.REPLY, nth=3),     # a loss.item() applied, its reply never read
            2: Cut("up", offset=7_000)}
    proxy = CuttingProxy((server.host, server.port), cuts)
    try:
        cut, resumes = _losses(proxy.address, server.token)
    finally:
        proxy.close()
    assert len(uncut) == 12 and cut == uncut, (uncut, cut)
    assert resumes == f"resumes {len(proxy.cuts_done)}" and len(proxy.cuts_done) == 3, (resumes, proxy.cuts_done)
    assert "Traceback" not in server.stderr
