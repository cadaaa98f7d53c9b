"""The fake driver's device memory: allocations in host memory at device-like addresses.

Addresses start high and never repeat within a session, so a stale pointer
fails like an illegal address instead of landing in someone else's buffer.
"""
from __future__ import annotations

import bisect

import numpy as np

from .base import CUDA_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, CudaDriverError

BASE = 0x7F0000000000
ALIGN = 512          # cudaMalloc's alignment guarantee is 256; more does no harm


class FakeMemory:
    def __init__(self, total: int):
        self.total = total
        self.used = 0
        self._next = BASE
        self._starts: list[int] = []         # sorted allocation bases
        self._blocks: dict[int, bytearray] = {}

    def alloc(self, size: int) -> int:
        if size <= 0:
            raise CudaDriverError(CUDA_ERROR_INVALID_VALUE, "allocation size must be positive")
        if self.used + size > self.total:
            raise CudaDriverError(CUDA_ERROR_OUT_OF_MEMORY, f"fake device memory: {size} bytes asked, "
                                                            f"{self.total - self.used} free")
        ptr = self._next
        self._next += (size + ALIGN - 1) // ALIGN * ALIGN + ALIGN   # a gap: overruns do not reach a neighbour
        self._blocks[ptr] = bytearray(size)
        bisect.insort(self._starts, ptr)
        self.used += size
        return ptr

    def free(self, ptr: int) -> None:
        block = self._blocks.pop(ptr, None)
        if block is None:
            raise CudaDriverError(CUDA_ERROR_INVALID_VALUE, f"cuMemFree: {ptr:#x} is not an allocation")
        self._starts.remove(ptr)
        self.used -= len(block)

    def find(self, ptr: int) -> tuple[int, bytearray] | None:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return None
        base = self._starts[i]
        block = self._blocks[base]
        return (base, block) if ptr < base + len(block) else None

    def view(self, ptr: int, nbytes: int) -> memoryview:
        """Writable bytes [ptr, ptr + nbytes) of one allocation."""
        found = self.find(ptr)
        if found is None or ptr + nbytes > found[0] + len(found[1]):
            raise CudaDriverError(CUDA_ERROR_ILLEGAL_ADDRESS if found is None else CUDA_ERROR_INVALID_VALUE,
                                  f"{nbytes} bytes at {ptr:#x} are not inside one allocation")
        off = ptr - found[0]
        return memoryview(found[1])[off:off + nbytes]

    def array(self, ptr: int, count: int, dtype) -> np.ndarray:
        return np.frombuffer(self.view(ptr, count * np.dtype(dtype).itemsize), dtype=dtype)

    def range_of(self, ptr: int) -> tuple[int, int]:
        found = self.find(ptr)
        if found is None:
            raise CudaDriverError(CUDA_ERROR_INVALID_VALUE, f"{ptr:#x} is not device memory")
        return found[0], len(found[1])
