"""One session's fatal CUDA error (a device-side assert) while another trains: only the first ends, with the
error named; the trainer's weights equal the same steps run natively on the GPU.

The CPU test below checks the worker's half everywhere (an op failing with a sticky CUDA error's message: its
ERROR, then a BYE that names it); the GPU test is the real thing (``gpu/check_resilience.sh`` runs it).
"""
from __future__ import annotations


import pytest
import torch

from rgpu.errors import RemoteError, SessionLost
from rgpu.protocol.ops import DTYPES, Msg
from rgpu.server.route import Executor
from rgpu.transport.wire import BufferPool, Limits, MsgKind, encode_frame

from in_process import session_on_a_thread
from test_resilience_killed import Trainer

aten = torch.ops.aten
F32, I64 = DTYPES.index("float32"), DTYPES.index("int64")


class Asserting(Executor):
    def handle(self, meta, buffers, reply):
        if meta == "assert":
            raise RuntimeError("CUDA error: device-side assert triggered\nCompile with TORCH_USE_CUDA_DSA ...")
        if meta == "bug":
            raise KeyError("an ordinary failure")
        return None

    def close(self):
        pass


def test_an_op_failing_with_a_sticky_cuda_error_ends_its_session_with_the_error_named(monkeypatch):
    with session_on_a_thread(monkeypatch, Asserting) as (client, t):
        ask = lambda meta, seq: (client.send([encode_frame(MsgKind.REQUEST, seq, meta)]),   # noqa: E731
                                 client.recv_frame(Limits(), BufferPool()))[1]
        assert ask("bug", 1).kind == MsgKind.ERROR and ask("ok", 2).kind == MsgKind.REPLY   # an ordinary one: goes on
        err = ask("assert", 3)
        assert err.kind == MsgKind.ERROR and "device-side assert" in err.meta["message"]
        bye = client.recv_frame(Limits(), BufferPool())
        assert bye.kind == MsgKind.BYE and bye.meta["error"] == "FatalDeviceError"
        assert "fatal CUDA error" in bye.meta["reason"] and "device-side assert triggered" in bye.meta["reason"]
        t.join(10)
        assert not t.is_alive()


def _desc(sid: int, dtype: int, n: int, item: int = 4) -> list:
    return [sid, n * item, dtype, [n], [1], 0, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU: a device-side assert on a CUDA server")
def test_a_device_side_assert_ends_only_its_session_while_another_trains(start_server):
    server = start_server("--device", "cuda", "--spare-workers", "2", env={"RGPU_SERVER_C": "0"})   # (no C++ build)
    trainer = Trainer(server.connect("ops"))
    for _ in range(5):
        trainer.step()
    victim = server.connect("ops")
    op = aten.index_select.default
    victim.post([Msg.DEFINE, 1, f"{op._schema.name[6:]}.{op._overloadname}", str(op._schema)])
    victim.post([Msg.UPLOAD, [], _desc(1, F32, 16)], [torch.arange(16, dtype=torch.float32).numpy()])
    victim.post([Msg.UPLOAD, [], _desc(2, I64, 1, 8)], [torch.tensor([1 << 20]).numpy()])   # out of bounds
    victim.post([Msg.OP, [], 1, [{"t": _desc(1, F32, 16)}, 0, {"t": _desc(2, I64, 1, 8)}], {}, [_desc(3, F32, 1)]])
    errors = []
    with pytest.raises(SessionLost) as lost:
        for _ in range(5):          # the assert surfaces at the next sync: an ERROR naming it, then the BYE
            try:
                victim.call([Msg.DOWNLOAD, [], _desc(3, F32, 1)]).release()
            except RemoteError as exc:
                errors.append(str(exc))
    assert "fatal CUDA error" in str(lost.value) and "device-side assert" in str(lost.value), (str(lost.value), errors)
    for _ in range(20):             # the other session goes on, on the same GPU
        trainer.step()
    got = trainer.weights()
    # the same steps natively on the GPU: the reference, value by value
    x, xt, y, w = (t.cuda() for t in (trainer.x, trainer.xt, trainer.y, torch.zeros(8, 1)))
    for _ in range(trainer.steps):
        w = torch.sub(w, torch.mm(xt, torch.sub(torch.mm(x, w), y)), alpha=trainer.lr)
    assert torch.equal(got, w.cpu()), (got - w.cpu()).abs().max()
