"""The C++ fast path (device_backend/fast_path.cpp) sends what the Python fallback would, and trains to the same numbers.

Each test starts sessions of its own on the test server, with the fast path on
or off (``RGPU_NATIVE=auto|off``), and leaves a fast-path session behind for the tests after it.
"""
from __future__ import annotations

import json
import signal

import msgpack
import pytest
import torch
from device_helpers import rgpu_device, run_python  # noqa: F401

from rgpu.protocol.ops import Msg


class Recorder:
    """A connection that keeps every message it posts, requests or calls, decoded as the server decodes it."""

    def __init__(self, conn):
        self.conn, self.seen = conn, []
        self.after_sent = None   # called once a call's request is written, after the caller's own ``sent``

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

    def call(self, meta, buffers=(), reply_into=None, timeout=None, sent=None):
        self._keep(meta)
        if self.after_sent is not None and sent is not None:
            first, sent = sent, lambda: (first(), self.after_sent())
        return self.conn.call(meta, buffers, reply_into, timeout, sent)


@pytest.fixture
def start(rgpu_device, rgpu_server, monkeypatch):  # noqa: F811
    """``start(fast)``: a new device session on the test server, recorded; a fast one is left at the end."""
    from rgpu.device_backend import session, startup

    def begin(fast: bool) -> Recorder:
        monkeypatch.setenv("RGPU_NATIVE", "auto" if fast else "off")
        rec = Recorder(rgpu_server.connect("ops"))
        startup.use(rec)
        session.current().C.fast_path_stats(reset=True)
        return rec

    yield begin
    monkeypatch.setenv("RGPU_NATIVE", "auto")
    startup.use(rgpu_server.connect("ops"))


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
        # composites whose intermediates live only on the boxed stack (freed once the op is posted)
        m = torch.fft.hfftn(d, s=(3, 10), dim=(0, 1), norm="ortho")
        # attention: returns ints and undefined tensors (max_q, cum_seq_q), which its backward takes back
        q = d[:, :8].reshape(1, 1, 4, 8).contiguous().detach().requires_grad_()   # aligned rows: fused
        att = torch.nn.functional.scaled_dot_product_attention(q, q * 0.5, q, is_causal=True)
        (grad,) = torch.autograd.grad(att.sum(), q)
        out += [a.clone(), c, d, e, f, g, h, k, m, (i % 5).bitwise_and(3), att.detach(), grad]
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
            if "j" in v:  # [descriptor, conj, neg]
                d = v["j"][0]
                return {"j": [[sid(d[0]), *d[1:]], *v["j"][1:]]}
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


def _no_storage_is_named_after_its_free(messages: list) -> None:
    """The server applies a message's events before its op: a storage freed there must not be named again."""
    freed: set = set()

    def names(v):
        if isinstance(v, dict):
            return [v["t"][0]] if "t" in v else [v["j"][0][0]] if "j" in v else []
        return [n for x in v for n in names(x)] if isinstance(v, list) else []

    for n, m in enumerate(messages):
        if m[0] in (Msg.OP, Msg.CALL, Msg.UPLOAD, Msg.DOWNLOAD, Msg.EVENTS):
            events = m[1]
            i = 0
            while i < len(events):
                if events[i] == 0:
                    freed.add(events[i + 1])
                i += 2 if events[i] == 0 else 6
        used = []
        if m[0] == Msg.OP:
            used = names(m[3:5]) + [o[0] for o in m[5] or () if o is not None]
        elif m[0] == Msg.CALL:
            used = names(m[3:5])
        elif m[0] in (Msg.UPLOAD, Msg.DOWNLOAD):
            used = [m[2][0]]
        assert not freed & set(used) - {0}, f"message {n} names a freed storage: {m}"


