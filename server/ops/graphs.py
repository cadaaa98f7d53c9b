"""Shipped graphs: aten graphs a client sent once, compiled here, then run by one message per call.

Wire form of a graph (``Msg.GRAPH``; values as in ``codec``, plus ``{"n": i}`` naming node i)::

    {"inputs": n,                          nodes 0..n-1 are the call's inputs, in order
     "nodes": [[op index, args, kwargs],   an op the session DEFINEd; args may name earlier nodes
               [0, node, k], ...],         item k of a node's result (multi-output ops)
     "outputs": [node or None, ...]}       what a call returns; None: the client makes it itself

The client names every output it wants with a descriptor it minted (``Msg.RUN``);
this side binds each to the storage the graph produced, copying only where the
layout differs or the storage is an input's or another output's. On a GPU the
graph goes through Inductor, and in the modes that ask for CUDA graphs
(``CUDA_GRAPH_MODES``) its calls are captured and replayed by rgpu's own
``cuda_graphs.Replayer`` (Inductor's own stay off: ``INDUCTOR_OPTIONS``); anywhere
else, or if Inductor fails, it is interpreted op by op.
"""
from __future__ import annotations

import logging
import operator
import time

import torch

from .codec import Decoder
from .cuda_graphs import CudaCapturer, Replayer
from .handles import DTYPE_BY_CODE, HandleTable, Poisoned

log = logging.getLogger("rgpu.server.graphs")

MAX_NODES = 1_000_000
MAX_GRAPHS = 4096
GETITEM = 0
# Inductor's own CUDA graphs ("triton.cudagraphs") stay off in every mode: its cudagraph trees hung or
# crashed our two independent forward/backward graphs (docs/perf/fast_path.md); cuda_graphs.py captures instead
INDUCTOR_OPTIONS = {"default": {}, "reduce-overhead": {}, "max-autotune": {"max_autotune": True},
                    "max-autotune-no-cudagraphs": {"max_autotune": True}}
CUDA_GRAPH_MODES = {"reduce-overhead", "max-autotune"}


class GraphError(Exception):
    """A graph message this server will not take; the message says why."""


class GraphFailed(Exception):
    """A graph failed while running; ``op`` names the graph (the worker reports it to the client)."""

    def __init__(self, op: str, message: str):
        super().__init__(message)
        self.op = op


class Ref:
    """Node ``i`` of the graph, inside a node's arguments."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


class _GraphDecoder(Decoder):
    """The codec's values, plus node references (checked to point backwards)."""

    __slots__ = ("limit",)

    def value(self, v):
        if type(v) is dict and len(v) == 1 and "n" in v:
            i = v["n"]
            if type(i) is not int or not 0 <= i < self.limit:
                raise GraphError(f"node reference {i!r} is not an earlier node")
            return Ref(i)
        return super().value(v)


def _has_ref(v) -> bool:
    return type(v) is Ref or (type(v) is list and any(_has_ref(x) for x in v))


def _fill(v, env):
    if type(v) is Ref:
        return env[v.i]
    if type(v) is list:
        return [_fill(x, env) for x in v]
    return v


class Step:
    """One node, ready to run: which arguments come from the environment, and what dies after it."""

    __slots__ = ("name", "op", "args", "kwargs", "slots", "nested", "kw_refs", "frees")

    def __init__(self, name, op, args: list, kwargs: dict):
        self.name, self.op, self.args, self.kwargs = name, op, args, kwargs
        self.slots = [(i, a.i) for i, a in enumerate(args) if type(a) is Ref]
        self.nested = [i for i, a in enumerate(args) if type(a) is list and _has_ref(a)]
        self.kw_refs = [k for k, a in kwargs.items() if _has_ref(a)]
        self.frees: list[int] = []

    def refs(self) -> list[int]:
        out: list[int] = []

        def walk(v):
            if type(v) is Ref:
                out.append(v.i)
            elif type(v) is list:
                for x in v:
                    walk(x)
        walk(self.args)
        walk(list(self.kwargs.values()))
        return out


