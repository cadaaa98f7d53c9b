"""Turns the wire's argument values into torch values on the server, and results back into wire values."""
from __future__ import annotations

import torch

from .handles import DTYPE_BY_CODE, HandleTable, dtype_of
from rgpu.protocol.ops import LAYOUTS, MEMORY_FORMATS

CODE_BY_DTYPE = {d: i for i, d in enumerate(DTYPE_BY_CODE) if d is not None}
_LAYOUT = {name: getattr(torch, name) for name in LAYOUTS if hasattr(torch, name)}
_MEMORY_FORMAT = {name: getattr(torch, name) for name in MEMORY_FORMATS}


_PLAIN = frozenset((int, float, bool, str, type(None)))  # wire values that are already torch values


class Decoder:
    """Decodes one message's values; remembers the input storages (outputs must not alias them).

    ``cached``: tensors come from the handle table's view cache (the op path: the executor then
    checks the views an op wrote); without it each tensor is a view of its own."""

    __slots__ = ("table", "inputs", "device", "_tensor", "_cached")

    def __init__(self, table: HandleTable, cached: bool = False):
        self.table = table
        self.inputs: list[int] = []  # base addresses of the storages the inputs live in
        self.device = 0  # the rgpu index of the first tensor or device argument: where the op runs
        self._tensor = table.view if cached else table.tensor
        self._cached = cached

    def value(self, v):
        """A wire value as the op takes it: lists item by item, ``{"t": descriptor}`` a tensor of the table (its
        ``Poisoned`` raised for a failed op's), the other tags (``rgpu.protocol.ops``) a dtype, device, layout,
        memory format, complex, 0-dim tensor or ``GeneratorArg``; ``ValueError`` for an unknown tag or name."""
        t = type(v)
        if t is list:
            if self._cached and v and type(v[0]) is dict and "t" in v[0]:  # a list of tensors, in one loop
                if not self.inputs:
                    self.device = v[0]["t"][6]
                got = self.table.view_list(v, self.inputs)
                if got is not None:
                    return got
            return [x if type(x) in _PLAIN else self.value(x) for x in v]
        if t is not dict:
            return v
        if len(v) == 1:
            x = v.get("t")
            if x is not None:  # the common case first: a tensor
                inputs = self.inputs
                if not inputs:
                    self.device = x[6]
                return self._tensor(x, inputs)
        return self._tagged(v)

    def _tagged(self, v: dict):
        ((tag, x),) = v.items()
        if tag == "t":
            if not self.inputs:
                self.device = x[6]
            return self._tensor(x, self.inputs)
        if tag == "j":  # a conjugate or negative view: the kernels here read the bits as on the client
            if not self.inputs:
                self.device = x[0][6]
            t = self._tensor(x[0], self.inputs)
            t = t.conj() if x[1] and t.is_complex() else t
            return t._neg_view() if x[2] else t
        if tag == "s":
            return torch.tensor(x[1], dtype=dtype_of(x[0]))
        if tag == "d":
            return dtype_of(x)
        if tag == "v":
            if x[0] != "rgpu":
                return torch.device(_check(x[0], ("cpu",), "device"))
            if not self.inputs:
                self.device = x[1] or 0
            return self.table.device(x[1] or 0)
        if tag == "l":
            return _LAYOUT[_check(x, _LAYOUT, "layout")]
        if tag == "m":
            return _MEMORY_FORMAT[_check(x, _MEMORY_FORMAT, "memory format")]
        if tag == "c":
            return complex(x[0], x[1])
        if tag == "g":
            return GeneratorArg(int(x[0]), int(x[1]))
        raise ValueError(f"unknown value tag {tag!r}")

    def kwargs(self, v: dict) -> dict:
        """``value`` of each keyword argument."""
        return {k: x if type(x) in _PLAIN else self.value(x) for k, x in v.items()}


class GeneratorArg:
    """An explicit generator argument: the client's (seed, offset); the executor makes the generator."""

    __slots__ = ("seed", "offset")

    def __init__(self, seed: int, offset: int):
        self.seed, self.offset = seed, offset

    def stream_seed(self) -> int:
        """The seed of this op's stream: (seed, offset) mixed, so neighbouring offsets draw unrelated numbers."""
        return _splitmix64(self.seed ^ _splitmix64(self.offset))


def _splitmix64(x: int) -> int:
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def _check(name, allowed, what: str) -> str:
    if name not in allowed:
        raise ValueError(f"unknown {what} {name!r}")
    return name


def descriptor(wire):
    """The descriptor inside a wire tensor value ("t" or "j"), or None for any other value."""
    if type(wire) is dict:
        if "t" in wire:
            return wire["t"]
        if "j" in wire:
            return wire["j"][0]
    return None


def flatten(result) -> list:
    """An op's result as a flat list (tuples and lists of tensors unrolled, in order)."""
    if isinstance(result, (tuple, list)):
        return [x for r in result for x in flatten(r)]
    return [result]


def encode_result(value, bind):
    """A CALL's result for the wire; ``bind(tensor)`` stores a fresh tensor and returns its descriptor."""
    if isinstance(value, torch.Tensor):
        return {"t": bind(value)}
    if isinstance(value, (tuple, list)):
        return [encode_result(v, bind) for v in value]
    if isinstance(value, complex):
        return {"c": [value.real, value.imag]}
    if isinstance(value, torch.dtype):
        return {"d": CODE_BY_DTYPE[value]}
    return value
