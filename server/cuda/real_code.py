"""The real driver's code: modules, libraries, links and launches (``base.Code``; its ``RealDriver`` hands them here).

Launches pass the client's packed argument buffer through ``extra``
(CU_LAUNCH_PARAM_BUFFER_POINTER/SIZE): it is laid out by the same
cuFuncGetParamInfo offsets, so no per-argument pointer array is built here.
"""
from __future__ import annotations

import ctypes
from ctypes import byref, c_int, c_size_t, c_uint, c_ulonglong, c_void_p

from .base import CUDA_ERROR_INVALID_IMAGE, CUDA_ERROR_INVALID_VALUE, Code, CudaDriverError
from .images import image_problem
from .real_api import JitOptions, address

MAX_ENUMERATED = 4096      # kernels of one library sent with its load; more: the client asks one by one
CU_LAUNCH_PARAM_END, CU_LAUNCH_PARAM_BUFFER_POINTER, CU_LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2


def _check_image(image) -> None:
    problem = image_problem(image)
    if problem:
        raise CudaDriverError(CUDA_ERROR_INVALID_IMAGE, problem)


def _typed(lib, name: str, argtypes: list) -> None:
    """Argument types for a call real_api.SIGNATURES does not list (64-bit handles would be truncated)."""
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, c_int


class LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", c_uint), ("gridDimY", c_uint), ("gridDimZ", c_uint), ("blockDimX", c_uint),
                ("blockDimY", c_uint), ("blockDimZ", c_uint), ("sharedMemBytes", c_uint), ("hStream", c_void_p),
                ("attrs", c_void_p), ("numAttrs", c_uint)]


