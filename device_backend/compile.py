"""``torch.compile(model, backend="rgpu")``: graphs shipped to the server once, then one message per call.

Dynamo hands over a graph; aot_autograd turns it into aten forward and backward
graphs traced on fake tensors. Each is encoded with the op stream's closed
encoding (ops by the session's integer index, values as in ``encode.py``, no
pickle) and posted once (``Msg.GRAPH``); the server compiles it (Inductor on a
GPU, its calls replayed as CUDA graphs in the modes that ask for them;
interpreted on the CPU). A call
then mints its output tensors here from the fake trace's metadata and posts one
``Msg.RUN`` naming its inputs and outputs: nothing waits. While the session streams
from C++ (``RGPU_FAST_PATH``), ``graph_call.cpp`` does that call with no Python per
tensor (a forward of ~80 inputs and ~170 outputs: docs/perf/fast_path-history.md, run7).

A graph that cannot be shipped (a tensor constant other than a CPU scalar, a
non-aten node, tensors on two servers' devices) runs eagerly, op by op, with one
warning saying why; in a session of several servers a graph goes to the server its
tensors are on. Dynamic shapes are compiled per
concrete shape, so a new shape ships a new graph.
"""
from __future__ import annotations

import functools
import importlib.util
import operator
import sys
import warnings
import weakref

import torch
from torch.utils import _pytree

from rgpu.protocol.ops import Msg

from . import session as _session
from .encode import CODE, Encoder

REGISTRY_MODULE = "torch._dynamo.backends.registry"
_counts = {"shipped": 0, "eager": 0}
_live: "weakref.WeakSet[ShippedGraph]" = weakref.WeakSet()


class Unshippable(Exception):
    """Why a graph cannot go to the server as it is."""


# ---- registration with dynamo ---------------------------------------------------------------

def register_backend() -> None:
    """Make ``backend="rgpu"`` known to dynamo: now if its registry is imported, else when it is.

    Why not at once: importing dynamo costs about a second, and ``import rgpu`` must stay cheap.
    """
    if REGISTRY_MODULE in sys.modules:
        _register(sys.modules[REGISTRY_MODULE])
    elif not any(isinstance(f, _RegistryWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegistryWatcher())
    _guard_default_backend()


DEFAULT_BACKEND_ERROR = (
    "rgpu: torch.compile's default backend (Inductor) cannot generate code for rgpu tensors; "
    "use torch.compile(model, backend=\"rgpu\"), which ships the graph to the server (Inductor runs there)")


def _guard_default_backend() -> None:
    """Inductor given rgpu tensors fails with a clear error naming ``backend="rgpu"`` (not an internal assert)."""
    wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
    if wrapper is None or getattr(wrapper.__call__, "_rgpu_guard", False):
        return
    call = wrapper.__call__

    def __call__(self, model_, inputs_, **kwargs):
        devtype = torch._C._get_privateuse1_backend_name()
        tensors = [*inputs_, *getattr(model_, "parameters", lambda: ())(), *getattr(model_, "buffers", lambda: ())()]
        if any(isinstance(t, torch.Tensor) and t.device.type == devtype for t in tensors):
            raise RuntimeError(DEFAULT_BACKEND_ERROR)
        return call(self, model_, inputs_, **kwargs)

    __call__._rgpu_guard = True
    wrapper.__call__ = __call__


def _register(registry) -> None:
    if "rgpu" not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=backend, name="rgpu")


class _RegistryWatcher:
    """A meta-path finder that registers the backend right after dynamo's registry module loads."""

    def find_spec(self, name, path=None, target=None):
        if name != REGISTRY_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register(module)

        spec.loader.exec_module = exec_module
        return spec


# ---- the backend ------------------------------------------------------------------------------

def backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
    """The dynamo backend: aot_autograd with graphs compiled on the server."""
    if any(_symbolic(x) for x in example_inputs):
        return PerShape(gm, mode or "default")
    return _aot(mode or "default")(gm, example_inputs)


def _symbolic(x) -> bool:
    if isinstance(x, torch.SymInt):
        return True
    return isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*x.shape, *x.stride()))


def _aot(mode: str):
    from functorch.compile import default_partition, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    s = _session.get()
    compiler = functools.partial(compile_graph, mode=mode)
    # Why the partitioner follows the server: Inductor fuses what min-cut recomputes; an
    # interpreter would pay for each recomputed op
    partition = min_cut_rematerialization_partition if s.kind == "cuda" else default_partition
    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, inference_compiler=compiler,
                        partition_fn=partition, keep_inference_input_mutations=True)


