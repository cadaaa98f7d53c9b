"""Driver calls for memory: device allocations, copies, memsets, page-locked host memory, pointer queries.

The process's table of its device allocations lives in C (shim_ptr.c), so pointer
queries and the direction of a unified ``cuMemcpy`` are answered without the
server, and a free queued in C (shim_queue.c) forgets its pointer there too.
Host memory the GPU would map (DEVICEMAP, managed memory) is refused: it
cannot cross a network.  Page-locked host memory is plain host memory here.
"""
from __future__ import annotations

from . import client
from .annotations import CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTREGISTER_DEVICEMAP
from .calls_device import handle
from .registry import (CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS,
                       CudaCallError, implements)

CU_MEMORYTYPE_HOST, CU_MEMORYTYPE_DEVICE = 1, 2


class Allocations:
    """Python's face on the process's device allocations, which C keeps (shim_ptr.c): base -> size, context,
    device, buffer id.  One table, because a free queued in C (shim_queue.c) forgets its pointer there."""

    def __init__(self):
        self.next_id = 1

    def add(self, base: int, size: int, ctx: int, dev: int) -> None:
        if not client.get().lib.rgpu_alloc_note(base, size, ctx, dev, self.next_id):
            raise CudaCallError(CUDA_ERROR_OUT_OF_MEMORY, "the client's allocation table could not grow")
        self.next_id += 1

    def remove(self, base: int) -> bool:
        return bool(client.get().lib.rgpu_alloc_forget(base))

    def find(self, ptr: int):
        c = client.get()
        out = c.ffi.new("uint64_t[5]")
        if not c.lib.rgpu_alloc_find(ptr, out):
            return None
        return int(out[0]), int(out[1]), int(out[2]), int(out[3]), int(out[4])


ALLOCS = Allocations()
HOST: dict[int, tuple[object, int, int]] = {}      # host address -> (cffi owner or None, size, flags)


def _dev_of_current() -> int:
    c = client.get()
    return max(0, c.lib.rgpu_ctx_device(c.ctx()))


@implements("cuMemAlloc_v2")
def cu_mem_alloc(dptr, size):
    c = client.get()
    if not c.ctx():
        return 201
    if size == 0:
        return CUDA_ERROR_INVALID_VALUE
    ptr, _ = c.call("mem_alloc", int(size))
    ALLOCS.add(ptr, int(size), c.ctx(), _dev_of_current())
    dptr[0] = ptr
    return CUDA_SUCCESS


def _alloc_async(dptr, size, stream, pool=None) -> int:
    """Stream-ordered: the server's driver allocates from its pool in stream order (a graph captures it)."""
    c = client.get()
    if not c.ctx():
        return 201
    if size == 0:
        return CUDA_ERROR_INVALID_VALUE
    ptr, _ = c.call("mem_alloc_async", int(size), s_(stream), pool)
    ALLOCS.add(ptr, int(size), c.ctx(), _dev_of_current())
    dptr[0] = ptr
    return CUDA_SUCCESS


@implements("cuMemAllocAsync", "cuMemAllocAsync_ptsz", stream=2)
def cu_mem_alloc_async(dptr, size, stream):
    return _alloc_async(dptr, size, stream)


# cuMemFree_v2, cuMemFreeAsync, the memsets, cuMemcpyHtoDAsync_v2 up to QUEUED_COPY_BYTES: queued in C
# (shim_queue.c) once there is a context; these are the reference (RGPU_NATIVE=off) and the fallback.
@implements("cuMemFree_v2")
def cu_mem_free(dptr):
    if not ALLOCS.remove(int(dptr)):
        return CUDA_ERROR_INVALID_VALUE if dptr else CUDA_SUCCESS
    client.get().post("mem_free", int(dptr))
    return CUDA_SUCCESS


@implements("cuMemFreeAsync", "cuMemFreeAsync_ptsz", stream=1)
def cu_mem_free_async(dptr, stream):
    if not ALLOCS.remove(int(dptr)):
        return CUDA_ERROR_INVALID_VALUE if dptr else CUDA_SUCCESS
    client.get().post("mem_free_async", int(dptr), s_(stream))
    return CUDA_SUCCESS


