"""cuDNN beside the real driver: the client's forwarded calls run on the real libcudnn.so.9 through ctypes.

The client's handles and descriptors are ids; they map here to the real objects, inside attribute
payloads too (``CUDNN_TYPE_HANDLE`` and ``CUDNN_TYPE_BACKEND_DESCRIPTOR`` elements; ``VOID_PTR`` ones
are device addresses and pass through). The stream travels with each call and is set on the real
handle only when it changed. A Finalize (and a Get that fills the caller's descriptors) answers with
the readable attributes of the descriptors it made readable (``READABLE``), so the client answers the
frontend's later Gets itself. Every call runs on the session's thread with its context current.
With cuBLAS's C table, a steady step's cuDNN records run in C (``cudnn_records.c``, ``self.fast``): the variant
packs and the legacy tensor descriptors live there (their create, sets, finalize, derive and destroy, however
they come: this file hands it the same calls), the walker's batch norms run there on them, and executes of the
plans found plain here (no by-value tensors: a plan's first execute here); told of each handle and plain plan
as they come and go, it owns the handles' streams.
"""
from __future__ import annotations

import ctypes
import struct
from ctypes import POINTER, byref, c_char_p, c_double, c_float, c_int, c_int64, c_size_t, c_void_p

from rgpu.protocol.cuda_libs import BY_NAME
from rgpu.protocol.lib_cudnn import TYPE_BACKEND_DESCRIPTOR, TYPE_HANDLE, WIDTH, dump

from . import LibError
from .cudnn_by_value import ByValue

BAD_PARAM, NOT_INITIALIZED, VERSION_MISMATCH, NOT_SUPPORTED = 2000, 1001, 1002, 3000
DOUBLE = 1                              # CUDNN_DATA_DOUBLE: its scalars are doubles, every other type's floats
VARIANT_PACK = 16                       # CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR
HANDLE, PACK, PLAN, TENSOR, ALLOC_FAILED = 0, 1, 2, 3, 4001   # a client id's kind in the C table; CUDNN_STATUS_ALLOC_FAILED
NOT_HERE, PACK_TYPES = -2, (3, 6)       # the C table's "not one of mine"; the attribute types a pack takes there
STATUS = {0: "CUDNN_STATUS_SUCCESS", 1001: "CUDNN_STATUS_NOT_INITIALIZED", 2000: "CUDNN_STATUS_BAD_PARAM",
          2002: "CUDNN_STATUS_BAD_PARAM_NULL_POINTER", 2004: "CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED",
          2010: "CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE", 2012: "CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE",
          3000: "CUDNN_STATUS_NOT_SUPPORTED", 4000: "CUDNN_STATUS_INTERNAL_ERROR", 5000: "CUDNN_STATUS_EXECUTION_FAILED"}

