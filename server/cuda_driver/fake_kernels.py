"""The fake driver's kernels: a registry of CPU implementations, keyed by kernel name.

A PTX module loaded on the fake driver runs only the entries named here (a C++
mangled name matches by its identifier: ``_Z6vecAddPKfS0_Pfi`` is ``vecAdd``).
Each kernel gets the fake memory, the launch's thread count and its arguments
decoded by the PTX parameter types, and works on numpy views of device memory.
"""
from __future__ import annotations

import re
from typing import Callable

import numpy as np

KERNELS: dict[str, Callable] = {}


def kernel(name: str):
    def register(fn):
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
