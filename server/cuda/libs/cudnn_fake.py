"""cuDNN beside the fake driver: the backend graph API's bookkeeping and the legacy BN calls, computed with torch on the CPU.

Descriptors keep their attributes, checked as cuDNN checks them (the attribute belongs to the
descriptor's type, its element type and count are right; Finalize wants what it needs). One engine
exists: the heuristic answers one engine config, and a plan over a single-op graph runs
CONVOLUTION_FORWARD, _BACKWARD_DATA or _BACKWARD_FILTER (any spatial rank, pads, strides, dilations,
alpha/beta) with torch, in double precision rounded once, as the fake driver's stream work (``_run``:
in order with the copies and kernels, recorded while the stream is captured). Batch normalization
(training forward, backward, inference) likewise. Tensors are read in place through strided views of
the fake device memory. A graph of other ops (attention's) is kept, finalized and planned unchecked,
its by-value tensors found as the real side finds them; only its execution is refused.
"""
from __future__ import annotations

import logging
import struct

import torch
import torch.nn.functional as F

from rgpu.protocol.lib_cudnn import TYPE_BACKEND_DESCRIPTOR, TYPE_HANDLE, WIDTH, dump

from . import LibError
from .cudnn_by_value import ByValue
from .cudnn_real import STATUS

log = logging.getLogger("rgpu.server.cuda")
VERSION = 91900
BAD_PARAM, NOT_FINALIZED, ATTRIBUTE_TYPE, DESCRIPTOR_TYPE = 2000, 2004, 2010, 2012
NOT_INITIALIZED, NOT_SUPPORTED, VERSION_MISMATCH = 1001, 3000, 1002
DTYPES = {0: torch.float32, 1: torch.float64, 2: torch.float16, 9: torch.bfloat16}
_D, _I64, _I32, _DT, _BOOL, _F, _DBL, _PTR = TYPE_BACKEND_DESCRIPTOR, 3, 23, 1, 2, 4, 5, 6
SCALE = {_F, _DBL}
CONV_FWD, CONV_BWD_FILTER, CONV_BWD_DATA = 10, 11, 12
# descriptor type -> {attribute: element types it takes}; the ones the fake models
SETTABLE = {
    17: {900: {_I64}, 901: {_DT}, 902: {_I64}, 903: {_I64}, 904: {_I64}, 905: {_I64}, 906: {_I64}, 907: {_BOOL},
         908: {_BOOL}, 909: {20}},                                                         # tensor
    1: {100: {_DT}, 101: {7}, 102: {_I64}, 103: {_I64}, 104: {_I64}, 105: {_I64}, 106: {_I64}},   # convolution
    CONV_FWD: {700: SCALE, 701: SCALE, 702: {_D}, 703: {_D}, 704: {_D}, 705: {_D}},
    CONV_BWD_DATA: {706: SCALE, 707: SCALE, 708: {_D}, 709: {_D}, 710: {_D}, 711: {_D}},
    CONV_BWD_FILTER: {712: SCALE, 713: SCALE, 714: {_D}, 715: {_D}, 716: {_D}, 717: {_D}},
    15: {800: {TYPE_HANDLE}, 801: {_D}},                                                   # operation graph
    4: {200: {8}, 201: {_D}, 203: {_I32}},                                                 # engine heuristic
    2: {1300: {_D}, 1301: {_I64}, 1306: {_I32}},                                           # engine
    3: {300: {_D}, 302: {_D}},                                                             # engine config
    7: {600: {9}, 601: {_I64}},                                                            # knob choice
    5: {400: {TYPE_HANDLE}, 401: {_D}},                                                    # execution plan
    16: {1000: {_I64}, 1001: {_PTR}, 1002: {_PTR}, 1003: {_PTR}},                          # variant pack
}
# an op's (alpha, beta, conv, then its three tensors: the two inputs and the output)
OPS = {CONV_FWD: (700, 701, 702, 704, 703, 705), CONV_BWD_DATA: (706, 707, 708, 711, 709, 710),
       CONV_BWD_FILTER: (712, 713, 714, 716, 717, 715)}


