"""What the header cannot say: which calls are answered in C, queued, refused, and how buffers are sized.

Keys are export names for the C tables and base names (``cuMemcpyHtoD`` for
``cuMemcpyHtoD_v2`` and ``cuMemcpyHtoD_v2_ptds``) everywhere else.  The
coverage page (docs/cuda_coverage.md) is generated from these tables and the
Python implementations in ``calls_*.py``.
"""
from __future__ import annotations

# Answered in C, never entering Python (exact without the server).
C_ONLY = frozenset({
    "cuGetErrorName", "cuGetErrorString", "cuGetProcAddress", "cuGetProcAddress_v2",
    "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2", "cuCtxSetCurrent", "cuCtxGetCurrent", "cuCtxGetDevice",
})

# Answered in C when C can (after cuInit; a launch whose function layout is
# known), otherwise handed to Python.
C_ANSWERED = frozenset({
    "cuDeviceGet", "cuDeviceGetCount", "cuDeviceGetAttribute", "cuLaunchKernel", "cuLaunchKernel_ptsz",
    "cuPointerGetAttribute",
})

# Calls whose effect shows only at a later synchronisation: posted in batches,
# never waited for.  A failure comes back at the next synchronising call.
QUEUED = frozenset({
    "cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel",
    "cuMemsetD8", "cuMemsetD16", "cuMemsetD32", "cuMemsetD8Async", "cuMemsetD16Async", "cuMemsetD32Async",
    "cuMemcpyHtoDAsync", "cuMemcpyDtoD", "cuMemcpyDtoDAsync",
    "cuMemFree", "cuMemFreeAsync", "cuModuleUnload", "cuLibraryUnload",
    "cuEventRecord", "cuEventRecordWithFlags", "cuEventDestroy", "cuStreamWaitEvent", "cuStreamDestroy",
    "cuGraphLaunch", "cuGraphUpload", "cuGraphExecDestroy", "cuGraphDestroy",
    "cuFuncSetCacheConfig", "cuCtxSetCacheConfig",
})

# Synchronising calls: where an earlier queued call's failure is reported.
SYNCHRONISING = frozenset({
    "cuCtxSynchronize", "cuStreamSynchronize", "cuStreamQuery", "cuEventSynchronize", "cuEventQuery",
    "cuMemcpyDtoH", "cuMemcpyDtoHAsync", "cuMemcpyHtoD", "cuMemcpy", "cuStreamEndCapture",
})

# Refused with a clear message (CUDA_ERROR_NOT_SUPPORTED): cannot cross a network.
REFUSED = {
    "cuMemAllocManaged": "managed memory cannot be shared with a GPU across a network",
    "cuMemHostGetDevicePointer": "mapped host memory cannot be reached by a GPU across a network",
    "cuMemAdvise": "managed memory is not supported over rgpu",
    "cuMemPrefetchAsync": "managed memory is not supported over rgpu",
    "cuStreamAttachMemAsync": "managed memory is not supported over rgpu",
    "cuStreamAddCallback": "host callbacks would run on the server, not in this process",
    "cuLaunchHostFunc": "host functions would run on the server, not in this process",
    "cuIpcGetMemHandle": "IPC handles name memory on the server's host",
    "cuIpcOpenMemHandle": "IPC handles name memory on the server's host",
    "cuGetExportTable": "the driver's private export tables cannot cross a network (the runtime layer replaces them)",
    "cuGraphicsMapResources": "graphics interop needs a local display",
}

# Host-memory flags that mean "map this into the GPU": refused like managed memory.
CU_MEMHOSTALLOC_DEVICEMAP = 0x02
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02

# Output buffers whose size another parameter gives: base -> (buffer param, size param).
SIZED_OUT = {
    "cuDeviceGetName": ("name", "len"),
    "cuDeviceGetPCIBusId": ("pciBusId", "len"),
}


def base_of(name: str) -> str:
    """cuMemcpyHtoD_v2_ptds -> cuMemcpyHtoD."""
    from .model import _split_export
    return _split_export(name)[0]
