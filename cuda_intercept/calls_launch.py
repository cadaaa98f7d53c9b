"""Kernel launches that C hands over: ``extra`` argument buffers, cuLaunchKernelEx with attributes, and every refusal, explained.

The common cuLaunchKernel and cuLaunchKernelEx without attributes
(kernelParams, a known function or CUkernel, a current context) never get
here: shim_launch.c queues them.  Arguments are packed by the layout the
server read with cuFuncGetParamInfo, the same packing C does.
"""
from __future__ import annotations

import struct

from . import client
from .calls_code import layout
from .calls_device import handle
from .registry import CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_VALUE, CUDA_SUCCESS, CudaCallError, implements

CU_LAUNCH_PARAM_END, CU_LAUNCH_PARAM_BUFFER_POINTER, CU_LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2


def pack(f, kernel_params, extra) -> bytes:
    """The argument bytes for ``f`` from kernelParams or extra; refuses what does not fit its layout."""
    ffi = client.get().ffi
    lay = layout(f)
    name, nbytes, params = lay["name"], lay["bytes"], lay["params"]
    if kernel_params != ffi.NULL and extra != ffi.NULL:
        raise CudaCallError(CUDA_ERROR_INVALID_VALUE, f"launch of {name!r}: both kernelParams and extra given")
    if extra != ffi.NULL:
        buf, size, i = None, None, 0
        while True:
            key = int(ffi.cast("uintptr_t", extra[i]))
            if key == CU_LAUNCH_PARAM_END:
                break
            if key == CU_LAUNCH_PARAM_BUFFER_POINTER:
                buf = extra[i + 1]
            elif key == CU_LAUNCH_PARAM_BUFFER_SIZE:
                size = ffi.cast("size_t *", extra[i + 1])[0]
            else:
                raise CudaCallError(CUDA_ERROR_INVALID_VALUE, f"launch of {name!r}: unknown extra key {key:#x}")
            i += 2
        if buf is None or size is None:
            raise CudaCallError(CUDA_ERROR_INVALID_VALUE, f"launch of {name!r}: extra needs BUFFER_POINTER and SIZE")
        if size < nbytes:
            raise CudaCallError(CUDA_ERROR_INVALID_VALUE, f"launch of {name!r}: the kernel takes {nbytes} bytes of "
                                                          f"arguments ({len(params)} parameters), extra gives {size}")
        return bytes(ffi.buffer(ffi.cast("char *", buf), nbytes))
    if params and kernel_params == ffi.NULL:
        raise CudaCallError(CUDA_ERROR_INVALID_VALUE, f"launch of {name!r}: the kernel takes {len(params)} "
                                                      "parameters and neither kernelParams nor extra was given")
    out = bytearray(nbytes)
    for i, (off, size) in enumerate(params):
        out[off:off + size] = ffi.buffer(ffi.cast("char *", kernel_params[i]), size)
    return bytes(out)


def launch(f, grid, block, shared, stream, kernel_params, extra, attrs=None) -> int:
    c = client.get()
    if not c.ctx():
        return CUDA_ERROR_INVALID_CONTEXT
    if not all(grid) or not all(block):
        raise CudaCallError(CUDA_ERROR_INVALID_VALUE, f"launch of {layout(f)['name']!r}: a zero grid or block "
                                                      f"dimension ({grid}, {block})")
    args = pack(f, kernel_params, extra)
    c.post("launch", handle(c.ffi, f), list(grid), list(block), int(shared), handle(c.ffi, stream), attrs, args)
    return CUDA_SUCCESS


@implements("cuLaunchKernel", "cuLaunchKernel_ptsz", stream=8)
def cu_launch_kernel(f, gx, gy, gz, bx, by, bz, shared, stream, kernel_params, extra):
    return launch(f, (gx, gy, gz), (bx, by, bz), shared, stream, kernel_params, extra)


def _launch_ex(config, f, kernel_params, extra, default_stream) -> int:
    ffi = client.get().ffi
    size = ffi.sizeof("CUlaunchAttribute")
    attrs = [bytes(ffi.buffer(config.attrs + i, size)) for i in range(config.numAttrs)] or None
    return launch(f, (config.gridDimX, config.gridDimY, config.gridDimZ),
                  (config.blockDimX, config.blockDimY, config.blockDimZ), config.sharedMemBytes,
                  config.hStream or default_stream, kernel_params, extra, attrs)


@implements("cuLaunchKernelEx")
def cu_launch_kernel_ex(config, f, kernel_params, extra):
    return _launch_ex(config, f, kernel_params, extra, 0)


@implements("cuLaunchKernelEx_ptsz")
def cu_launch_kernel_ex_ptsz(config, f, kernel_params, extra):
    return _launch_ex(config, f, kernel_params, extra, 0x2)   # NULL: the per-thread default stream


# CUlaunchAttribute {CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2, pad, value.cooperative = 1}: 72 bytes
COOPERATIVE = struct.pack("<I4xi60x", 2, 1)


@implements("cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel_ptsz", stream=8)
def cu_launch_cooperative_kernel(f, gx, gy, gz, bx, by, bz, shared, stream, kernel_params):
    return launch(f, (gx, gy, gz), (bx, by, bz), shared, stream, kernel_params, client.get().ffi.NULL, [COOPERATIVE])
