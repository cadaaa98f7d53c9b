"""Driver calls for initialisation, devices and contexts (the hot ones are answered in shim*.c).

cuInit connects and fetches every device's description once: names, memory,
UUIDs and all attributes, which C then answers from.  Attributes that promise
what cannot cross a network (mapping host memory, managed memory) read 0.
"""
from __future__ import annotations

from . import client
from .registry import (CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_INITIALIZED,
                       CUDA_ERROR_NOT_SUPPORTED, CUDA_SUCCESS, CudaCallError, implements)

INT32_MIN = -(1 << 31)
CUDA_ERROR_INVALID_DEVICE = 101
# Attributes this route cannot honour, whatever the GPU does: host memory the GPU maps or shares.
NO_SUCH_THING = ("CAN_MAP_HOST_MEMORY", "MANAGED_MEMORY", "CONCURRENT_MANAGED_ACCESS", "PAGEABLE_MEMORY_ACCESS",
                 "PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES", "DIRECT_MANAGED_MEM_ACCESS_FROM_HOST",
                 "CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM", "HOST_NATIVE_ATOMIC_SUPPORTED", "INTEGRATED",
                 "HOST_REGISTER_SUPPORTED", "READ_ONLY_HOST_REGISTER_SUPPORTED", "HOST_NUMA_ID")


def handle(ffi, h) -> int:
    """A driver handle (cffi pointer, or int) as the int the server knows it by."""
    return h if isinstance(h, int) else int(ffi.cast("uintptr_t", h))


def ensure_init() -> dict:
    c = client.get()
    if c.init_info is None:
        with c.lock:
            if c.init_info is None:
                lib, ffi = c.lib, c.ffi
                nattr = int(lib.CU_DEVICE_ATTRIBUTE_MAX)
                info, _ = c.call("init", nattr)
                devices = info["devices"]
                if not devices:
                    raise CudaCallError(100, "the server has no CUDA device")
                for name in NO_SUCH_THING:
                    a = getattr(lib, "CU_DEVICE_ATTRIBUTE_" + name, None)
                    for d in devices:
                        if a is not None and a < nattr:
                            d["attrs"][a] = 0
                flat = [INT32_MIN if v is None else int(v) for d in devices for v in d["attrs"]]
                c.server_version = int(info.get("version") or client.API_VERSION)
                c.init_info = info
                lib.rgpu_set_devices(len(devices), nattr, ffi.new("int[]", flat))
    return c.init_info


def device(dev: int) -> dict:
    c = client.get()
    if c.init_info is None:
        raise CudaCallError(CUDA_ERROR_NOT_INITIALIZED)
    devices = c.init_info["devices"]
    if not 0 <= dev < len(devices):
        raise CudaCallError(CUDA_ERROR_INVALID_DEVICE)
    return devices[dev]


@implements("cuInit")
def cu_init(flags):
    if flags != 0:
        return CUDA_ERROR_INVALID_VALUE
    ensure_init()
    return CUDA_SUCCESS


@implements("cuDriverGetVersion")
def cu_driver_get_version(version):
    if version == client.get().ffi.NULL:
        return CUDA_ERROR_INVALID_VALUE
    c = client.get()
    if c.init_info is None:
        ensure_init()
    version[0] = min(c.server_version, client.API_VERSION)
    return CUDA_SUCCESS


@implements("cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetAttribute")
def cu_before_init(*args):
    return CUDA_ERROR_NOT_INITIALIZED    # C answers these after cuInit


@implements("cuDeviceGetName")
def cu_device_get_name(name, length, dev):
    text = device(dev)["name"].encode()[:max(0, length - 1)] + b"\0"
    client.get().ffi.memmove(name, text, len(text))
    return CUDA_SUCCESS


@implements("cuDeviceGetPCIBusId")
def cu_device_get_pci_bus_id(bus, length, dev):
    text = device(dev)["pci_bus_id"].encode()[:max(0, length - 1)] + b"\0"
    client.get().ffi.memmove(bus, text, len(text))
    return CUDA_SUCCESS


