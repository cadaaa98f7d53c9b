"""``ops``: the device route's executor: aten ops on the server's GPU (or CPU) for one session.

The client streams ops with output ids it minted itself; this side binds each id to the storage the op produced.
A failing op poisons the ids it would have written, so later ops on them fail quietly and the client hears of the
first failure once (an ERROR frame naming the op); reading a poisoned tensor names it again.
"""
from __future__ import annotations

import warnings

import torch

from rgpu.server.ops import fast_op
from rgpu.server.ops.collectives import Collectives
from rgpu.server.ops.codec import CODE_BY_DTYPE, Decoder, GeneratorArg, descriptor, encode_result, flatten
from rgpu.server.ops.graphs import Graphs
from rgpu.server.ops.peer import Peers, PeerError
from rgpu.server.ops.staging import READBACK_MIN_BYTES, RING_BYTES
from rgpu.server.ops.uploads import Uploads
from rgpu.server.ops.handles import DTYPE_BY_CODE, Poisoned, dtype_of, table as handle_table
from rgpu.protocol.ops import Msg
from rgpu.server.ops.as_on_cuda import CPU_ADAPT, CPU_RESULTS
from rgpu.server.ops.resolve import OpRefused, Resolved, resolve
from rgpu.server.ops.trace import Calls, Trace

from rgpu.server.route import Executor as BaseExecutor, OpFailed

# Why: the receive pool's buffers may be read-only views; we copy out of them at once.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

_InferenceMode = torch._C._InferenceMode
_inference_mode_on = torch.is_inference_mode_enabled
_Tensor = torch.Tensor


def _resolved_bits(t: torch.Tensor) -> torch.Tensor:
    """A result read through its conjugate/negative bit (vdot returns ``dot(...).conj()``): ids name bytes only."""
    return t.resolve_conj().resolve_neg() if t.is_conj() or t.is_neg() else t


def _bits_into_memory(t: torch.Tensor, wire) -> None:
    """An out= tensor whose kernel flipped its conjugate/negative bit (linalg_lu_solve(left=False) ends with
    ``result._set_conj(...)``): the client's tensor keeps its bits, so the bytes must say the value."""
    conj, neg = (bool(wire["j"][1]), bool(wire["j"][2])) if "j" in wire else (False, False)
    if t.is_conj() != conj or t.is_neg() != neg:
        value = t.resolve_conj().resolve_neg()
        torch._C._set_conj(t, conj)
        torch._C._set_neg(t, neg)
        t.copy_(value)


def pick_devices(settings) -> tuple[str, list[torch.device], list[str]]:
    """('cuda'|'cpu', the devices rgpu:0.. map to, their names) from ``--device``/``--devices``."""
    kind = settings.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: this server has no usable CUDA device")
        n = torch.cuda.device_count()
        return kind, [torch.device("cuda", i) for i in range(n)], [torch.cuda.get_device_name(i) for i in range(n)]
    n = max(1, settings.devices)
    return kind, [torch.device("cpu")] * n, [f"CPU (rgpu cpu executor, device {i})" for i in range(n)]