@implements("cuMemGetInfo_v2")
def cu_mem_get_info(free, total):
    (f, t), _ = client.get().call("mem_get_info")
    free[0], total[0] = f, t
    return CUDA_SUCCESS


@implements("cuMemGetAddressRange_v2")
def cu_mem_get_address_range(pbase, psize, dptr):
    ffi = client.get().ffi
    found = ALLOCS.find(int(dptr))
    if found is None:
        return CUDA_ERROR_INVALID_VALUE
    if pbase != ffi.NULL:
        pbase[0] = found[0]
    if psize != ffi.NULL:
        psize[0] = found[1]
    return CUDA_SUCCESS



# ---- copies and memsets ------------------------------------------------------------------
CHUNK = 256 << 20       # copies travel in pieces of this size: frames stay far below the transport's limit
HTOD_PIECE = 8 << 20    # uploads go in pieces of this size: the server copies one to the GPU while the next travels


def htod(dst: int, src, n: int, stream: int | None, wait: bool) -> int:
    c = client.get()
    base = c.ffi.cast("char *", src)
    for off in range(0, n, HTOD_PIECE):
        data = c.ffi.buffer(base + off, min(HTOD_PIECE, n - off))
        if wait and off + HTOD_PIECE >= n:
            c.call("memcpy_htod", int(dst) + off, stream, buffers=[data], sync=True)
        else:
            c.post("memcpy_htod", int(dst) + off, stream, buffers=[data])   # copied or written before post() returns
    return CUDA_SUCCESS


def dtoh(dst, src: int, n: int, stream: int | None) -> int:
    c = client.get()
    base = c.ffi.cast("char *", dst)
    for off in range(0, n, CHUNK):
        size = min(CHUNK, n - off)
        into = memoryview(c.ffi.buffer(base + off, size))
        _, got = c.call("memcpy_dtoh", int(src) + off, size, stream, into=[into], sync=True)
        if got:
            bufs, reply = got
            if bufs[0] is not into:           # landed in a pool buffer: copy it over
                into[:] = bufs[0]
            reply.release()
    if stream is not None and n:
        c.idle(stream)                        # the server synchronised the stream before it replied
    return CUDA_SUCCESS


def dtod(dst: int, src: int, n: int, stream: int | None) -> int:
    if n:
        client.get().post("memcpy_dtod", int(dst), int(src), int(n), stream)
    return CUDA_SUCCESS


def s_(stream) -> int:
    return handle(client.get().ffi, stream)


@implements("cuMemcpyHtoD_v2", "cuMemcpyHtoD_v2_ptds")
def cu_memcpy_htod(dst, src, n):
    return htod(dst, src, n, None, True)


@implements("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync_v2_ptsz", stream=3)
def cu_memcpy_htod_async(dst, src, n, stream):
    return htod(dst, src, n, s_(stream), False)


@implements("cuMemcpyDtoH_v2", "cuMemcpyDtoH_v2_ptds")
def cu_memcpy_dtoh(dst, src, n):
    return dtoh(dst, src, n, None)


@implements("cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync_v2_ptsz", stream=3)
def cu_memcpy_dtoh_async(dst, src, n, stream):
    return dtoh(dst, src, n, s_(stream))   # the host bytes must be here when the stream syncs: done now


@implements("cuMemcpyDtoD_v2", "cuMemcpyDtoD_v2_ptds")
def cu_memcpy_dtod(dst, src, n):
    return dtod(dst, src, n, None)


@implements("cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync_v2_ptsz", stream=3)
def cu_memcpy_dtod_async(dst, src, n, stream):
    return dtod(dst, src, n, s_(stream))