class PerShape:
    """A graph dynamo made dynamic, compiled again for each concrete shape it meets."""

    def __init__(self, gm, mode: str):
        self.gm, self.mode = gm, mode
        self.compiled: dict = {}

    def __call__(self, *args):
        key = tuple((tuple(a.shape), tuple(a.stride()), a.dtype, a.device, a.requires_grad)
                    if isinstance(a, torch.Tensor) else (type(a), a) for a in args)
        fn = self.compiled.get(key)
        if fn is None:
            fn = self.compiled[key] = _aot(self.mode)(self.gm, list(args))
        return fn(*args)


def compile_graph(gm: torch.fx.GraphModule, example_inputs, mode: str = "default"):
    """aot_autograd's compiler for one aten graph: shipped, or eager with one warning saying why."""
    try:
        g = ShippedGraph(gm, mode)
    except Unshippable as why:
        _counts["eager"] += 1
        warnings.warn(f"rgpu: torch.compile graph runs eagerly, op by op: {why}", stacklevel=2)
        from functorch.compile import make_boxed_func

        return make_boxed_func(gm.forward)
    _counts["shipped"] += 1
    return g


def stats() -> dict:
    """Graphs shipped to the server and graphs left eager, since import."""
    return {"graphs_shipped": _counts["shipped"], "graphs_eager": _counts["eager"]}


def info() -> list[dict]:
    """For each live shipped graph: how the server runs it (``backend``), any compile error, runs so far."""
    s = _session.get()
    return [dict(s.request([Msg.GRAPH_INFO, g.gid], g.device) or {}, graph=g.gid)
            for g in list(_live) if g.session is s]


# ---- one shipped graph ------------------------------------------------------------------------

class _GraphEncoder(Encoder):
    """The op stream's encoder, plus references to earlier nodes; tensors must be nodes."""

    __slots__ = ("index",)

    def value(self, v):
        if isinstance(v, torch.fx.Node):
            return {"n": self.index[v]}
        if isinstance(v, torch.Tensor):
            raise Unshippable("a tensor constant in the arguments of a node")
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise Unshippable("a symbolic size")
        if isinstance(v, (list, tuple)) and type(v) not in (list, tuple):
            v = list(v)  # fx's immutable_list
        return super().value(v)


