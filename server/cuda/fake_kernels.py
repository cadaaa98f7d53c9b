"""The fake driver's kernels: a registry of CPU implementations, keyed by kernel name.

A PTX module loaded on the fake driver runs only the entries named here (a C++
mangled name matches by its identifier: ``_Z6vecAddPKfS0_Pfi`` is ``vecAdd``).
Each kernel gets the fake memory, the launch's thread count and its arguments
decoded by the PTX parameter types, and works on numpy views of device memory.
A kernel registered with ``launch=True`` gets the whole ``Launch`` instead of
the thread count: grid, block, dynamic shared bytes and its module's globals
(``__constant__`` and ``__device__`` variables by name), for kernels whose
result depends on the launch's shape (a per-block reduction).
"""
from __future__ import annotations

import re
from typing import Callable, NamedTuple

import numpy as np

from .base import CUDA_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_LAUNCH_FAILED, CudaDriverError

KERNELS: dict[str, Callable] = {}


class Launch(NamedTuple):
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    globals: dict[str, int]       # the module's variables: name -> fake device address

    @property
    def threads(self) -> int:
        return int(np.prod(self.grid) * np.prod(self.block))


def kernel(name: str, launch: bool = False):
    def register(fn):
        fn.wants_launch = launch
        KERNELS[name] = fn
        return fn
    return register


def lookup(entry: str) -> Callable | None:
    """The CPU kernel for a PTX entry name, or None."""
    if entry in KERNELS:
        return KERNELS[entry]
    m = re.match(r"_Z(\d+)", entry)          # Itanium mangling: _Z<len><identifier>...
    if m:
        n = int(m.group(1))
        ident = entry[m.end():m.end() + n]
        return KERNELS.get(ident)
    return None


def _n(n: int, threads: int) -> int:
    return max(0, min(int(n), threads))


@kernel("noop")
def noop(mem, threads):
    pass


@kernel("vecAdd")
def vec_add(mem, threads, a, b, c, n):
    n = _n(n, threads)
    mem.array(c, n, np.float32)[:] = mem.array(a, n, np.float32) + mem.array(b, n, np.float32)


@kernel("saxpy")
def saxpy(mem, threads, alpha, x, y, n):
    n = _n(n, threads)
    out = mem.array(y, n, np.float32)
    out[:] = np.float32(alpha) * mem.array(x, n, np.float32) + out


@kernel("scale_f32")
def scale(mem, threads, p, s, n):
    n = _n(n, threads)
    arr = mem.array(p, n, np.float32)
    arr *= np.float32(s)


@kernel("add_one_f32")
def add_one(mem, threads, p, n):
    n = _n(n, threads)
    mem.array(p, n, np.float32)[:] += np.float32(1)


@kernel("fill_u32")
def fill(mem, threads, p, value, n):
    n = _n(n, threads)
    mem.array(p, n, np.uint32)[:] = np.uint32(value)


@kernel("iota_u32")
def iota(mem, threads, p, n):
    n = _n(n, threads)
    mem.array(p, n, np.uint32)[:] = np.arange(n, dtype=np.uint32)


# ---- the runtime test programs' kernels (tests/cuda_programs/*.cu) --------------------------------
@kernel("scale_shift")
def scale_shift(mem, threads, x, a, b, n):
    n = _n(n, threads)
    arr = mem.array(x, n, np.float32)
    arr[:] = np.float32(a) * arr + np.float32(b)


@kernel("block_sum", launch=True)
def block_sum(mem, launch, src, out, n):
    """out[b] = the sum of block b's blockDim.x elements (zero past n); the tree needs blockDim.x floats of shared."""
    per = launch.block[0]
    blocks = launch.grid[0]
    if launch.shared < per * 4:
        raise CudaDriverError(CUDA_ERROR_ILLEGAL_ADDRESS, f"block_sum: {per} threads need {per * 4} bytes of "
                                                          f"shared memory, the launch gave {launch.shared}")
    n = max(0, min(int(n), per * blocks))
    vals = np.zeros(per * blocks, dtype=np.float32)
    vals[:n] = mem.array(src, n, np.float32)
    mem.array(out, blocks, np.float32)[:] = vals.reshape(blocks, per).sum(axis=1, dtype=np.float32)


@kernel("poly3", launch=True)
def poly3(mem, launch, x, y, n):
    """y = c0 + c1 x + c2 x^2 + c3 x^3 (Horner) with c the module's ``__constant__ float coeffs[4]``."""
    n = _n(n, launch.threads)
    if "coeffs" not in launch.globals:
        raise CudaDriverError(CUDA_ERROR_LAUNCH_FAILED, "poly3: its module has no __constant__ coeffs")
    c = mem.array(launch.globals["coeffs"], 4, np.float32)
    v = mem.array(x, n, np.float32)
    mem.array(y, n, np.float32)[:] = ((c[3] * v + c[2]) * v + c[1]) * v + c[0]