class Desc:
    """A backend descriptor: its type, attributes (name -> (element type, count, bytes or [Desc])), state."""

    def __init__(self, type_: int):
        self.type, self.attrs, self.finalized = type_, {}, False

    def copy_from(self, other: Desc) -> None:
        self.attrs, self.finalized = dict(other.attrs), True

    def ints(self, name: int) -> list[int]:
        t, n, data = self.attrs[name]
        return list(struct.unpack(f"<{n}q", data))

    def one(self, name: int) -> int:
        return self.ints(name)[0]

    def enum(self, name: int) -> int:
        return struct.unpack("<i", self.attrs[name][2])[0]

    def desc(self, name: int) -> Desc:
        return self.attrs[name][2][0]

    def scalar(self, name: int, default: float) -> float:
        if name not in self.attrs:
            return default
        t, _, data = self.attrs[name]
        return struct.unpack("<f" if t == _F else "<d", data)[0]


def _fail(status: int, message: str):
    raise LibError(status, message)


class Library:
    def __init__(self, driver, owner):
        self.driver = driver
        self.mem = driver.mem
        self.handles: dict[int, dict] = {}
        self.descs: dict[int, Desc] = {}
        self.tensors: dict[int, dict] = {}        # legacy: {"dtype", "dims", "strides"}
        self.asked = {"cudnnBackendFinalize": 0, "cudnnBackendGetAttribute": 0}   # what reached the server
        self.by_value = ByValue()

    # ---- the contract --------------------------------------------------------------------------
    def status_name(self, status: int) -> str:
        return STATUS.get(status, "CUDNN_STATUS_UNKNOWN")

    def counts(self) -> tuple[int, int, int]:
        """(handles, backend descriptors, tensor descriptors) the session holds."""
        return len(self.handles), len(self.descs), len(self.tensors)

    def close(self) -> None:
        log.debug("cuDNN: %d Finalize and %d GetAttribute calls reached the server; the session left %d handles, "
                  "%d backend and %d tensor descriptors (freed now)", *self.asked.values(), *self.counts())
        self.handles.clear()
        self.descs.clear()
        self.tensors.clear()

    # ---- handles -------------------------------------------------------------------------------
    def cudnnCreate(self, handle, stream, tail, client_version):
        if client_version // 10000 != VERSION // 10000:
            _fail(VERSION_MISMATCH, f"the client's cuDNN is {client_version}, the server's {VERSION}")
        if handle in self.handles:
            _fail(BAD_PARAM, f"cuDNN handle {handle:#x} exists already")
        self.handles[handle] = {}
        return 0

    def cudnnDestroy(self, handle, stream, tail):
        self._handle("cudnnDestroy", handle)
        del self.handles[handle]
        return 0

    def _handle(self, name, handle):
        if handle not in self.handles:
            _fail(BAD_PARAM, f"{name}: {handle:#x} is not a cuDNN handle of this session")
        return self.handles[handle]

    def _desc(self, name: str, desc: int) -> Desc:
        d = self.descs.get(desc)
        if d is None:
            _fail(BAD_PARAM, f"{name}: {desc:#x} is not a backend descriptor of this session")
        return d

    # ---- the backend graph API -----------------------------------------------------------------
    def cudnnBackendCreateDescriptor(self, handle, stream, tail, type):
        if handle in self.descs:
            _fail(BAD_PARAM, f"backend descriptor {handle:#x} exists already")
        if not 0 <= type <= 43:
            _fail(BAD_PARAM, f"cudnnBackendCreateDescriptor: no descriptor type {type}")
        self.descs[handle] = Desc(type)
        return 0

    def cudnnBackendDestroyDescriptor(self, handle, stream, tail):
        self._desc("cudnnBackendDestroyDescriptor", handle)
        del self.descs[handle]                 # descriptors set into others live on there (cuDNN copies)
        self.by_value.forget(handle)
        return 0

    def cudnnBackendSetAttribute(self, handle, stream, tail, name, type, count):
        n = "cudnnBackendSetAttribute"
        d = self._desc(n, handle)
        if d.finalized:
            _fail(BAD_PARAM, f"{n}: the descriptor is finalized")
        allowed = SETTABLE.get(d.type, {}).get(name, {type})      # one it does not model: kept, unchecked
        if type not in allowed:
            _fail(ATTRIBUTE_TYPE, f"{n}: attribute {name} takes element type {sorted(allowed)}, not {type}")
        if type not in WIDTH or count < 0 or len(tail) != count * WIDTH[type]:
            _fail(BAD_PARAM, f"{n}: {len(tail)} bytes for {count} elements of type {type}")
        if type in SCALE and count != 1:
            _fail(BAD_PARAM, f"{n}: a scale is one element")
        value = bytes(tail)
        if type == _D:
            ids = struct.unpack(f"<{count}Q", tail)
            value = [self._desc(n, i) for i in ids]
            if any(not v.finalized for v in value):
                _fail(NOT_FINALIZED, f"{n}: attribute {name} names a descriptor that is not finalized")
        elif type == TYPE_HANDLE:
            for i in struct.unpack(f"<{count}Q", tail):
                self._handle(n, i)
        d.attrs[name] = (type, count, value)
        self.by_value.set(handle, name, type, count, tail)
        return 0

    def readable(self, d: Desc) -> bytes:
        return dump((name, t, n, None if t == _D else v) for name, (t, n, v) in sorted(d.attrs.items()))

    def cudnnBackendGetAttribute(self, handle, stream, tail, name, type, requested):
        n = "cudnnBackendGetAttribute"
        self.asked[n] += 1
        d = self._desc(n, handle)
        if not d.finalized:
            _fail(NOT_FINALIZED, f"{n}: the descriptor is not finalized")
        if name not in d.attrs:
            _fail(BAD_PARAM, f"{n}: attribute {name} is not set on descriptor type {d.type}")
        t, count, value = d.attrs[name]
        if t != type:
            _fail(ATTRIBUTE_TYPE, f"{n}: attribute {name} has element type {t}, not {type}")
        if requested < 0 or (type == _D and len(tail) != 8 * requested):
            _fail(BAD_PARAM, f"{n}: {len(tail)} bytes of descriptors for {requested} elements")
        k = min(requested, count)
        if type != _D:
            return 0, struct.pack("<q", count) + value[:k * WIDTH[type]]
        out = bytearray(struct.pack("<q", count))
        for target_id, source in zip(struct.unpack(f"<{requested}Q", tail)[:k], value):
            target = self._desc(n, target_id)
            if target.type != source.type:
                _fail(DESCRIPTOR_TYPE, f"{n}: attribute {name} holds descriptor type {source.type}, given {target.type}")
            target.copy_from(source)
            self.by_value.filled(target_id, handle)
            d_ = self.readable(target)
            out += struct.pack("<I", len(d_)) + d_
        return 0, bytes(out)

    def cudnnBackendInitialize(self, handle, stream, tail):
        d = self._desc("cudnnBackendInitialize", handle)
        d.attrs, d.finalized = {}, False
        return 0

    def _need(self, d: Desc, *names):
        missing = [a for a in names if a not in d.attrs]
        if missing:
            _fail(BAD_PARAM, f"cudnnBackendFinalize: descriptor type {d.type} lacks attribute(s) {missing}")

    def _finalize(self, d: Desc) -> None:
        if d.finalized:
            _fail(BAD_PARAM, "cudnnBackendFinalize: the descriptor is finalized already")
        t = d.type
        if t == 17:
            self._need(d, 900, 901, 902, 903, 906)
            if len(d.ints(902)) != len(d.ints(903)) or not 1 <= len(d.ints(902)) <= 8:
                _fail(BAD_PARAM, "cudnnBackendFinalize: a tensor's dimensions and strides differ in count")
        elif t == 1:
            self._need(d, 100, 101, 102, 103, 104, 105, 106)
            k = d.one(106)
            if any(len(d.ints(a)) != k for a in (102, 103, 104, 105)):
                _fail(BAD_PARAM, f"cudnnBackendFinalize: a convolution of {k} spatial dims wants {k} of each")
        elif t in OPS:
            self._need(d, *OPS[t][2:])
            if d.desc(OPS[t][2]).type != 1 or any(d.desc(a).type != 17 for a in OPS[t][3:]):
                _fail(BAD_PARAM, "cudnnBackendFinalize: a convolution op wants a convolution and three tensors")
        elif t == 15:                     # the graph's and the plan's handles are deprecated in cuDNN 9: optional
            self._need(d, 801)
            d.attrs[802] = (_I64, 1, struct.pack("<q", 1))          # one engine
        elif t == 4:
            self._need(d, 200, 201)
            engine = Desc(2)
            engine.attrs = {1300: (_D, 1, [d.desc(201)]), 1301: (_I64, 1, struct.pack("<q", 0)),
                            1302: (_D, 0, []), 1303: (11, 0, b""), 1305: (19, 0, b""), 1306: (_I32, 1, bytes(4))}
            engine.finalized = True
            cfg = Desc(3)
            cfg.attrs = {300: (_D, 1, [engine]), 302: (_D, 0, []), 303: (_I64, 1, bytes(8)), 304: (_I32, 1, bytes(4))}
            cfg.finalized = True
            d.attrs[202] = (_D, 1, [cfg])
        elif t == 2:
            self._need(d, 1300, 1301)
            if d.one(1301) != 0:
                _fail(NOT_SUPPORTED, f"cudnnBackendFinalize: the fake cuDNN has engine 0 only, not {d.one(1301)}")
            d.attrs.update({1302: (_D, 0, []), 1303: (11, 0, b""), 1305: (19, 0, b""), 1306: (_I32, 1, bytes(4))})
        elif t == 3:
            self._need(d, 300)
            d.attrs.setdefault(303, (_I64, 1, struct.pack("<q", 0)))
        elif t == 5:
            self._need(d, 401)
            d.attrs[402] = (_I64, 1, struct.pack("<q", 0))          # no workspace
        elif t == 16:
            self._need(d, 1000, 1001)
            if d.attrs[1000][1] != d.attrs[1001][1]:
                _fail(BAD_PARAM, "cudnnBackendFinalize: a variant pack's ids and pointers differ in count")
        d.finalized = True

    def cudnnBackendFinalize(self, handle, stream, tail):
        self.asked["cudnnBackendFinalize"] += 1
        d = self._desc("cudnnBackendFinalize", handle)
        self._finalize(d)
        self.by_value.finalized(handle)
        return 0, self.readable(d) + dump(self.by_value.entry(handle) if d.type == 5 else [])

    def cudnnBackendFinalizeQueued(self, handle, stream, tail):
        self._finalize(self._desc("cudnnBackendFinalize", handle))
        return 0

    def cudnnBackendExecute(self, handle, stream, tail, plan, pack):
        n = "cudnnBackendExecute"
        self._handle(n, handle)
        p, v = self._desc(n, plan), self._desc(n, pack)
        if p.type != 5 or v.type != 16 or not (p.finalized and v.finalized):
            _fail(BAD_PARAM, f"{n}: wants a finalized execution plan and variant pack")
        self.by_value.patched(plan, pack, tail)         # every by-value tensor came with its bytes
        ops = p.desc(401).desc(300).desc(1300).attrs[801][2]
        if len(ops) != 1 or ops[0].type not in OPS:
            _fail(NOT_SUPPORTED, f"{n}: the fake cuDNN runs a graph of one convolution, not {[o.type for o in ops]}")
        op = ops[0]
        uids = v.ints(1000)
        ptrs = dict(zip(uids, struct.unpack(f"<{len(uids)}Q", v.attrs[1001][2])))
        alpha_at, beta_at, conv_at, a_at, b_at, out_at = OPS[op.type]
        tensors = [op.desc(a) for a in (a_at, b_at, out_at)]
        for t in tensors:
            if t.one(906) not in ptrs:
                _fail(BAD_PARAM, f"{n}: the variant pack has no pointer for tensor uid {t.one(906)}")
        alpha, beta = op.scalar(alpha_at, 1.0), op.scalar(beta_at, 0.0)
        conv = op.desc(conv_at)

        def work():
            a, b, out = (self._view(ptrs[t.one(906)], t.ints(902), t.ints(903), t.enum(901)) for t in tensors)
            got = _convolve(op.type, conv, a.double(), b.double(), out.shape)
            _blend(out, got, alpha, beta)
        self.driver._run(stream, work)
        return 0

    # ---- legacy tensor descriptors -------------------------------------------------------------
    def _view(self, ptr: int, dims, strides, dtype: int) -> torch.Tensor:
        """The strided tensor at device address ``ptr``, over the fake memory itself."""
        if dtype not in DTYPES:
            _fail(NOT_SUPPORTED, f"the fake cuDNN's tensors are float, double, half or bfloat16, not {dtype}")
        t = DTYPES[dtype]
        n = 1 + sum((d - 1) * s for d, s in zip(dims, strides))
        flat = torch.frombuffer(self.mem.view(ptr, n * t.itemsize), dtype=t)
        return flat.as_strided(tuple(dims), tuple(strides))

    def _t(self, name, t: int) -> dict:
        if t not in self.tensors:
            _fail(BAD_PARAM, f"{name}: {t:#x} is not a tensor descriptor of this session")
        if not self.tensors[t]:
            _fail(BAD_PARAM, f"{name}: tensor descriptor {t:#x} was never set")
        return self.tensors[t]

    def _at(self, name, t: int, ptr: int) -> torch.Tensor:
        d = self._t(name, t)
        return self._view(ptr, d["dims"], d["strides"], d["dtype"])

    def cudnnCreateTensorDescriptor(self, handle, stream, tail):
        if handle in self.tensors:
            _fail(BAD_PARAM, f"tensor descriptor {handle:#x} exists already")
        self.tensors[handle] = {}
        return 0

    def cudnnSetTensorNdDescriptor(self, handle, stream, tail, dtype, nbdims):
        if handle not in self.tensors:
            _fail(BAD_PARAM, f"cudnnSetTensorNdDescriptor: {handle:#x} is not a tensor descriptor of this session")
        if not 0 < nbdims <= 8 or len(tail) != 8 * nbdims:
            _fail(BAD_PARAM, f"cudnnSetTensorNdDescriptor: {len(tail)} bytes for {nbdims} dims and strides")
        v = struct.unpack(f"<{2 * nbdims}i", tail)
        if min(v) <= 0:
            _fail(BAD_PARAM, "cudnnSetTensorNdDescriptor: dims and strides must be positive")
        self.tensors[handle] = {"dtype": dtype, "dims": list(v[:nbdims]), "strides": list(v[nbdims:])}
        return 0

    def cudnnDestroyTensorDescriptor(self, handle, stream, tail):
        if self.tensors.pop(handle, None) is None:
            _fail(BAD_PARAM, f"cudnnDestroyTensorDescriptor: {handle:#x} is not a tensor descriptor of this session")
        return 0

    def cudnnDeriveBNTensorDescriptor(self, handle, stream, tail, x, mode):
        n = "cudnnDeriveBNTensorDescriptor"
        src = self._t(n, x)
        if handle not in self.tensors or mode not in (0, 1, 2):
            _fail(BAD_PARAM, f"{n}: {handle:#x} is not a tensor descriptor of this session, or mode {mode} is unknown")
        dims = [d if i == 1 or (mode == 0 and i > 1) else 1 for i, d in enumerate(src["dims"])]
        strides = [1] * len(dims)
        for i in range(len(dims) - 2, -1, -1):
            strides[i] = strides[i + 1] * dims[i + 1]
        self.tensors[handle] = {"dtype": 0 if src["dtype"] in (2, 9) else src["dtype"], "dims": dims, "strides": strides}
        return 0

    # ---- batch normalization -------------------------------------------------------------------
    def _bn_sizes(self, name, handle, mode, ops, *tensors):
        self._handle(name, handle)
        if ops != 0:
            _fail(NOT_SUPPORTED, f"{name}: the fake cuDNN normalizes only (no activation, no add)")
        for t in tensors:
            self._t(name, t)
        return 0, struct.pack("<Q", 0)

    def cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(self, handle, stream, tail, mode, ops, x, z, y, bn, act):
        return self._bn_sizes("cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize", handle, mode, ops, x, y, bn)

    def cudnnGetBatchNormalizationBackwardExWorkspaceSize(self, handle, stream, tail, mode, ops, x, y, dy, dz, dx, dbn, act):
        return self._bn_sizes("cudnnGetBatchNormalizationBackwardExWorkspaceSize", handle, mode, ops, x, dy, dx, dbn)

    def cudnnGetBatchNormalizationTrainingExReserveSpaceSize(self, handle, stream, tail, mode, ops, act, x):
        return self._bn_sizes("cudnnGetBatchNormalizationTrainingExReserveSpaceSize", handle, mode, ops, x)

    def _bn_check(self, name, handle, mode, ops=0):
        self._handle(name, handle)
        if ops != 0 or mode not in (0, 1, 2):
            _fail(NOT_SUPPORTED, f"{name}: mode {mode}, ops {ops}: the fake cuDNN normalizes only")

    def cudnnBatchNormalizationForwardTrainingEx(self, handle, stream, tail, **f):
        n = "cudnnBatchNormalizationForwardTrainingEx"
        self._bn_check(n, handle, f["mode"], f["ops"])
        x, y, bn = self._t(n, f["x"]), self._t(n, f["y"]), self._t(n, f["bn"])
        eps, factor = f["epsilon"], f["factor"]

        def work():
            xs = self._view(f["x_data"], x["dims"], x["strides"], x["dtype"]).double()
            param = (lambda p: self._view(p, bn["dims"], bn["strides"], bn["dtype"]))
            dims = _reduced(f["mode"], xs.dim())
            mean, var = xs.mean(dims, keepdim=True), xs.var(dims, unbiased=False, keepdim=True)
            inv = (var + eps).rsqrt()
            out = self._view(f["y_data"], y["dims"], y["strides"], y["dtype"])
            _blend(out, (xs - mean) * inv * param(f["scale"]).double() + param(f["bias"]).double(), f["alpha"], f["beta"])
            m = xs.numel() // mean.numel()
            if f["running_mean"] and f["running_var"]:
                rm, rv = param(f["running_mean"]), param(f["running_var"])
                rm.copy_((1 - factor) * rm.double() + factor * mean)
                rv.copy_((1 - factor) * rv.double() + factor * var * m / max(m - 1, 1))
            if f["save_mean"] and f["save_inv_var"]:
                param(f["save_mean"]).copy_(mean)
                param(f["save_inv_var"]).copy_(inv)
        self.driver._run(stream, work)
        return 0

    def cudnnBatchNormalizationBackwardEx(self, handle, stream, tail, **f):
        n = "cudnnBatchNormalizationBackwardEx"
        self._bn_check(n, handle, f["mode"], f["ops"])
        x, dy, dx, bn = (self._t(n, f[k]) for k in ("x", "dy", "dx", "dbn"))
        eps = f["epsilon"]

        def work():
            xs = self._view(f["x_data"], x["dims"], x["strides"], x["dtype"]).double()
            g = self._view(f["dy_data"], dy["dims"], dy["strides"], dy["dtype"]).double()
            param = (lambda p: self._view(p, bn["dims"], bn["strides"], bn["dtype"]))
            dims = _reduced(f["mode"], xs.dim())
            if f["save_mean"] and f["save_inv_var"]:
                mean, inv = param(f["save_mean"]).double(), param(f["save_inv_var"]).double()
            else:
                mean = xs.mean(dims, keepdim=True)
                inv = (xs.var(dims, unbiased=False, keepdim=True) + eps).rsqrt()
            xhat = (xs - mean) * inv
            m = xs.numel() // mean.numel()
            dbias, dscale = g.sum(dims, keepdim=True), (g * xhat).sum(dims, keepdim=True)
            grad = param(f["scale"]).double() * inv / m * (m * g - dbias - xhat * dscale)
            _blend(self._view(f["dx_data"], dx["dims"], dx["strides"], dx["dtype"]), grad, f["alpha_data"], f["beta_data"])
            _blend(param(f["dscale"]), dscale, f["alpha_param"], f["beta_param"])
            _blend(param(f["dbias"]), dbias, f["alpha_param"], f["beta_param"])
        self.driver._run(stream, work)
        return 0

    def cudnnBatchNormalizationForwardInference(self, handle, stream, tail, **f):
        n = "cudnnBatchNormalizationForwardInference"
        self._bn_check(n, handle, f["mode"])
        x, y, bn = self._t(n, f["x"]), self._t(n, f["y"]), self._t(n, f["bn"])

        def work():
            xs = self._view(f["x_data"], x["dims"], x["strides"], x["dtype"]).double()
            p = {k: self._view(f[k], bn["dims"], bn["strides"], bn["dtype"]).double() for k in ("scale", "bias", "mean", "var")}
            got = (xs - p["mean"]) * (p["var"] + f["epsilon"]).rsqrt() * p["scale"] + p["bias"]
            _blend(self._view(f["y_data"], y["dims"], y["strides"], y["dtype"]), got, f["alpha"], f["beta"])
        self.driver._run(stream, work)
        return 0