# descriptor type -> the attributes a frontend reads once it is finalized: (attribute, its type); the
# descriptor-typed ones travel as counts (their Get fills the caller's descriptors: a round trip)
_D, _I64, _I32, _DT, _BOOL = TYPE_BACKEND_DESCRIPTOR, 3, 23, 1, 2
READABLE = {
    1: [(100, _DT), (101, 7), (102, _I64), (103, _I64), (104, _I64), (105, _I64), (106, _I64)],        # convolution
    2: [(1300, _D), (1301, _I64), (1302, _D), (1303, 11), (1304, _D), (1305, 19), (1306, _I32)],        # engine
    3: [(300, _D), (301, _D), (302, _D), (303, _I64), (304, _I64)],                                     # engine config
    4: [(200, 8), (201, _D), (202, _D), (203, _I32)],                                                   # engine heuristic
    5: [(401, _D), (402, _I64), (403, _I64), (404, _I64)],                                              # execution plan
    6: [(500, _I64), (501, _I64), (502, _I64), (503, 13)],                                              # intermediate info
    7: [(600, 9), (601, _I64)],                                                                         # knob choice
    8: [(1200, 9), (1201, _I64), (1202, _I64), (1203, _I64)],                                           # knob info
    9: [(1100, _I64), (1101, 12)],                                                                      # layout info
    15: [(801, _D), (802, _I64), (803, _BOOL)],                                                         # operation graph
    17: [(900, _I64), (901, _DT), (902, _I64), (903, _I64), (904, _I64), (905, _I64), (906, _I64),
         (907, _BOOL), (908, _BOOL), (909, 20)],                                                        # tensor
}
_P = c_void_p
def _bind(lib) -> None:
    """The C prototypes (cudnn_graph.h, cudnn_ops.h), so ctypes passes int64, size_t and doubles right."""
    sigs = {
        "cudnnCreate": [POINTER(_P)], "cudnnDestroy": [_P], "cudnnSetStream": [_P, _P],
        "cudnnBackendCreateDescriptor": [c_int, POINTER(_P)], "cudnnBackendDestroyDescriptor": [_P],
        "cudnnBackendInitialize": [_P], "cudnnBackendFinalize": [_P],
        "cudnnBackendSetAttribute": [_P, c_int, c_int, c_int64, _P],
        "cudnnBackendGetAttribute": [_P, c_int, c_int, c_int64, POINTER(c_int64), _P],
        "cudnnBackendExecute": [_P, _P, _P],
        "cudnnCreateTensorDescriptor": [POINTER(_P)], "cudnnDestroyTensorDescriptor": [_P],
        "cudnnSetTensorNdDescriptor": [_P, c_int, c_int, POINTER(c_int), POINTER(c_int)],
        "cudnnDeriveBNTensorDescriptor": [_P, _P, c_int],
        "cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize": [_P, c_int, c_int, _P, _P, _P, _P, _P, POINTER(c_size_t)],
        "cudnnGetBatchNormalizationBackwardExWorkspaceSize": [_P, c_int, c_int, _P, _P, _P, _P, _P, _P, _P, POINTER(c_size_t)],
        "cudnnGetBatchNormalizationTrainingExReserveSpaceSize": [_P, c_int, c_int, _P, _P, POINTER(c_size_t)],
        "cudnnBatchNormalizationForwardTrainingEx": [_P, c_int, c_int, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P,
                                                     c_double, _P, _P, c_double, _P, _P, _P, _P, c_size_t, _P, c_size_t],
        "cudnnBatchNormalizationBackwardEx": [_P, c_int, c_int, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P,
                                              _P, _P, _P, _P, _P, c_double, _P, _P, _P, _P, c_size_t, _P, c_size_t],
        "cudnnBatchNormalizationForwardInference": [_P, c_int, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, c_double],
        "cudnnGetLastErrorString": [c_char_p, c_size_t], "cudnnGetErrorString": [c_int],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = c_int
    lib.cudnnGetErrorString.restype = c_char_p
    lib.cudnnGetVersion.restype = c_size_t
    lib.cudnnGetVersion.argtypes = []


class Library:
    def __init__(self, driver, owner):
        self.driver, self.owner = driver, owner
        self.lib = None
        self.handles: dict[int, list] = {}         # client id -> [real handle, the stream set on it]
        self.descs: dict[int, list] = {}           # client id -> [real descriptor, its type]
        self.tensors: dict[int, list] = {}         # client id -> [real tensor descriptor, its data type]
        self.by_value = ByValue()
        self.c = self.fast = self._cublas = None   # with cuBLAS's C table: the C library, ours, cuBLAS's

    # ---- the contract --------------------------------------------------------------------------
    def status_name(self, status: int) -> str:
        if self.lib is not None:
            return self.lib.cudnnGetErrorString(status).decode()
        return STATUS.get(status, "CUDNN_STATUS_UNKNOWN")

    def close(self) -> None:
        if self.lib is None:
            return
        if self.fast:
            cublas, table = self._cublas
            if cublas.fast == table:             # still open: its walker must not reach ours once freed
                self.c.rgpu_cublas_set_dnn(table, None)
            self.c.rgpu_cudnn_free(self.fast)
            self.c = self.fast = self._cublas = None
        for real, _ in self.descs.values():
            self.lib.cudnnBackendDestroyDescriptor(real)
        for real, _ in self.tensors.values():
            self.lib.cudnnDestroyTensorDescriptor(real)
        for real, _ in self.handles.values():
            self.lib.cudnnDestroy(real)
        self.descs.clear()
        self.tensors.clear()
        self.handles.clear()

    # ---- helpers -------------------------------------------------------------------------------
    def _check(self, name: str, status: int) -> int:
        if status:
            buf = ctypes.create_string_buffer(512)
            self.lib.cudnnGetLastErrorString(buf, len(buf))
            text = buf.value.decode(errors="replace")
            raise LibError(status, f"{self.status_name(status)} ({status}){': ' + text if text else ''}")
        return 0

    def _handle(self, name: str, handle: int, stream=None):
        h = self.handles.get(handle)
        if h is None:
            raise LibError(BAD_PARAM, f"{name}: {handle:#x} is not a cuDNN handle of this session")
        stream = stream or 0
        if self.fast:                             # the C table holds the stream set on it
            self._check(name, self.c.rgpu_cudnn_stream(self.fast, handle, stream))
        elif h[1] != stream:                        # the session's stream, set only when it changed
            self._check(name, self.lib.cudnnSetStream(h[0], stream))
            h[1] = stream
        return h[0]

    def _desc(self, name: str, desc: int) -> list:
        d = self.descs.get(desc)
        if d is None and self._c_pack(desc):        # a variant pack the C table owns
            d = [_P(self.c.rgpu_cudnn_real(self.fast, PACK, desc)), VARIANT_PACK]
        if d is None:
            raise LibError(BAD_PARAM, f"{name}: {desc:#x} is not a backend descriptor of this session")
        return d

    def _c_pack(self, desc: int) -> bool:
        return bool(self.fast) and desc not in self.descs and bool(self.c.rgpu_cudnn_real(self.fast, PACK, desc))

    def _in_c(self, call: str, desc: int, payload: bytes = b"") -> int:
        """A variant pack's or legacy tensor's call run by the C table, as the walker runs it (NOT_HERE: not one it runs)."""
        return self.c.rgpu_cudnn_desc_record(self.fast, BY_NAME[call].id, desc, payload, len(payload))

    def _pack_attrs(self, pack: int) -> dict:
        """A pack's attributes as set (name -> (type, count, bytes)): the C table's, or those kept here."""
        if not self._c_pack(pack):
            return self.by_value.sets.get(pack, {})
        attrs, out, i = {}, (ctypes.c_int32 * 2)(), 0
        while (n := self.c.rgpu_cudnn_pack_attr(self.fast, pack, i, out, None, 0)) >= 0:
            v = (ctypes.c_uint64 * max(n, 1))()
            self.c.rgpu_cudnn_pack_attr(self.fast, pack, i, out, v, n)
            attrs[out[0]] = (out[1], n, bytes(v)[:8 * n])
            i += 1
        return attrs

    def _tensor(self, name: str, t: int, optional: bool = False):
        if optional and t == 0:
            return None
        d = self.tensors.get(t) or (self.fast and [self.c.rgpu_cudnn_tensor(self.fast, t, None)])   # or C's
        if not d or not d[0]:
            raise LibError(BAD_PARAM, f"{name}: {t:#x} is not a tensor descriptor of this session")
        return d[0]

    def _dtype(self, t: int) -> int:
        if not self.fast:
            return self.tensors[t][1] if t in self.tensors else 0
        dtype = ctypes.c_int32(0)
        self.c.rgpu_cudnn_tensor(self.fast, t, byref(dtype))
        return dtype.value

    def _scalar(self, name: str, x: int, value: float):
        return byref(c_double(value) if self._dtype(x) == DOUBLE else c_float(value))

    # ---- handles -------------------------------------------------------------------------------
    def cudnnCreate(self, handle, stream, tail, client_version):
        self._need_lib()
        version = self.lib.cudnnGetVersion()
        if version // 10000 != client_version // 10000:
            raise LibError(VERSION_MISMATCH, f"the client's cuDNN is {client_version}, the server's {version}")
        if handle in self.handles:
            raise LibError(BAD_PARAM, f"cuDNN handle {handle:#x} exists already")
        real = _P()
        self._check("cudnnCreate", self.lib.cudnnCreate(byref(real)))
        self.handles[handle] = [real, 0]
        self._fast("add", HANDLE, handle, real.value)
        return 0

    def cudnnDestroy(self, handle, stream, tail):
        real = self._handle("cudnnDestroy", handle)
        del self.handles[handle]
        self._fast("remove", HANDLE, handle)
        return self._check("cudnnDestroy", self.lib.cudnnDestroy(real))

    # ---- the backend graph API -----------------------------------------------------------------
    def _need_lib(self):
        """The real library, loaded at the first call that needs it (descriptors need no handle)."""
        if self.lib is None:
            from .loading import LibraryMissing, load
            try:
                lib = load("libcudnn.so.9")
                _bind(lib)
            except (LibraryMissing, AttributeError) as exc:
                raise LibError(NOT_INITIALIZED, str(exc)) from None
            self.lib = lib
            self._table(lib)

    def _table(self, lib) -> None:
        """Our C table, hung on cuBLAS's (the walker's entry), where the server's C part is built."""
        from ..real_batch import library
        c, table = library(), None
        cublas = self.owner.library("cublas") if c is not None else None
        try:
            table = cublas and cublas.fn("cublasCreate_v2") and cublas.records_table()
        except LibError:                          # no cuBLAS here: Python runs every execute
            pass
        if table:
            self.c, self._cublas = c, (cublas, table)
            self.fast = c.rgpu_cudnn_new(ctypes.cast(lib.cudnnBackendExecute, _P), ctypes.cast(lib.cudnnSetStream, _P))
            c.rgpu_cudnn_bind_packs(self.fast, *(ctypes.cast(getattr(lib, f"cudnnBackend{f}"), _P) for f in
                                                 ("CreateDescriptor", "SetAttribute", "Finalize", "DestroyDescriptor")))
            c.rgpu_cudnn_bind_tensors(self.fast, *(ctypes.cast(getattr(lib, f"cudnn{f}"), _P) for f in (
                "CreateTensorDescriptor", "SetTensorNdDescriptor", "DestroyTensorDescriptor", "DeriveBNTensorDescriptor")))
            c.rgpu_cudnn_bind_bn(self.fast, *(ctypes.cast(getattr(lib, f"cudnnBatchNormalization{f}"), _P) for f in (
                "ForwardTrainingEx", "BackwardEx", "ForwardInference")))
            c.rgpu_cublas_set_dnn(table, self.fast)

    def _fast(self, verb: str, kind: int, client: int, real=None) -> None:
        """Tell the C table of a client id (HANDLE, PACK, PLAN) made (``add``, its real object) or gone."""
        if self.fast and (self.c.rgpu_cudnn_add(self.fast, kind, client, real) if verb == "add"
                          else self.c.rgpu_cudnn_remove(self.fast, kind, client)):
            raise LibError(ALLOC_FAILED, f"the C table refused {client:#x} (no memory)")

    def cudnnBackendCreateDescriptor(self, handle, stream, tail, type):
        self._need_lib()
        if handle in self.descs or self._c_pack(handle):
            raise LibError(BAD_PARAM, f"backend descriptor {handle:#x} exists already")
        if type == VARIANT_PACK and self.fast:      # the C table's, as when the walker runs it
            return self._check("cudnnBackendCreateDescriptor",
                               self._in_c("cudnnBackendCreateDescriptor", handle, struct.pack("<i", type)))
        real = _P()
        self._check("cudnnBackendCreateDescriptor", self.lib.cudnnBackendCreateDescriptor(type, byref(real)))
        self.descs[handle] = [real, type]
        return 0

    def cudnnBackendDestroyDescriptor(self, handle, stream, tail):
        if self._c_pack(handle):
            status = self._in_c("cudnnBackendDestroyDescriptor", handle)
            self._fast("remove", PACK, handle)      # gone either way, as below
            return self._check("cudnnBackendDestroyDescriptor", status)
        real, _ = self._desc("cudnnBackendDestroyDescriptor", handle)
        del self.descs[handle]
        self.by_value.forget(handle)
        self._fast("remove", PLAN, handle)
        return self._check("cudnnBackendDestroyDescriptor", self.lib.cudnnBackendDestroyDescriptor(real))

    def _elements(self, name: str, type: int, count: int, tail):
        """The payload's elements as the real library takes them: client ids mapped to real values."""
        width = WIDTH.get(type)
        if width is None or count < 0 or len(tail) != count * width:
            raise LibError(BAD_PARAM, f"{name}: {len(tail)} bytes for {count} elements of attribute type {type}")
        if type in (TYPE_HANDLE, TYPE_BACKEND_DESCRIPTOR):
            ids = struct.unpack_from(f"<{count}Q", tail)
            table = self.handles if type == TYPE_HANDLE else self.descs
            missing = [i for i in ids if i and i not in table]
            if missing:
                what = "cuDNN handle" if type == TYPE_HANDLE else "backend descriptor"
                raise LibError(BAD_PARAM, f"{name}: {missing[0]:#x} is not a {what} of this session")
            return (_P * max(count, 1))(*[table[i][0] if i else None for i in ids])
        return (ctypes.c_uint8 * max(len(tail), 1)).from_buffer_copy(bytes(tail) or b"\0")

    def cudnnBackendSetAttribute(self, handle, stream, tail, name, type, count):
        if self._c_pack(handle):
            if type not in PACK_TYPES or count < 0 or len(tail) != 8 * count:
                raise LibError(BAD_PARAM, f"cudnnBackendSetAttribute: a variant pack's attribute {name} of type {type}"
                                          f" with {len(tail)} bytes for {count} elements (it takes int64s and pointers)")
            payload = struct.pack("<iiq", name, type, count) + bytes(tail)
            return self._check("cudnnBackendSetAttribute", self._in_c("cudnnBackendSetAttribute", handle, payload))
        real, _ = self._desc("cudnnBackendSetAttribute", handle)
        elements = self._elements("cudnnBackendSetAttribute", type, count, tail)
        self._check("cudnnBackendSetAttribute",
                    self.lib.cudnnBackendSetAttribute(real, name, type, count, ctypes.cast(elements, _P)))
        self.by_value.set(handle, name, type, count, tail)
        self._fast("remove", PLAN, handle)       # a plan changed: plain again only at its next execute here
        return 0

    def _get(self, real, name: int, type: int):
        """(count, element bytes) of one attribute, or None when the library refuses it. With an array
        cuDNN counts what it wrote (at most the request), without one the attribute's total: asked first."""
        width = WIDTH[type]
        count = c_int64(0)
        if self.lib.cudnnBackendGetAttribute(real, name, type, 0, byref(count), None):
            return None
        total = max(count.value, 0)
        buf = ctypes.create_string_buffer(max(total * width, 1))
        if total and self.lib.cudnnBackendGetAttribute(real, name, type, total, byref(count), buf):
            return None
        n = min(max(count.value, 0), total)
        return n, buf.raw[:n * width]

    def readable(self, desc: int) -> bytes:
        """The dump of a finalized descriptor: every attribute in ``READABLE`` the library answers."""
        real, type_ = self.descs[desc]
        entries = []
        for name, atype in READABLE.get(type_, ()):
            if atype == TYPE_BACKEND_DESCRIPTOR:
                count = c_int64(0)
                if not self.lib.cudnnBackendGetAttribute(real, name, atype, 0, byref(count), None):
                    entries.append((name, atype, count.value, None))
                continue
            got = self._get(real, name, atype)
            if got is not None:
                entries.append((name, atype, got[0], got[1]))
        return dump(entries)

    def cudnnBackendGetAttribute(self, handle, stream, tail, name, type, requested):
        real, _ = self._desc("cudnnBackendGetAttribute", handle)
        width = WIDTH.get(type)
        if width is None or requested < 0 or requested * width > 1 << 24:
            raise LibError(BAD_PARAM, f"cudnnBackendGetAttribute: {requested} elements of attribute type {type}")
        count = c_int64(0)
        if type == TYPE_BACKEND_DESCRIPTOR:       # the caller's descriptors, filled by the library
            targets = self._elements("cudnnBackendGetAttribute", type, requested, tail)
            ids = struct.unpack_from(f"<{requested}Q", tail)
            self._check("cudnnBackendGetAttribute", self.lib.cudnnBackendGetAttribute(
                real, name, type, requested, byref(count), ctypes.cast(targets, _P) if requested else None))
            out = bytearray(struct.pack("<q", count.value))
            for i in ids[:min(requested, count.value)]:
                self.by_value.filled(i, handle)
                self._fast("remove", PLAN, i)
                d = self.readable(i) if i else b""
                out += struct.pack("<I", len(d)) + d
            return 0, bytes(out)
        buf = ctypes.create_string_buffer(max(requested * width, 1))
        self._check("cudnnBackendGetAttribute", self.lib.cudnnBackendGetAttribute(
            real, name, type, requested, byref(count), buf if requested else None))
        data = buf.raw[:min(requested, count.value) * width]
        if type == TYPE_HANDLE:                   # real handles -> the client's ids
            back = {h[0].value: cid for cid, h in self.handles.items()}
            data = struct.pack(f"<{len(data) // 8}Q", *(back.get(v, 0) for v in struct.unpack(f"<{len(data) // 8}Q", data)))
        return 0, struct.pack("<q", count.value) + data

    def cudnnBackendInitialize(self, handle, stream, tail):
        real, _ = self._desc("cudnnBackendInitialize", handle)
        return self._check("cudnnBackendInitialize", self.lib.cudnnBackendInitialize(real))

    def cudnnBackendFinalize(self, handle, stream, tail):
        if self._c_pack(handle):
            return self.cudnnBackendFinalizeQueued(handle, stream, tail), b""
        real, type_ = self._desc("cudnnBackendFinalize", handle)
        status = self.lib.cudnnBackendFinalize(real)
        if NOT_SUPPORTED <= status < NOT_SUPPORTED + 1000:
            return status           # a frontend's next engine: its status alone (the client says each once)
        self._check("cudnnBackendFinalize", status)
        self.by_value.finalized(handle)
        self._fast("remove", PLAN, handle)
        if type_ == VARIANT_PACK:
            return 0, b""
        return 0, self.readable(handle) + dump(self.by_value.entry(handle))

    def cudnnBackendFinalizeQueued(self, handle, stream, tail):
        if self._c_pack(handle):
            return self._check("cudnnBackendFinalize", self._in_c("cudnnBackendFinalizeQueued", handle))
        real, _ = self._desc("cudnnBackendFinalize", handle)
        return self._check("cudnnBackendFinalize", self.lib.cudnnBackendFinalize(real))

    def cudnnBackendExecute(self, handle, stream, tail, plan, pack):
        n = "cudnnBackendExecute"
        h = self._handle(n, handle, stream)
        p, _ = self._desc(n, plan)
        v, _ = self._desc(n, pack)
        if not len(tail) and not self.by_value.of.get(plan):
            self._fast("add", PLAN, plan, p.value)     # plain: the C table runs its next executes
            return self._check(n, self.lib.cudnnBackendExecute(h, p, v))
        # by-value tensors: the same pack, rebuilt with the client's bytes where its host pointers were
        attrs, keep = self.by_value.patched(plan, pack, tail, self._pack_attrs(pack))
        tmp = _P()
        self._check(n, self.lib.cudnnBackendCreateDescriptor(VARIANT_PACK, byref(tmp)))
        try:
            for name, (type_, count, data) in attrs.items():
                elements = ctypes.cast(self._elements(n, type_, count, data), _P)
                self._check(n, self.lib.cudnnBackendSetAttribute(tmp, name, type_, count, elements))
            self._check(n, self.lib.cudnnBackendFinalize(tmp))
            return self._check(n, self.lib.cudnnBackendExecute(h, p, tmp))
        finally:
            self.lib.cudnnBackendDestroyDescriptor(tmp)
            del keep

    # ---- legacy tensor descriptors and batch normalization -------------------------------------
    def cudnnCreateTensorDescriptor(self, handle, stream, tail):
        self._need_lib()
        if handle in self.tensors or (self.fast and self.c.rgpu_cudnn_tensor(self.fast, handle, None)):
            raise LibError(BAD_PARAM, f"tensor descriptor {handle:#x} exists already")
        if self.fast:                               # the C table's, as when the walker runs it
            return self._check("cudnnCreateTensorDescriptor", self._in_c("cudnnCreateTensorDescriptor", handle))
        real = _P()
        self._check("cudnnCreateTensorDescriptor", self.lib.cudnnCreateTensorDescriptor(byref(real)))
        self.tensors[handle] = [real, 0]
        return 0

    def cudnnSetTensorNdDescriptor(self, handle, stream, tail, dtype, nbdims):
        real = self._tensor("cudnnSetTensorNdDescriptor", handle)
        if not 0 < nbdims <= 8 or len(tail) != 8 * nbdims:
            raise LibError(BAD_PARAM, f"cudnnSetTensorNdDescriptor: {len(tail)} bytes for {nbdims} dims and strides")
        if self.fast:
            payload = struct.pack("<ii", dtype, nbdims) + bytes(tail)
            return self._check("cudnnSetTensorNdDescriptor", self._in_c("cudnnSetTensorNdDescriptor", handle, payload))
        v = struct.unpack(f"<{2 * nbdims}i", tail)
        dims, strides = (c_int * nbdims)(*v[:nbdims]), (c_int * nbdims)(*v[nbdims:])
        self._check("cudnnSetTensorNdDescriptor", self.lib.cudnnSetTensorNdDescriptor(real, dtype, nbdims, dims, strides))
        self.tensors[handle][1] = dtype
        return 0

    def cudnnDestroyTensorDescriptor(self, handle, stream, tail):
        real = self._tensor("cudnnDestroyTensorDescriptor", handle)
        if self.fast:
            status = self._in_c("cudnnDestroyTensorDescriptor", handle)
            self._fast("remove", TENSOR, handle)      # gone either way, as below
            return self._check("cudnnDestroyTensorDescriptor", status)
        del self.tensors[handle]
        return self._check("cudnnDestroyTensorDescriptor", self.lib.cudnnDestroyTensorDescriptor(real))

    def cudnnDeriveBNTensorDescriptor(self, handle, stream, tail, x, mode):
        n = "cudnnDeriveBNTensorDescriptor"
        derived, of = self._tensor(n, handle), self._tensor(n, x)
        if self.fast:
            return self._check(n, self._in_c(n, handle, struct.pack("<Qi", x, mode)))
        self._check(n, self.lib.cudnnDeriveBNTensorDescriptor(derived, of, mode))
        dtype = self.tensors[x][1]
        self.tensors[handle][1] = 0 if dtype in (2, 9) else dtype       # half, bfloat16 -> float parameters
        return 0

    def _size(self, name: str, fn, *args):
        size = c_size_t(0)
        self._check(name, fn(*args, byref(size)))
        return 0, struct.pack("<Q", size.value)

    def cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(self, handle, stream, tail, mode, ops, x, z, y, bn, act):
        n = "cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize"
        return self._size(n, getattr(self.lib, n), self._handle(n, handle, stream), mode, ops, self._tensor(n, x),
                          self._tensor(n, z, True), self._tensor(n, y), self._tensor(n, bn), None)

    def cudnnGetBatchNormalizationBackwardExWorkspaceSize(self, handle, stream, tail, mode, ops, x, y, dy, dz, dx, dbn, act):
        n = "cudnnGetBatchNormalizationBackwardExWorkspaceSize"
        t = self._tensor
        return self._size(n, getattr(self.lib, n), self._handle(n, handle, stream), mode, ops, t(n, x), t(n, y, True),
                          t(n, dy), t(n, dz, True), t(n, dx), t(n, dbn), None)

    def cudnnGetBatchNormalizationTrainingExReserveSpaceSize(self, handle, stream, tail, mode, ops, act, x):
        n = "cudnnGetBatchNormalizationTrainingExReserveSpaceSize"
        return self._size(n, getattr(self.lib, n), self._handle(n, handle, stream), mode, ops, None, self._tensor(n, x))

    def cudnnBatchNormalizationForwardTrainingEx(self, handle, stream, tail, **f):
        n = "cudnnBatchNormalizationForwardTrainingEx"
        t, s = self._tensor, self._scalar
        return self._check(n, self.lib.cudnnBatchNormalizationForwardTrainingEx(
            self._handle(n, handle, stream), f["mode"], f["ops"], s(n, f["x"], f["alpha"]), s(n, f["x"], f["beta"]),
            t(n, f["x"]), f["x_data"], t(n, f["z"], True), f["z_data"] or None, t(n, f["y"]), f["y_data"], t(n, f["bn"]),
            f["scale"], f["bias"], f["factor"], f["running_mean"] or None, f["running_var"] or None, f["epsilon"],
            f["save_mean"] or None, f["save_inv_var"] or None, None, f["workspace"] or None, f["workspace_size"],
            f["reserve"] or None, f["reserve_size"]))

    def cudnnBatchNormalizationBackwardEx(self, handle, stream, tail, **f):
        n = "cudnnBatchNormalizationBackwardEx"
        t, s, x = self._tensor, self._scalar, f["x"]
        return self._check(n, self.lib.cudnnBatchNormalizationBackwardEx(
            self._handle(n, handle, stream), f["mode"], f["ops"], s(n, x, f["alpha_data"]), s(n, x, f["beta_data"]),
            s(n, x, f["alpha_param"]), s(n, x, f["beta_param"]), t(n, x), f["x_data"], t(n, f["y"], True),
            f["y_data"] or None, t(n, f["dy"]), f["dy_data"], t(n, f["dz"], True), f["dz_data"] or None, t(n, f["dx"]),
            f["dx_data"], t(n, f["dbn"]), f["scale"], f["bias"] or None, f["dscale"], f["dbias"], f["epsilon"],
            f["save_mean"] or None, f["save_inv_var"] or None, None, f["workspace"] or None, f["workspace_size"],
            f["reserve"] or None, f["reserve_size"]))

    def cudnnBatchNormalizationForwardInference(self, handle, stream, tail, **f):
        n = "cudnnBatchNormalizationForwardInference"
        t, s = self._tensor, self._scalar
        return self._check(n, self.lib.cudnnBatchNormalizationForwardInference(
            self._handle(n, handle, stream), f["mode"], s(n, f["x"], f["alpha"]), s(n, f["x"], f["beta"]), t(n, f["x"]),
            f["x_data"], t(n, f["y"]), f["y_data"], t(n, f["bn"]), f["scale"], f["bias"], f["mean"], f["var"],
            f["epsilon"]))
