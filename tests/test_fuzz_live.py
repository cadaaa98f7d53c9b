"""A live server fuzzed over its socket while a second session trains: no crash, no hang, the training unchanged.

Hypothesis drives raw clients (a socket, the wire codec, the handshake; no Connection) at one running
``rgpu serve`` with the ops route on the CPU and the cuda route on the fake driver:

    pre-auth   one connection a case: garbage bytes; frame headers with hostile magic, version, kind,
               flags and lengths (the body short, long or missing); HELLOs of wrong types and shapes;
               a valid HELLO, then a hostile PROOF. The client then closes its sending side and must
               be answered or closed within ``ANSWER_S``.
    ops        after one handshake, many cases on one session: messages of every ops-route kind (and
               unknown ones) with arguments of wrong types, arities, huge or negative numbers,
               descriptors naming storages, dtypes, devices and geometries that do not exist, ops run on
               defined op indices (the C++ op path) and undefined ones. Each request gets its REPLY or
               ERROR; posts are followed by a request that must be answered.
    cuda       the same on the cuda route: every driver call by name (and unknown ones) with hostile
               arguments and handles, queued launch records of random bytes, image loads.

A few session cases break the framing after the handshake (a kind a client may not send, unknown flags,
a truncated body): those sessions must end with a BYE or a close, and the next one is accepted.
Meanwhile a least-squares fit trains over the ops route (``Trainer``), checked at the end against the
same steps on the CPU, value by value; the acceptor must be alive and still accept sessions.

``RGPU_FUZZ_CASES`` (default 10000: 10,100 cases, about 85 s on 2 cores) is the total; the large run:
``RGPU_FUZZ_CASES=30000 RGPU_TEST_WATCHDOG=3000 python -m pytest tests/test_fuzz_live.py``.
"""
from __future__ import annotations

import os
import re
import socket
import struct
import threading
import time
import uuid

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from rgpu.errors import ConnectionLost
from rgpu.protocol.ops import DTYPES, Msg
from rgpu.server.cuda.executor import OPS as CUDA_OPS
from rgpu.transport import handshake, tcp
from rgpu.transport.tcp import TcpTransport
from rgpu.transport.wire import HEADER, MAGIC, PROTOCOL_VERSION, Limits, MsgKind, encode_frame

from test_resilience_killed import Trainer

CASES = int(os.environ.get("RGPU_FUZZ_CASES", "10000"))   # CI: ~85 s on 2 cores
ANSWER_S = 10.0           # an answer or a close within this, or it is a hang
LIMITS = Limits()
F32 = DTYPES.index("float32")
aten = torch.ops.aten

# ---- hostile values -------------------------------------------------------------------------------

HUGE = st.sampled_from([-1, -(1 << 63), (1 << 63) - 1, (1 << 64) - 1, 1 << 31, (1 << 32) + 1, 1 << 40, 0])
INTS = st.one_of(st.integers(-4, 300), HUGE, st.integers(-(1 << 63), (1 << 64) - 1))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, st.floats(), st.text(max_size=12), st.binary(max_size=24))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.one_of(st.text(max_size=4), INTS), inner,
                                                                       max_size=4)), max_leaves=12)
SMALL = st.one_of(st.integers(-2, 70), HUGE)
SHAPES = st.lists(SMALL, max_size=4)
DESCS = st.one_of(st.builds(lambda *f: list(f), st.sampled_from([0, 1, 2, 3, 7, 100]) | INTS, SMALL,
                            st.integers(-1, len(DTYPES) + 2) | HUGE, SHAPES, SHAPES, SMALL, st.integers(-1, 3) | HUGE),
                  st.lists(VALUES, max_size=8))
WIRE_ARGS = st.lists(st.one_of(st.builds(lambda d: {"t": d}, DESCS), VALUES), max_size=4)
EVENTS = st.one_of(st.just([]), st.lists(st.one_of(st.integers(-1, 4), SMALL), max_size=6), VALUES)