class ShippedGraph:
    """An aten graph on the server; calling it posts one ``Msg.RUN`` and returns its outputs at once."""

    _next_id = 1

    def __init__(self, gm: torch.fx.GraphModule, mode: str):
        s = _session.get()
        # on the instance, not the class: dynamo's wrappers copy __dict__, and this tells aot_autograd
        # to pass the inputs as one list (which we clear)
        self._boxed_call = True
        self.mode, self.session, self.devtype = mode, None, s.devtype
        self.gid = ShippedGraph._next_id
        ShippedGraph._next_id += 1
        self.device = _server_device(gm, s)  # several servers: the first device of the one its tensors are on
        self.wire, self.outs = self._encode(gm, s, s.server(self.device))
        # its calls made and posted in C++ while the session streams from C++ (graph_call.cpp), which
        # posts to the session's first server: a graph on another server's devices is called from Python
        cpp = s.server(self.device) is s.servers.all[0]
        self._fast = s.C.GraphCall(self.gid, [_cpp_spec(spec) for spec in self.outs]) if cpp else _no_call
        self._ship(s)
        _live.add(self)

    def _encode(self, gm, s, server):
        enc = _GraphEncoder(s.C.describe, s.devtype, mixed_ok=True)
        enc.index = {}
        n_in, nodes, placeholders, outputs = 0, [], [], None
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                val = node.meta.get("val")
                if isinstance(val, torch.Tensor) and val.device.type != s.devtype and val.dim() > 0:
                    raise Unshippable(f"input {node.name} is a {val.device.type} tensor")
                enc.index[node] = n_in
                placeholders.append(val)
                n_in += 1
            elif node.op == "call_function":
                enc.index[node] = n_in + len(nodes)
                nodes.append(self._node(node, enc, s, server))
            elif node.op == "output":
                outputs = node.args[0]
            elif node.op == "get_attr":
                enc.index[node] = n_in + len(nodes)
                nodes.append(self._constant(gm, node, enc, s, server))
            else:
                raise Unshippable(f"a {node.op} node ({node.target})")
        outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        wire_outs = [enc.index[o] if isinstance(o, torch.fx.Node) and o.op != "placeholder" else None
                     for o in outputs]
        wire = {"inputs": n_in, "nodes": nodes, "outputs": wire_outs}
        return wire, _output_specs(outputs, placeholders, s.devtype)

    @staticmethod
    def _node(node, enc, s, server) -> list:
        target = node.target
        if target is operator.getitem:
            src, item = node.args
            if not isinstance(src, torch.fx.Node) or type(item) is not int:
                raise Unshippable(f"an item of a non-node ({node.name})")
            return [0, enc.index[src], item]
        if not isinstance(target, torch._ops.OpOverload):
            raise Unshippable(f"a node that is not an aten op ({node.name}: {target})")
        if target.namespace != "aten":
            raise Unshippable(f"an op outside aten ({target})")
        return [s._index(target, server), enc.value(list(node.args)), enc.kwargs(dict(node.kwargs))]

    @staticmethod
    def _constant(gm, node, enc, s, server) -> list:
        """A CPU scalar the graph holds (``torch.tensor(3.0)`` in forward) becomes a node that makes it."""
        value = gm
        for part in str(node.target).split("."):
            value = getattr(value, part, None)
        if not (type(value) is torch.Tensor and value.device.type == "cpu" and value.dim() == 0):
            raise Unshippable(f"a constant the graph holds ({node.target}"
                              f"{f': {tuple(value.shape)} on {value.device}' if isinstance(value, torch.Tensor) else ''})")
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # we compile inside dynamo's fake mode; the constant is real
            number = value.item()
        op = torch.ops.aten.scalar_tensor.default
        return [s._index(op, server), [enc.value(number)],
                enc.kwargs({"dtype": value.dtype, "device": torch.device("cpu")})]

    def _ship(self, s) -> None:
        s.post([Msg.GRAPH, self.gid, {"mode": self.mode}, self.wire], self.device)
        self.session = s
        weakref.finalize(self, _free, weakref.ref(s), self.gid, self.device)

    def __call__(self, args: list):
        s = _session.current()
        if s is not self.session:  # a new session (a new server): ship again
            self._ship(_session.get())
            s = self.session
        results = self._fast(args)
        if results is None:  # the fast path is off, or an input only Python sends
            results = self._call(s, args)
        args.clear()
        return results

    def _call(self, s, args: list) -> list:
        describe, devtype = s.C.describe, self.devtype
        ins = [describe(a) if isinstance(a, torch.Tensor) and a.device.type == devtype else _value(a) for a in args]
        results, outs = [], []
        for spec in self.outs:
            kind = spec[0]
            if kind == "new":
                t = torch.empty_strided(spec[2], spec[3], dtype=spec[1], device=spec[4])
                outs.append(describe(t))
            elif kind == "base":  # a storage other outputs view: made whole, then viewed
                base = torch.empty(spec[5], dtype=torch.uint8, device=spec[4])
                t = s.C.alias(base, CODE[spec[1]], spec[2], spec[3], spec[6])
                outs.append(describe(t))
            else:
                outs.append(None)
                if kind == "input":
                    t = args[spec[1]]
                elif kind == "alias_in":
                    t = s.C.alias(args[spec[1]], CODE[spec[2]], spec[3], spec[4], spec[5])
                elif kind == "alias_out":
                    t = s.C.alias(results[spec[1]], CODE[spec[2]], spec[3], spec[4], spec[5])
                else:
                    t = spec[1]
            results.append(t)
        server = s.server(self.device)
        with s.lock:
            s._on(server, lambda: server.conn.post([Msg.RUN, server.events(), self.gid, ins, outs]))
        return results


def _no_call(args):
    return None  # graph_call.cpp's answer when Python must do the call


def _server_device(gm, s) -> "int | None":
    """Several servers: the first device of the server that every tensor of ``gm`` is on; None with one server.

    Every node's traced value counts (inputs, results) and devices named in arguments;
    tensors on two servers' devices leave the graph eager (an op of it would mix them).
    """
    if not s.several:
        return None
    devices = set()
    for node in gm.graph.nodes:
        values = [*_pytree.tree_leaves(node.meta.get("val")), *node.args, *node.kwargs.values()]
        for v in values:
            device = v.device if isinstance(v, torch.Tensor) else v if isinstance(v, torch.device) else None
            if device is not None and device.type == s.devtype:
                devices.add(device.index or 0)
    servers = {id(server): server for server in (s.server(d) for d in sorted(devices) or [None])}
    if len(servers) > 1:
        raise Unshippable("its tensors are on several servers' devices (" + ", ".join(
            f"{server.devices()} on server {server.where}" for server in servers.values()) + ")")
    return next(iter(servers.values())).first


