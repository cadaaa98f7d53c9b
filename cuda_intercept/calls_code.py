"""Driver calls for code: modules, libraries, links (numba-cuda's path), functions, kernels and their layouts.

Module images are sized here (PTX up to its NUL, ELF cubins from their
headers, fatbins from theirs), fatbins trimmed to the server's GPU
(fatbin.py), and loaded by content: the sha256 goes first and the bytes only
when the server's store lacks them (``IMAGES`` counts what crossed).  Looking
a function up also reads its parameter layout on the server, once; C uses it
to pack launches.  JIT log buffers stay on this side: the server's logs are
copied into them.
"""
from __future__ import annotations

import hashlib
import logging
import struct

from . import client, fatbin
from .calls_device import handle
from .registry import CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED, CUDA_SUCCESS, CudaCallError, implements

JIT_INFO_LOG, JIT_INFO_SIZE, JIT_ERROR_LOG, JIT_ERROR_SIZE, JIT_WALL_TIME = 3, 4, 5, 6, 2
JIT_SCALAR = {0, 1, 7, 8, 9, 10, 11, 12, 13, 14, 16, 20, 21, 22, 23, 24, 29, 30, 31, 32, 33, 34}
FATBIN_MAGIC, FATBIN_WRAPPER_MAGIC = 0xBA55ED50, 0x466243B1

log = logging.getLogger("rgpu.cuda")
LAYOUTS: dict[int, dict] = {}      # function or kernel handle -> {"params": [(off, size)], "bytes", "name", "module"}
MODULE_OF_LIBRARY: dict[int, int] = {}
# images loaded; of them sent as bytes (the server's store lacked them); bytes sent; bytes before trimming
IMAGES = {"loads": 0, "uploads": 0, "bytes_uploaded": 0, "bytes_before_trim": 0, "bytes_after_trim": 0}