@implements("cuDeviceGetByPCIBusId")
def cu_device_get_by_pci_bus_id(dev, bus):
    want = client.get().ffi.string(bus).decode().lower()
    for i, d in enumerate(ensure_init()["devices"]):
        if d["pci_bus_id"].lower() == want:
            dev[0] = i
            return CUDA_SUCCESS
    return CUDA_ERROR_INVALID_DEVICE


@implements("cuDeviceGetUuid", "cuDeviceGetUuid_v2")
def cu_device_get_uuid(uuid, dev):
    client.get().ffi.memmove(uuid, bytes(device(dev)["uuid"])[:16].ljust(16, b"\0"), 16)
    return CUDA_SUCCESS


@implements("cuDeviceTotalMem_v2")
def cu_device_total_mem(nbytes, dev):
    nbytes[0] = device(dev)["total_mem"]
    return CUDA_SUCCESS


@implements("cuDeviceComputeCapability")
def cu_device_compute_capability(major, minor, dev):
    attrs, lib = device(dev)["attrs"], client.get().lib
    major[0] = attrs[lib.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR]
    minor[0] = attrs[lib.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR]
    return CUDA_SUCCESS


@implements("cuDeviceCanAccessPeer")
def cu_device_can_access_peer(can, dev, peer):
    device(dev), device(peer)
    can[0] = 0                           # peer access between remote GPUs is not offered yet
    return CUDA_SUCCESS


# ---- primary and created contexts -------------------------------------------------------
def _note(ctx: int, dev: int) -> None:
    client.get().lib.rgpu_ctx_note(ctx, dev)


# This process's retains and flags of each primary context, noted in C, which answers
# cuDevicePrimaryCtxGetState (torch asks it ~1,000 times a step) without the server.
PRIMARY: dict[int, list[int]] = {}       # device -> [outstanding retains, flags]


def _primary(dev: int, retains: int | None = None, flags: int | None = None) -> None:
    state = PRIMARY.setdefault(dev, [0, 0])
    if retains is not None:
        state[0] = max(0, retains)
    if flags is not None:
        state[1] = flags
    client.get().lib.rgpu_primary_note(dev, state[0], state[1])


@implements("cuDevicePrimaryCtxRetain")
def cu_primary_retain(pctx, dev):
    device(dev)
    ctx, _ = client.get().call("primary_ctx_retain", dev)
    _note(ctx, dev)
    _primary(dev, PRIMARY.get(dev, [0, 0])[0] + 1)
    pctx[0] = client.get().ffi.cast("CUcontext", ctx)
    return CUDA_SUCCESS


@implements("cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2")
def cu_primary_release(dev):
    client.get().call("primary_ctx_release", dev)
    _primary(dev, PRIMARY.get(dev, [0, 0])[0] - 1)
    return CUDA_SUCCESS


@implements("cuDevicePrimaryCtxReset", "cuDevicePrimaryCtxReset_v2")
def cu_primary_reset(dev):
    client.get().call("primary_ctx_reset", dev)
    _primary(dev, 0)
    return CUDA_SUCCESS


@implements("cuDevicePrimaryCtxGetState")
def cu_primary_get_state(dev, flags, active):
    """Only before cuInit (C answers after it)."""
    return CUDA_ERROR_NOT_INITIALIZED


@implements("cuDevicePrimaryCtxSetFlags", "cuDevicePrimaryCtxSetFlags_v2")
def cu_primary_set_flags(dev, flags):
    client.get().call("primary_ctx_set_flags", dev, flags)
    _primary(dev, flags=int(flags))
    return CUDA_SUCCESS


def _create(pctx, flags, dev) -> int:
    c = client.get()
    device(dev)
    ctx, _ = c.call("ctx_create", dev, flags)
    _note(ctx, dev)
    c.lib.rgpu_ctx_push(ctx)             # a new context is current to the thread that made it
    pctx[0] = c.ffi.cast("CUcontext", ctx)
    return CUDA_SUCCESS


@implements("cuCtxCreate_v2")
def cu_ctx_create_v2(pctx, flags, dev):
    return _create(pctx, flags, dev)


@implements("cuCtxCreate_v3")
def cu_ctx_create_v3(pctx, params, nparams, flags, dev):
    if nparams:
        raise CudaCallError(CUDA_ERROR_NOT_SUPPORTED, "cuCtxCreate_v3: execution affinity is not supported")
    return _create(pctx, flags, dev)