def test_the_server_receives_the_same_messages_with_the_fast_path_on_and_off(start):
    rec = start(False)
    slow = [t.cpu() for t in _mix("rgpu")]
    assert _stats()["hits"] == 0
    off = _canonical(rec.seen)
    rec = start(True)
    fast = [t.cpu() for t in _mix("rgpu")]
    stats = _stats()
    on = _canonical(rec.seen)
    _no_storage_is_named_after_its_free(rec.seen)
    assert stats["hits"] > 20, stats
    assert len(on) == len(off)
    for n, (x, y) in enumerate(zip(on, off)):
        assert x == y, f"message {n} differs:\n on {x}\noff {y}"
    for x, y in zip(fast, slow):
        assert torch.equal(x, y)
    for x, y in zip(fast, _mix("cpu")):   # a GPU server's fused attention sums in another order (1.8e-5 apart)
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


PURE_PYTHON = """
import json, sys
sys.path.insert(0, "tests")
import torch, rgpu
from rgpu.device_backend import registration, startup
from rgpu.transport.client import connect
import test_fast_path_ops as T
rec = T.Recorder(connect("ops"))
startup.use(rec)
assert registration.has_python_fallback()  # PyTorch's own Python fallback, never the C++ one
values = [t.cpu().tolist() for t in T._mix("rgpu")]
print(json.dumps({"messages": T._canonical(rec.seen), "values": values}))
"""


def test_the_messages_match_those_of_a_process_that_never_installs_the_fast_path(start, rgpu_server):
    got = run_python(PURE_PYTHON, env={"RGPU_SERVER": rgpu_server.address, "RGPU_TOKEN": rgpu_server.token,
                                       "RGPU_NATIVE": "off"})
    assert got.returncode == 0, got.stderr[-2000:]
    pure = json.loads(got.stdout.strip().splitlines()[-1])
    rec = start(True)
    values = [t.cpu().tolist() for t in _mix("rgpu")]
    assert _stats()["hits"] > 20
    _no_storage_is_named_after_its_free(rec.seen)
    on = json.loads(json.dumps(_canonical(rec.seen)))  # the same JSON round trip (tuples to lists)
    assert len(on) == len(pure["messages"])
    for n, (x, y) in enumerate(zip(on, pure["messages"])):
        assert x == y, f"message {n} differs:\n   fast {x}\n python {y}"
    assert values == pure["values"]


class _Attention(torch.nn.Module):
    """Causal self-attention over 16 features as 1 head x 2 positions x 8 (fused attention needs a multiple of
    8): the fused attention op and its backward, whose arguments include the forward's undefined tensors."""

    def forward(self, h):
        x = h.view(h.shape[0], 1, 2, 8)
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True).reshape(h.shape)


def _train(device: str, steps: int = 6, stats_after: int | None = None):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), _Attention(),
                                torch.nn.Linear(16, 4)).to(device)
    adam = torch.optim.AdamW(model[:3].parameters(), lr=1e-2, weight_decay=0.1)
    sgd = torch.optim.SGD(model[4].parameters(), lr=0.05, momentum=0.9)
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
    rec = start(True)
    on_losses, on_params, _ = _train("rgpu")
    _no_storage_is_named_after_its_free(rec.seen)
    for on, off, cpu in zip(on_losses + on_params, off_losses + off_params, cpu_losses + cpu_params):
        assert torch.equal(on, off)
        torch.testing.assert_close(on, cpu, rtol=1e-5, atol=1e-6)


def test_a_steady_training_step_posts_its_ops_from_cpp(start):
    start(True)
    _, _, stats = _train("rgpu", steps=4, stats_after=3)
    # every op, attention's (ints and undefined tensors among its results) and its backward's too
    assert stats["misses"] == 0 and stats["passes"] == 0 and stats["hits"] > 30, stats


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


