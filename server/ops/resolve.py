"""Which ops a session may run: aten only, by validated name, schema compared, a block list.

The client names each op once (``Msg.DEFINE``) with its schema as its torch
prints it; an op whose schema differs here is refused by name, so a client and
a server on different torch versions never disagree silently about arguments.
"""
from __future__ import annotations

import re

import torch

from rgpu.ops_substitutes import substitute

# Ops a client may never run on the server, and why.
BLOCKED = {
    "from_file": "reads a file on the server",
    "save": "writes a file on the server",
    "_print": "writes to the server's stdout",
    "set_grad_enabled": "changes the worker's autograd state",
    "set_data": "swaps a tensor's identity; handles are the server's",
    "record_stream": "streams are the server's",
    "_cufft_set_plan_cache_max_size": "changes process-wide cuFFT state",
    "_cufft_clear_plan_cache": "changes process-wide cuFFT state",
    "_set_item": "a TorchScript list helper, not a tensor op",
}
_NAME = re.compile(r"^[a-z_][a-z0-9_]*\.[A-Za-z0-9_]+$")


class OpRefused(Exception):
    """The server will not run this op; the message says why."""

    def __init__(self, op: str, message: str):
        super().__init__(message)
        self.op = op


class Resolved:
    """A runnable op (the op, or its substitute here) and what the executor needs to know of its schema."""

    __slots__ = ("name", "op", "call", "substituted", "fast", "mutable", "checked", "outs", "generator", "tensor_args", "wrap_numbers", "adapt", "fix")

    def __init__(self, name: str, op, run=None):
        self.name, self.op = name, run or op
        self.call = run or op._op  # what runs it: the overload's C++ callable, one Python frame fewer
        self.substituted = run is not None
        self.fast = False  # whether the executor's C++ op path runs it (FastOps.define)
        args = op._schema.arguments
        # positions and keyword names of arguments the op writes: they share the fate of a failure
        self.mutable = [(i, a.name, a.kwarg_only) for i, a in enumerate(args)
                        if a.alias_info is not None and a.alias_info.is_write]
        self.outs = [name for _, name, kwarg_only in self.mutable if kwarg_only]  # out= arguments
        # the written arguments whose layout the executor checks after the op: all but the lists of the
        # in-place _foreach_ and fused optimizer ops (kernels that write their elements' data, never their
        # sizes or strides)
        in_place_lists = name.startswith(("aten._foreach_", "aten._fused_")) and name.split(".")[1].endswith("_")
        self.checked = [m for m in self.mutable if not (in_place_lists and str(args[m[0]].type) == "List[Tensor]")]
        # where the op takes its generator: (position, name, keyword-only) or None
        self.generator = next(((i, a.name, a.kwarg_only) for i, a in enumerate(args) if a.name == "generator"), None)
        self.tensor_args = [(i, a.name, a.kwarg_only) for i, a in enumerate(args)
                            if str(a.type) in ("Tensor", "Optional[Tensor]")]
        self.wrap_numbers = False  # set once the op has refused a number where its schema says Tensor
        self.adapt = self.fix = None  # the executor's own adaptations of arguments (args) and of results (args, result)

    def numbers_as_tensors(self, args: list, kwargs: dict) -> None:
        """Python numbers in Tensor arguments become CPU scalar tensors, in place.

        Why: PyTorch wraps a scalar into a tensor (``x % 4`` calls ``remainder.Tensor``)
        and the client's boxed fallback receives it as a number again; ``torch.ops``
        takes numbers for Tensor arguments only for a few ops (add, mul, ...).
        The dtype is the wrapped number's: int64, float64, complex128 or bool.
        """
        for pos, name, kwarg_only in self.tensor_args:
            if not kwarg_only and pos < len(args):
                if type(args[pos]) in _NUMBER_DTYPES:
                    args[pos] = torch.tensor(args[pos], dtype=_NUMBER_DTYPES[type(args[pos])])
            elif type(kwargs.get(name)) in _NUMBER_DTYPES:
                kwargs[name] = torch.tensor(kwargs[name], dtype=_NUMBER_DTYPES[type(kwargs[name])])


_NUMBER_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def resolve(qualified: str, schema: str, kind: str = "cpu") -> Resolved:
    """``qualified`` is "name.overload" in the aten namespace; ``schema`` the client's ``str(op._schema)``;
    ``kind`` the server's device kind (which substitute runs an overrideable op)."""
    if not isinstance(qualified, str) or not _NAME.match(qualified):
        raise OpRefused(str(qualified)[:80], "not an aten op name")
    name, overload = qualified.split(".")
    if name in BLOCKED:
        raise OpRefused(qualified, f"refused by the server: it {BLOCKED[name]}")
    packet = getattr(torch.ops.aten, name, None)
    op = getattr(packet, overload, None) if packet is not None else None
    if not isinstance(op, torch._ops.OpOverload):
        raise OpRefused(qualified, f"the server's torch {torch.__version__} has no aten::{qualified}")
    mine = str(op._schema)
    if mine != schema:
        raise OpRefused(qualified, f"schema differs between client and server (torch {torch.__version__}): "
                                   f"client {schema!r}, server {mine!r}")
    return Resolved(f"aten.{qualified}", op, substitute(qualified, kind))