@implements("cuCtxCreate_v4")
def cu_ctx_create_v4(pctx, params, flags, dev):
    ffi = client.get().ffi
    if params != ffi.NULL and (params.execAffinityParams != ffi.NULL or params.cigParams != ffi.NULL):
        raise CudaCallError(CUDA_ERROR_NOT_SUPPORTED, "cuCtxCreate_v4: affinity and CIG parameters are not supported")
    return _create(pctx, flags, dev)


@implements("cuCtxDestroy", "cuCtxDestroy_v2")
def cu_ctx_destroy(ctx):
    c = client.get()
    h = handle(c.ffi, ctx)
    c.call("ctx_destroy", h)
    c.lib.rgpu_ctx_forget(h)
    return CUDA_SUCCESS


@implements("cuCtxSynchronize")
def cu_ctx_synchronize():
    c = client.get()
    if not c.ctx():
        return CUDA_ERROR_INVALID_CONTEXT
    c.call("ctx_synchronize", sync=True)
    c.idle(None)
    return CUDA_SUCCESS


@implements("cuCtxGetApiVersion")
def cu_ctx_get_api_version(ctx, version):
    version[0] = client.API_VERSION
    return CUDA_SUCCESS


@implements("cuCtxGetFlags")
def cu_ctx_get_flags(flags):
    flags[0], _ = client.get().call("ctx_get_flags")
    return CUDA_SUCCESS


@implements("cuCtxGetLimit")
def cu_ctx_get_limit(value, limit):
    value[0], _ = client.get().call("ctx_get_limit", int(limit))
    return CUDA_SUCCESS


@implements("cuCtxSetLimit")
def cu_ctx_set_limit(limit, value):
    client.get().call("ctx_set_limit", int(limit), int(value))
    return CUDA_SUCCESS


@implements("cuCtxGetCacheConfig")
def cu_ctx_get_cache_config(config):
    config[0] = 0                        # CU_FUNC_CACHE_PREFER_NONE: what the driver reports until set
    return CUDA_SUCCESS


@implements("cuCtxSetCacheConfig")
def cu_ctx_set_cache_config(config):
    client.get().post("ctx_set_cache_config", int(config))
    return CUDA_SUCCESS


@implements("cuCtxGetStreamPriorityRange")
def cu_ctx_get_stream_priority_range(least, greatest):
    c = client.get()
    (lo, hi), _ = c.call("ctx_get_stream_priority_range")
    if least != c.ffi.NULL:
        least[0] = lo
    if greatest != c.ffi.NULL:
        greatest[0] = hi
    return CUDA_SUCCESS


# ---- small queries answered here ------------------------------------------------------------
_CTX_IDS: dict[int, int] = {}


@implements("cuCtxGetDevice_v2")
def cu_ctx_get_device_v2(pdev, ctx):
    c = client.get()
    h = handle(c.ffi, ctx) or c.ctx()
    dev = c.lib.rgpu_ctx_device(h) if h else -1
    if dev < 0:
        return CUDA_ERROR_INVALID_CONTEXT
    pdev[0] = dev
    return CUDA_SUCCESS


@implements("cuCtxSynchronize_v2")
def cu_ctx_synchronize_v2(ctx):
    c = client.get()
    h = handle(c.ffi, ctx) or c.ctx()
    if not h:
        return CUDA_ERROR_INVALID_CONTEXT
    c.call("ctx_synchronize", sync=True, ctx=h)
    c.idle(None, ctx=h)
    return CUDA_SUCCESS


@implements("cuCtxGetId")
def cu_ctx_get_id(ctx, pid):
    c = client.get()
    h = handle(c.ffi, ctx) or c.ctx()
    if not h:
        return CUDA_ERROR_INVALID_CONTEXT
    pid[0] = _CTX_IDS.setdefault(h, len(_CTX_IDS) + 1)
    return CUDA_SUCCESS


@implements("cuModuleGetLoadingMode")
def cu_module_get_loading_mode(mode):
    mode[0] = 1                          # CU_MODULE_EAGER_LOADING: the server loads a module whole
    return CUDA_SUCCESS