def test_threads_streaming_at_once_each_get_their_own_numbers(start):
    import threading

    start(True)
    results, errors = {}, []

    def chain(k: int):
        try:
            y = torch.full((3,), float(k), device="rgpu")
            for step in range(200):
                y = y * 1.01 + k
                y.sub_(0.5 * step)
            results[k] = y.cpu()
        except Exception as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=chain, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for k in range(4):
        y = torch.full((3,), float(k))
        for step in range(200):
            y = y * 1.01 + k
            y.sub_(0.5 * step)
        assert torch.equal(results[k], y)
    assert _stats()["hits"] > 1000


def test_unusual_arguments_go_to_python_and_still_run(start):
    start(True)
    x = torch.arange(4, dtype=torch.float32, device="rgpu")
    z = torch.tensor([1 + 2j, 3 - 1j], device="rgpu")
    for _ in range(3):
        a = x + torch.tensor(2.0)  # a CPU scalar tensor: its value is data, Python's business
        b = (z.conj() * 2).resolve_conj()  # a conjugate view
    assert _stats()["passes"] >= 3
    assert torch.equal(a.cpu(), torch.arange(4.0) + 2)
    assert torch.equal(b.cpu(), torch.tensor([2 - 4j, 6 + 2j]))


def test_small_uploads_are_posted_from_cpp_and_the_rest_from_python(start):
    rec = start(True)
    x = torch.randn(64, 32)
    on_device = x.to("rgpu")
    sent = x.clone()
    x.add_(1.0)  # the caller's memory changes once .to() returned: the server has the bytes of the call
    assert _stats()["uploads"] == 1
    kind, events, desc = rec.seen[-1]
    assert kind == Msg.UPLOAD and isinstance(events, list) and desc[2:5] == [6, [64, 32], [32, 1]]
    others = [x.t(),                              # strided: made contiguous first, Python's
              torch.randn(300 << 10 >> 2),        # past RGPU_POST_COPY_BYTES: pieces and pinned memory, Python's
              torch.arange(6, dtype=torch.int32)]  # converted below
    moved = [others[0].to("rgpu"), others[1].to("rgpu"), others[2].to("rgpu", torch.float64)]
    assert _stats()["uploads"] == 1, _stats()
    torch.testing.assert_close(on_device.cpu(), sent, rtol=0, atol=0)
    for got, want in zip(moved[:2], others[:2]):
        assert torch.equal(got.cpu(), want)
    assert torch.equal(moved[2].cpu(), torch.arange(6, dtype=torch.float64))
    for value in (torch.tensor([True, False, True]), torch.tensor([1 + 2j, -1j]).conj(), torch.tensor(7)):
        assert torch.equal(value.to("rgpu").cpu().resolve_conj(), value.resolve_conj())
    pinned = torch.arange(16384.0).pin_memory()   # 64 KiB of pinned memory, which shm could name: copied all the same
    before = _stats()["uploads"]
    moved = pinned.to("rgpu")
    pinned.zero_()
    assert _stats()["uploads"] == before + 1
    assert torch.equal(moved.cpu(), torch.arange(16384.0))


DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)


def test_small_downloads_and_items_are_read_from_cpp_and_the_rest_from_python(start):
    rec = start(True)
    for dtype in DTYPES:
        want = torch.tensor([True, False, True]) if dtype == torch.bool else (torch.arange(3) * 7 - 5).to(dtype)
        on_device = want.to("rgpu")
        before = _stats()
        got = [on_device[i].item() for i in range(3)]
        assert got == want.tolist() and [type(v) for v in got] == [type(v) for v in want.tolist()], dtype
        assert torch.equal(on_device.cpu(), want), dtype
        after = _stats()
        assert (after["items"] - before["items"], after["downloads"] - before["downloads"]) == (3, 1), dtype
    kind, events, desc = rec.seen[-1]    # the .cpu(): a download of the tensor as Python asks for it
    assert kind == Msg.DOWNLOAD and isinstance(events, list) and desc[2:5] == [10, [3], [1]]
    x = torch.randn(8, 4)
    d = x.to("rgpu")
    before = _stats()["downloads"]
    into = torch.empty(4, 8)
    into.t().copy_(d)                            # a strided destination: Python's
    big = torch.randn(300 << 10 >> 2)            # past RGPU_POST_COPY_BYTES: Python's (shm may name pinned memory)
    assert torch.equal(into.t(), x) and torch.equal(big.to("rgpu").cpu(), big)
    assert torch.equal(d.to(torch.float64).cpu(), x.double())   # converted on the device, then read in C++
    assert torch.equal(d.cpu().to(torch.float64), x.double())
    assert torch.equal(torch.empty(0, device="rgpu").cpu(), torch.empty(0))
    assert _stats()["downloads"] == before + 2, _stats()
    z = torch.tensor([1 + 2j], device="rgpu").conj()
    assert z.cpu().resolve_conj().item() == 1 - 2j     # a conjugate view: Python applies the bit


