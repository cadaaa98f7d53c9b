"""What the fallback does with each aten op: the tables, then per-op facts read once from the schema.

Kinds (``OpInfo.kind``):
    local   answered on the client by a function in ``LOCAL`` (copies, scalars, choices)
    out     an ``out=`` op whose outputs PyTorch already sized: post it as it is
    stream  outputs worked out from the meta kernel (cached by signature), then posted
    call    data or data-dependent shapes: one round trip, the server sizes the outputs
"""
from __future__ import annotations

import torch

from rgpu.ops_substitutes import SUBSTITUTES

# Ops whose result is data the client must wait for, though their meta kernels answer.
DATA = {"equal", "is_nonzero", "is_set_to", "_local_scalar_dense", "allclose", "_nnz",
        "repeat_interleave"}  # its meta kernel refuses when output_size is not given

# Ops answered on the client: (name, overload) -> name of a function in copies.py.
LOCAL = {
    ("_copy_from", "default"): "copy_from",
    ("_copy_from_and_resize", "default"): "copy_from_and_resize",
    ("_has_compatible_shallow_copy_type", "default"): "compatible_for_set_data",
}

# Ops PyTorch would decompose for a backend without a kernel, that the server runs whole
# (fewer messages, the server's fused kernels); registered for PrivateUse1 at load.
CLAIMED = (
    "native_layer_norm.default", "native_layer_norm_backward.default",
    # decomposed for a backend without a kernel, they round bfloat16 at each step; CUDA's kernels fuse them
    "native_group_norm.default", "addr.default", "addr.out",
    "_has_compatible_shallow_copy_type.default",  # else Module.to makes new Parameters (breaks weight tying)
    *SUBSTITUTES,  # kernels that only raise for a third-party device (convolution, fused attention)
)
CLAIMED_PREFIXES = ("_foreach_",)

# Return types the meta kernel can be trusted to compute (shapes); anything else is data.
_META_RETURNS = {"Tensor", "Optional[Tensor]", "List[Tensor]", "List[Optional[Tensor]]", "int", "SymInt", "List[int]"}


class OpInfo:
    __slots__ = ("name", "kind", "writes", "outs", "by_type", "returns", "views", "indices")

    def __init__(self, op):
        schema = op._schema
        self.name = f"{schema.name[6:]}.{op._overloadname}"
        args = schema.arguments
        self.writes = [_loc(i, a) for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]
        self.outs = [_loc(i, a) for i, a in enumerate(args)
                     if a.alias_info is not None and a.alias_info.is_write and a.kwarg_only]
        # Why by type for in-place ops: their outputs are their inputs whatever the
        # scalar's value, and optimizers change scalars (learning rates) every step.
        self.by_type = bool(self.writes) and not self.outs
        # advanced indexing's index tensors, which may sit on the CPU as they may for a CUDA tensor
        self.indices = next((_loc(i, a) for i, a in enumerate(args)
                             if a.name == "indices" and str(a.type) == "List[Optional[Tensor]]"), None)
        sets = {}
        for i, a in enumerate(args):
            if a.alias_info is not None:
                for s in a.alias_info.before_set:
                    sets.setdefault(s, _loc(i, a))
        # per return: ("write"|"view", locator of the input it aliases) or None (a fresh value)
        self.returns = []
        for r in schema.returns:
            ai = r.alias_info
            loc = sets.get(next(iter(ai.before_set))) if ai is not None and ai.before_set else None
            self.returns.append(None if loc is None else ("write" if ai.is_write else "view", loc))
        self.views = any(r is not None and r[0] == "view" for r in self.returns)
        rtypes = {str(r.type) for r in schema.returns}
        key = (schema.name[6:], op._overloadname)
        if key in LOCAL:
            self.kind = "local"
        elif schema.name[6:] in DATA or not rtypes <= _META_RETURNS:
            self.kind = "call"
        elif self.outs and len(self.outs) == len(self.writes):
            self.kind = "out"
        else:
            self.kind = "stream"


def _loc(i: int, a) -> tuple:
    """Where an argument sits in the boxed call: ("k", name) for keyword-only, else ("a", position)."""
    return ("k", a.name) if a.kwarg_only else ("a", i)


def locate(loc, args, kwargs):
    if loc[0] == "a":
        return args[loc[1]] if loc[1] < len(args) else None
    return kwargs.get(loc[1])


def functional(op):
    """The out-of-place overload of an out= op (``linalg_lstsq.out`` -> ``.default``), or None."""
    if op not in _FUNCTIONAL:
        schema = op._schema
        outs = [a for a in schema.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
        want = [(a.name, str(a.type)) for a in schema.arguments if a not in outs]
        packet = getattr(torch.ops.aten, schema.name[6:])
        _FUNCTIONAL[op] = next((f for f in (getattr(packet, n) for n in packet.overloads())
                                if [(a.name, str(a.type)) for a in f._schema.arguments] == want
                                and not any(a.alias_info is not None for a in f._schema.arguments)
                                and len(f._schema.returns) == len(outs)), None)
    return _FUNCTIONAL[op]


_FUNCTIONAL: dict = {}
_INFO: dict = {}


def info(op) -> OpInfo:
    i = _INFO.get(op)
    if i is None:
        i = _INFO[op] = OpInfo(op)
    return i
