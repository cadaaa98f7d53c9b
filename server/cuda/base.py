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
        """Unload ``mod``; its functions and globals go with it."""
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
        """A function's or kernel's name as its image has it (mangled, for C++ kernels)."""
        raise NotImplementedError

    def func_get_attribute(self, attr: int, handle: int) -> int:
        """CUfunction_attribute ``attr`` of a function (or a kernel, in the current context)."""
        raise NotImplementedError

    def func_set_attribute(self, handle: int, attr: int, value: int) -> None:
        """Set CUfunction_attribute ``attr`` (the settable ones: max dynamic shared bytes, carveout, ...), as
        the real driver takes it (it refuses a read-only one with INVALID_VALUE)."""
        raise NotImplementedError

    def kernel_get_attribute(self, attr: int, handle: int, dev: int) -> int:
        """CUfunction_attribute ``attr`` of a CUkernel on device ``dev``."""
        raise NotImplementedError

    def kernel_set_attribute(self, attr: int, value: int, handle: int, dev: int) -> None:
        """Set CUfunction_attribute ``attr`` of a CUkernel on device ``dev``, as ``func_set_attribute``."""
        raise NotImplementedError

    def func_set_cache_config(self, handle: int, config: int) -> None:
        """A function's preferred CUfunc_cache split of L1 and shared memory (a hint)."""
        raise NotImplementedError

    def library_load(self, options: dict | None, image) -> int:
        """A CUlibrary loaded from ``image`` (context-independent, the runtime's path)."""
        raise NotImplementedError

    def library_kernels(self, lib: int) -> dict | None:
        """``{name: [kernel, param layout]}`` of every kernel of ``lib``, without loading any into a context;
        None where this driver cannot enumerate them (the client then asks kernel by kernel)."""
        return None

    def library_unload(self, lib: int) -> None:
        """Unload ``lib``; its kernels go with it."""
        raise NotImplementedError

    def library_get_module(self, lib: int) -> int:
        """``lib``'s module in the current context (loaded there on first use)."""
        raise NotImplementedError

    def library_get_kernel(self, lib: int, name: str) -> int:
        """The CUkernel ``name`` of ``lib`` (launched as a function in the current context)."""
        raise NotImplementedError

    def kernel_get_function(self, kernel: int) -> int:
        """The CUfunction of CUkernel ``kernel`` in the current context."""
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
        """End a link state (its inputs and options are released; a completed cubin is the caller's)."""
        raise NotImplementedError

    def launch(self, func: int, grid, block, shared: int, stream: int, attrs, args) -> None:
        """cuLaunchKernel (or cuLaunchKernelEx with ``attrs``, a list of 72-byte CUlaunchAttribute structs)
        of a function or kernel: ``grid``/``block`` (x, y, z), ``shared`` bytes, on ``stream``, ``args`` the
        packed parameter buffer laid out as ``param_layout`` says."""
        raise NotImplementedError

    def occupancy_max_active_blocks(self, func: int, block: int, shared: int, flags: int = 0) -> int:
        """Blocks of ``block`` threads and ``shared`` dynamic bytes that fit on one multiprocessor at once."""
        raise NotImplementedError

    def occupancy_max_potential_block_size(self, func: int, shared: int, limit: int, flags: int = 0) -> list:
        """``[min grid size, block size]``."""
        raise NotImplementedError


CODE_CALLS = tuple(n for n in vars(Code) if not n.startswith("_"))   # what a Driver hands to its Code


