"""rgpu's own CUDA graphs for shipped graphs: a few plain calls, one capture, then replays.

Why not Inductor's ("triton.cudagraphs"): its cudagraph trees assume dynamo-managed
generations, and our forward and backward are two independent graphs whose outputs
the client keeps; on the GPU host they hung, crashed or refused (docs/perf/fast_path.md).

A ``Replayer`` wraps one compiled graph::

    calls 1..WARM_CALLS  run as they are (autotuning, cuBLAS workspaces, lazy init), each input noted
    the next call        captures: an input at the same address and layout on the last two calls is
                         *stable* (a parameter, optimizer state, another graph's static output) and is
                         captured in place; the others get a static buffer each replay copies into.
                         Capture records without running, so a replay makes this call's outputs
    later calls          check the inputs, copy the varying ones in, replay, return the static outputs
    a stable input moved the graph is dropped, the call runs as it is, the next one captures again
                         with that input copied from then on (the allocator may hand a batch the
                         same address twice, then another); past MAX_RECAPTURES that moved no new
                         input, the graph runs without CUDA graphs for good

Non-tensor inputs (and CPU scalars, which a capture would bake in) must equal the captured
values; a call where they do not runs without its graph.

A replay overwrites the static outputs, and the client may still hold an earlier call's
(last step's loss). So every client id bound to memory the graph overwrites is noted
(``note_bound``), and before the next replay each one still bound is *evicted*: moved to a
copy of its bytes (``HandleTable.evict``). Ids the client freed meanwhile cost nothing.

The GPU mechanics sit behind a capturer (``warm``, ``capture``, ``replay``, ``device_type``):
``CudaCapturer`` here; the tests' fake replays by calling the graph again.
"""
from __future__ import annotations

import logging

import torch

from .handles import HandleTable

log = logging.getLogger("rgpu.server.cuda_graphs")

WARM_CALLS = 2      # plain calls before the first capture
MAX_RECAPTURES = 3  # recaptures that copied no new input (a layout change, an input moving back), before giving up
_TENSOR, _VALUE, _OFF = "t", "v", "off"


class CudaCapturer:
    """torch.cuda.CUDAGraph, captured on a side stream of the graph's device into a fresh private memory pool."""

    device_type = "cuda"

    def __init__(self):
        self.streams: dict = {}  # device -> its capture stream

    def _stream(self, device) -> torch.cuda.Stream:
        s = self.streams.get(device)
        if s is None:
            s = self.streams[device] = torch.cuda.Stream(device)
        return s

    def warm(self, fn, inputs: list, device):
        """A plain call on the capture stream: what a stream makes lazily (cuBLAS's workspace) exists before capture."""
        with torch.cuda.device(device):
            stream, current = self._stream(device), torch.cuda.current_stream()
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                outputs = fn(*inputs)
            current.wait_stream(stream)
        return outputs

    def capture(self, fn, inputs: list, device):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device):
            # the outer stream context puts the current stream back even when a failed capture_end skips the
            # inner one's exit; thread_local: another thread of the worker may call CUDA meanwhile
            with torch.cuda.stream(torch.cuda.current_stream()), \
                    torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(), stream=self._stream(device),
                                     capture_error_mode="thread_local"):
                outputs = fn(*inputs)
        return graph, outputs

    def replay(self, graph) -> None:
        graph.replay()  # on the current stream, after the copies into the static inputs


