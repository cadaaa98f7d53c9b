"""The real libcuda.so.1 through ctypes: found by absolute path (never rgpu's own), every used entry point typed.

Signatures are data: one letter per parameter (p pointer or handle, i int,
u unsigned int, z size_t, q unsigned long long, d CUdeviceptr, f float).
"""
from __future__ import annotations

import ctypes
import glob
import os
import subprocess
from ctypes import c_int, c_void_p

import numpy as np

from rgpu.errors import ConfigError

from .base import (CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, CU_JIT_INFO_LOG_BUFFER,
                   CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES, CudaDriverError)

_T = {"p": ctypes.c_void_p, "i": ctypes.c_int, "u": ctypes.c_uint, "z": ctypes.c_size_t,
      "q": ctypes.c_ulonglong, "d": ctypes.c_ulonglong, "f": ctypes.c_float}

SIGNATURES = {
    "cuInit": "u", "cuDriverGetVersion": "p", "cuDeviceGetCount": "p", "cuDeviceGet": "pi",
    "cuDeviceGetName": "pii", "cuDeviceTotalMem_v2": "pi", "cuDeviceGetUuid_v2": "pi", "cuDeviceGetPCIBusId": "pii",
    "cuDeviceGetAttribute": "pii",
    "cuDevicePrimaryCtxRetain": "pi", "cuDevicePrimaryCtxRelease_v2": "i", "cuDevicePrimaryCtxReset_v2": "i",
    "cuDevicePrimaryCtxGetState": "ipp", "cuDevicePrimaryCtxSetFlags_v2": "iu",
    "cuCtxCreate_v2": "pui", "cuCtxDestroy_v2": "p", "cuCtxSetCurrent": "p", "cuCtxPopCurrent_v2": "p",
    "cuCtxSynchronize": "", "cuCtxGetFlags": "p", "cuCtxGetLimit": "pi", "cuCtxSetLimit": "iz",
    "cuCtxGetStreamPriorityRange": "pp", "cuCtxSetCacheConfig": "i",
    "cuMemAlloc_v2": "pz", "cuMemFree_v2": "d", "cuMemGetInfo_v2": "pp", "cuMemGetAddressRange_v2": "ppd",
    "cuMemAllocHost_v2": "pz", "cuMemFreeHost": "p",
    "cuMemcpyHtoD_v2": "dpz", "cuMemcpyHtoDAsync_v2": "dpzp", "cuMemcpyDtoH_v2": "pdz", "cuMemcpyDtoHAsync_v2": "pdzp",
    "cuMemcpyDtoD_v2": "ddz", "cuMemcpyDtoDAsync_v2": "ddzp",
    "cuMemsetD8_v2": "duz", "cuMemsetD16_v2": "duz", "cuMemsetD32_v2": "duz",
    "cuMemsetD8Async": "duzp", "cuMemsetD16Async": "duzp", "cuMemsetD32Async": "duzp",
    "cuModuleLoadDataEx": "ppupp", "cuModuleUnload": "p", "cuModuleGetFunction": "ppp", "cuModuleGetGlobal_v2": "pppp",
    "cuFuncGetParamInfo": "pzpp", "cuKernelGetParamInfo": "pzpp", "cuFuncGetName": "pp",
    "cuFuncGetAttribute": "pip", "cuFuncSetAttribute": "pii", "cuFuncSetCacheConfig": "pi",
    "cuLibraryLoadData": "ppppuppu", "cuLibraryUnload": "p", "cuLibraryGetModule": "pp", "cuLibraryGetKernel": "ppp",
    "cuKernelGetFunction": "pp", "cuLibraryGetGlobal": "pppp",
    "cuLinkCreate_v2": "uppp", "cuLinkAddData_v2": "pipzpupp", "cuLinkComplete": "ppp", "cuLinkDestroy": "p",
    "cuLaunchKernel": "puuuuuuuppp", "cuLaunchKernelEx": "pppp",
    "cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags": "ppizu",
    "cuOccupancyMaxPotentialBlockSizeWithFlags": "ppppziu",
    "cuStreamCreateWithPriority": "pui", "cuStreamDestroy_v2": "p", "cuStreamSynchronize": "p", "cuStreamQuery": "p",
    "cuStreamGetFlags": "pp", "cuStreamGetPriority": "pp", "cuStreamWaitEvent": "ppu",
    "cuEventCreate": "pu", "cuEventDestroy_v2": "p", "cuEventRecord": "pp", "cuEventRecordWithFlags": "ppu",
    "cuEventSynchronize": "p", "cuEventQuery": "p", "cuEventElapsedTime": "ppp", "cuEventElapsedTime_v2": "ppp",
    "cuStreamBeginCapture_v2": "pi", "cuStreamEndCapture": "pp", "cuStreamIsCapturing": "pp",
    "cuThreadExchangeStreamCaptureMode": "p",
    "cuGraphInstantiateWithFlags": "ppq", "cuGraphLaunch": "pp", "cuGraphUpload": "pp", "cuGraphExecDestroy": "p",
    "cuGraphDestroy": "p", "cuGraphGetNodes": "ppp", "cuStreamGetCaptureInfo_v3": "ppppppp",
    "cuKernelGetAttribute": "pipi", "cuKernelSetAttribute": "iipi",
    "cuMemAllocAsync": "pzp", "cuMemFreeAsync": "dp", "cuMemAllocFromPoolAsync": "pzpp",
    "cuDeviceGetDefaultMemPool": "pi", "cuMemPoolSetAttribute": "pip", "cuMemPoolGetAttribute": "pip",
    "cuMemPoolTrimTo": "pz",
}