class Driver:
    """What the cuda route's executor calls (by name, ``executor.OPS``): ``real.RealDriver`` (ctypes on the
    host's ``libcuda.so.1``) and ``fake.FakeDriver`` (the reference semantics, no GPU) implement it.

    Every call runs in the calling worker's current context (``set_current``) and raises
    ``CudaDriverError(code, message)`` with the CUresult the real driver would give; the executor sends
    that code back as the call's result (never an ERROR frame). Handles are ints. ``stream`` 0 is the
    legacy default stream (``CU_STREAM_LEGACY`` and ``CU_STREAM_PER_THREAD`` are taken too); a copy's or a
    memset's ``stream=None`` is its synchronous form. Common to every call: CUDA_ERROR_INVALID_CONTEXT
    where a context is needed and none is current, CUDA_ERROR_INVALID_HANDLE (or _VALUE) for a handle the
    session does not hold, CUDA_ERROR_INVALID_DEVICE for a device past ``init``'s list.

    A driver owns its devices, contexts, memory and ordering (streams, events, capture, graphs); its
    ``code`` (a ``Code``) owns modules, functions, libraries, links and launches, and the ``CODE_CALLS``
    on a driver are that object's (one line each below, no attribute forwarding).

    Devices and contexts:
        ``init(nattr)`` -> ``{"driver", "version", "devices": [{"name", "total_mem", "uuid", "pci_bus_id",
        "attrs": the first nattr CUdevice_attribute values}]}``; ``primary_ctx_retain(dev)`` -> ctx;
        ``primary_ctx_release(dev)`` (INVALID_CONTEXT when not retained), ``primary_ctx_reset(dev)``,
        ``primary_ctx_get_state(dev)`` -> ``[flags, active]``, ``primary_ctx_set_flags(dev, flags)``;
        ``ctx_create(dev, flags)`` -> ctx, ``ctx_destroy(ctx)`` (a created one, not a primary),
        ``set_current(ctx)`` (0: none), ``ctx_synchronize()``, ``ctx_get_flags()`` -> flags,
        ``ctx_get_limit(limit)`` -> value, ``ctx_set_limit(limit, value)``,
        ``ctx_get_stream_priority_range()`` -> ``[least, greatest]``, ``ctx_set_cache_config(config)``.
    Memory:
        ``mem_alloc(size)`` -> address (OUT_OF_MEMORY), ``mem_free(ptr)``, ``mem_get_info()`` ->
        ``[free, total]``, ``mem_get_address_range(ptr)`` -> ``[base, size]``;
        ``memcpy_htod(dst, stream, data)`` (``data`` may be reused once it returns),
        ``memcpy_dtoh(src, nbytes, stream)`` -> the bytes (it synchronises: STREAM_CAPTURE_UNSUPPORTED on a
        capturing stream), ``memcpy_dtod(dst, src, nbytes, stream)``,
        ``memset(dst, value, elem, count, stream)`` (``elem`` 1, 2 or 4 bytes, else INVALID_VALUE);
        ``device_get_default_mem_pool(dev)`` -> pool, ``mem_alloc_async(size, stream, pool=None)`` ->
        address, ``mem_free_async(ptr, stream)``, ``mem_pool_set_attribute(pool, attr, value)``,
        ``mem_pool_get_attribute(pool, attr)`` -> value (INVALID_VALUE for an attribute it has not),
        ``mem_pool_trim_to(pool, keep)``.
    Order:
        ``stream_create(flags, priority)`` -> stream, ``stream_destroy(stream)``,
        ``stream_synchronize(stream)``, ``stream_query(stream)`` (NOT_READY while work is pending),
        ``stream_get_flags(stream)``, ``stream_get_priority(stream)``, ``stream_wait_event(stream, event,
        flags)``; ``event_create(flags)`` -> event, ``event_destroy(event)``, ``event_record(event, stream,
        flags=0)``, ``event_synchronize(event)``, ``event_query(event)`` (NOT_READY while pending),
        ``event_elapsed_time(start, end)`` -> milliseconds (NOT_READY before both are recorded);
        ``stream_begin_capture(stream, mode)`` (the legacy stream: STREAM_CAPTURE_UNSUPPORTED),
        ``stream_end_capture(stream)`` -> graph (STREAM_CAPTURE_INVALIDATED when it was not capturing),
        ``stream_is_capturing(stream)`` -> CUstreamCaptureStatus, ``stream_get_capture_info(stream)`` ->
        ``[status, capture id, graph, dependencies]``; ``graph_get_nodes(graph)`` -> nodes,
        ``graph_instantiate(graph, flags)`` -> exec, ``graph_launch(exec, stream)``,
        ``graph_upload(exec, stream)``, ``graph_exec_destroy(exec)``, ``graph_destroy(graph)``.
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