def image_bytes(image) -> bytes:
    """The whole module image at ``image``: PTX, cubin (ELF), fatbin or a fatbin wrapper."""
    ffi = client.get().ffi
    p = ffi.cast("unsigned char *", image)
    head = bytes(ffi.buffer(p, 16))
    magic = struct.unpack_from("<I", head)[0]
    if magic == FATBIN_WRAPPER_MAGIC:             # __fatBinC_Wrapper_t {int magic, version; const void *data; ...}
        return image_bytes(ffi.cast("void **", p + 8)[0])
    if magic == FATBIN_MAGIC:                     # {u32 magic; u16 version, header_size; u64 fat_size}
        _, _, header_size, fat_size = struct.unpack_from("<IHHQ", head)
        return bytes(ffi.buffer(p, header_size + fat_size))
    if head[:4] == b"\x7fELF":
        ehdr = bytes(ffi.buffer(p, 64))
        phoff, shoff = struct.unpack_from("<QQ", ehdr, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", ehdr, 0x36)
        return bytes(ffi.buffer(p, max(64, phoff + phentsize * phnum, shoff + shentsize * shnum)))
    return ffi.string(ffi.cast("char *", p)) + b"\0"     # PTX text, NUL included as the driver reads it


def jit_options(n, options, values) -> tuple[dict, dict]:
    """(scalar options for the server, {which log: (buffer, size slot index)}) from cuJIT option arrays."""
    ffi = client.get().ffi
    scalar, logs = {}, {}
    for i in range(n or 0):
        opt = int(options[i])
        raw = int(ffi.cast("uintptr_t", values[i])) if values != ffi.NULL else 0
        if opt in JIT_SCALAR:
            scalar[opt] = raw
        elif opt in (JIT_INFO_LOG, JIT_ERROR_LOG):
            logs.setdefault(opt, [raw, 0, None])[0] = raw
        elif opt in (JIT_INFO_SIZE, JIT_ERROR_SIZE):
            logs.setdefault(opt - 1, [0, 0, None])[1:] = [raw, i]
    return scalar, logs


def write_logs(logs: dict, info: str, error: str, values) -> None:
    ffi = client.get().ffi
    for opt, text in ((JIT_INFO_LOG, info), (JIT_ERROR_LOG, error)):
        buf, size, slot = logs.get(opt, (0, 0, None))
        if buf and size:
            data = text.encode()[:size - 1] + b"\0"
            ffi.memmove(ffi.cast("char *", buf), data, len(data))
            if slot is not None:
                values[slot] = ffi.cast("void *", len(data) - 1)


def _capabilities() -> list[tuple[int, int]]:
    """The compute capability of each of the server's devices, as it reported them (empty: unknown).

    All of them: a library loads into every device, whichever context is current."""
    c = client.get()
    at = int(c.lib.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR), int(c.lib.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
    out = []
    for d in (c.init_info or {}).get("devices") or []:
        got = [d["attrs"][a] if a < len(d["attrs"]) else None for a in at]
        if not (all(isinstance(v, int) and v >= 0 for v in got) and got[0] > 0):
            return []                    # one device we cannot place: send images whole
        out.append((got[0], got[1]))
    return out


def load_image(what: str, scalar: dict, data: bytes):
    """Load ``data`` as a module or library on the server by its sha256; the bytes cross only if it lacks them.

    ``library_kernels`` with no current context loads the library alone (``[library, None]``): a kernel's
    parameter layout is read in a context, the one its launches run in (a static CUDA runtime loads its
    fatbins before it makes one; the driver picks a kernel's image by the context's device), so each kernel's
    layout then comes with its cuLibraryGetKernel."""
    c = client.get()
    if what == "library_kernels" and not c.ctx():
        return [load_image("library", scalar, data), None]
    trimmed = fatbin.trim(data, _capabilities())
    digest = hashlib.sha256(trimmed).hexdigest()
    IMAGES["loads"] += 1
    IMAGES["bytes_before_trim"] += len(data)
    IMAGES["bytes_after_trim"] += len(trimmed)
    value, _ = c.call("image_load", what, scalar, digest, len(trimmed))
    if isinstance(value, dict) and value.get("send"):
        if len(trimmed) > 1 << 20:           # the uploads a slow first step is made of
            log.info("rgpu: uploading a %.1f MB module image (%.1f MB before trimming to the server's GPU)",
                     len(trimmed) / 1e6, len(data) / 1e6)
        IMAGES["uploads"] += 1
        IMAGES["bytes_uploaded"] += len(trimmed)
        value, _ = c.call("image_load", what, scalar, digest, len(trimmed), buffers=[trimmed])
    return value


def _load(pmod, data: bytes, n=0, options=None, values=None) -> int:
    c = client.get()
    scalar, logs = jit_options(n, options, values)
    mod, info, error = load_image("module", scalar, data)
    if logs:
        write_logs(logs, info, error, values)
    pmod[0] = c.ffi.cast("CUmodule", mod)
    return CUDA_SUCCESS


@implements("cuModuleLoadData")
def cu_module_load_data(pmod, image):
    return _load(pmod, image_bytes(image))


@implements("cuModuleLoadDataEx")
def cu_module_load_data_ex(pmod, image, n, options, values):
    return _load(pmod, image_bytes(image), n, options, values)


@implements("cuModuleLoadFatBinary")
def cu_module_load_fat_binary(pmod, fatbin):
    return _load(pmod, image_bytes(fatbin))


def _read(path) -> bytes:
    name = client.get().ffi.string(path).decode()
    try:
        with open(name, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CudaCallError(301, f"cannot read {name}: {exc}") from None   # CUDA_ERROR_FILE_NOT_FOUND
    return data if not data.lstrip().startswith((b"//", b".version")) or data.endswith(b"\0") else data + b"\0"


@implements("cuModuleLoad")
def cu_module_load(pmod, path):
    return _load(pmod, _read(path))


def forget_module(h: int) -> None:
    """Drop what is known of a module's or library's functions (the driver may reuse their handles)."""
    gone = {f for f, lay in LAYOUTS.items() if lay["module"] == h}
    for f in gone:
        del LAYOUTS[f]
    for key in [k for k in ATTRS if k[0] in gone]:
        del ATTRS[key]
    FETCHED.difference_update({k for k in FETCHED if k[0] in gone})
    SET.clear()        # kernels of a library are not in LAYOUTS until launched: forget every set value


@implements("cuModuleUnload")
def cu_module_unload(mod):
    h = handle(client.get().ffi, mod)
    forget_module(h)
    client.get().post("module_unload", h)
    return CUDA_SUCCESS


def note_function(h: int, name: str, module: int, layout=None) -> None:
    """Fetch (unless given) and remember a function's parameter layout, here and in C."""
    c = client.get()
    if layout is None:
        layout, _ = c.call("param_layout", h)
    params = [(int(o), int(s)) for o, s in layout]
    nbytes = max((o + s for o, s in params), default=0)
    LAYOUTS[h] = {"params": params, "bytes": nbytes, "name": name, "module": module,
                  "cname": c.ffi.new("char[]", name.encode())}
    offs = c.ffi.new("uint32_t[]", [o for o, _ in params] or [0])
    sizes = c.ffi.new("uint32_t[]", [s for _, s in params] or [0])
    c.lib.rgpu_func_note(h, len(params), offs, sizes, nbytes)


def layout(f) -> dict:
    h = handle(client.get().ffi, f)
    found = LAYOUTS.get(h)
    if found is None:
        raise CudaCallError(400, f"function {h:#x} was not obtained through this libcuda.so.1")
    return found


@implements("cuModuleGetFunction")
def cu_module_get_function(pf, mod, name):
    c = client.get()
    text, m = c.ffi.string(name).decode(), handle(c.ffi, mod)
    (f, lay), _ = c.call("module_get_function_layout", m, text)
    note_function(f, text, m, lay)
    pf[0] = c.ffi.cast("CUfunction", f)
    return CUDA_SUCCESS


@implements("cuModuleGetGlobal_v2")
def cu_module_get_global(pdptr, psize, mod, name):
    c = client.get()
    (ptr, size), _ = c.call("module_get_global", handle(c.ffi, mod), c.ffi.string(name).decode())
    if pdptr != c.ffi.NULL:
        pdptr[0] = ptr
    if psize != c.ffi.NULL:
        psize[0] = size
    return CUDA_SUCCESS


@implements("cuFuncGetParamInfo", "cuKernelGetParamInfo")
def cu_func_get_param_info(f, index, poffset, psize):
    params = layout(f)["params"]
    if not 0 <= index < len(params):
        return CUDA_ERROR_INVALID_VALUE
    c = client.get()
    if poffset != c.ffi.NULL:
        poffset[0] = params[index][0]
    if psize != c.ffi.NULL:
        psize[0] = params[index][1]
    return CUDA_SUCCESS


@implements("cuFuncGetName", "cuKernelGetName")
def cu_func_get_name(pname, f):
    pname[0] = layout(f)["cname"]
    return CUDA_SUCCESS


@implements("cuFuncGetModule")
def cu_func_get_module(pmod, f):
    pmod[0] = client.get().ffi.cast("CUmodule", layout(f)["module"])
    return CUDA_SUCCESS


# Attribute reads are cached: a function's attributes change only through a set that passes here
# (runtimes ask before launches: cuBLASLt ~100 cuKernelGetAttribute per training step); a function's first
# read fetches all of them at once.
ATTRS: dict[tuple[int, int, int], int] = {}       # (handle, attribute, device or -1) -> value
FETCHED: set[tuple[int, int]] = set()             # (handle, device or -1) whose attributes came in one reply


@implements("cuFuncGetAttribute")
def cu_func_get_attribute(pi, attr, f):
    key = (handle(client.get().ffi, f), int(attr), -1)
    if key not in ATTRS:
        _all_attributes(key, "func_get_attributes", key[0])
    if key not in ATTRS:                 # one the driver refused among the rest: its own call says why
        ATTRS[key], _ = client.get().call("func_get_attribute", int(attr), key[0])
    pi[0] = ATTRS[key]
    return CUDA_SUCCESS


@implements("cuKernelGetAttribute")
def cu_kernel_get_attribute(pi, attr, kernel, dev):
    key = (handle(client.get().ffi, kernel), int(attr), int(dev))
    if key not in ATTRS:
        _all_attributes(key, "kernel_get_attributes", key[0], key[2])
    if key not in ATTRS:
        ATTRS[key], _ = client.get().call("kernel_get_attribute", int(attr), key[0], int(dev))
    pi[0] = ATTRS[key]
    return CUDA_SUCCESS


def _all_attributes(key: tuple, op: str, *args) -> None:
    """Cache every attribute of the function (or kernel on a device) of ``key`` from one reply: a first
    cudaFuncGetAttributes reads ten, each would be a round trip. Not one asked after a set: a set forgets only
    the attribute it changed, and the others stay cached."""
    if (key[0], key[2]) in FETCHED:
        return
    FETCHED.add((key[0], key[2]))
    got, _ = client.get().call(op, *args)
    for a, v in enumerate(got):
        if v is not None:
            ATTRS.setdefault((key[0], a, key[2]), v)


def _forget_attrs(h: int, attr: int) -> None:
    for key in [k for k in ATTRS if k[0] == h and k[1] == attr]:
        del ATTRS[key]


# What the program last set, by (function or kernel, attribute, device): setting it again to the same value
# is a no-op in the driver, and kernels with large shared memory set it before every launch (torch's
# memory-efficient attention does, twice a layer per step): each would be a round trip.
SET: dict[tuple[int, int, int], int] = {}


@implements("cuFuncSetAttribute")
def cu_func_set_attribute(f, attr, value):
    h = handle(client.get().ffi, f)
    if SET.get((h, int(attr), -1)) == int(value):
        return CUDA_SUCCESS
    client.get().call("func_set_attribute", h, int(attr), int(value))
    _forget_attrs(h, int(attr))
    SET[(h, int(attr), -1)] = int(value)
    return CUDA_SUCCESS


@implements("cuKernelSetAttribute")
def cu_kernel_set_attribute(attr, value, kernel, dev):
    h = handle(client.get().ffi, kernel)
    if SET.get((h, int(attr), int(dev))) == int(value):
        return CUDA_SUCCESS
    client.get().call("kernel_set_attribute", int(attr), int(value), h, int(dev))
    _forget_attrs(h, int(attr))
    SET[(h, int(attr), int(dev))] = int(value)
    return CUDA_SUCCESS


@implements("cuFuncSetCacheConfig")
def cu_func_set_cache_config(f, config):
    client.get().post("func_set_cache_config", handle(client.get().ffi, f), int(config))
    return CUDA_SUCCESS


@implements("cuKernelSetCacheConfig")
def cu_kernel_set_cache_config(kernel, config, dev):
    return cu_func_set_cache_config(kernel, config)


@implements("cuOccupancyMaxActiveBlocksPerMultiprocessor")
def cu_occupancy(pn, f, block, shared):
    return cu_occupancy_flags(pn, f, block, shared, 0)


@implements("cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags")
def cu_occupancy_flags(pn, f, block, shared, flags):
    pn[0], _ = client.get().call("occupancy_max_active_blocks", handle(client.get().ffi, f), int(block),
                                 int(shared), int(flags))
    return CUDA_SUCCESS


@implements("cuOccupancyMaxPotentialBlockSize")
def cu_occupancy_potential(pgrid, pblock, f, callback, shared, limit):
    return cu_occupancy_potential_flags(pgrid, pblock, f, callback, shared, limit, 0)


@implements("cuOccupancyMaxPotentialBlockSizeWithFlags")
def cu_occupancy_potential_flags(pgrid, pblock, f, callback, shared, limit, flags):
    c = client.get()
    if callback != c.ffi.NULL:
        raise CudaCallError(CUDA_ERROR_NOT_SUPPORTED, "a shared-memory-size callback would have to run on the server")
    (grid, block), _ = c.call("occupancy_max_potential_block_size", handle(c.ffi, f), int(shared), int(limit),
                              int(flags))
    pgrid[0], pblock[0] = grid, block
    return CUDA_SUCCESS


@implements("cuFuncIsLoaded")
def cu_func_is_loaded(pstate, f):
    layout(f)
    pstate[0] = 1                        # CU_FUNCTION_LOADING_STATE_LOADED: modules load eagerly
    return CUDA_SUCCESS


@implements("cuFuncLoad")
def cu_func_load(f):
    layout(f)
    return CUDA_SUCCESS


@implements("cuKernelGetLibrary")
def cu_kernel_get_library(plib, kernel):
    plib[0] = client.get().ffi.cast("CUlibrary", layout(kernel)["module"])
    return CUDA_SUCCESS
