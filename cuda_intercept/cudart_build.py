"""Builds rgpu's libcudart.so.13 (plain C) beside rgpu's libcuda.so.1, which it links against.

    python -m rgpu.cuda_intercept.cudart_build [FOLDER]

Compiled against the toolkit's own ``cuda_runtime_api.h``, ``driver_types.h``
and ``cuda.h``, so CUDA 13's struct layouts and signatures are the real ones;
SONAME ``libcudart.so.13``, every export under the version node
``libcudart.so.13`` (programs import ``cudaMalloc@libcudart.so.13``), and
``$ORIGIN`` as its rpath so it finds the libcuda.so.1 next to it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from rgpu import native

from . import cudart_gen, header

SONAME = "libcudart.so.13"


def build(folder: str | os.PathLike | None = None, *, cuda_home: str | None = None, force: bool = False) -> Path:
    """Build (or find built) libcudart.so.13 in ``folder`` (default: libcuda.so.1's folder) and return its path."""
    from . import build as driver_build

    include_dir = header.find_include_dir(cuda_home)
    libcuda = driver_build.build(cuda_home=cuda_home)
    out = Path(folder) if folder is not None else libcuda.parent
    if out.resolve() != libcuda.parent.resolve() and not (out / "libcuda.so.1").exists():
        (out / "libcuda.so.1").symlink_to(libcuda)       # $ORIGIN finds the driver beside us
    return native.build_library(
        "cudart", [cudart_gen.HERE / f for f in cudart_gen.SOURCES], out_dir=out, soname=SONAME,
        version_node=SONAME, include_dirs=[include_dir, cudart_gen.HERE], library_dirs=[libcuda.parent],
        libraries=[":libcuda.so.1", "pthread"], rpath=["$ORIGIN"],
        extra_cflags=["-std=gnu11", "-fvisibility=hidden", "-Wall", "-Wno-unused-function", "-Werror=implicit-function-declaration"],
        extra_ldflags=["-Wl,--no-undefined"],
        generated={"cudart_stubs.c": cudart_gen.source(include_dir)},
        key_extra=str(include_dir), force=force)


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else None, force=True))
