"""The cuda route's numbers: the CUresult values rgpu itself produces (cuda.h's), and the records of the C queue.

Both ends of the route use them (``cuda_intercept/registry.py`` on the client,
``server/cuda/base.py`` on the server); ``shim*.c`` reads them from
``rgpu_protocol.h``.
"""
from __future__ import annotations

import struct

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_DEVICE_UNAVAILABLE = 46
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_IMAGE = 200
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_NO_BINARY_FOR_GPU = 209
CUDA_ERROR_INVALID_PTX = 218
CUDA_ERROR_INVALID_SOURCE = 300
CUDA_ERROR_INVALID_HANDLE = 400
CUDA_ERROR_NOT_FOUND = 500
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701
CUDA_ERROR_INVALID_PC = 718
CUDA_ERROR_LAUNCH_FAILED = 719
CUDA_ERROR_NOT_PERMITTED = 800
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900
CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901
CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908
CUDA_ERROR_UNKNOWN = 999

CURESULTS = {name: value for name, value in globals().items() if name.startswith("CUDA_")}

# A launch record from the interceptor's C queue (shim_launch.c), read by the server's cuda route
# (server/cuda/executor.py, launch_records.c), 8-byte aligned:
# u32 size, u32 kind, u64 func, u64 ctx, u64 stream, u32 grid[3], u32 block[3], u32 shared, u32 arg_bytes, then
#   kind 1 (cuLaunchKernel):   args[arg_bytes]
#   kind 2 (cuLaunchKernelEx): u32 nattrs, u32 0, CUlaunchAttribute[nattrs] (72 bytes each), args[arg_bytes]
LAUNCH = struct.Struct("<IIQQQ3I3III")
LAUNCH_KIND, LAUNCH_EX_KIND = 1, 2
LAUNCH_EX_ATTRS = struct.Struct("<II")
ATTR_BYTES = 72   # sizeof(CUlaunchAttribute)

# Every record starts with u32 size (a multiple of 8), u32 kind: a reader skips by size.
RECORD_HEAD = struct.Struct("<II")

# The other stream-ordered calls the same queue carries (shim_queue.c), so their order with launches is exact:
# u32 size, u32 kind, u64 ctx, u64 stream, u64 a, u64 b, u64 c, then the kind's bytes.  stream NO_STREAM: the
# synchronous form (cuMemsetD8_v2, cuMemFree_v2), which the drivers take as stream None.
OP = struct.Struct("<IIQQQQQ")
MEMSET_KIND = 3         # a: dst, b: value | elem bytes << 32, c: count                   -> memset
EVENT_RECORD_KIND = 4   # a: event, b: flags                                               -> event_record
STREAM_WAIT_KIND = 5    # a: event, b: flags                                               -> stream_wait_event
MEM_FREE_KIND = 6       # a: dptr (NO_STREAM: cuMemFree_v2, else cuMemFreeAsync)           -> mem_free(_async)
MEMCPY_HTOD_KIND = 7    # a: dst, b: nbytes, then the bytes (at most QUEUED_COPY_BYTES)    -> memcpy_htod
GRAPH_LAUNCH_KIND = 8   # a: exec                                                          -> graph_launch
LIB_KIND = 9            # a: call id, b: handle, c: payload bytes, then the payload (cuda_libs) -> lib_call
MEMCPY_DTOD_KIND = 10   # a: dst, b: src, c: nbytes (NO_STREAM: cuMemcpyDtoD_v2)           -> memcpy_dtod
NO_STREAM = (1 << 64) - 1
QUEUED_COPY_BYTES = 64 << 10   # a bigger host-to-device copy keeps its own message (pieces, no copy into the queue)
