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


class Code:
    """A driver's modules, functions, libraries, links and launches (``RealCode``, ``FakeCode``); its
    ``Driver`` hands these calls to it. Handles are ints; every call runs in the current context and
    raises ``CudaDriverError`` with the driver's CUresult (an image that is no module:
    CUDA_ERROR_INVALID_IMAGE; a name not in it: CUDA_ERROR_NOT_FOUND; an unknown handle:
    CUDA_ERROR_INVALID_HANDLE or CUDA_ERROR_INVALID_VALUE, as the real driver answers)."""

    def module_load(self, options: dict | None, image) -> list:
        """Load a cubin, fatbin or PTX ``image`` with cuJIT ``options`` ({option: value}, log buffers
        supplied here): ``[module, info log, error log]``."""
        raise NotImplementedError

    def module_unload(self, mod: int) -> None:
        raise NotImplementedError

    def module_get_function(self, mod: int, name: str) -> int:
        """The CUfunction ``name`` of ``mod``."""
        raise NotImplementedError

    def module_get_global(self, mod: int, name: str) -> list:
        """``[device address, bytes]`` of the global ``name``."""
        raise NotImplementedError

    def param_layout(self, handle: int) -> list:
        """A function's or kernel's parameters as ``[[offset, size], ...]`` (what a launch's packed buffer holds)."""
        raise NotImplementedError

    def func_name(self, handle: int) -> str:
        raise NotImplementedError

    def func_get_attribute(self, attr: int, handle: int) -> int:
        """CUfunction_attribute ``attr`` of a function (or a kernel, in the current context)."""
        raise NotImplementedError

    def func_set_attribute(self, handle: int, attr: int, value: int) -> None:
        raise NotImplementedError

    def kernel_get_attribute(self, attr: int, handle: int, dev: int) -> int:
        raise NotImplementedError

    def kernel_set_attribute(self, attr: int, value: int, handle: int, dev: int) -> None:
        raise NotImplementedError

    def func_set_cache_config(self, handle: int, config: int) -> None:
        raise NotImplementedError

    def library_load(self, options: dict | None, image) -> int:
        """A CUlibrary loaded from ``image`` (context-independent, the runtime's path)."""
        raise NotImplementedError

    def library_kernels(self, lib: int) -> dict | None:
        """``{name: [kernel, param layout]}`` of every kernel of ``lib``, without loading any into a context;
        None where this driver cannot enumerate them (the client then asks kernel by kernel)."""
        return None

    def library_unload(self, lib: int) -> None:
        raise NotImplementedError

    def library_get_module(self, lib: int) -> int:
        raise NotImplementedError

    def library_get_kernel(self, lib: int, name: str) -> int:
        """The CUkernel ``name`` of ``lib`` (launched as a function in the current context)."""
        raise NotImplementedError

    def kernel_get_function(self, kernel: int) -> int:
        raise NotImplementedError

    def library_get_global(self, lib: int, name: str) -> list:
        """``[device address, bytes]`` of the global ``name``."""
        raise NotImplementedError

    def link_create(self, options: dict | None = None) -> int:
        """A link state (numba-cuda's path); ``options`` as module_load's."""
        raise NotImplementedError

    def link_add_data(self, link: int, kind: int, name: str, options: dict | None, data) -> None:
        """Add ``data`` of CUjitInputType ``kind``; a failure's CUDA_ERROR_* message carries the error log."""
        raise NotImplementedError

    def link_complete(self, link: int) -> list:
        """``[linked cubin bytes, info log, error log]``."""
        raise NotImplementedError

    def link_destroy(self, link: int) -> None:
        raise NotImplementedError

    def launch(self, func: int, grid, block, shared: int, stream: int, attrs, args) -> None:
        """cuLaunchKernel (or cuLaunchKernelEx with ``attrs``, a list of 72-byte CUlaunchAttribute structs)
        of a function or kernel: ``grid``/``block`` (x, y, z), ``shared`` bytes, on ``stream``, ``args`` the
        packed parameter buffer laid out as ``param_layout`` says."""
        raise NotImplementedError

    def occupancy_max_active_blocks(self, func: int, block: int, shared: int, flags: int = 0) -> int:
        raise NotImplementedError

    def occupancy_max_potential_block_size(self, func: int, shared: int, limit: int, flags: int = 0) -> list:
        """``[min grid size, block size]``."""
        raise NotImplementedError


CODE_CALLS = tuple(n for n in vars(Code) if not n.startswith("_"))   # what a Driver hands to its Code