def _unified(dst, src, n, stream):
    ffi = client.get().ffi
    d, s = int(ffi.cast("uintptr_t", dst)), int(ffi.cast("uintptr_t", src))
    on_dev = ALLOCS.find(d) is not None, ALLOCS.find(s) is not None
    if on_dev == (True, True):
        return dtod(d, s, n, stream)
    if on_dev == (True, False):
        return htod(d, s, n, stream, stream is None)
    if on_dev == (False, True):
        return dtoh(d, s, n, stream)
    ffi.memmove(ffi.cast("char *", d), ffi.cast("char *", s), n)   # host to host
    return CUDA_SUCCESS


@implements("cuMemcpy", "cuMemcpy_ptds")
def cu_memcpy(dst, src, n):
    return _unified(dst, src, n, None)


@implements("cuMemcpyAsync", "cuMemcpyAsync_ptsz", stream=3)
def cu_memcpy_async(dst, src, n, stream):
    return _unified(dst, src, n, s_(stream))


def memset(dst, value, elem, count, stream):
    if count:
        client.get().post("memset", int(dst), int(value), elem, int(count), stream)
    return CUDA_SUCCESS


for _elem, _bits in ((1, 8), (2, 16), (4, 32)):
    implements(f"cuMemsetD{_bits}_v2", f"cuMemsetD{_bits}_v2_ptds")(
        lambda dst, value, n, _e=_elem: memset(dst, value, _e, n, None))
    implements(f"cuMemsetD{_bits}Async", f"cuMemsetD{_bits}Async_ptsz", stream=3)(
        lambda dst, value, n, stream, _e=_elem: memset(dst, value, _e, n, s_(stream)))


# ---- host memory -------------------------------------------------------------------------
def _host_alloc(pp, size, flags) -> int:
    c = client.get()
    if flags & CU_MEMHOSTALLOC_DEVICEMAP:
        raise CudaCallError(CUDA_ERROR_NOT_SUPPORTED, "refused: mapped host memory (CU_MEMHOSTALLOC_DEVICEMAP) "
                                                      "cannot be reached by a GPU across a network")
    owner = c.ffi.new_allocator(should_clear_after_alloc=False)("char[]", int(size) + 4096)
    addr = (int(c.ffi.cast("uintptr_t", owner)) + 4095) & ~4095   # page-aligned, as the driver's is
    HOST[addr] = (owner, int(size), int(flags))
    pp[0] = c.ffi.cast("void *", addr)
    return CUDA_SUCCESS


@implements("cuMemAllocHost_v2")
def cu_mem_alloc_host(pp, size):
    return _host_alloc(pp, size, 0)


@implements("cuMemHostAlloc")
def cu_mem_host_alloc(pp, size, flags):
    return _host_alloc(pp, size, flags)


@implements("cuMemFreeHost")
def cu_mem_free_host(p):
    """Python's own table of page-locked host memory (it owns the buffer): no server call, and not queued in C."""
    addr = int(client.get().ffi.cast("uintptr_t", p))
    return CUDA_SUCCESS if HOST.pop(addr, None) is not None else CUDA_ERROR_INVALID_VALUE


@implements("cuMemHostRegister_v2")
def cu_mem_host_register(p, size, flags):
    if flags & CU_MEMHOSTREGISTER_DEVICEMAP:
        raise CudaCallError(CUDA_ERROR_NOT_SUPPORTED, "refused: mapping registered host memory into the GPU "
                                                      "(CU_MEMHOSTREGISTER_DEVICEMAP) cannot cross a network")
    HOST[int(client.get().ffi.cast("uintptr_t", p))] = (None, int(size), int(flags))
    return CUDA_SUCCESS


@implements("cuMemHostUnregister")
def cu_mem_host_unregister(p):
    HOST.pop(int(client.get().ffi.cast("uintptr_t", p)), None)
    return CUDA_SUCCESS


@implements("cuMemHostGetFlags")
def cu_mem_host_get_flags(pflags, p):
    found = HOST.get(int(client.get().ffi.cast("uintptr_t", p)))
    if found is None:
        return CUDA_ERROR_INVALID_VALUE
    pflags[0] = found[2]
    return CUDA_SUCCESS