class Graph:
    """A decoded graph: steps to interpret, and (on a GPU) the Inductor-compiled callable."""

    def __init__(self, wire: dict, resolve_op, table: HandleTable, options: dict):
        if type(wire) is not dict:
            raise GraphError("a graph must be a map")
        n_in, nodes, outputs = wire.get("inputs"), wire.get("nodes"), wire.get("outputs")
        if type(n_in) is not int or type(nodes) is not list or type(outputs) is not list:
            raise GraphError("a graph needs inputs (int), nodes (list) and outputs (list)")
        if n_in < 0 or n_in + len(nodes) > MAX_NODES:
            raise GraphError(f"a graph may have at most {MAX_NODES} nodes")
        self.n_in, self.options, self.table = n_in, options, table
        self.steps: list[Step] = []
        self.writes_inputs = False  # whether an op may write an argument (a replay then copies inputs back)
        dec = _GraphDecoder(table)
        for k, node in enumerate(nodes):
            dec.limit = n_in + k
            if type(node) is not list or len(node) != 3 or type(node[0]) is not int:
                raise GraphError(f"node {n_in + k}: expected [op, args, kwargs]")
            if node[0] == GETITEM:
                src, item = node[1], node[2]
                if type(src) is not int or not 0 <= src < dec.limit or type(item) is not int:
                    raise GraphError(f"node {n_in + k}: bad item reference")
                self.steps.append(Step("getitem", operator.getitem, [Ref(src), item], {}))
                continue
            r = resolve_op(node[0])
            if type(node[1]) is not list or type(node[2]) is not dict:
                raise GraphError(f"node {n_in + k} ({r.name}): args must be a list, kwargs a map")
            self.writes_inputs = self.writes_inputs or _writes_an_argument(r)
            self.steps.append(Step(r.name, r.op, dec.value(node[1]), dec.kwargs(node[2])))
        total = n_in + len(nodes)
        for o in outputs:
            if o is not None and (type(o) is not int or not 0 <= o < total):
                raise GraphError(f"output {o!r} is not a node")
        self.outputs = outputs
        self._plan_frees(total)
        self.backend = "interpreted"
        self.error: str | None = None
        self.compiled = None
        self.replayer: Replayer | None = None  # the compiled graph through CUDA graphs
        self.runs = 0
        self.seconds = 0.0  # server time in calls that neither compiled nor captured (GRAPH_INFO's run_ms)
        self.timed = 0      # those calls
        self.copies = 0     # outputs copied because their layout differed from the client's (or aliased)
        self.pending_compile = options.get("compile", False)

    def _plan_frees(self, total: int) -> None:
        """Each intermediate is dropped right after its last use, as generated code would."""
        last = {}
        for k, step in enumerate(self.steps):
            for i in step.refs():
                last[i] = k
        keep = {o for o in self.outputs if o is not None}
        for i, k in last.items():
            if i not in keep:
                self.steps[k].frees.append(i)

    def interpret(self, inputs: list) -> list:
        env: list = inputs + [None] * len(self.steps)
        base = self.n_in
        for k, step in enumerate(self.steps):
            args = step.args
            if step.slots or step.nested:
                args = list(args)
                for i, r in step.slots:
                    args[i] = env[r]
                for i in step.nested:
                    args[i] = _fill(args[i], env)
            kwargs = step.kwargs
            if step.kw_refs:
                kwargs = dict(kwargs)
                for key in step.kw_refs:
                    kwargs[key] = _fill(kwargs[key], env)
            try:
                env[base + k] = step.op(*args, **kwargs)
            except Poisoned:
                raise
            except Exception as exc:
                raise RuntimeError(f"{step.name} (node {base + k}): {type(exc).__name__}: {exc}") from None
            for i in step.frees:
                env[i] = None
        return [None if o is None else env[o] for o in self.outputs]

    def fx_module(self) -> torch.fx.GraphModule:
        """The graph as an ``fx.GraphModule`` of the same aten ops (what Inductor compiles)."""
        g = torch.fx.Graph()
        env = [g.placeholder(f"in_{i}") for i in range(self.n_in)]
        for step in self.steps:
            env.append(g.call_function(step.op, tuple(_fill(step.args, env)), _fill_kw(step.kwargs, env)))
        g.output(tuple(None if o is None else env[o] for o in self.outputs))
        return torch.fx.GraphModule(torch.nn.Module(), g)

    def compile(self, inputs: list) -> None:
        """Inductor, with example inputs shaped like this first call's (outside inference mode);
        then a ``Replayer`` where the mode asks for CUDA graphs and the server has a GPU."""
        mode = self.options.get("mode") or "default"
        try:
            from torch._inductor import compile as inductor_compile

            with torch.inference_mode(False), torch.no_grad():
                examples = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                            if isinstance(t, torch.Tensor) else t for t in inputs]
                options = {**INDUCTOR_OPTIONS.get(mode, {}), "triton.cudagraphs": False}
                self.compiled = inductor_compile(self.fx_module(), examples, options=options)
            self.backend = f"inductor ({mode})"
            capturer = self.options.get("capturer")
            if capturer is not None and mode in CUDA_GRAPH_MODES:
                self.replayer = Replayer(self.compiled, capturer(), self.table, self.writes_inputs)
        except Exception as exc:  # interpreted instead; the client can ask why (GRAPH_INFO)
            self.error = f"inductor: {type(exc).__name__}: {str(exc)[:2000]}"
            log.warning("graph not compiled, interpreting it: %s", self.error)

    def run(self, inputs: list, wire: list | None = None, stable_known: bool = False) -> list:
        """The graph on ``inputs`` (``wire``, ``stable_known``: for the replayer, see ``Replayer.inputs_from``)."""
        if self.pending_compile:
            self.pending_compile = False
            self.compile(inputs)
        self.runs += 1
        if self.compiled is not None:
            try:
                if self.replayer is not None:
                    return self.replayer(inputs, wire, stable_known)
                return list(self.compiled(*inputs))
            except Exception as exc:
                self.compiled, self.replayer, self.backend = None, None, "interpreted"
                self.error = f"inductor run: {type(exc).__name__}: {str(exc)[:2000]}"
                log.warning("compiled graph failed, interpreting it: %s", self.error)
        return self.interpret(inputs)

    def captures(self) -> int:
        return self.replayer.captures if self.replayer is not None else 0

    def label(self) -> str:
        """How the graph runs (GRAPH_INFO's ``backend``): with CUDA graphs, recaptures, or why it gave them up."""
        if self.replayer is None:
            return self.backend
        return f"inductor ({self.options.get('mode')}, {self.replayer.state()})"


