"""The Python boxed fallback for PrivateUse1: every aten op without a C++ kernel arrives here.

It decides, per op (``optable``), whether to post the op as it is, work out
its outputs from the meta cache and post it, answer it locally, or ask the
server and wait. Shape and dtype errors come out of the meta kernel, here,
at the user's line; failures on the server come back at the next wait.

Once a session runs the C++ fast path (``fast_path.cpp``, ``RGPU_FAST_PATH``),
that is the registered fallback: it replays the plans it has learnt and hands
every other call to ``from_cpp``, which runs this fallback and says what C++
may learn from the call.
"""
from __future__ import annotations

import torch

from rgpu.protocol.ops import CALL_RESERVED_IDS, CALL_RESERVED_IDS_FOR_LISTS

from . import copies, meta, optable, session
from .encode import Encoder
from .optable import locate


def fallback(op, *args, **kwargs):
    s = session.current()
    if s is None:
        session.get()  # first use of the device: load the C++ part, connect
        return op(*args, **kwargs)  # again: the op may have a C++ kernel now
    i = optable.info(op)
    if i.indices is not None:
        args, kwargs = _indices_to_device(i.indices, args, kwargs)
    kind = i.kind
    if kind == "stream":
        return stream(s, op, i, args, kwargs)
    if kind == "out":
        return post_out(s, op, i, args, kwargs)
    if kind == "call":
        return call(s, op, i, args, kwargs)
    return getattr(copies, optable.LOCAL[(op._schema.name[6:], op._overloadname)])(
        s, lambda o, a, k, mixed_ok=False: stream(s, o, optable.info(o), a, k, mixed_ok), *args, **kwargs)


def _returns(i: optable.OpInfo, args, kwargs):
    outs = [locate(r[1], args, kwargs) for r in i.returns]
    return None if not outs else outs[0] if len(outs) == 1 else tuple(outs)


def post_out(s, op, i, args, kwargs):
    """An out= op: posted as it is once its plan (cached) says the outs have the sizes the result needs.

    Why a plan even here: a user's ``out=`` tensor of another size is resized first,
    with PyTorch's warning, as CUDA's kernels resize it (the server's would otherwise).
    """
    return stream(s, op, i, args, kwargs)


def from_cpp(op, args, kwargs, learn: bool, device: int = -1):
    """The C++ fast path's way in (fast_path.cpp), for a call it has no plan for: (result, what it may learn).

    What it may learn: None (nothing: this call's plan is not one C++ replays), False
    (this op never streams: C++ stops asking), or the plan in C++'s terms (``meta.express``),
    with the op's index at the server of ``rgpu:device`` (the call's device, as C++ found it).
    """
    s = session.current()
    if not learn or s is None:
        return fallback(op, *args, **kwargs), None
    i = optable.info(op)
    if i.kind not in ("stream", "out"):
        return fallback(op, *args, **kwargs), False
    if i.indices is not None:
        args, kwargs = _indices_to_device(i.indices, args, kwargs)
    empty = [loc for loc in i.outs if _empty(optable.locate(loc, args, kwargs))]  # before they are resized
    result, plan = _stream(s, op, i, args, kwargs)
    if plan is None:   # sized by the server (a data-dependent shape): nothing C++ can replay
        return result, None
    index = s._index(op, s.servers.of(device if device >= 0 else None)) if plan.post else 0
    return result, meta.express(plan, op, i, index, empty)


def _empty(t) -> bool:
    return isinstance(t, torch.Tensor) and t.numel() == 0


def stream(s, op, i, args, kwargs, mixed_ok: bool = False):
    return _stream(s, op, i, args, kwargs, mixed_ok)[0]


def _stream(s, op, i, args, kwargs, mixed_ok: bool = False):
    """The op streamed from its plan: (result, plan), plan None when the op went to the server to be sized."""
    enc = Encoder(s.C.describe, s.devtype, i.by_type, mixed_ok)
    wargs, wkwargs = enc.value(args), enc.kwargs(kwargs)
    try:
        plan = meta.plan_for(op, i, (op, tuple(enc.key)), args, kwargs, s.devtype, s.kind)
    except NotImplementedError:  # no meta kernel, or a data-dependent shape: the server sizes it
        i.kind = "call"
        return call(s, op, i, args, kwargs), None
    if plan.resize:  # out= tensors that must grow first (their storage ids may change)
        for loc, size in plan.resize:
            locate(loc, args, kwargs).resize_(size)  # PyTorch's warning came from the meta kernel
        enc = Encoder(s.C.describe, s.devtype, i.by_type, mixed_ok)
        wargs, wkwargs = enc.value(args), enc.kwargs(kwargs)
    device = torch.device(s.devtype, s.C.current_device() if enc.device is None else enc.device)
    outs: list = []
    result = meta.build(plan.specs, args, kwargs, device, s.C.describe, s.C.alias, outs)
    if plan.post:
        s.post_op(op, wargs, wkwargs, outs if any(o is not None for o in outs) else None, device.index)
    return result, plan


def _indices_to_device(loc, args, kwargs):
    """Index tensors on the CPU travel to the indexed tensor's device first (CUDA's kernels move them too)."""
    indices = locate(loc, args, kwargs)
    if not indices or not any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in indices):
        return args, kwargs
    device = args[0].device
    moved = [t.to(device) if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t for t in indices]
    if loc[0] == "a":
        return (*args[:loc[1]], moved, *args[loc[1] + 1:]), kwargs
    return args, {**kwargs, loc[1]: moved}


def _out_through_functional(s, f, i, args, kwargs):
    """An out= op the client cannot size: the server runs its out-of-place overload, whose results fill the outs.

    Why the server's: here the out-of-place overload may be built on the out= one (linalg_lstsq).
    """
    outs = [locate(loc, args, kwargs) for loc in i.outs]
    result = call(s, f, optable.info(f), args, {k: v for k, v in kwargs.items() if ("k", k) not in i.outs})
    for out, r in zip(outs, result if isinstance(result, (tuple, list)) else [result]):
        if out.shape != r.shape:
            out.resize_(r.shape)
        out.copy_(r)
    return _returns(i, args, kwargs)


def call(s, op, i, args, kwargs):
    """One round trip: the server runs the op and says what came out (ids reserved here)."""
    if i.outs and optable.functional(op) is not None:  # the server's kernel would resize outs it cannot name
        return _out_through_functional(s, optable.functional(op), i, args, kwargs)
    enc = Encoder(s.C.describe, s.devtype, mixed_ok=True)
    wargs, wkwargs = enc.value(args), enc.kwargs(kwargs)
    lists = any(str(r.type).startswith("List") for r in op._schema.returns)
    count = CALL_RESERVED_IDS_FOR_LISTS if lists else CALL_RESERVED_IDS
    result = _decode(s.call_op(op, wargs, wkwargs, s.C.mint_ids(count), count, enc.device), s.C)
    return tuple(result) if len(op._schema.returns) > 1 else result


def _decode(v, C):
    if type(v) is list:
        return [_decode(x, C) for x in v]
    if type(v) is dict:
        ((tag, x),) = v.items()
        if tag == "t":
            sid, nbytes, code, size, stride, offset, dev = x
            return C.adopt(sid, nbytes, dev, code, list(size), list(stride), offset)
        if tag == "c":
            return complex(*x)
        if tag == "d":
            return meta.DTYPE[x]
    return v
