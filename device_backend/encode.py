"""Arguments to wire values, with the op's signature for the meta cache built in the same pass.

A tensor on the device becomes its descriptor (``describe`` in C++); a CPU
0-dim tensor travels as its value; everything else as the protocol's tags.
The signature keeps what output metadata can depend on: tensor geometry,
dtypes, scalar types, and scalar values unless the op is in-place.
"""
from __future__ import annotations

import torch

from rgpu.protocol.ops import DTYPES

CODE = {getattr(torch, n): i for i, n in enumerate(DTYPES) if hasattr(torch, n)}
_SCALARS = (bool, int, float, str)


class Encoder:
    """Encodes one call; ``device`` ends as the index of its first rgpu tensor (or device argument)."""

    __slots__ = ("describe", "by_type", "mixed_ok", "key", "device", "devtype")

    def __init__(self, describe, devtype: str, by_type: bool = False, mixed_ok: bool = False):
        self.describe, self.devtype, self.by_type, self.mixed_ok = describe, devtype, by_type, mixed_ok
        self.key: list = []
        self.device: int | None = None

    def value(self, v):
        t = type(v)
        if t in _SCALARS or v is None:
            self.key.append(t if (self.by_type and t is float) else (t, v))
            return v
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if t is list or t is tuple:
            self.key.append(len(v))
            return [self.value(x) for x in v]
        self.key.append((t, v) if t is not torch.Generator else t)
        if t is torch.dtype:
            return {"d": CODE[v]}
        if t is torch.device:
            if v.type == self.devtype:
                index = 0 if v.index is None else v.index
                if self.device is None:
                    self.device = index
                return {"v": ["rgpu", index]}
            return {"v": [v.type, v.index]}
        if t is torch.layout:
            return {"l": str(v).removeprefix("torch.")}
        if t is torch.memory_format:
            return {"m": str(v).removeprefix("torch.")}
        if t is complex:
            return {"c": [v.real, v.imag]}
        if t is torch.Generator:
            return self.generator(v)
        raise TypeError(f"rgpu: cannot send an argument of type {t.__name__} to the server")

    def generator(self, g: torch.Generator):
        """A generator's state, (seed, offset); each use moves the offset on, so each op draws a new stream.

        The state lives here, in the generator object: ``get_state``/``set_state``
        and seeding need no message, and the server derives an op's numbers from
        the pair alone (``rgpu.server.ops.codec.GeneratorArg``).
        """
        if g.device.type != self.devtype:
            raise RuntimeError(f"Expected a '{self.devtype}' device type for generator but found '{g.device.type}'")
        seed, offset = g.initial_seed(), g.get_offset()
        g.set_offset(offset + 1)
        return {"g": [seed, offset]}

    def tensor(self, v: torch.Tensor):
        if v.device.type == self.devtype:
            d = self.describe(v)
            if self.device is None:
                self.device = d[6]
            elif d[6] != self.device and not self.mixed_ok:
                raise RuntimeError("Expected all tensors to be on the same device, but found at least two "
                                   f"devices, rgpu:{self.device} and rgpu:{d[6]}!")
            if v.is_conj() or v.is_neg():  # views whose kernels read the bits (mm of a .conj(), copies)
                self.key.append((d[1:], v.is_conj(), v.is_neg()))
                return {"j": [d, v.is_conj(), v.is_neg()]}
            self.key.append(d[1:])
            return {"t": d}
        if v.device.type == "cpu" and v.dim() == 0:
            # a CPU scalar mixes with device tensors, as on CUDA; its value is data, not signature
            self.key.append(("s", v.dtype))
            return {"s": [CODE[v.dtype], v.item()]}
        raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices, "
                           f"{self.devtype}:{self.device or 0} and {v.device}!")

    def kwargs(self, kw: dict) -> dict:
        out = {}
        for k, v in kw.items():
            self.key.append(k)
            out[k] = self.value(v)
        return out