def _reduced(mode: int, rank: int) -> list[int]:
    """The dimensions BN averages over: the batch (per activation), else all but the channels."""
    return [0] if mode == 0 else [i for i in range(rank) if i != 1]


def _blend(out: torch.Tensor, value: torch.Tensor, alpha: float, beta: float) -> None:
    """out = alpha * value + beta * out, rounded once; beta 0 never reads out (it may hold NaNs)."""
    result = alpha * value + (beta * out.double() if beta else 0)
    out.copy_(result.to(out.dtype))


def _convolve(kind: int, conv: Desc, a: torch.Tensor, b: torch.Tensor, out_shape) -> torch.Tensor:
    """The op's output from its two inputs: y from (x, w); dx from (dy, w); dw from (x, dy)."""
    k = conv.one(106)
    pre, post = conv.ints(105), conv.ints(104)
    stride, dilation = conv.ints(103), conv.ints(102)
    flip = conv.enum(101) == 0        # CUDNN_CONVOLUTION: the filter turned round
    fn = (F.conv1d, F.conv2d, F.conv3d)[k - 1]

    def forward(x, w):
        pads = [p for i in reversed(range(k)) for p in (pre[i], post[i])]
        return fn(F.pad(x, pads), w.flip(list(range(2, 2 + k))) if flip else w, stride=stride, dilation=dilation)
    if kind == CONV_FWD:
        return forward(a, b)
    with torch.enable_grad():
        return _gradient(kind, forward, a, b, out_shape)


def _gradient(kind: int, forward, a: torch.Tensor, b: torch.Tensor, out_shape) -> torch.Tensor:
    if kind == CONV_BWD_DATA:                 # the gradient of a linear map: exact
        x = torch.zeros(out_shape, dtype=torch.float64, requires_grad=True)
        forward(x, b).backward(a)
        return x.grad
    w = torch.zeros(out_shape, dtype=torch.float64, requires_grad=True)
    forward(a, w).backward(b)
    return w.grad