OPS_META = st.one_of(
    st.builds(lambda i, ev, a, k, o: [Msg.OP, ev, i, a, k, o], st.sampled_from([1, 2, 3, 99]) | INTS, EVENTS, WIRE_ARGS,
              st.one_of(st.just({}), st.dictionaries(st.text(max_size=6), VALUES, max_size=3), VALUES),
              st.lists(st.one_of(st.none(), DESCS), max_size=3) | VALUES),
    st.builds(lambda i, ev, a, f, c: [Msg.CALL, ev, i, a, {}, f, c], st.sampled_from([1, 2, 99]) | INTS, EVENTS,
              WIRE_ARGS, INTS, SMALL),
    st.builds(lambda ev, d: [Msg.UPLOAD, ev, d], EVENTS, DESCS),
    st.builds(lambda ev, d, *rest: [Msg.DOWNLOAD, ev, d, *rest], EVENTS, DESCS, st.lists(VALUES, max_size=2)),
    st.builds(lambda i, n, s: [Msg.DEFINE, i, n, s], INTS, st.sampled_from(["add.Tensor", "mm.default", "x.y", ""])
              | st.text(max_size=20), st.text(max_size=40)),
    st.builds(lambda k, rest: [k, *rest], st.sampled_from(list(Msg)) | st.integers(-3, 40) | HUGE,
              st.lists(VALUES, max_size=7)),
    VALUES)

CUDA_META = st.one_of(
    st.builds(lambda op, ctx, args: [op, ctx, *args], st.sampled_from(sorted(CUDA_OPS) + ["image_load"]),
              st.sampled_from([0, 1]) | INTS, st.lists(st.one_of(SMALL, VALUES), max_size=6)),
    st.builds(lambda op, ctx, args: [op, ctx, *args], st.text(max_size=16), VALUES, st.lists(VALUES, max_size=3)),
    VALUES)
BUFFERS = st.lists(st.binary(max_size=256), max_size=3)

# ---- raw clients ----------------------------------------------------------------------------------


def _hello_meta(route: str = "ops", **change) -> dict:
    meta = {"proto": PROTOCOL_VERSION, "versions": handshake.software_versions(), "route": route,
            "session": uuid.uuid4().hex, "transports": ["tcp"], "nonce": os.urandom(handshake.NONCE_BYTES),
            "options": {}}
    meta.update(change)
    return meta


class Session:
    """One authenticated raw session; ``ask`` sends a frame and says how the server answered."""

    def __init__(self, server, route: str):
        self.server, self.route = server, route
        sock = tcp.connect(server.host, server.port, ANSWER_S)
        sock.settimeout(ANSWER_S)
        self.sock, self.t = sock, TcpTransport(sock)
        hello = handshake.Hello(route=route, session=uuid.uuid4().hex, versions=handshake.software_versions(),
                                transports=["tcp"])
        handshake.client_handshake(self.t, server.token.encode(), hello, LIMITS, on_wait=lambda meta: None)
        self.seq = 0

    def send(self, kind: int, meta, buffers=()) -> int:
        self.seq += 1
        self.sock.sendall(encode_frame(kind, self.seq, meta, buffers))
        return self.seq

    def answer(self, seq: int) -> str:
        """Frames read until the one that answers ``seq``: "reply", "error", or "bye"/"closed" when the session ended."""
        deadline = time.monotonic() + ANSWER_S
        while time.monotonic() < deadline:
            try:
                frame = self.t.recv_frame(LIMITS, None)
            except ConnectionLost:
                return "closed"
            except (socket.timeout, TimeoutError):
                break
            try:
                if frame.kind == MsgKind.BYE:
                    return f"bye: {frame.meta}"
                if frame.kind in (MsgKind.REPLY, MsgKind.ERROR) and frame.seq == seq:
                    return "reply" if frame.kind == MsgKind.REPLY else "error"
            finally:
                frame.release()
        raise AssertionError(f"{self.route}: no answer to request {seq} within {ANSWER_S} s (a hang)")

    def close(self) -> None:
        self.t.close()


