"""Output metadata worked out on the client: the meta kernel, run once per op signature and cached.

A ``Plan`` says, for each output of an op, whether it is a fresh tensor (made
here with ``empty_strided``, so its id is minted here), one of the op's inputs
(in-place and ``out=``), a view of an input (made here: the server is not told),
or a plain value. A cached plan costs a small part of running a meta kernel
(docs/perf/fast_path-history.md, "Where a streamed op's client time goes").
"""
from __future__ import annotations

import torch

from rgpu.ops_substitutes import substitute

from . import optable
from .encode import CODE

DTYPE = {i: d for d, i in CODE.items()}
MAX_PLANS = 50_000  # why a bound: scalar values are part of some signatures


class Plan:
    __slots__ = ("specs", "resize", "post")

    def __init__(self, specs, resize, post):
        self.specs = specs    # nested like the op's result; leaves are tuples, see build()
        self.resize = resize  # [(locator, sizes)]: out= tensors to resize before the op is sent
        self.post = post      # False when the op only makes views: nothing to tell the server


_plans: dict = {}


def plan_for(op, info: optable.OpInfo, key, args, kwargs, devtype: str, kind: str) -> Plan:
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        plan = _plans[key] = make_plan(op, info, args, kwargs, devtype, kind)
    return plan


def clear() -> None:
    """Forget every plan (a new session may run on another kind of device)."""
    _plans.clear()