class Driver:
    """What the cuda route's executor calls (by name, ``executor.OPS``). See ``fake.FakeDriver`` for the
    reference semantics; every call runs in the calling worker's current context (``set_current``) and
    raises ``CudaDriverError`` with the CUresult the real driver would give.

    A driver owns its devices, contexts, memory and ordering (streams, events, capture, graphs); its
    ``code`` (a ``Code``) owns modules, functions, libraries, links and launches, and the ``CODE_CALLS``
    on a driver are that object's (one line each below, no attribute forwarding).

    Devices and contexts: ``init(nattr)``, ``primary_ctx_retain/release/reset/get_state/set_flags``,
    ``ctx_create/destroy``, ``set_current``, ``ctx_synchronize``, ``ctx_get_limit/set_limit``.
    Memory: ``mem_alloc/free/get_info``, ``mem_alloc_async/free_async``, pools, ``memcpy_htod/dtoh/dtod``
    (``stream`` None: the synchronous form), ``memset``.
    Order: ``stream_*``, ``event_*``, ``stream_begin_capture/end_capture``, ``graph_*``.
    """

    name = "driver"
    code: Code
    # The real driver's launch of a record's packed arguments where they lie (its hot path), or None.
    launch_at = None

    def launch_records(self, base: int, length: int, pos: int, ctx: int | None, cublas: int | None = None):
        """Walk the queued records at address ``base`` (``length`` bytes, kept alive by the caller) from
        ``pos`` in C: ``(pos, current ctx, rc)``, rc 0 when all ran, -1 at a malformed record, else the
        record at pos is the executor's to run (another kind, or a failure to explain); None where this
        driver has no walker (the executor walks them in Python). ``cublas``: the session's cuBLAS table."""
        return None

    # ---- the Code's calls, handed to ``self.code`` (documented on ``Code``) ---------------------
    def module_load(self, options: dict | None, image) -> list:
        return self.code.module_load(options, image)

    def module_unload(self, mod: int) -> None:
        return self.code.module_unload(mod)

    def module_get_function(self, mod: int, name: str) -> int:
        return self.code.module_get_function(mod, name)

    def module_get_global(self, mod: int, name: str) -> list:
        return self.code.module_get_global(mod, name)

    def param_layout(self, handle: int) -> list:
        return self.code.param_layout(handle)

    def func_name(self, handle: int) -> str:
        return self.code.func_name(handle)

    def func_get_attribute(self, attr: int, handle: int) -> int:
        return self.code.func_get_attribute(attr, handle)

    def func_set_attribute(self, handle: int, attr: int, value: int) -> None:
        return self.code.func_set_attribute(handle, attr, value)

    def kernel_get_attribute(self, attr: int, handle: int, dev: int) -> int:
        return self.code.kernel_get_attribute(attr, handle, dev)

    def kernel_set_attribute(self, attr: int, value: int, handle: int, dev: int) -> None:
        return self.code.kernel_set_attribute(attr, value, handle, dev)

    def func_set_cache_config(self, handle: int, config: int) -> None:
        return self.code.func_set_cache_config(handle, config)

    def library_load(self, options: dict | None, image) -> int:
        return self.code.library_load(options, image)

    def library_kernels(self, lib: int) -> dict | None:
        return self.code.library_kernels(lib)

    def library_unload(self, lib: int) -> None:
        return self.code.library_unload(lib)

    def library_get_module(self, lib: int) -> int:
        return self.code.library_get_module(lib)

    def library_get_kernel(self, lib: int, name: str) -> int:
        return self.code.library_get_kernel(lib, name)

    def kernel_get_function(self, kernel: int) -> int:
        return self.code.kernel_get_function(kernel)

    def library_get_global(self, lib: int, name: str) -> list:
        return self.code.library_get_global(lib, name)

    def link_create(self, options: dict | None = None) -> int:
        return self.code.link_create(options)

    def link_add_data(self, link: int, kind: int, name: str, options: dict | None, data) -> None:
        return self.code.link_add_data(link, kind, name, options, data)

    def link_complete(self, link: int) -> list:
        return self.code.link_complete(link)

    def link_destroy(self, link: int) -> None:
        return self.code.link_destroy(link)

    def launch(self, func: int, grid, block, shared: int, stream: int, attrs, args) -> None:
        return self.code.launch(func, grid, block, shared, stream, attrs, args)

    def occupancy_max_active_blocks(self, func: int, block: int, shared: int, flags: int = 0) -> int:
        return self.code.occupancy_max_active_blocks(func, block, shared, flags)

    def occupancy_max_potential_block_size(self, func: int, shared: int, limit: int, flags: int = 0) -> list:
        return self.code.occupancy_max_potential_block_size(func, shared, limit, flags)

    # A look-up and its parameter layout in one reply: each kernel's first use costs one round trip, not
    # two. Composed from the contract's own calls, so every driver answers it alike.
    def library_get_kernel_layout(self, lib: int, name: str) -> list:
        k = self.library_get_kernel(lib, name)
        return [k, self.param_layout(k)]

    def module_get_function_layout(self, mod: int, name: str) -> list:
        f = self.module_get_function(mod, name)
        return [f, self.param_layout(f)]

    # Every attribute the client may cache, in one reply (cudaFuncGetAttributes reads ten; cuBLASLt asks
    # several per kernel): the values of CUfunction_attribute 0..9 by number, None for one the driver
    # refuses (the client asks it alone, and that call says why).
    FUNC_ATTRIBUTES = 10

    def func_get_attributes(self, handle: int) -> list:
        return self._attributes(lambda a: self.func_get_attribute(a, handle))

    def kernel_get_attributes(self, handle: int, dev: int) -> list:
        return self._attributes(lambda a: self.kernel_get_attribute(a, handle, dev))

    def _attributes(self, read) -> list:
        out = []
        for a in range(self.FUNC_ATTRIBUTES):
            try:
                out.append(read(a))
            except CudaDriverError:
                out.append(None)
        return out

    def close(self) -> None:
        """Release everything this session created."""