_SEARCH = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/nvidia/lib64",
           "/usr/local/nvidia/lib", "/usr/lib/wsl/lib", "/lib/x86_64-linux-gnu")


def candidates() -> list[str]:
    """Absolute paths of libcuda.so.1 on this host: ldconfig's first, then the usual folders.

    Never a bare name: a bare dlopen would find rgpu's own libcuda.so.1 first
    whenever LD_LIBRARY_PATH names it (a local server started by an intercepted program).
    """
    found = []
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
        found += [line.split("=>")[-1].strip() for line in out.splitlines() if "libcuda.so.1 " in line]
    except (OSError, subprocess.SubprocessError):
        pass
    for d in _SEARCH:
        found += glob.glob(os.path.join(d, "libcuda.so.1"))
    return list(dict.fromkeys(os.path.realpath(p) for p in found if os.path.exists(p)))


def load() -> ctypes.CDLL:
    errors = []
    for path in candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
            continue
        if hasattr(lib, "PyInit__rgpu_libcuda"):
            errors.append(f"{path}: rgpu's own interceptor, not a driver")
            continue
        return typed(lib)
    raise ConfigError("no NVIDIA driver library (libcuda.so.1) found" + (": " + "; ".join(errors) if errors else ""))


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give every entry point we call its argument types (64-bit handles would be truncated to int otherwise)."""
    for name, sig in SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = [_T[c] for c in sig]
            fn.restype = ctypes.c_int
    return lib


class Api:
    """Calls into the loaded driver; a non-zero CUresult raises CudaDriverError with its name."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self._name = getattr(lib, "cuGetErrorName")
        self._name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def has(self, name: str) -> bool:
        return getattr(self.lib, name, None) is not None

    def error_name(self, code: int) -> str:
        p = ctypes.c_char_p()
        return p.value.decode() if self._name(code, ctypes.byref(p)) == 0 and p.value else f"CUresult {code}"

    def __call__(self, name: str, *args, detail: str = "") -> None:
        rc = getattr(self.lib, name)(*args)
        if rc:
            raise CudaDriverError(rc, f"{name}: {self.error_name(rc)}" + (f": {detail}" if detail else ""))

    def out(self, name: str, ctype, *args):
        """Call ``name`` with a ``ctype`` output first, then ``args``: the output's value."""
        v = ctype()
        self(name, ctypes.byref(v), *args)
        return v.value


LOG_BYTES = 16 << 10


def address(buf) -> int:
    """The address of a buffer's bytes, read-only buffers included, without a copy."""
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data if len(buf) else 0


class JitOptions:
    """cuJIT options as the driver takes them, with log buffers the driver writes into."""

    def __init__(self, options: dict | None):
        self.info = ctypes.create_string_buffer(LOG_BYTES)
        self.error = ctypes.create_string_buffer(LOG_BYTES)
        opts = {int(k): int(v) for k, v in (options or {}).items()
                if int(k) not in (CU_JIT_INFO_LOG_BUFFER, CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
                                  CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)}
        opts.update({CU_JIT_INFO_LOG_BUFFER: ctypes.addressof(self.info), CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES: LOG_BYTES,
                     CU_JIT_ERROR_LOG_BUFFER: ctypes.addressof(self.error), CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES: LOG_BYTES})
        self.n = len(opts)
        self.keys = (c_int * self.n)(*opts.keys())
        self.values = (c_void_p * self.n)(*opts.values())

    def logs(self) -> list[str]:
        return [self.info.value.decode(errors="replace"), self.error.value.decode(errors="replace")]