class Fuzzed:
    """The sessions of one route's fuzz: a new one whenever the server ended the last."""

    def __init__(self, server, route: str, ping, setup=None):
        self.server, self.route, self.ping, self.setup = server, route, ping, setup
        self.session: Session | None = None
        self.cases = self.sessions = 0

    def current(self) -> Session:
        if self.session is None:
            self.session = Session(self.server, self.route)
            self.sessions += 1
            for meta in self.setup or ():
                self.session.send(MsgKind.POST, meta)
        return self.session

    def well_framed(self, meta, buffers, post: bool) -> None:
        """A malformed message in a well-formed frame: an ERROR at most, the session goes on."""
        s = self.current()
        self.cases += 1
        if post:
            s.send(MsgKind.POST, meta, buffers)
            meta, buffers = self.ping, []
        got = s.answer(s.send(MsgKind.REQUEST, meta, buffers))
        assert got in ("reply", "error"), f"{self.route}: {meta!r} ended the session ({got})"

    def broken(self, frame: bytes) -> None:
        """A frame the session may not carry: the server ends the session, or answers, within the bound."""
        s = self.current()
        self.cases += 1
        s.sock.sendall(frame)
        s.sock.shutdown(socket.SHUT_WR)
        got = s.answer(-1)   # no request of that seq: only the session's end answers
        assert got == "closed" or got.startswith("bye"), got
        s.close()
        self.session = None


HEADERS = st.builds(
    lambda magic, version, kind, flags, seq, meta_len, nbufs, lengths, body: HEADER.pack(
        magic, version, kind, flags, seq, seq, meta_len, nbufs) + b"".join(struct.pack("<Q", n) for n in lengths) + body,
    st.sampled_from([MAGIC, b"RGPX", b"\0\0\0\0"]) | st.binary(min_size=4, max_size=4),
    st.sampled_from([PROTOCOL_VERSION, 0, 2, 0xFFFF]), st.sampled_from(list(MsgKind)) | st.integers(0, 0xFFFF),
    st.sampled_from([0, 1, 2, 0xFFFFFFFF]) | st.integers(0, 0xFFFFFFFF), st.integers(0, (1 << 64) - 1),
    st.sampled_from([0, 1, 10, 1 << 20, (1 << 20) + 1, 0xFFFFFFFF]) | st.integers(0, 0xFFFFFFFF),
    st.sampled_from([0, 1, 2, 65536, 0xFFFFFFFF]) | st.integers(0, 0xFFFFFFFF),
    st.lists(st.sampled_from([0, 1, 1 << 31, (1 << 64) - 1]) | st.integers(0, (1 << 64) - 1), max_size=3),
    st.binary(max_size=64))

HELLOS = st.builds(lambda drop, change: {k: v for k, v in _hello_meta(**change).items() if k not in drop},
                   st.sets(st.sampled_from(["proto", "versions", "route", "session", "transports", "nonce", "options"]),
                           max_size=2),
                   st.dictionaries(st.sampled_from(["proto", "versions", "route", "session", "transports", "nonce",
                                                    "options"]) | st.text(max_size=5),
                                   VALUES | st.text(min_size=100, max_size=200), max_size=3))

PRE_AUTH = st.one_of(
    st.binary(max_size=200).map(lambda b: [b]),
    HEADERS.map(lambda b: [b]),
    st.builds(lambda meta, kind: [encode_frame(kind, 0, meta)], HELLOS | VALUES,
              st.sampled_from([MsgKind.HELLO, MsgKind.PROOF, MsgKind.REQUEST, MsgKind.WELCOME])),
    st.builds(lambda second: [encode_frame(MsgKind.HELLO, 0, _hello_meta()), second],
              HEADERS | st.builds(lambda m: encode_frame(MsgKind.PROOF, 0, m), VALUES
                                  | st.builds(lambda p: {"proof": p}, st.binary(max_size=40) | VALUES))),
)


def _pre_auth_case(server, parts: list[bytes]) -> None:
    """Send, stop sending, and read until the server closes: it must, within the bound."""
    sock = socket.create_connection((server.host, server.port), timeout=ANSWER_S)
    try:
        for part in parts:
            try:
                sock.sendall(part)
            except OSError:    # the server refused and closed already
                return
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return
        deadline = time.monotonic() + ANSWER_S
        while True:
            try:
                if not sock.recv(1 << 16):
                    return
            except ConnectionResetError:
                return
            except (socket.timeout, TimeoutError):
                pass
            assert time.monotonic() < deadline, f"the server neither answered nor closed: {parts!r:.300}"
    finally:
        sock.close()