class Executor(BaseExecutor):
    """One ops-route session: the aten ops, uploads, downloads and graphs a client's device streams."""

    def __init__(self, session):
        """The devices ``--device``/``--devices`` name (``RuntimeError``: ``cuda`` without a GPU) and the session's
        parts; ``ValueError`` for a ``device_offset`` hello option that is not an integer 0..1023."""
        super().__init__(session)
        self.kind, devices, self.names = pick_devices(session.settings)
        # A client of several servers numbers every server's devices in one row (rgpu:0..N-1): this
        # server's are rgpu:offset.. (the list repeats its first device before them: the client sends
        # an op only to the server of its device, so those indices never come)
        self.offset = _offset(session.options)
        devices = [devices[0]] * self.offset + devices
        # A session with a device memory quota runs ops in Python: the C++ op path allocates an op's fresh
        # outputs before the table counts them, past the quota's check (RGPU_MAX_SESSION_BYTES)
        use_c = session.settings.server_c and session.settings.max_session_bytes is None
        fast = fast_op.for_session(use_c)
        self.table = handle_table(devices, session.settings.max_session_bytes, fast)  # C++ beside the C++ op path
        self.ops: dict[int, object] = {}
        # TF32 off unless asked for, so results match a CPU reference
        torch.backends.cuda.matmul.allow_tf32 = session.settings.tf32
        # the setter beneath the attribute: the attribute refuses once a test harness in this process
        # has called torch.backends.disable_global_flags() (PyTorch's OpInfo suite does, at import)
        torch._C._set_cudnn_allow_tf32(session.settings.tf32)
        # Why per-device generators on the CPU: rgpu:0..N-1 all run on the one CPU here,
        # yet each must keep its own stream of random numbers. (This worker process is the
        # session's own, so the process-wide default generators are per-session as well.)
        self.gens = [torch.Generator() for _ in devices] if self.kind == "cpu" else None
        self.scratch_gens: dict[int, torch.Generator] = {}  # reseeded per op for explicit generator= arguments
        self.graphs = Graphs(self.table, self._resolved, self.kind == "cuda")  # torch.compile(backend="rgpu")
        self.uploads = Uploads(self.table, self.kind == "cuda")  # big uploads in pieces, staged through pinned memory
        self.receive_pool = self.uploads.receive_pool   # the frame loop's receive buffers (pinned on a GPU), or None
        self.handlers = {Msg.GRAPH: self.graphs.define, Msg.RUN: self.graphs.run, Msg.UPLOAD_PART: self.uploads.part,
                         Msg.UPLOAD_INFO: self._upload_info,
                         Msg.GRAPH_FREE: self.graphs.free, Msg.GRAPH_INFO: self.graphs.info,
                         Msg.DEFINE: self._define, Msg.OP: self._op, Msg.CALL: self._call,
                         Msg.UPLOAD: self._upload, Msg.DOWNLOAD: self._download, Msg.EVENTS: self._events,
                         Msg.SEED: self._seed, Msg.SYNC: self._sync, Msg.MEMORY: self._memory,
                         Msg.GET_RNG_STATE: self._get_rng_state, Msg.SET_RNG_STATE: self._set_rng_state,
                         Msg.PROFILE: self._profile, Msg.PEER_RECV: self._peer_recv, Msg.PEER_SEND: self._peer_send}
        # torch.distributed groups among servers' sessions (rgpu/distributed.py's collectives)
        self.collectives = Collectives(self.table, self.kind, session.settings.host)
        self.handlers.update(self.collectives.handlers)
        # a peer listener only for a client of several servers (copies server to server)
        self.peers = Peers.of_server(session.settings) if session.options.get("peer") is True else None
        self.profiler = None
        # the common op in C++; what it does not take, and whatever is unusual after an op, is done here
        self.fast = fast.FastOps(self.table, self.kind == "cuda", self._check_written,
                                 self._bind) if fast is not None else None
        self.op_path = fast_op.describe(fast, use_c)
        # said apart from the words: `rgpu doctor` tells its user to install a compiler when this is true
        self.op_path_failed = fast is None and use_c and fast_op.why_not() is not None

    def welcome(self) -> dict:
        """The handshake's facts: devices (kind, count, names), torch, TF32, what ops run through (``op_path``;
        ``op_path_failed``: C++ could not be built), this server's first device index, its peer port or None."""
        return {"device": self.kind, "device_count": len(self.names), "names": self.names,
                "torch": torch.__version__, "tf32": self.session.settings.tf32, "op_path": self.op_path,
                "op_path_failed": self.op_path_failed, "device_offset": self.offset,
                "peer_port": self.peers.port if self.peers is not None else None,
                "peer_tls": self.peers.fingerprint if self.peers is not None else None}

    def handle(self, meta, buffers, reply: bool):
        """Run ``[Msg kind, ...]`` (payloads: ``rgpu.protocol.ops``) in inference mode; ``buffers`` live for the
        call. Returns None for a post, ``(meta, buffers)`` for a request. Raises ``ValueError`` for a message
        not the route's, ``OpFailed`` naming an op that failed (its outputs poisoned first), or what a handler
        raised: each an ERROR frame, and the session goes on."""
        handler = self.handlers.get(meta[0]) if type(meta) is list and meta else None
        if handler is None:
            raise ValueError(f"not an ops-route message: {str(meta)[:80]}")
        if _inference_mode_on():  # the session loop holds it (serving())
            return handler(meta, buffers)
        with _InferenceMode(True):  # torch.inference_mode()'s guard, without its Python wrapper
            return handler(meta, buffers)

    def serving(self):
        """Held around the session loop: inference mode entered once, not per message (a microsecond an op)."""
        return _InferenceMode(True)

    def close(self) -> None:
        """Release the session: its profile, staged uploads (finished first), groups, storages, peer listener."""
        self._stop_profiling()
        self.uploads.close()  # pending staged copies finish before their pinned memory is unregistered
        self.collectives.close()
        self.table.close()
        self.ops.clear()
        if self.peers is not None:
            self.peers.close()

    # ---- messages ------------------------------------------------------------------------

    def _define(self, meta, buffers):
        _, index, name, schema = meta
        if self.fast is not None:
            self.fast.undefine(index)  # whatever the index named before is gone from both paths
        try:
            r = resolve(name, schema, self.kind)
        except OpRefused as exc:
            self.ops[index] = exc  # refused on every use, by name
            return
        if self.kind == "cpu":  # looked up once here, not per op
            r.adapt, r.fix = CPU_ADAPT.get(r.name), CPU_RESULTS.get(r.name)
        self.ops[index] = r
        if self.fast is not None and r.adapt is None and r.fix is None:
            r.fast = self.fast.define(index, *name.split("."), r.checked, r.substituted)

    def _resolved(self, index):
        r = self.ops.get(index)
        if type(r) is Resolved:
            return r
        if r is None:
            raise OpFailed(f"op #{index}", "op used before it was defined")
        if isinstance(r, OpRefused):
            raise OpFailed(r.op, str(r))
        return r

    def _run(self, r, args, kwargs, dec: Decoder):
        a = dec.value(args)
        if type(kwargs) is not dict:
            raise ValueError("kwargs: not a map")
        k = dec.kwargs(kwargs) if kwargs else {}
        if r.adapt is not None:
            a = r.adapt(a)
        if r.generator is not None:
            self._pick_generator(r.generator, a, k, dec.device)
        if r.wrap_numbers:
            r.numbers_as_tensors(a, k)
        try:
            result = r.call(*a, **k)
        except RuntimeError as exc:  # once per op: torch.ops took no number for a Tensor argument
            if r.wrap_numbers or "Expected a value of type 'Tensor" not in str(exc):
                raise
            r.wrap_numbers = True
            r.numbers_as_tensors(a, k)
            result = r.call(*a, **k)
        if r.fix is not None:
            result = r.fix(a, result)
        for pos, name, kwarg_only in r.checked:
            if kwarg_only or pos >= len(args):
                self._check_written(name, kwarg_only, k.get(name), kwargs.get(name))
            else:
                self._check_written(name, kwarg_only, a[pos], args[pos])
        return result

    def _check_written(self, name: str, kwarg_only: bool, t, wire) -> None:
        """After an op that wrote argument ``name`` (``t``, from ``wire``): out= tensors as the client sized
        them, cached views still as built."""
        keep = self.table.keep
        if type(wire) is list and type(t) is list:  # a list of written tensors (the _foreach_ ops)
            for w, x in zip(wire, t):
                if type(w) is dict and "t" in w and isinstance(x, _Tensor):
                    keep(w["t"], x)
            return
        if not isinstance(t, _Tensor) or type(wire) is not dict:
            return
        if "t" in wire and keep(wire["t"], t):
            return  # as the client laid it out
        if kwarg_only:  # the client sized out= tensors: one the kernel resized would leave it behind
            _bits_into_memory(t, wire)
            size = descriptor(wire)[3]
            if list(t.shape) != size:
                raise RuntimeError(f"out= tensor {name!r} has shape {size}, the result needs "
                                   f"{list(t.shape)}; resize it first (the client and server would disagree)")

    def _pick_generator(self, where, a: list, k: dict, dev: int) -> None:
        """The generator an op draws from: an explicit one's stream, or this device's own on the CPU."""
        pos, name, kwarg_only = where
        positional = not kwarg_only and pos < len(a)
        g = a[pos] if positional else k.get(name)
        if type(g) is GeneratorArg:
            scratch = self.scratch_gens.get(dev)
            if scratch is None:
                scratch = self.scratch_gens[dev] = torch.Generator(self.table.device(dev))
            g = scratch.manual_seed(g.stream_seed())
        elif g is None and self.gens is not None:
            g = self.gens[dev]
        else:
            return
        if positional:
            a[pos] = g
        else:
            k[name] = g

    def _op(self, meta, buffers):
        _, events, index, args, kwargs, outs = meta
        done = 0
        if self.fast is not None:  # the common op whole in C++: its frees, the op, its outputs bound
            try:
                done = self.fast.op(meta)  # 2: ran there; 1: frees applied, the op left here; 0: nothing done
            except Exception as exc:
                return self._failed(self._resolved(index), args, kwargs, outs, exc)
            if done == 2:
                return None
        if events and not done:
            self.table.apply_events(events)
        r = self.ops.get(index)
        if type(r) is not Resolved:
            r = self._resolved(index)
        try:
            if not done and r.fast and self.fast.run(index, args, kwargs, outs):  # after frees and copies
                return None
            dec = Decoder(self.table, True)
            result = self._run(r, args, kwargs, dec)
            if outs:
                self._bind(flatten(result), outs, dec.inputs)
        except Exception as exc:
            return self._failed(r, args, kwargs, outs, exc)
        return None

    def _failed(self, r, args, kwargs, outs, exc: Exception) -> None:
        """An op that raised: what it would write is poisoned; an input from a failed op fails quietly
        (the cause passed on), anything else is the op's failure, said once."""
        if isinstance(exc, Poisoned):
            self._poison(r, args, kwargs, outs, exc)
            return None
        self._poison(r, args, kwargs, outs, Poisoned(r.name, f"{type(exc).__name__}: {exc}"))
        raise OpFailed(r.name, f"{type(exc).__name__}: {exc}") from None

    def _bind(self, results: list, outs: list, inputs: list) -> None:
        """Each result bound to the id its descriptor in ``outs`` names; ``inputs``: the base addresses of the
        storages the op read (a result there, or one returned twice, is copied into a storage of its own)."""
        taken = set(inputs)
        for value, desc in zip(results, outs):
            if desc is None:
                continue
            sid, nbytes, code, size, stride, offset, dev = desc
            t = _resolved_bits(value)
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if (t.dtype is not DTYPE_BY_CODE[code] or list(t.shape) != size or list(t.stride()) != stride
                    or t.storage_offset() != offset or ptr in taken):
                # the kernel's layout differs from the meta kernel's, or it returned an input or one
                # result twice (ids name storages of their own): copy
                fixed = torch.empty(0, dtype=dtype_of(code), device=t.device)
                fixed.set_(torch.empty(nbytes, dtype=torch.uint8, device=t.device).untyped_storage(), offset, size, stride)
                t = fixed.copy_(t)
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
            if ptr:
                taken.add(ptr)
            # the result is the next op's view of it: nothing else holds it
            self.table.bind(sid, storage, dev, (desc, t))

    def _forget_written(self, r, args, kwargs) -> None:
        if type(args) is not list or type(kwargs) is not dict:
            return
        for pos, name, kwarg_only in getattr(r, "mutable", ()):
            v = kwargs.get(name) if kwarg_only or pos >= len(args) else args[pos]
            for d in map(descriptor, v if type(v) is list else [v]):
                if type(d) is list and d:
                    self.table.forget(d[0])

    def _poison(self, r, args, kwargs, outs, cause: Poisoned) -> None:
        written = [d for d in outs or () if d is not None]
        for pos, name, kwarg_only in getattr(r, "mutable", ()):
            v = kwargs.get(name) if kwarg_only or pos >= len(args) else args[pos]
            written.extend(d for d in map(descriptor, v if type(v) is list else [v]) if d is not None)
        for d in written:
            self.table.poison(d[0], d[6], cause)

    def _call(self, meta, buffers):
        _, events, index, args, kwargs, first_id, count = meta
        self.table.apply_events(events)
        r = self._resolved(index)
        dec = Decoder(self.table, True)
        try:
            result = self._run(r, args, kwargs, dec)
        except Poisoned as cause:
            raise OpFailed(cause.op, str(cause)) from None
        except Exception as exc:
            self._forget_written(r, args, kwargs)  # nothing is poisoned here, but a half-run op may have changed a view
            raise OpFailed(r.name, f"{type(exc).__name__}: {exc}") from None
        ids = iter(range(first_id, first_id + count))
        taken = set(dec.inputs)

        def bind(t: torch.Tensor):
            t = _resolved_bits(t)
            if t.layout != torch.strided:
                raise OpFailed(r.name, f"rgpu supports only strided tensors: the op made a "
                                       f"{str(t.layout).removeprefix('torch.')} tensor")
            if t.untyped_storage().data_ptr() in taken:
                t = t.clone()
            sid = next(ids, None)
            if sid is None:
                raise OpFailed(r.name, f"returned more than the {count} tensors the client reserved ids for")
            # the CPU executor's rgpu:N is a label; a GPU's index is this server's own, after its offset
            dev = self.offset + t.device.index if t.device.type == "cuda" else dec.device
            self.table.bind(sid, t.untyped_storage(), dev)
            return [sid, t.untyped_storage().nbytes(), CODE_BY_DTYPE[t.dtype], list(t.shape), list(t.stride()),
                    t.storage_offset(), dev]
        return [encode_result(result, bind)], []

    def _upload(self, meta, buffers):
        _, events, desc = meta
        # a batch in C++ (bigger whole uploads, rare, go through Python's pinned slots)
        if (self.fast is not None and len(buffers) == 1 and buffers[0].nbytes <= RING_BYTES
                and self.fast.upload(events, desc, buffers[0])):
            return
        self.table.apply_events(events)
        try:
            dst = self.table.tensor(desc)
        except Poisoned:  # new bytes replace a failed op's result
            self.table.free(desc[0])
            dst = self.table.tensor(desc)
        if dst.numel():  # on a GPU through pinned staging: a copy from the frame's memory would wait for it
            self.uploads.whole(dst, buffers[0])

    def _peer_recv(self, meta, buffers):
        """A copy from another server's device: its bytes, pushed by that server, into ``dst`` (peer.py)."""
        _, events, desc, ticket = meta
        self.table.apply_events(events)
        if self.peers is None:
            raise OpFailed("peer copy", "this session has no peer listener (the client did not ask for one)")
        try:
            dst = self.table.tensor(desc)
        except Poisoned:  # new bytes replace a failed op's result
            self.table.free(desc[0])
            dst = self.table.tensor(desc)
        try:
            self.peers.receive(bytes(ticket), dst)
        except PeerError as exc:
            self.table.poison(desc[0], desc[6], Poisoned("peer copy", str(exc)))
            raise OpFailed("peer copy", str(exc)) from None

    def _peer_send(self, meta, buffers):
        """A copy to another server's device: ``src``'s bytes pushed to that server's peer listener."""
        _, events, desc, ticket, host, port, *pin = meta   # pin: the destination's TLS fingerprint, or None
        self.table.apply_events(events)
        try:
            src = self.table.tensor(desc)
        except Poisoned as cause:
            raise OpFailed(cause.op, str(cause)) from None
        if self.peers is None:
            raise OpFailed("peer copy", "this session has no peer listener (the client did not ask for one)")
        try:
            self.peers.send(bytes(ticket), str(host), int(port), src, pin[0] if pin else None)
        except PeerError as exc:
            raise OpFailed("peer copy", str(exc)) from None

    def _upload_info(self, meta, buffers):
        info, bufs = self.uploads.info(meta, buffers)
        info["pieces"]["whole in C++"] = self.fast.uploads if self.fast is not None else 0
        if self.peers is not None:  # copies this session sent to another server: GPU to GPU, or over tcp
            info["peer_sent"] = {"cuda_ipc": self.peers.ipc, "tcp": self.peers.tcp}
        return info, bufs

    def _download(self, meta, buffers):
        events, desc = meta[1], meta[2]
        if self.fast is not None and not buffers:   # a small one whole in C++ (an .item(), a loss's .cpu())
            data = self.fast.download(events, desc, READBACK_MIN_BYTES)
            if data is not None:
                return None, [data]
        self.table.apply_events(events)
        try:
            t = self.table.tensor(desc)
        except Poisoned as cause:
            raise OpFailed(cause.op, str(cause)) from None
        if buffers:  # the client's pinned memory to fill in place (shm): nothing comes back but the answer
            if len(meta) != 4 or len(buffers) != 1:
                raise ValueError("DOWNLOAD into memory: [events, tensor, byte offset] and one buffer")
            self.uploads.fill(t, meta[3], buffers[0])
            return None, []
        kept = self.uploads.answer(t)   # a GPU tensor's bytes in the kept pinned buffer, where it applies
        if kept is not None:
            return None, [kept]
        data = t.detach().to("cpu").contiguous().reshape(-1)
        if data.stride() != (1,):  # one element keeps its view's stride: contiguous() leaves it be
            data = data.clone(memory_format=torch.contiguous_format)
        return None, [memoryview(data.view(torch.uint8).numpy())]

    def _events(self, meta, buffers):
        self.table.apply_events(meta[1])

    def _seed(self, meta, buffers):
        _, dev, seed = meta
        device = self.table.device(dev)
        if self.gens is not None:
            self.gens[dev].manual_seed(seed)
            torch.manual_seed(seed)  # ops without a generator argument (dropout) use the default one
        else:
            torch.cuda.default_generators[device.index].manual_seed(seed)

    def _get_rng_state(self, meta, buffers):
        device = self.table.device(meta[1])
        if self.gens is not None:  # the device's generator, then the default one that dropout draws from
            return [bytes(self.gens[meta[1]].get_state().numpy()) + bytes(torch.default_generator.get_state().numpy())], []
        return [bytes(torch.cuda.get_rng_state(device).numpy())], []

    def _set_rng_state(self, meta, buffers):
        _, dev, state = meta
        device = self.table.device(dev)
        t = torch.frombuffer(bytearray(state), dtype=torch.uint8)
        if self.gens is not None:
            half = t.numel() // 2
            self.gens[dev].set_state(t[:half].clone())
            torch.default_generator.set_state(t[half:].clone())
        else:
            torch.cuda.set_rng_state(t, device)

    def _sync(self, meta, buffers):
        if self.kind == "cuda":
            torch.cuda.synchronize()
        return None, []

    def _memory(self, meta, buffers):
        dev = meta[1]
        if self.kind == "cuda":
            device = self.table.device(dev)
            return [torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)], []
        return [self.table.allocated[dev], self.table.peak[dev]], []

    def _profile(self, meta, buffers):
        """Where this session's server time goes: ``["start"]`` a cProfile of the executor (``rgpu bench
        train --profile``), ``["start", "trace"]`` torch.profiler's timeline of its CPU and GPU (``--trace``);
        ``["stop", top N]`` -> the text, and with a trace its gzipped Chrome trace as the reply's buffer."""
        if meta[1] == "start":
            self._stop_profiling()
            self.profiler = Trace(self.handlers, self.kind == "cuda") if meta[2:3] == ["trace"] else Calls()
            return None
        profiler, self.profiler = self.profiler, None
        return ("", []) if profiler is None else profiler.stop(int(meta[2]) if len(meta) > 2 else 40)

    def _stop_profiling(self) -> None:
        """A second start, or the session's end, ends a running one quietly (its results are dropped)."""
        if self.profiler is not None:
            self.profiler.cancel()
        self.profiler = None


def _offset(options: dict) -> int:
    """The client's index of this server's first device (hello option ``device_offset``; 0 alone)."""
    offset = options.get("device_offset", 0)
    if type(offset) is not int or not 0 <= offset < 1024:
        raise ValueError(f"device_offset {offset!r}: expected an integer 0..1023")
    return offset
