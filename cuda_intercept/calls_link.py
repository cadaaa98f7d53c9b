"""Driver calls for the library API (cuLibrary*, cuKernel*; cuda.core uses it) and links (cuLink*; numba-cuda's path).

A linked image comes back from the server whole and stays in this process
until cuLinkDestroy, since the program reads it (and usually hands it
straight to cuModuleLoadData).
"""
from __future__ import annotations

import itertools

from rgpu import config

from . import client
from .calls_code import (LAYOUTS, _read, forget_module, image_bytes, jit_options, layout, load_image, note_function,
                         write_logs)
from .calls_device import handle
from .registry import CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_FOUND, CUDA_SUCCESS, CudaCallError, implements

LINKS: dict[int, dict] = {}


# ---- libraries (the CUDA 12 loading API; cuda.core and the CUDA runtimes use it) ----------
# A library's load brings back every kernel's handle and parameter layout ("library_kernels"), so a
# kernel's look-up is answered here. With RGPU_CUDA_LAZY_LIBRARIES the load itself waits for the library's
# first use: a static CUDA runtime loads every image of the program when it starts, and most programs use
# a few; the program then holds a handle minted here until then.
LIBRARIES: dict[int, dict] = {}     # the program's handle -> {"server", "kernels" (None: ask), "image" (lazy)}
_MINTED = itertools.count(0x5247_5055_0000_0001)      # far from any pointer or fake handle


def _library(scalar: dict, data: bytes) -> int:
    if config.settings().cuda_lazy_libraries:
        h = next(_MINTED)
        LIBRARIES[h] = {"server": None, "kernels": None, "image": (scalar, data)}
        return h
    h, kernels = load_image("library_kernels", scalar, data)
    LIBRARIES[h] = {"server": h, "kernels": kernels, "image": None}
    return h


def _server(h: int) -> int:
    """The server's handle of library ``h``, loading it there now if its load was put off."""
    lib = LIBRARIES.get(h)
    if lib is None:
        return h                         # not loaded through here: the server says what is wrong with it
    if lib["server"] is None:
        scalar, data = lib["image"]
        lib["server"], lib["kernels"] = load_image("library_kernels", scalar, data)
        lib["image"] = None
    return lib["server"]


@implements("cuLibraryLoadData")
def cu_library_load_data(plib, code, jit_opts, jit_vals, njit, lib_opts, lib_vals, nlib):
    c = client.get()
    scalar, _ = jit_options(njit, jit_opts, jit_vals)
    plib[0] = c.ffi.cast("CUlibrary", _library(scalar, image_bytes(code)))
    return CUDA_SUCCESS


@implements("cuLibraryLoadFromFile")
def cu_library_load_from_file(plib, path, jit_opts, jit_vals, njit, lib_opts, lib_vals, nlib):
    c = client.get()
    scalar, _ = jit_options(njit, jit_opts, jit_vals)
    plib[0] = c.ffi.cast("CUlibrary", _library(scalar, _read(path)))
    return CUDA_SUCCESS


@implements("cuLibraryUnload")
def cu_library_unload(lib):
    h = handle(client.get().ffi, lib)
    forget_module(h)
    known = LIBRARIES.pop(h, None)
    if known is not None and known["server"] is None:
        return CUDA_SUCCESS              # never used, never loaded
    client.get().post("library_unload", known["server"] if known else h)
    return CUDA_SUCCESS


@implements("cuLibraryGetModule")
def cu_library_get_module(pmod, lib):
    c = client.get()
    mod, _ = c.call("library_get_module", _server(handle(c.ffi, lib)))
    pmod[0] = c.ffi.cast("CUmodule", mod)
    return CUDA_SUCCESS


@implements("cuLibraryGetKernel")
def cu_library_get_kernel(pkernel, lib, name):
    c = client.get()
    text, h = c.ffi.string(name).decode(), handle(c.ffi, lib)
    server = _server(h)
    kernels = LIBRARIES.get(h, {}).get("kernels")
    if kernels is None:                  # a driver that cannot list them (before CUDA 12.4), or too many
        (k, lay), _ = c.call("library_get_kernel_layout", server, text)
    elif text in kernels:
        k, lay = kernels[text]
    else:
        raise CudaCallError(CUDA_ERROR_NOT_FOUND, f"cuLibraryGetKernel: no kernel named {text!r} in library {h:#x}")
    note_function(k, text, h, lay)
    pkernel[0] = c.ffi.cast("CUkernel", k)
    return CUDA_SUCCESS


@implements("cuKernelGetFunction")
def cu_kernel_get_function(pf, kernel):
    c = client.get()
    k = handle(c.ffi, kernel)
    f, _ = c.call("kernel_get_function", k)
    lay = layout(k)
    if f not in LAYOUTS:
        note_function(f, lay["name"], lay["module"], lay["params"])
    pf[0] = c.ffi.cast("CUfunction", f)
    return CUDA_SUCCESS


@implements("cuLibraryGetGlobal")
def cu_library_get_global(pdptr, psize, lib, name):
    c = client.get()
    (ptr, size), _ = c.call("library_get_global", _server(handle(c.ffi, lib)), c.ffi.string(name).decode())
    if pdptr != c.ffi.NULL:
        pdptr[0] = ptr
    if psize != c.ffi.NULL:
        psize[0] = size
    return CUDA_SUCCESS


# ---- links ---------------------------------------------------------------------------
@implements("cuLinkCreate_v2")
def cu_link_create(n, options, values, pstate):
    c = client.get()
    scalar, logs = jit_options(n, options, values)
    state, _ = c.call("link_create", scalar)
    LINKS[state] = {"logs": logs, "values": values, "image": None}
    pstate[0] = c.ffi.cast("CUlinkState", state)
    return CUDA_SUCCESS


def _add(state, kind, data: bytes, name) -> int:
    c = client.get()
    text = c.ffi.string(name).decode() if name != c.ffi.NULL else ""
    c.call("link_add_data", handle(c.ffi, state), int(kind), text, {}, buffers=[data])
    return CUDA_SUCCESS


@implements("cuLinkAddData_v2")
def cu_link_add_data(state, kind, data, size, name, n, options, values):
    c = client.get()
    return _add(state, kind, bytes(c.ffi.buffer(c.ffi.cast("char *", data), size)), name)


@implements("cuLinkAddFile_v2")
def cu_link_add_file(state, kind, path, n, options, values):
    return _add(state, kind, _read(path), path)


@implements("cuLinkComplete")
def cu_link_complete(state, pcubin, psize):
    c = client.get()
    h = handle(c.ffi, state)
    link = LINKS.get(h)
    if link is None:
        return CUDA_ERROR_INVALID_VALUE
    logs, got = c.call("link_complete", h)
    bufs, reply = got
    data = bytes(bufs[0])
    image = c.ffi.new("char[]", data)       # the program reads it until cuLinkDestroy
    reply.release()
    link["image"] = image
    if link["logs"]:
        write_logs(link["logs"], logs[0], logs[1], link["values"])
    pcubin[0] = image
    psize[0] = len(data)
    return CUDA_SUCCESS


@implements("cuLinkDestroy")
def cu_link_destroy(state):
    h = handle(client.get().ffi, state)
    LINKS.pop(h, None)
    client.get().call("link_destroy", h)
    return CUDA_SUCCESS
