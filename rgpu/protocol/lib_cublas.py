"""cuBLAS's forwarded calls (``cuda_intercept/lib_cublas.c`` on the client, ``server/cuda/libs/cublas_*.py``).

Handles are minted on the client; the setters (stream, workspace, math mode, pointer mode) stay there
and every call that computes carries the handle's current values (``STATE``): the server applies one
to the real handle only when it changed. Scalars (``alpha``, ``beta``: 16 bytes, room for a complex
double) hold the value by copy in host pointer mode, else the device address in their first 8 bytes.
Matrix, vector and workspace pointers are the server's addresses and pass through.

``cublasCreate_v2`` is answered the first time (the server checks its library's major version against
the client's and answers its version, 4 bytes) and queued after; the dot products are answered in host
pointer mode (the result lands in the caller's memory: 4, 8 or the result type's bytes) and queued in
device pointer mode.
"""
from __future__ import annotations

from .lib_call import LibCall

IDS = (0x100, 0x200)

# cublasStatus_t (cublas_api.h), as both server sides answer them
NOT_INITIALIZED, INVALID_VALUE, NOT_SUPPORTED = 1, 7, 15
DEFAULT_WORKSPACE = (1 << 64) - 1      # workspace_size meaning "the library's own pool" (lib_cublas.c)
STATUS = {0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
          7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
          13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR",
          15: "CUBLAS_STATUS_NOT_SUPPORTED", 16: "CUBLAS_STATUS_LICENSE_ERROR"}

# the handle's state, in every computing call
STATE = (("workspace", "Q"), ("workspace_size", "Q"), ("math_mode", "i"), ("pointer_mode", "i"))
_SCALARS = (("alpha", "16s"), ("beta", "16s"))
_GEMM = (*STATE, ("transa", "i"), ("transb", "i"), ("m", "i"), ("n", "i"), ("k", "i"),
         ("lda", "i"), ("ldb", "i"), ("ldc", "i"), *_SCALARS, ("A", "Q"), ("B", "Q"), ("C", "Q"))
_TYPES = (("atype", "i"), ("btype", "i"), ("ctype", "i"))
_EX = (*_TYPES, ("compute_type", "i"), ("algo", "i"))
_STRIDES = (("stride_a", "q"), ("stride_b", "q"), ("stride_c", "q"), ("batch", "i"))
_GEMV = (*STATE, ("trans", "i"), ("m", "i"), ("n", "i"), ("lda", "i"), ("incx", "i"), ("incy", "i"), *_SCALARS,
         ("A", "Q"), ("x", "Q"), ("y", "Q"))
_DOT = (*STATE, ("n", "i"), ("incx", "i"), ("incy", "i"), ("x", "Q"), ("y", "Q"), ("result", "Q"))

CALLS: tuple[LibCall, ...] = (
    # the server creates the real handle; the reply's status says whether its library loaded (version checked)
    LibCall(0x100, "cublasCreate_v2", (("client_version", "i"),), sync=True),
    LibCall(0x101, "cublasDestroy_v2"),
    LibCall(0x110, "cublasSgemm_v2", _GEMM),
    LibCall(0x111, "cublasDgemm_v2", _GEMM),
    LibCall(0x112, "cublasGemmEx", (*_GEMM, *_EX)),
    LibCall(0x113, "cublasSgemmEx", (*_GEMM, *_TYPES)),
    LibCall(0x114, "cublasSgemmStridedBatched", (*_GEMM, *_STRIDES)),
    LibCall(0x115, "cublasDgemmStridedBatched", (*_GEMM, *_STRIDES)),
    LibCall(0x116, "cublasGemmStridedBatchedEx", (*_GEMM, *_EX, *_STRIDES)),
    # A, B, C: device arrays of batch device pointers
    LibCall(0x117, "cublasGemmBatchedEx", (*_GEMM, *_EX, ("batch", "i"))),
    LibCall(0x120, "cublasSgemv_v2", _GEMV),
    LibCall(0x121, "cublasDgemv_v2", _GEMV),
    LibCall(0x130, "cublasSdot_v2", _DOT),
    LibCall(0x131, "cublasDdot_v2", _DOT),
    LibCall(0x132, "cublasDotEx", (*_DOT, ("xtype", "i"), ("ytype", "i"), ("result_type", "i"), ("exec_type", "i"))),
)
