"""The C++ fast path (device_backend/fast_path.cpp) sends what the Python fallback would, and trains to the same numbers.

Each test starts sessions of its own on the test server, with ``RGPU_FAST_PATH`` on
or off, and leaves a fast-path session behind for the tests after it.
"""
from __future__ import annotations

import msgpack
import pytest
import torch
from device_helpers import rgpu_device  # noqa: F401

from rgpu.ops_protocol import Msg


class Recorder:
    """A connection that keeps every message it posts or requests, decoded as the server decodes it."""

    def __init__(self, conn):
        self.conn, self.seen = conn, []

    def __getattr__(self, name):
        return getattr(self.conn, name)

    def _keep(self, meta):
        self.seen.append(msgpack.unpackb(msgpack.packb(meta, use_bin_type=True), raw=False))

    def post(self, meta, buffers=()):
        self._keep(meta)
        return self.conn.post(meta, buffers)

    def post_packed(self, meta: bytes, buffers=()):
        self.seen.append(msgpack.unpackb(meta, raw=False))
        return self.conn.post_packed(meta, buffers)

    def request(self, meta, buffers=(), reply_into=None):
        self._keep(meta)
        return self.conn.request(meta, buffers, reply_into)


@pytest.fixture
def start(rgpu_device, rgpu_server, monkeypatch):  # noqa: F811
    """``start(fast)``: a new device session on the test server, recorded; a fast one is left at the end."""
    from rgpu.device_backend import session

    def begin(fast: bool) -> Recorder:
        monkeypatch.setenv("RGPU_FAST_PATH", "1" if fast else "0")
        rec = Recorder(rgpu_server.connect("ops"))
        session.use(rec)
        session.current().C.fast_path_stats(reset=True)
        return rec

    yield begin
    monkeypatch.setenv("RGPU_FAST_PATH", "1")
    session.use(rgpu_server.connect("ops"))


def _stats():
    from rgpu.device_backend import session

    return session.current().C.fast_path_stats()


def _mix(device: str) -> list[torch.Tensor]:
    """Ops of every shape the fast path replays: in-place with changing scalars, views, lists, reductions, dtypes."""
    torch.manual_seed(0)
    a = torch.randn(4, 6).to(device)
    b = torch.randn(6, 3).to(device)
    i = torch.arange(12, dtype=torch.int64).reshape(3, 4).to(device)
    out = []
    for step in range(3):
        a.mul_(0.5 + step)  # in-place: keyed by the scalar's type, so the value changes and it still hits
        a.add_(torch.ones_like(a), alpha=0.25 * step)
        c = a @ b
        d = torch.cat([c, c * 2.0, c.relu()], dim=1)
        parts = d.split([2, 2, 5], dim=1)
        e = torch.stack([p.sum(dim=1) for p in parts[:2]])
        f = d.mean(dim=0, keepdim=True) - d.amax(dim=1, keepdim=True)
        g = (i * 3 + step).to(torch.float32).softmax(dim=-1).half().float()
        h = d.t().contiguous().view(-1)[::2]
        k = torch.where(d > 0, d, torch.zeros_like(d)).sum()
        out += [a.clone(), c, d, e, f, g, h, k, (i % 5).bitwise_and(3)]
    return out


def _canonical(messages: list) -> list:
    """The OP and DEFINE messages, storage ids renamed in order of first sight (events left out: frees come when Python drops a tensor)."""
    names: dict = {}

    def sid(x):
        return names.setdefault(x, len(names))

    def walk(v):
        if isinstance(v, dict):
            if "t" in v:
                d = v["t"]
                return {"t": [sid(d[0]), *d[1:]]}
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    kept = []
    for m in messages:
        if m[0] == Msg.OP:
            outs = None if m[5] is None else [None if o is None else [sid(o[0]), *o[1:]] for o in m[5]]
            kept.append([m[0], m[2], walk(m[3]), walk(m[4]), outs])
        elif m[0] == Msg.DEFINE:
            kept.append(m)
        elif m[0] in (Msg.UPLOAD, Msg.DOWNLOAD):
            kept.append([m[0], sid(m[2][0]), *m[2][1:]])
        elif m[0] == Msg.CALL:  # its reserved ids come from the same counter: left out
            kept.append([m[0], m[2], walk(m[3]), walk(m[4])])
    return kept


def test_the_server_receives_the_same_messages_with_the_fast_path_on_and_off(start):
    rec = start(False)
    slow = [t.cpu() for t in _mix("rgpu")]
    assert _stats()["hits"] == 0
    off = _canonical(rec.seen)
    rec = start(True)
    fast = [t.cpu() for t in _mix("rgpu")]
    stats = _stats()
    on = _canonical(rec.seen)
    assert stats["hits"] > 20, stats
    assert len(on) == len(off)
    for n, (x, y) in enumerate(zip(on, off)):
        assert x == y, f"message {n} differs:\n on {x}\noff {y}"
    for x, y in zip(fast, slow):
        assert torch.equal(x, y)
    for x, y in zip(fast, _mix("cpu")):
        torch.testing.assert_close(x, y)


def _train(device: str, steps: int = 6, stats_after: int | None = None):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 4)).to(device)
    adam = torch.optim.AdamW(model[:3].parameters(), lr=1e-2, weight_decay=0.1)
    sgd = torch.optim.SGD(model[3].parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(2)
    losses, stats = [], None
    for step in range(steps):
        if step == stats_after:
            _stats_reset()
        x, y = torch.randn(5, 8, generator=gen), torch.randint(0, 4, (5,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        adam.zero_grad(set_to_none=True)
        sgd.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        adam.step()
        sgd.step()
        for group in adam.param_groups:
            group["lr"] *= 0.9  # a scalar that changes every step
        losses.append(loss.detach())
        if step == stats_after:
            stats = _stats()
    return [l.cpu() for l in losses], [p.detach().cpu() for p in model.parameters()], stats


def _stats_reset():
    from rgpu.device_backend import session

    session.current().C.fast_path_stats(reset=True)


def test_a_training_loop_with_the_fast_path_matches_the_cpu_and_the_fast_path_off(start):
    cpu_losses, cpu_params, _ = _train("cpu")
    start(False)
    off_losses, off_params, _ = _train("rgpu")
    start(True)
    on_losses, on_params, _ = _train("rgpu")
    for on, off, cpu in zip(on_losses + on_params, off_losses + off_params, cpu_losses + cpu_params):
        assert torch.equal(on, off)
        torch.testing.assert_close(on, cpu, rtol=1e-5, atol=1e-6)


def test_a_steady_training_step_posts_its_ops_from_cpp(start):
    start(True)
    _, _, stats = _train("rgpu", steps=4, stats_after=3)
    assert stats["misses"] == 0, stats
    assert stats["hits"] > 3 * stats["passes"], stats


def test_with_the_fast_path_off_nothing_streams_from_cpp(start):
    start(False)
    _train("rgpu", steps=2)
    assert _stats()["hits"] == 0


def test_a_shape_error_still_comes_from_pytorch_at_the_call(start):
    start(True)
    a, b = torch.ones(2, 3, device="rgpu"), torch.ones(4, 5, device="rgpu")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="size of tensor a"):
            a + b
    c = torch.ones(2, 3, device="rgpu")
    for _ in range(3):
        c = c + a
    assert _stats()["hits"] >= 1
    assert torch.equal(c.cpu(), torch.full((2, 3), 4.0))