_CPP_KINDS = {"new": 0, "base": 1, "input": 2, "alias_in": 3, "alias_out": 4, "value": 5}  # graph_call.cpp's Make


def _cpp_spec(spec: tuple) -> tuple:
    """An output spec in graph_call.cpp's terms: dtypes as codes, devices as indices."""
    kind = spec[0]
    if kind in ("new", "base"):
        return (_CPP_KINDS[kind], CODE[spec[1]], list(spec[2]), list(spec[3]), spec[4].index or 0, *spec[5:])
    if kind in ("alias_in", "alias_out"):
        return (_CPP_KINDS[kind], spec[1], CODE[spec[2]], list(spec[3]), list(spec[4]), spec[5])
    return (_CPP_KINDS[kind], spec[1])


def _value(a):
    if isinstance(a, torch.Tensor):
        if a.device.type == "cpu" and a.dim() == 0:
            return {"s": [CODE[a.dtype], a.item()]}
        raise RuntimeError(f"rgpu: a compiled graph got a {a.device} tensor where it was traced with rgpu")
    if isinstance(a, (bool, int, float)) or a is None:
        return a
    raise RuntimeError(f"rgpu: a compiled graph got an input of type {type(a).__name__}")


def _output_specs(outputs, placeholders, devtype) -> list:
    """How each output is made at a call, from the fake trace: fresh, an input, a view of one, or a value."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def key(v):
        return StorageWeakRef(v.untyped_storage())

    inputs = {key(v): j for j, v in enumerate(placeholders) if isinstance(v, torch.Tensor)}
    vals = [o.meta.get("val") if isinstance(o, torch.fx.Node) else o for o in outputs]
    shared: dict = {}
    for v in vals:
        if isinstance(v, torch.Tensor) and key(v) not in inputs:
            shared[key(v)] = shared.get(key(v), 0) + 1
    owner: dict = {}
    specs = []
    for k, (o, v) in enumerate(zip(outputs, vals)):
        if isinstance(o, torch.fx.Node) and o.op == "placeholder":
            specs.append(("input", _placeholder_index(o)))
            continue
        if not isinstance(v, torch.Tensor):
            if isinstance(o, torch.fx.Node) and not isinstance(v, (int, float, bool, type(None))):
                raise Unshippable(f"output {o.name} has no static value")
            specs.append(("value", v))
            continue
        geometry = (v.dtype, tuple(v.shape), tuple(v.stride()), v.storage_offset())
        if key(v) in inputs:
            specs.append(("alias_in", inputs[key(v)], *geometry))
        elif key(v) in owner:
            specs.append(("alias_out", owner[key(v)], *geometry))
        elif shared[key(v)] > 1 or v.storage_offset() or v.untyped_storage().nbytes() != _extent(v):
            owner[key(v)] = k
            specs.append(("base", v.dtype, tuple(v.shape), tuple(v.stride()), _device(v, devtype),
                          v.untyped_storage().nbytes(), v.storage_offset()))
        else:
            owner[key(v)] = k
            specs.append(("new", v.dtype, tuple(v.shape), tuple(v.stride()), _device(v, devtype)))
    return specs


def _placeholder_index(node) -> int:
    i = 0
    for n in node.graph.nodes:
        if n is node:
            return i
        if n.op == "placeholder":
            i += 1
    raise AssertionError("not a placeholder of its graph")


def _extent(v: torch.Tensor) -> int:
    if v.numel() == 0:
        return 0
    return (1 + sum((d - 1) * st for d, st in zip(v.shape, v.stride()))) * v.element_size()


def _device(v: torch.Tensor, devtype: str) -> torch.device:
    if v.device.type != devtype:
        raise Unshippable(f"an output on {v.device}")
    return torch.device(devtype, v.device.index or 0)


def _free(session_ref, gid: int, device: "int | None") -> None:
    s = session_ref()
    if s is not None and s is _session.current():
        try:
            s.post([Msg.GRAPH_FREE, gid], device)
        except Exception:  # the connection may be closing at exit
            pass