def _to_meta(v, devtype):
    if isinstance(v, torch.Tensor):
        if v.device.type != devtype:
            return v  # CPU scalars stay as they are
        storage = v.untyped_storage()
        base = torch.empty(-(-storage.nbytes() // v.element_size()), dtype=v.dtype, device="meta")
        return _set_bits(base.as_strided(v.shape, v.stride(), v.storage_offset()), v.is_conj(), v.is_neg())
    if type(v) in (list, tuple):
        return type(v)(_to_meta(x, devtype) for x in v)
    if type(v) is torch.device and v.type == devtype:
        return torch.device("meta")
    return v


def _set_bits(t: torch.Tensor, conj: bool, neg: bool) -> torch.Tensor:
    """``t`` with the conjugate and negative bits given (views carry them, as PyTorch's own views do)."""
    if conj:
        torch._C._set_conj(t, True)
    if neg:
        torch._C._set_neg(t, True)
    return t


_WRAPPED = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def _numbers_as_scalars(op, args, kwargs):
    """Numbers where the schema says Tensor become 0-dim stand-ins of a wrapped number's dtype.

    Why: PyTorch wraps a scalar into a tensor (``x % 4`` calls ``remainder.Tensor``), the
    boxed fallback receives it as a number again, and ``torch.ops`` takes numbers for
    Tensor arguments of only a few ops (add, mul, ...).
    """
    args, kwargs = list(args), dict(kwargs)
    for i, a in enumerate(op._schema.arguments):
        if str(a.type) not in ("Tensor", "Optional[Tensor]"):
            continue
        if not a.kwarg_only and i < len(args) and type(args[i]) in _WRAPPED:
            args[i] = torch.empty((), dtype=_WRAPPED[type(args[i])], device="meta")
        elif type(kwargs.get(a.name)) in _WRAPPED:
            kwargs[a.name] = torch.empty((), dtype=_WRAPPED[type(kwargs[a.name])], device="meta")
    return args, kwargs


def make_plan(op, info: optable.OpInfo, args, kwargs, devtype: str, kind: str) -> Plan:
    """Run the meta kernel on stand-ins of the inputs (raises what the op would raise on shapes/dtypes).

    ``kind`` is the server's device kind: an op the server runs as a substitute
    is sized by that substitute (see rgpu.ops_substitutes).
    """
    margs = _to_meta(args, devtype)
    mkwargs = {k: _to_meta(v, devtype) for k, v in kwargs.items()}
    run = substitute(info.name, kind) or op
    try:
        result = run(*margs, **mkwargs)
    except RuntimeError as exc:
        if "Expected a value of type 'Tensor" not in str(exc):
            raise
        margs, mkwargs = _numbers_as_scalars(op, margs, mkwargs)  # as the server does (its resolve.py)
        result = run(*margs, **mkwargs)
    resize = []
    for loc in info.outs:
        real, fake = optable.locate(loc, args, kwargs), optable.locate(loc, margs, mkwargs)
        if isinstance(real, torch.Tensor) and real.shape != fake.shape:
            resize.append((loc, tuple(fake.shape)))

    def spec(value, ret):
        if isinstance(value, (tuple, list)):
            return type(value)(spec(v, ret) for v in value)
        if not isinstance(value, torch.Tensor):
            return ("value", value)
        if value.layout != torch.strided:
            raise RuntimeError(f"rgpu supports only strided tensors: {info.name} makes a "
                               f"{str(value.layout).removeprefix('torch.')} tensor")
        if ret is not None and ret[0] == "write":
            return ("arg", ret[1])
        if ret is not None and ret[0] == "view":
            return ("alias", ret[1], CODE[value.dtype], tuple(value.shape), tuple(value.stride()),
                    value.storage_offset(), value.is_conj(), value.is_neg())
        return ("new", CODE[value.dtype], tuple(value.shape), tuple(value.stride()))

    if len(info.returns) == 1:
        specs = spec(result, info.returns[0])
    elif len(info.returns) == 0:
        specs = None  # "-> ()": the kernel must return None
    else:
        specs = tuple(spec(v, r) for v, r in zip(result, info.returns))
    post = bool(info.writes) or not info.views
    return Plan(specs, resize, post)


def express(plan: Plan, op, info: optable.OpInfo, index: int, empty_outs=()):
    """The plan in the C++ fast path's terms, or None where it has no such terms (fast_path.cpp replays it).

    ``(op index, post, returns, resize)``, a return being a leaf or a list of leaves:
    ``(0, dtype, sizes, strides)`` new, ``(1, position)`` an input written in place,
    ``(2, position, dtype, sizes, strides, offset)`` a view, ``(3,)`` None, ``(4, value)`` an
    int (attention's max_q: a function of the shapes the plan is keyed by), ``(5,)`` an
    undefined Tensor (attention's cum_seq_q); ``resize``
    is ``[(position, sizes)]``, out= tensors to resize first. Positions are the
    schema's, which is how C++ sees the boxed arguments.
    """
    schema = op._schema
    position = {a.name: n for n, a in enumerate(schema.arguments)}
    resize = []
    for loc, size in plan.resize:
        # Only outs that were empty: what PyTorch makes for a structured op's out= kernel (``x + 1``
        # runs ``add.out``). Resizing one with elements warns, and the warning stays Python's.
        if loc not in empty_outs:
            return None
        resize.append((loc[1] if loc[0] == "a" else position[loc[1]], list(size)))

    def leaf(spec, rtype: str):
        if type(spec) is not tuple or not spec or type(spec[0]) is not str:
            return None
        kind = spec[0]
        if rtype in ("int", "SymInt"):
            return (4, spec[1]) if kind == "value" and type(spec[1]) is int else None
        if kind == "value" and spec[1] is None and rtype == "Tensor":
            return (5,)
        if kind == "new":
            return (0, spec[1], list(spec[2]), list(spec[3]))
        where = None if kind == "value" else spec[1][1] if spec[1][0] == "a" else position[spec[1][1]]
        if kind == "arg":
            return (1, where)
        if kind == "alias" and not spec[6] and not spec[7]:  # math bits stay with Python
            return (2, where, spec[2], list(spec[3]), list(spec[4]), spec[5])
        return (3,) if kind == "value" and spec[1] is None and rtype == "Optional[Tensor]" else None

    specs = () if plan.specs is None else (plan.specs,) if len(info.returns) == 1 else plan.specs
    returns = []
    for spec, r in zip(specs, schema.returns):
        rtype = str(r.type)
        if rtype == "List[Tensor]" and type(spec) is list:
            leaves = [leaf(s, rtype) for s in spec]   # a None in a list: no plan
        elif rtype in ("Tensor", "Optional[Tensor]", "int", "SymInt"):
            leaves = leaf(spec, rtype)
        else:
            return None
        if leaves is None or (type(leaves) is list and None in leaves):
            return None
        returns.append(leaves)
    return (index, plan.post, returns, resize)


def build(spec, args, kwargs, device, describe, alias, outs: list):
    """The op's outputs from its plan; ``outs`` collects the wire form of each leaf, in order."""
    if spec is None:
        return None
    if type(spec) is list or (type(spec) is tuple and (not spec or type(spec[0]) is not str)):
        return type(spec)(build(s, args, kwargs, device, describe, alias, outs) for s in spec)
    kind = spec[0]
    if kind == "new":
        t = torch.empty_strided(spec[2], spec[3], dtype=DTYPE[spec[1]], device=device)
        outs.append(describe(t))
        return t
    outs.append(None)
    if kind == "arg":
        return optable.locate(spec[1], args, kwargs)
    if kind == "alias":
        return _set_bits(alias(optable.locate(spec[1], args, kwargs), *spec[2:6]), *spec[6:])
    return spec[1]