class RealCode(Code):
    """The real driver's ``Code``: modules, functions, libraries, links and launches, on ``api``."""

    def __init__(self, api):
        self.api = api
        self.kernels: set[int] = set()             # CUkernel handles (library API), told apart from CUfunctions
        self.links: dict[int, list] = {}            # link state -> what must outlive it (options, inputs)
        self._size = c_size_t()
        self._extra = (c_void_p * 5)(CU_LAUNCH_PARAM_BUFFER_POINTER, None, CU_LAUNCH_PARAM_BUFFER_SIZE,
                                     ctypes.addressof(self._size), CU_LAUNCH_PARAM_END)
        self._launch = self.api.lib.cuLaunchKernel
        self.layouts: dict[int, list] = {}          # function -> [[offset, size], ...] as the client was told
        from .real_batch import driver_ops, library
        self._batch = library()                     # None without a C compiler: the executor walks records itself
        self._walk = self._batch.rgpu_walk_all if self._batch else None
        # the walk's entry points, by reference once (the reference keeps the structure alive)
        self._ops = byref(driver_ops(self.api.lib)) if self._batch else None
        self.by_params: set[int] = set()            # functions whose launches need kernelParams, not extra

    def _function(self, handle: int) -> int:
        """A CUfunction for a CUfunction or CUkernel handle (in the current context)."""
        return self.api.out("cuKernelGetFunction", c_void_p, handle) if handle in self.kernels else handle

    # ---- modules and libraries -------------------------------------------------------
    def module_load(self, options: dict | None, image) -> list:
        _check_image(image)
        jit = JitOptions(options)
        mod = c_void_p()
        rc = self.api.lib.cuModuleLoadDataEx(byref(mod), address(image), jit.n, jit.keys, jit.values)
        info, error = jit.logs()
        if rc:
            raise CudaDriverError(rc, f"cuModuleLoadDataEx: {self.api.error_name(rc)}: {error.strip()}")
        return [mod.value, info, error]

    def module_unload(self, mod: int) -> None:
        self.api("cuModuleUnload", mod)

    def module_get_function(self, mod: int, name: str) -> int:
        return self.api.out("cuModuleGetFunction", c_void_p, mod, name.encode(), )

    def module_get_global(self, mod: int, name: str) -> list:
        ptr, size = c_ulonglong(), c_size_t()
        self.api("cuModuleGetGlobal_v2", byref(ptr), byref(size), mod, name.encode(), detail=name)
        return [ptr.value, size.value]

    def param_layout(self, handle: int) -> list:
        fn = "cuKernelGetParamInfo" if handle in self.kernels else "cuFuncGetParamInfo"
        if not self.api.has(fn):
            raise CudaDriverError(801, f"{fn} needs a CUDA 12.4 or newer driver on the server")
        out, off, size, i = [], c_size_t(), c_size_t(), 0
        while (rc := getattr(self.api.lib, fn)(handle, i, byref(off), byref(size))) == 0:
            out.append([off.value, size.value])
            i += 1
        if rc != CUDA_ERROR_INVALID_VALUE:      # INVALID_VALUE: past the last parameter; anything else is a failure
            raise CudaDriverError(rc, f"{fn} of {handle:#x}, parameter {i}: {self.api.error_name(rc)}")
        self.layouts[handle] = out
        return out

    def func_name(self, handle: int) -> str:
        p = ctypes.c_char_p()
        self.api("cuFuncGetName", byref(p), self._function(handle))
        return p.value.decode()

    def func_get_attribute(self, attr: int, handle: int) -> int:
        return self.api.out("cuFuncGetAttribute", c_int, attr, self._function(handle))

    def func_set_attribute(self, handle: int, attr: int, value: int) -> None:
        self.api("cuFuncSetAttribute", self._function(handle), attr, value)

    def kernel_get_attribute(self, attr: int, handle: int, dev: int) -> int:
        if handle not in self.kernels:
            return self.func_get_attribute(attr, handle)
        return self.api.out("cuKernelGetAttribute", c_int, attr, handle, dev)

    def kernel_set_attribute(self, attr: int, value: int, handle: int, dev: int) -> None:
        if handle not in self.kernels:
            return self.func_set_attribute(handle, attr, value)
        self.api("cuKernelSetAttribute", attr, value, handle, dev)

    def func_set_cache_config(self, handle: int, config: int) -> None:
        self.api("cuFuncSetCacheConfig", self._function(handle), config)

    def library_load(self, options: dict | None, image) -> int:
        _check_image(image)
        lib = c_void_p()
        self.api("cuLibraryLoadData", byref(lib), address(image), None, None, 0, None, None, 0)
        return lib.value

    def library_kernels(self, lib: int) -> dict | None:
        # CUDA 12.4+: the kernels' handles, names and parameter layouts come from the library's metadata;
        # none is loaded into a context (lazy loading stays lazy until a kernel's first launch).
        fns = ("cuLibraryGetKernelCount", "cuLibraryEnumerateKernels", "cuKernelGetName", "cuKernelGetParamInfo")
        if not all(self.api.has(f) for f in fns) or not self.api.out("cuCtxGetCurrent", c_void_p):
            return None                  # a kernel's layout is read in a context: the client asks per kernel
        _typed(self.api.lib, "cuLibraryGetKernelCount", [c_void_p, c_void_p])
        _typed(self.api.lib, "cuLibraryEnumerateKernels", [c_void_p, c_uint, c_void_p])
        _typed(self.api.lib, "cuKernelGetName", [c_void_p, c_void_p])
        n = self.api.out("cuLibraryGetKernelCount", c_uint, lib)
        if n > MAX_ENUMERATED:
            return None                  # a reply that big costs more than asking for the few kernels used
        handles = (c_void_p * max(n, 1))()
        self.api("cuLibraryEnumerateKernels", handles, n, lib)
        out = {}
        for k in handles[:n]:
            name = ctypes.c_char_p()
            self.api("cuKernelGetName", byref(name), k)
            self.kernels.add(k)
            out[name.value.decode()] = [k, self.param_layout(k)]
        return out

    def library_unload(self, lib: int) -> None:
        self.api("cuLibraryUnload", lib)

    def library_get_module(self, lib: int) -> int:
        return self.api.out("cuLibraryGetModule", c_void_p, lib)

    def library_get_kernel(self, lib: int, name: str) -> int:
        k = self.api.out("cuLibraryGetKernel", c_void_p, lib, name.encode())
        self.kernels.add(k)
        return k

    def kernel_get_function(self, kernel: int) -> int:
        return self.api.out("cuKernelGetFunction", c_void_p, kernel)

    def library_get_global(self, lib: int, name: str) -> list:
        ptr, size = c_ulonglong(), c_size_t()
        self.api("cuLibraryGetGlobal", byref(ptr), byref(size), lib, name.encode(), detail=name)
        return [ptr.value, size.value]

    # ---- links (numba-cuda's path) ---------------------------------------------------
    def link_create(self, options: dict | None = None) -> int:
        jit = JitOptions(options)
        state = c_void_p()
        self.api("cuLinkCreate_v2", jit.n, jit.keys, jit.values, byref(state))
        self.links[state.value] = [jit]
        return state.value

    def link_add_data(self, link: int, kind: int, name: str, options: dict | None, data) -> None:
        keep = bytes(data)                          # the driver may read it until cuLinkComplete
        self.links.setdefault(link, []).append(keep)
        self.api("cuLinkAddData_v2", link, kind, address(keep), len(keep), name.encode(), 0, None, None,
                 detail=self.links[link][0].logs()[1].strip())

    def link_complete(self, link: int) -> list:
        cubin, size = c_void_p(), c_size_t()
        jit = self.links[link][0]
        self.api("cuLinkComplete", link, byref(cubin), byref(size), detail=jit.logs()[1].strip())
        return [ctypes.string_at(cubin.value, size.value), *jit.logs()]

    def link_destroy(self, link: int) -> None:
        self.api("cuLinkDestroy", link)
        self.links.pop(link, None)

    # ---- launches ----------------------------------------------------------------------
    def launch_at(self, func, gx, gy, gz, bx, by, bz, shared, stream, args_addr: int, nargs: int) -> None:
        """cuLaunchKernel with the packed arguments at ``args_addr`` (the hot path: no copies)."""
        if func in self.by_params:
            return self._launch_params(func, gx, gy, gz, bx, by, bz, shared, stream, args_addr)
        self._extra[1] = args_addr
        self._size.value = nargs
        rc = self._launch(func, gx, gy, gz, bx, by, bz, shared, stream, None, self._extra if nargs else None)
        if rc == CUDA_ERROR_INVALID_VALUE and nargs and func in self.layouts:
            # a driver that will not take this buffer through extra: point kernelParams into it instead
            self.by_params.add(func)
            return self._launch_params(func, gx, gy, gz, bx, by, bz, shared, stream, args_addr)
        if rc:
            raise self._launch_failed(rc, func, nargs)

    def _launch_failed(self, rc: int, func: int, nargs: int) -> CudaDriverError:
        return CudaDriverError(rc, f"cuLaunchKernel: {self.api.error_name(rc)} (function {func:#x}, {nargs} bytes of "
                                   f"arguments, layout {self.layouts.get(func, 'not read here')})")

    def launch_records(self, base: int, length: int, pos: int, ctx: int | None, cublas: int | None = None):
        """Run the records at address ``base`` (``length`` bytes) from ``pos`` in C (launches, event records,
        stream waits, graph launches, host-to-device copies of up to QUEUED_COPY_BYTES, device-to-device copies)
        until the end, the first record C leaves or the first
        failure: (pos, current ctx, CUresult). ``cublas``: the session's cuBLAS table
        (``libs/cublas_records.c``), whose math-library records run there too."""
        if self._batch is None:
            return None
        p, c = c_size_t(pos), c_ulonglong((1 << 64) - 1 if ctx is None else ctx)
        rc = self._walk(self._ops, base, length, byref(p), byref(c), cublas)
        return p.value, c.value, rc

    def _launch_params(self, func, gx, gy, gz, bx, by, bz, shared, stream, args_addr: int) -> None:
        offsets = [off for off, _ in self.layouts[func]]
        params = (c_void_p * max(1, len(offsets)))(*[args_addr + off for off in offsets])
        rc = self._launch(func, gx, gy, gz, bx, by, bz, shared, stream, params, None)
        if rc:
            raise self._launch_failed(rc, func, sum(size for _, size in self.layouts[func]))

    def launch(self, func: int, grid, block, shared: int, stream: int, attrs, args) -> None:
        keep = bytes(args)
        if not attrs:
            return self.launch_at(func, *grid, *block, shared, stream, address(keep) if keep else 0, len(keep))
        raw = b"".join(bytes(a) for a in attrs)     # CUlaunchAttribute structs, 72 bytes each, as the client sent
        if len(raw) != 72 * len(attrs):
            raise CudaDriverError(CUDA_ERROR_INVALID_VALUE, "launch attributes must be 72-byte CUlaunchAttribute")
        attr_buf = ctypes.create_string_buffer(raw, len(raw))
        cfg = LaunchConfig(*grid, *block, shared, stream, ctypes.addressof(attr_buf), len(attrs))
        self._size.value = len(keep)
        self._extra[1] = address(keep) if keep else None
        self.api("cuLaunchKernelEx", byref(cfg), func, None, self._extra if keep else None)

    def occupancy_max_active_blocks(self, func: int, block: int, shared: int, flags: int = 0) -> int:
        return self.api.out("cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags", c_int, self._function(func),
                           block, shared, flags)

    def occupancy_max_potential_block_size(self, func: int, shared: int, limit: int, flags: int = 0) -> list:
        grid, block = c_int(), c_int()
        self.api("cuOccupancyMaxPotentialBlockSizeWithFlags", byref(grid), byref(block), self._function(func),
                 None, shared, limit, flags)
        return [grid.value, block.value]
