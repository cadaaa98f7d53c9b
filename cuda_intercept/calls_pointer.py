"""cuPointerGetAttribute(s), answered from the client's own tables of device and host allocations.

Every attribute is exact for memory this process allocated through us: the
server never sees a question about a pointer it did not hand out.
"""
from __future__ import annotations

from . import client
from .calls_memory import ALLOCS, CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST, HOST
from .registry import CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED, CUDA_SUCCESS, implements

# attribute -> C type of its value
TYPES = {1: "CUcontext", 2: "unsigned int", 3: "CUdeviceptr", 4: "void *", 6: "int", 7: "unsigned long long",
         8: "int", 9: "int", 10: "int", 11: "CUdeviceptr", 12: "size_t", 13: "int", 14: "unsigned long long",
         15: "int", 16: "unsigned long long", 17: "CUmemoryPool", 18: "size_t", 19: "CUdeviceptr", 20: "unsigned long long",
         21: "int"}


def _host_range(ptr: int):
    for base, (_, size, _flags) in HOST.items():
        if base <= ptr < base + size:
            return base, size
    return None


def value(attr: int, ptr: int):
    """The attribute's value, or None when the driver would say CUDA_ERROR_INVALID_VALUE."""
    dev = ALLOCS.find(ptr)
    if dev is not None:
        base, size, ctx, ordinal, bid = dev
        return {1: ctx, 2: CU_MEMORYTYPE_DEVICE, 3: ptr, 6: 1, 7: bid, 8: 0, 9: ordinal, 10: 0, 11: base, 12: size,
                13: 1, 14: 0, 15: 0, 16: 3, 17: 0, 18: size, 19: base, 20: bid, 21: 0}.get(attr)
    host = _host_range(ptr)
    if host is not None:
        base, size = host
        return {1: client.get().ctx(), 2: CU_MEMORYTYPE_HOST, 4: ptr, 6: 0, 7: 0, 8: 0, 9: 0, 10: 0, 11: base,
                12: size, 13: 1}.get(attr)
    return None


@implements("cuPointerGetAttribute")
def cu_pointer_get_attribute(data, attr, ptr):
    ffi = client.get().ffi
    attr = int(attr)
    if attr not in TYPES:
        return CUDA_ERROR_NOT_SUPPORTED
    v = value(attr, int(ptr))
    if v is None:
        return CUDA_ERROR_INVALID_VALUE
    out = ffi.cast(TYPES[attr] + " *", data)
    out[0] = ffi.cast(TYPES[attr], v) if TYPES[attr] in ("CUcontext", "void *", "CUmemoryPool") else v
    return CUDA_SUCCESS


@implements("cuPointerGetAttributes")
def cu_pointer_get_attributes(n, attrs, data, ptr):
    """Unknown pointers are not an error here: their attributes read as zero, as the driver does."""
    ffi = client.get().ffi
    for i in range(n):
        attr = int(attrs[i])
        if attr not in TYPES or data[i] == ffi.NULL:
            continue
        v = value(attr, int(ptr))
        out = ffi.cast(TYPES[attr] + " *", data[i])
        v = 0 if v is None else v
        out[0] = ffi.cast(TYPES[attr], v) if TYPES[attr] in ("CUcontext", "void *", "CUmemoryPool") else v
    return CUDA_SUCCESS
