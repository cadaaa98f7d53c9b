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
    "cuThreadExchangeStreamCaptureMode",
    "cuGetExportTable",                   # the static runtime's tables, in C (export_tables.c); others refused
})

# Answered in C when C can (after cuInit; a launch whose function layout is
# known), otherwise handed to Python.
C_ANSWERED = frozenset({
    "cuDeviceGet", "cuDeviceGetCount", "cuDeviceGetAttribute", "cuLaunchKernel", "cuLaunchKernel_ptsz",
    "cuPointerGetAttribute", "cuDevicePrimaryCtxGetState",
    "cuStreamIsCapturing", "cuStreamIsCapturing_ptsz", "cuStreamGetCaptureInfo", "cuStreamGetCaptureInfo_ptsz",
    "cuStreamGetCaptureInfo_v2", "cuStreamGetCaptureInfo_v2_ptsz", "cuStreamGetCaptureInfo_v3",
    "cuStreamGetCaptureInfo_v3_ptsz",                               # status and id; dependencies from the server
    "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz",                     # queued in C when it has no attributes
    # queued in C (shim_queue.c) once there is a current context; Python with RGPU_NATIVE=off
    *(f"cuMemsetD{b}{v}" for b in (8, 16, 32) for v in ("_v2", "_v2_ptds", "Async", "Async_ptsz")),
    "cuEventRecord", "cuEventRecord_ptsz", "cuEventRecordWithFlags", "cuEventRecordWithFlags_ptsz",
    "cuStreamWaitEvent", "cuStreamWaitEvent_ptsz", "cuMemFree_v2", "cuMemFreeAsync", "cuMemFreeAsync_ptsz",
    "cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync_v2_ptsz",                # up to 64 KiB (QUEUED_COPY_BYTES)
    "cuMemcpyDtoD_v2", "cuMemcpyDtoD_v2_ptds", "cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync_v2_ptsz",
    "cuGraphLaunch", "cuGraphLaunch_ptsz",
    # answered in C when the server has just shown the stream (context) idle and nothing was sent since
    "cuStreamSynchronize", "cuStreamSynchronize_ptsz", "cuStreamQuery", "cuStreamQuery_ptsz", "cuCtxSynchronize",
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
    "cuGetExportTable": "the tables a static CUDA runtime asks for are served in C (see the export tables below); "
                        "others are refused, naming the library that asked",
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


# ---- libcudart.so.13 (cudart*.c), by base name (``cudaMemcpyAsync`` for ``cudaMemcpyAsync_ptsz``) ----
# Answered in C from the runtime's own state or libcuda.so.1's C tables: no Python, no round trip
# (properties and function attributes after their first use).
RT_IN_C = frozenset({
    "cudaGetDevice", "cudaGetLastError", "cudaPeekAtLastError", "cudaGetErrorName", "cudaGetErrorString",
    "cudaRuntimeGetVersion", "cudaGetDeviceCount", "cudaGetDeviceProperties", "cudaDeviceGetAttribute",
    "cudaStreamIsCapturing", "cudaStreamGetCaptureInfo", "cudaThreadExchangeStreamCaptureMode",
    "cudaFuncGetAttributes", "cudaFuncGetName", "cudaGetDriverEntryPoint", "cudaGetDriverEntryPointByVersion",
    "cudaCreateChannelDesc", "cudaProfilerStart", "cudaProfilerStop", "cudaChooseDevice",
    "__cudaPushCallConfiguration", "__cudaPopCallConfiguration", "__cudaRegisterFatBinary",
    "__cudaRegisterFatBinaryEnd", "__cudaRegisterFunction", "__cudaRegisterVar", "__cudaRegisterManagedVar",
    "__cudaRegisterHostVar", "__cudaRegisterUnifiedTable", "__cudaUnregisterFatBinary", "__cudaInitModule",
})

# Queued by libcuda.so.1, never waited for (a failure comes back at the next synchronising call).
RT_QUEUED = frozenset({
    "__cudaLaunchKernel", "cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel",
    "cudaMemcpyAsync", "cudaMemcpy2DAsync", "cudaMemcpyToSymbolAsync", "cudaMemcpyPeerAsync",
    "cudaMemset", "cudaMemsetAsync", "cudaMemset2D", "cudaMemset2DAsync", "cudaFree", "cudaFreeAsync",
    "cudaEventRecord", "cudaEventRecordWithFlags", "cudaEventDestroy", "cudaStreamWaitEvent", "cudaStreamDestroy",
    "cudaGraphLaunch", "cudaGraphUpload", "cudaGraphExecDestroy", "cudaGraphDestroy",
})

# Wait for the server, and report an earlier queued failure (kernel faults become sticky, as in CUDA).
RT_SYNCHRONISING = frozenset({
    "cudaMemcpy", "cudaMemcpy2D", "cudaMemcpyToSymbol", "cudaMemcpyFromSymbol", "cudaMemcpyFromSymbolAsync",
    "cudaMemcpyPeer", "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaStreamQuery", "cudaEventSynchronize",
    "cudaEventQuery", "cudaEventElapsedTime", "cudaStreamEndCapture", "cudaDeviceReset",
})

RT_REFUSED = {
    "cudaIpcGetMemHandle": "IPC handles name memory and events on the server's host",
    "cudaIpcOpenMemHandle": "IPC handles name memory and events on the server's host",
    "cudaIpcCloseMemHandle": "IPC handles name memory and events on the server's host",
    "cudaIpcGetEventHandle": "IPC handles name memory and events on the server's host",
    "cudaIpcOpenEventHandle": "IPC handles name memory and events on the server's host",
    "cudaStreamAddCallback": "host callbacks would run on the server, not in this process",
    "cudaLaunchHostFunc": "host functions would run on the server, not in this process",
    "cudaMallocManaged": "managed memory cannot be shared with a GPU across a network",
    "cudaMemAdvise": "managed memory cannot be shared with a GPU across a network",
    "cudaMemPrefetchAsync": "managed memory cannot be shared with a GPU across a network",
    "cudaStreamAttachMemAsync": "managed memory cannot be shared with a GPU across a network",
    "cudaHostGetDevicePointer": "mapped host memory cannot be reached by a GPU across a network",
}

# Implemented, with a refusal inside for one flag or kind.
RT_NOTES = {
    "cudaHostRegister": "`cudaHostRegisterMapped` refused: mapped host memory cannot be reached across a network",
    "cudaEventCreateWithFlags": "`cudaEventInterprocess` refused",
    "__cudaRegisterManagedVar": "registered; its use refused (managed memory)",
    "cudaMemcpy": "`cudaMemcpyDefault` from the client's record of its device allocations",
    "cudaMemcpyAsync": "host to device and device to device queued; device to host waits",
    "cudaStreamGetCaptureInfo": "status and id in C; the graph and dependency set in one round trip (the server's)",
    "cudaDeviceEnablePeerAccess": "the same device: CUDA's `cudaErrorInvalidDevice`; across devices refused "
                                  "(`cudaErrorPeerAccessUnsupported`: the server runs no `cuCtxEnablePeerAccess`)",
    "cudaMemPoolSetAccess": "the owner's read-write access; another device's refused (no peer access)",
    "cudaLaunchKernelExC": "queued in C without attributes; with attributes through Python",
    "__cudaGetKernel": "loads the owning fatbin once (`cuLibraryLoadData`), then `cuLibraryGetKernel`",
}


def runtime_base(name: str) -> str:
    """cudaMemcpyAsync_ptsz -> cudaMemcpyAsync."""
    return name[:-5] if name.endswith(("_ptsz", "_ptds")) else name


def base_of(name: str) -> str:
    """cuMemcpyHtoD_v2_ptds -> cuMemcpyHtoD."""
    from .model import _split_export
    return _split_export(name)[0]