# ---- stream-ordered pools: the server's driver's own, the default pool's handle asked once per device ----
POOL_INT_ATTRS = {1, 2, 3}          # CU_MEMPOOL_ATTR_REUSE_*: int; the rest are cuuint64_t
POOLS: dict[int, int] = {}          # device -> its default pool on the server


@implements("cuDeviceGetDefaultMemPool", "cuDeviceGetMemPool")
def cu_device_get_mem_pool(ppool, dev):
    c = client.get()
    if int(dev) not in POOLS:
        POOLS[int(dev)], _ = c.call("device_get_default_mem_pool", int(dev))
    ppool[0] = c.ffi.cast("CUmemoryPool", POOLS[int(dev)])
    return CUDA_SUCCESS


@implements("cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz", stream=3)
def cu_mem_alloc_from_pool_async(dptr, size, pool, stream):
    return _alloc_async(dptr, size, stream, handle(client.get().ffi, pool))


def _pool_value(attr, value):
    return client.get().ffi.cast("int *" if int(attr) in POOL_INT_ATTRS else "cuuint64_t *", value)


@implements("cuMemPoolSetAttribute")
def cu_mem_pool_set_attribute(pool, attr, value):
    c = client.get()
    if value == c.ffi.NULL:
        return CUDA_ERROR_INVALID_VALUE
    c.call("mem_pool_set_attribute", handle(c.ffi, pool), int(attr), int(_pool_value(attr, value)[0]))
    return CUDA_SUCCESS


@implements("cuMemPoolGetAttribute")
def cu_mem_pool_get_attribute(pool, attr, value):
    c = client.get()
    if value == c.ffi.NULL:
        return CUDA_ERROR_INVALID_VALUE
    _pool_value(attr, value)[0], _ = c.call("mem_pool_get_attribute", handle(c.ffi, pool), int(attr))
    return CUDA_SUCCESS


@implements("cuMemPoolTrimTo")
def cu_mem_pool_trim_to(pool, keep):
    client.get().post("mem_pool_trim_to", handle(client.get().ffi, pool), int(keep))
    return CUDA_SUCCESS


# ---- access to a pool: answered here, since a pool is only ever its own device's over rgpu ----
CU_MEM_LOCATION_TYPE_DEVICE, CU_MEM_ACCESS_FLAGS_PROT_NONE, CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 1, 0, 3


def _pool_device(pool) -> int:
    p = handle(client.get().ffi, pool)
    for dev, h in POOLS.items():
        if h == p:
            return dev
    raise CudaCallError(CUDA_ERROR_INVALID_VALUE, f"memory pool {p:#x} is not one this process was given")


@implements("cuMemPoolGetAccess")
def cu_mem_pool_get_access(pflags, pool, location):
    """The owning device reads and writes; another device never can (no peer access across rgpu's server)."""
    if pflags == client.get().ffi.NULL or location == client.get().ffi.NULL:
        return CUDA_ERROR_INVALID_VALUE
    own = location.type == CU_MEM_LOCATION_TYPE_DEVICE and location.id == _pool_device(pool)
    pflags[0] = CU_MEM_ACCESS_FLAGS_PROT_READWRITE if own else CU_MEM_ACCESS_FLAGS_PROT_NONE
    return CUDA_SUCCESS


@implements("cuMemPoolSetAccess")
def cu_mem_pool_set_access(pool, descs, count):
    """What is already so succeeds (the owner read-write, no access elsewhere); granting a peer is refused."""
    dev = _pool_device(pool)
    for i in range(int(count)):
        d = descs[i]
        own = d.location.type == CU_MEM_LOCATION_TYPE_DEVICE and d.location.id == dev
        if own and d.flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE:
            return CUDA_ERROR_INVALID_VALUE            # the owner's access cannot be taken away, as on a GPU
        if not own and d.flags != CU_MEM_ACCESS_FLAGS_PROT_NONE:
            raise CudaCallError(CUDA_ERROR_NOT_SUPPORTED, "refused: access to a pool from another device needs "
                                                          "peer access, which rgpu's server does not run")
    return CUDA_SUCCESS