def _writes_an_argument(r) -> bool:
    """Whether a resolved op may write one of its arguments; an op of no known schema may."""
    mutable = getattr(r, "mutable", None)
    if mutable is not None:
        return bool(mutable)
    schema = getattr(r.op, "_schema", None)
    return schema is None or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _fill_kw(kwargs: dict, env) -> dict:
    return {k: _fill(v, env) for k, v in kwargs.items()}


class Graphs:
    """The session's shipped graphs and the handlers of the graph messages."""

    def __init__(self, table: HandleTable, resolve_op, on_gpu: bool, capturer=None):
        self.table, self.resolve_op, self.on_gpu = table, resolve_op, on_gpu
        self.graphs: dict[int, Graph | GraphError] = {}
        self.capturer = capturer  # CUDA graphs' mechanics (cuda_graphs.py); made at the first need on a GPU

    def _capturer(self):
        if self.capturer is None:
            self.capturer = CudaCapturer()
        return self.capturer

    def define(self, meta, buffers):
        """``Msg.GRAPH`` ``[id, options, graph]``: the graph made (compiled at its first run on a GPU). A graph
        it cannot take raises ``GraphError`` naming why, and stays refused: each ``run`` of it fails so."""
        _, gid, options, wire = meta
        if type(gid) is not int or type(options) is not dict:
            raise GraphError("GRAPH: [id, options, graph]")
        if gid not in self.graphs and len(self.graphs) >= MAX_GRAPHS:
            raise GraphError(f"a session may hold at most {MAX_GRAPHS} graphs")
        options = {"mode": str(options.get("mode") or "default"), "compile": self.on_gpu,
                   "capturer": self._capturer if self.on_gpu else None}
        try:
            self.graphs[gid] = Graph(wire, self.resolve_op, self.table, options)
        except Exception as exc:
            self.graphs[gid] = GraphError(f"graph {gid} refused: {exc}")
            raise self.graphs[gid] from None

    def free(self, meta, buffers):
        """``Msg.GRAPH_FREE`` ``[id]``: the graph forgotten (an unknown id: nothing)."""
        self.graphs.pop(meta[1], None)

    def info(self, meta, buffers):
        """``Msg.GRAPH_INFO`` ``[id]``: ``({"backend", "error", "runs", "nodes", "run_ms", "copies_per_run",
        "cuda_graphs"?}, [])``, or ``(None, [])`` for an id it never had."""
        g = self.graphs.get(meta[1])
        if g is None:
            return None, []
        if isinstance(g, GraphError):
            return {"backend": None, "error": str(g), "runs": 0}, []
        info = {"backend": g.label(), "error": g.error, "runs": g.runs, "nodes": len(g.steps),
                "run_ms": g.seconds / max(g.timed, 1) * 1e3, "copies_per_run": g.copies / max(g.runs, 1)}
        if g.replayer is not None:
            info["cuda_graphs"] = g.replayer.counts()
        return info, []

    def run(self, meta, buffers):
        """``Msg.RUN`` ``[events, id, inputs, outs]``: inputs from the handle table, the graph, outputs bound to
        the client's ids. An input a failed op made poisons the outputs quietly; any other failure poisons
        them and raises ``GraphFailed`` naming the graph. Returns None (a post)."""
        _, events, gid, inputs, outs = meta
        self.table.apply_events(events)
        g = self.graphs.get(gid)
        try:
            if g is None or isinstance(g, GraphError):
                raise RuntimeError(str(g) if g is not None else f"graph {gid} was never defined")
            t0, captures = time.perf_counter(), g.captures()
            dec, table = Decoder(self.table), self.table

            def decode(x):
                return table.tensor(x) if type(x) is list else dec.value(x)
            if g.replayer is not None:
                args, known = g.replayer.inputs_from(inputs, decode)
            else:
                args, known = [decode(x) for x in inputs], False
            results = g.run(args, inputs, known)
        except Poisoned as cause:
            self._poison(outs, cause)
            return None
        except Exception as exc:
            cause = Poisoned(f"graph {gid}", f"{type(exc).__name__}: {exc}")
            self._poison(outs, cause)
            raise GraphFailed(f"graph {gid}", str(exc)) from None
        g.copies += self._bind(results, outs, args, g.replayer)
        if g.runs > 1 and g.captures() == captures:  # a compile or a capture is not a call's cost
            g.seconds += time.perf_counter() - t0
            g.timed += 1
        return None

    def _poison(self, outs, cause: Poisoned) -> None:
        for d in outs or ():
            if type(d) is list:
                self.table.poison(d[0], d[6], cause)

    def _bind(self, results: list, outs: list, inputs: list, replayer: Replayer | None = None) -> int:
        """Bind each output to its client id; returns how many had to be copied. A CUDA graph's static
        output is bound as it is, and its replayer told (it moves the id away before overwriting it)."""
        taken = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        copies = 0
        for value, desc in zip(results, outs):
            if type(desc) is not list or not isinstance(value, torch.Tensor) or desc[0] == 0:
                continue  # the client's own (an input, a view, a value), or a storage of no bytes
            sid, nbytes, code, size, stride, offset, dev = desc
            t = value
            ptr = t.untyped_storage().data_ptr()
            if (t.dtype is not DTYPE_BY_CODE[code] or list(t.shape) != size or list(t.stride()) != stride
                    or t.storage_offset() != offset or (ptr in taken and ptr != 0)):
                fixed = torch.empty(0, dtype=DTYPE_BY_CODE[code], device=t.device)
                fixed.set_(torch.empty(nbytes, dtype=torch.uint8, device=t.device).untyped_storage(),
                           offset, size, stride)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("graph output %s copied: %s %s+%s %s, client %s %s+%s %s%s", sid, list(t.shape),
                              list(t.stride()), t.storage_offset(), t.dtype, size, stride, offset,
                              DTYPE_BY_CODE[code], " (storage taken)" if ptr in taken else "")
                t = fixed.copy_(t)
                ptr = t.untyped_storage().data_ptr()
                copies += 1
            taken.add(ptr)
            self.table.bind(sid, t.untyped_storage(), dev)
            if replayer is not None:
                replayer.note_bound(sid, ptr)
        return copies