def test_a_small_read_with_nothing_in_flight_is_a_lone_call_and_the_session_lock_is_free_once_it_is_written(start):
    import threading

    from rgpu.device_backend import session

    rec = start(True)
    lock, conn = session.current().lock, rec.conn
    requests, free = [], []
    plain = conn.request
    conn.request = lambda *a, **k: requests.append(a[0]) or plain(*a, **k)   # call()'s path with a future

    def another_thread_takes_the_lock():
        t = threading.Thread(target=lambda: free.append(lock.acquire(timeout=5) and (lock.release() or True)))
        t.start()
        t.join()
    rec.after_sent = another_thread_takes_the_lock
    x = torch.arange(6.0).to("rgpu")
    y = (x * 2.0)[4]
    conn.flush()                           # nothing queued, nothing pending: the call goes alone
    assert y.item() == 8.0
    z = x + 1.0
    conn.flush()
    assert torch.equal(z.cpu(), torch.arange(1.0, 7.0))
    assert requests == [] and free == [True, True], (requests, free)
    assert _stats()["items"] == 1 and _stats()["downloads"] == 1


def test_a_server_gone_reaches_the_caller_of_cpps_item_and_cpu_by_name(start, start_server):
    from rgpu.device_backend import startup
    from rgpu.errors import SessionLost

    start(True)   # (its teardown leaves a fast session on the shared test server again)
    server = start_server()
    startup.use(server.connect("ops"))
    x = torch.arange(4.0).to("rgpu")
    assert x[1].item() == 1.0 and torch.equal(x.cpu(), torch.arange(4.0)) and _stats()["items"] == 1
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(15) == 0
    with pytest.raises(SessionLost, match="shutting down"):
        x[2].item()
    with pytest.raises(SessionLost):
        x.cpu()


def test_a_plan_in_cpp_terms_holds_int_and_undefined_results_but_not_a_none_in_a_list():
    from rgpu.device_backend import meta, optable

    f32 = meta.CODE[torch.float32]
    attention = torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default
    out, lse = ("new", f32, (1, 1, 4, 8), (32, 32, 8, 1)), ("new", f32, (1, 1, 4), (4, 4, 1))
    none, four = ("value", None), ("value", 4)
    plan = meta.Plan((out, lse, none, none, four, four, none, none, none), [], True)
    assert meta.express(plan, attention, optable.info(attention), 7) == (
        7, True, [(0, f32, [1, 1, 4, 8], [32, 32, 8, 1]), (0, f32, [1, 1, 4], [4, 4, 1]), (5,), (5,), (4, 4), (4, 4),
                  (5,), (5,), (5,)], [])
    split = torch.ops.aten.split_with_sizes.default   # -> Tensor[]: a None among its items has no C++ terms
    alias = ("alias", ("a", 0), f32, (2,), (1,), 0, False, False)
    assert meta.express(meta.Plan([alias, none], [], False), split, optable.info(split), 0) is None
    assert meta.express(meta.Plan([alias, alias], [], False), split, optable.info(split), 0) is not None
