"""The driver contract behind the cuda route, shared by the real driver and the fake one.

Every method runs in the calling worker's current context (``set_current``)
and raises ``CudaDriverError`` with the CUresult the real driver would give.
Handles are plain ints: the real driver's pointers, or the fake's counters.
"""
from __future__ import annotations

from rgpu.errors import RgpuError

# The CUresult values the server itself produces (cuda.h's numbers): rgpu.protocol.cuda's one table.
from rgpu.protocol.cuda import (  # noqa: F401
    CUDA_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_HANDLE,
    CUDA_ERROR_INVALID_IMAGE, CUDA_ERROR_INVALID_PC, CUDA_ERROR_INVALID_PTX, CUDA_ERROR_INVALID_SOURCE,
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_LAUNCH_FAILED, CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
    CUDA_ERROR_NO_BINARY_FOR_GPU, CUDA_ERROR_NOT_FOUND, CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_NOT_PERMITTED,
    CUDA_ERROR_NOT_READY, CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, CUDA_ERROR_UNKNOWN, CUDA_SUCCESS,
)

# Special stream handles (cuda.h macros).
CU_STREAM_LEGACY = 0x1
CU_STREAM_PER_THREAD = 0x2

# cuJIT options whose values are host pointers (log buffers): the driver gets
# its own buffers and the logs travel back in the reply.
CU_JIT_INFO_LOG_BUFFER = 3
CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES = 4
CU_JIT_ERROR_LOG_BUFFER = 5
CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6


class CudaDriverError(RgpuError):
    """A driver call failed: ``code`` is the CUresult the program should see."""

    def __init__(self, code: int, message: str = "", op: str | None = None):
        self.code = int(code)
        self.op = op
        super().__init__(f"CUresult {code}: {message}" if message else f"CUresult {code}")


def check(cond: bool, code: int, message: str) -> None:
    """Raise ``CudaDriverError(code, message)`` unless ``cond``."""
    if not cond:
        raise CudaDriverError(code, message)


class Driver:
    """What the cuda route's executor calls. See ``fake.FakeDriver`` for the reference semantics.

    Devices and contexts: ``init(nattr)``, ``primary_ctx_retain/release/reset/get_state/set_flags``,
    ``ctx_create/destroy``, ``set_current``, ``ctx_synchronize``, ``ctx_get_limit/set_limit``.
    Memory: ``mem_alloc/free/get_info``, ``memcpy_htod/dtoh/dtod``, ``memset``.
    Code: ``module_load/unload/get_function/get_global``, ``param_layout``, ``func_get_attribute``,
    ``func_set_attribute``, ``link_create/add_data/complete/destroy``, ``library_*``, ``launch``.
    Order: ``stream_*``, ``event_*``, ``stream_begin_capture/end_capture``, ``graph_*``.
    """

    name = "driver"

    # A look-up and its parameter layout in one reply: each kernel's first use costs one round trip, not
    # two. Composed from the contract's own calls, so every driver answers it alike.
    def library_get_kernel_layout(self, lib: int, name: str) -> list:
        k = self.library_get_kernel(lib, name)
        return [k, self.param_layout(k)]

    def module_get_function_layout(self, mod: int, name: str) -> list:
        f = self.module_get_function(mod, name)
        return [f, self.param_layout(f)]

    def close(self) -> None:
        """Release everything this session created."""