def _layout(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


def _entry(x, device_type: str) -> tuple:
    """What one input must keep for a graph: address and layout of a device tensor, else its value."""
    if isinstance(x, torch.Tensor):
        if x.device.type == device_type:
            return _TENSOR, x.data_ptr(), _layout(x)
        if x.dim() == 0:
            return _VALUE, x.dtype, x.item()
        return _OFF, x.device.type
    return _VALUE, type(x), x


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a value whose == is not a bool
        return False


class Captured:
    """One capture: the graph, each input position's kind, the static outputs and the memory replays overwrite."""

    def __init__(self, graph, n: int, stable: list, varying: list, values: list, outputs: list, owned: set):
        self.graph, self.n, self.outputs, self.owned = graph, n, outputs, owned
        self.stable = stable    # [(position, address, layout)]: captured in place
        self.varying = varying  # [(position, static buffer, layout)]: copied in at each replay
        self.values = values    # [(position, entry)]: must equal the captured value
        # [(position, its descriptor, the address its id named (table.address), the tensor, its storage's address)] of the stable
        # inputs, as captured: a call naming the same memory and layout passes that very tensor
        # (Replayer.inputs_from)
        self.known: list[tuple[int, list, int | None, torch.Tensor, int]] = []
        self.unknown: list[int] = []   # the other positions: decoded at every call

    def misfit(self, inputs: list, stable_known: bool = False) -> tuple[str, set] | None:
        """(why, the stable positions that moved) when these inputs do not fit the graph, or None.
        ``stable_known``: the stable inputs are the captured tensors (``inputs_from`` said so)."""
        if len(inputs) != self.n:
            return f"{len(inputs)} inputs for {self.n}", set()
        moved = set()
        for i, ptr, layout in () if stable_known else self.stable:
            x = inputs[i]
            if not isinstance(x, torch.Tensor) or _layout(x) != layout:
                return f"input {i} changed layout", set()
            if x.data_ptr() != ptr:
                moved.add(i)
        for i, _, layout in self.varying:
            x = inputs[i]
            if not isinstance(x, torch.Tensor) or _layout(x) != layout:
                return f"input {i} changed layout", set()
        return (f"input {min(moved)} moved", moved) if moved else None


class Replayer:
    """A compiled graph called through CUDA graphs; ``table`` is where the client's ids are bound."""

    def __init__(self, fn, capturer, table: HandleTable, writes_inputs: bool = False):
        self.fn, self.capturer, self.table = fn, capturer, table
        self.writes_inputs = writes_inputs  # then a replay copies the varying inputs back
        self.captured: Captured | None = None
        self.plain = 0          # plain calls since the last (re)start
        self.last: list = []    # the previous call's entries
        self.bound: list[tuple[int, int]] = []  # (client id, storage address) bound to overwritten memory
        self.reason: str | None = None  # why this graph runs without CUDA graphs
        self.copied: set[int] = set()   # positions that moved once: copied into a static buffer from then on
        self.captures = self.recaptures = self.replays = self.evictions = 0
        self.fruitless = 0      # recaptures that moved no new input to the copied ones

    def inputs_from(self, wire: list, decode) -> tuple[list, bool]:
        """A call's inputs from their descriptors, and whether every stable input is the captured one.

        A stable input named by the descriptor it was captured with, whose table entry is the one it
        was captured from (same storage), is the captured tensor: no view to build, no address to
        check, about 300 of them a call for the benchmark's backward graph. So is one named by a new
        id whose storage starts at the captured address, with the same layout: the forward's saved
        activations, CUDA graph outputs the client names anew at every call (the captured tensor
        keeps that memory alive, so the address cannot belong to anything else). The rest go through
        ``decode`` (the handle table's tensor, or a value).
        """
        c = self.captured
        if c is None or not c.known or len(wire) != c.n:
            return [decode(x) for x in wire], False
        inputs = [None] * c.n
        address, known = self.table.address, True
        for i, desc, at, tensor, ptr in c.known:
            x = wire[i]
            if x == desc and address(desc[0]) == at:
                inputs[i] = tensor
                continue
            if type(x) is list and len(x) == 7 and address(x[0]) == ptr and x[1:] == desc[1:]:
                inputs[i] = tensor
            else:
                inputs[i], known = decode(x), False
        for i in c.unknown:
            inputs[i] = decode(wire[i])
        return inputs, known

    def __call__(self, inputs: list, wire: list | None = None, stable_known: bool = False) -> list:
        """The graph on ``inputs`` (``wire``: their descriptors, kept at a capture for ``inputs_from``)."""
        if self.reason is not None:
            return list(self.fn(*inputs))
        c = self.captured
        if c is None:
            return self._plain_or_capture(inputs, wire)
        misfit = c.misfit(inputs, stable_known)
        if misfit is not None:
            return self._recapture(*misfit, inputs)
        dev = self.capturer.device_type
        if not all(_same(_entry(inputs[i], dev), v) for i, v in c.values):
            return list(self.fn(*inputs))  # a new value: this call without the graph
        return self._replay(c, inputs)

    def note_bound(self, sid: int, ptr: int) -> None:
        """Client id ``sid`` now names the storage at ``ptr`` (an output of this call)."""
        if self.captured is not None and ptr in self.captured.owned:
            self.bound.append((sid, ptr))

    def state(self) -> str:
        if self.reason is not None:
            return f"without CUDA graphs: {self.reason}"
        return f"CUDA graphs, {self.recaptures} recaptures" if self.recaptures else "CUDA graphs"

    def counts(self) -> dict:
        return {"captures": self.captures, "recaptures": self.recaptures, "replays": self.replays,
                "evictions": self.evictions}

    def _plain_or_capture(self, inputs: list, wire: list | None) -> list:
        entries = [_entry(x, self.capturer.device_type) for x in inputs]
        if self.plain >= WARM_CALLS and len(entries) == len(self.last):
            outputs = self._capture(inputs, entries, wire)
            return outputs if outputs is not None else list(self.fn(*inputs))  # None: given up
        self.plain += 1
        self.last = entries
        device = next((e[2][3] for e in entries if e[0] == _TENSOR), None)
        return list(self.capturer.warm(self.fn, inputs, device))

    def _capture(self, inputs: list, entries: list, wire: list | None) -> list | None:
        off = next((i for i, e in enumerate(entries) if e[0] == _OFF), None)
        devices = {e[2][3] for e in entries if e[0] == _TENSOR}
        if off is not None or len(devices) != 1:  # a capture on one device's stream misses other devices' work
            self._give_up(f"input {off} is a {entries[off][1]} tensor" if off is not None
                          else f"tensor inputs on {len(devices)} devices")
            return None
        device = devices.pop()
        stable, varying, values, static = [], [], [], list(inputs)
        # outside inference mode: Inductor's own capture crashed inside it
        with torch.inference_mode(False), torch.no_grad():
            try:
                for i, (e, x) in enumerate(zip(entries, inputs)):
                    if e[0] == _VALUE:
                        values.append((i, e))
                    elif e == self.last[i] and i not in self.copied:
                        stable.append((i, e[1], e[2]))
                    else:  # (an expanded input, whose elements overlap, cannot be copied into: given up)
                        buf = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
                        varying.append((i, buf, e[2]))
                        static[i] = buf.copy_(x)
                graph, outputs = self.capturer.capture(self.fn, static, device)
            except Exception as exc:
                self._give_up(f"capture failed: {type(exc).__name__}: {str(exc)[:500]}")
                return None
        outputs = list(outputs)
        off = next((k for k, o in enumerate(outputs) if isinstance(o, torch.Tensor) and o.device != device), None)
        if off is not None:  # made once by the capture, never by a replay
            self._give_up(f"output {off} is on {outputs[off].device}, the inputs on {device}")
            return None
        in_place = {inputs[i].untyped_storage().data_ptr() for i, _, _ in stable}
        owned = {t.untyped_storage().data_ptr() for t in outputs if isinstance(t, torch.Tensor)}
        owned |= {buf.untyped_storage().data_ptr() for _, buf, _ in varying}
        owned -= in_place | {0}  # a stable input written by the graph is the client's own business
        self.captured = c = Captured(graph, len(inputs), stable, varying, values, outputs, owned)
        if wire is not None and len(wire) == len(inputs):
            address = self.table.address
            c.known = [(i, wire[i], address(wire[i][0]), inputs[i], inputs[i].untyped_storage().data_ptr())
                       for i, _, _ in stable if type(wire[i]) is list]
            named = {k[0] for k in c.known}
            c.unknown = [i for i in range(len(inputs)) if i not in named]
        self.captures += 1
        self.bound.clear()
        return self._replay(self.captured, inputs)

    def _replay(self, c: Captured, inputs: list) -> list:
        for sid, ptr in self.bound:
            if self.table.evict(sid, ptr):
                self.evictions += 1
        self.bound.clear()
        for i, buf, _ in c.varying:
            buf.copy_(inputs[i])
        self.capturer.replay(c.graph)
        if self.writes_inputs:
            for i, buf, _ in c.varying:
                inputs[i].copy_(buf)
        self.replays += 1
        return list(c.outputs)

    def _recapture(self, why: str, moved: set, inputs: list) -> list:
        self.captured = None  # nothing replays it again: its outputs the client holds stay as they are
        self.bound.clear()
        self.recaptures += 1
        if moved - self.copied:   # progress: those inputs are copied from now on (bounded by the inputs)
            self.copied |= moved
        elif self.fruitless >= MAX_RECAPTURES:
            self._give_up(f"{why} after {MAX_RECAPTURES} recaptures")
            return list(self.fn(*inputs))
        else:
            self.fruitless += 1
        self.plain = WARM_CALLS - 1  # this call runs as it is, the next one captures
        return self._plain_or_capture(inputs, None)

    def _give_up(self, reason: str) -> None:
        self.reason, self.captured = reason, None
        self.bound.clear()
        log.warning("a shipped graph runs without CUDA graphs: %s", reason)