def _run(strategy, count: int, case) -> None:
    if count <= 0:
        return

    @settings(max_examples=count, deadline=None, database=None, derandomize=True, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def fuzz(value):
        case(value)

    fuzz()


def _define_trainer_ops() -> list:
    return [[Msg.DEFINE, 1, "mm.default", str(aten.mm.default._schema)],
            [Msg.DEFINE, 2, "sub.Tensor", str(aten.sub.Tensor._schema)],
            [Msg.DEFINE, 3, "add.Tensor", str(aten.add.Tensor._schema)],
            [Msg.UPLOAD, [], [1, 64, F32, [4, 4], [4, 1], 0, 0]]]


def _accepts_a_session(server) -> bool:
    s = Session(server, "echo")
    try:
        return s.answer(s.send(MsgKind.REQUEST, {"op": "echo"}, [b"ping"])) == "reply"
    finally:
        s.close()


def test_a_live_server_fuzzed_on_every_decoder_never_crashes_or_hangs_and_the_training_session_is_unaffected(
        start_server):
    server = start_server("--device", "cpu", "--cuda-driver", "fake", "--spare-workers", "2",
                          env={"RGPU_AUTH_TIMEOUT": "3"})
    trainer = Trainer(server.connect("ops"))
    trainer.step()
    stop, failures = threading.Event(), []

    def train() -> None:
        try:
            while not stop.is_set():
                trainer.step()
                if trainer.steps % 20 == 0:
                    assert torch.equal(trainer.weights(), trainer.reference()), f"step {trainer.steps}"
                time.sleep(0.05)   # training all along, leaving the 2 cores to the fuzz mostly
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    ops = Fuzzed(server, "ops", [Msg.MEMORY, 0], _define_trainer_ops())
    cuda = Fuzzed(server, "cuda", ["init", 0, 0])
    pre_auth = [0]
    broken = 3 + CASES // 20000    # each ends a session: a new worker (for ops, seconds of torch's import on 2 cores)
    started = time.monotonic()
    try:
        def pre(parts):
            pre_auth[0] += 1
            _pre_auth_case(server, parts)

        _run(PRE_AUTH, CASES * 4 // 10, pre)
        print(f"pre-auth: {time.monotonic() - started:.1f} s")
        _run(st.tuples(OPS_META, BUFFERS, st.booleans()), CASES * 3 // 10 - broken, lambda v: ops.well_framed(*v))
        _run(st.tuples(CUDA_META, BUFFERS, st.booleans()), CASES * 3 // 10 - broken, lambda v: cuda.well_framed(*v))
        launches = st.builds(lambda b: (["launches", 0], [b]), st.binary(max_size=400))
        _run(launches, max(1, CASES // 100), lambda v: cuda.well_framed(*v, post=True))
        _run(HEADERS, broken, ops.broken)
        _run(HEADERS, broken, cuda.broken)
        assert server.proc.poll() is None, f"the acceptor died:\n{server.stderr[-3000:]}"
        assert _accepts_a_session(server)
    finally:
        stop.set()
        thread.join(30)
        for f in (ops, cuda):
            if f.session is not None:
                f.session.close()
    took = time.monotonic() - started
    print(f"fuzzed: {pre_auth[0]} pre-auth, {ops.cases} ops ({ops.sessions} sessions), {cuda.cases} cuda "
          f"({cuda.sessions} sessions) in {took:.1f} s; the trainer ran {trainer.steps} steps")
    assert not failures, failures
    assert trainer.steps > 10
    assert torch.equal(trainer.weights(), trainer.reference())
    assert server.proc.poll() is None
    # no session ended by an internal error (a client's malformed call is its error, never the server's)
    assert not re.search(r"session \S+ failed", server.stderr), server.stderr[-3000:]


def test_a_download_of_a_quantized_tensor_is_refused_and_the_session_goes_on(start_server):
    """The fuzz's find: a DOWNLOAD naming a qint32 descriptor made torch crash the worker (a segfault copying it)."""
    server = start_server("--device", "cpu")
    s = Session(server, "ops")
    try:
        for meta in _define_trainer_ops():
            s.send(MsgKind.POST, meta)
        assert s.answer(s.send(MsgKind.REQUEST, [Msg.DOWNLOAD, [], [-5432, 66, 14, [0], [0], 0, 0], []])) == "error"
        assert s.answer(s.send(MsgKind.REQUEST, [Msg.MEMORY, 0])) == "reply"       # the session goes on
    finally:
        s.close()
