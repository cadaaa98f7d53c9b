"""The C and C++ parts compiled with warnings as errors (-Wall -Werror, syntax only: no object is kept).

Each unit is compiled as its real build sees it: every .c of the package that no other .c
includes on its own (with its folder, rgpu/protocol's generated header, CUDA's and Python's headers,
and the defines EXTRA names), the CUDA route's libcuda.so.1 as cffi emits it (the generated
declarations, shim*.c and the wrappers in one file), the torch C++ parts against the installed torch
(one precompiled <torch/extension.h> shared by them). A header or C++ file that no unit compiles
fails the check: add its unit here.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

WARN = ["-Wall", "-Werror"]
CXX_FLAGS = ["-std=c++17", "-fvisibility=hidden", "-DTORCH_EXTENSION_NAME=rgpu_check"]  # as torch's extension builder
TORCH_PARTS = ("device_backend", "server/ops")   # every .cpp there is one unit, against the installed torch
_STUB = ['-DRGPU_LIB="libcheck.so"', "-DRGPU_NOT_SUPPORTED=15", "-DRGPU_VERSION_MAJOR=13", "-DRGPU_VERSION_MINOR=0",
         "-DRGPU_VERSION_PATCH=0", "-DRGPU_CUDART_VERSION=13000", "-std=gnu11", "-fvisibility=hidden"]
# Every other .c of the package that no .c includes is a unit of its own, with these flags besides the
# include folders (its own, rgpu/protocol's generated header, CUDA's and Python's headers):
EXTRA = {  # path -> flags its build passes (cuda_intercept/stubs.py's defines, placeholder values)
    "cuda_intercept/stub.c": _STUB, "cuda_intercept/stub_cublas.c": _STUB,
    "cuda_intercept/stub_cublaslt.c": _STUB, "cuda_intercept/stub_cudnn.c": _STUB,
    "cuda_intercept/lib_door.c": _STUB, "cuda_intercept/lib_cublas.c": _STUB,
    "cuda_intercept/lib_cublaslt.c": _STUB, "cuda_intercept/lib_cudnn.c": _STUB, "cuda_intercept/lib_cudnn_bn.c": _STUB,
}


def _includes(path: Path) -> list[Path]:
    return [path.parent / m for m in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.M)]


def _covered(units: list[Path], folders: list[Path]) -> set[Path]:
    """Every file the units include, found beside the includer or in one of the include folders."""
    seen, todo = set(), [u.resolve() for u in units]
    while todo:
        p = todo.pop()
        if p in seen or not p.exists():
            continue
        seen.add(p)
        for inc in _includes(p):
            todo += [(d / inc.name).resolve() for d in (inc.parent, *folders) if (d / inc.name).exists()][:1]
    return seen


def _shim_sources() -> set[str]:
    """libcuda.so.1's C sources (cuda_intercept/build.py's C_SOURCES): one cffi module, compiled as cffi emits it."""
    try:
        from rgpu.cuda_intercept import build
    except ImportError:
        return set()
    return {f"cuda_intercept/{name}" for name in build.C_SOURCES}


def _folders(root: Path) -> list[Path]:
    out = [root / "rgpu" / "protocol", Path(sysconfig.get_paths()["include"])]
    try:
        from rgpu.cuda_intercept import header
        out.append(Path(header.find_include_dir()))
    except Exception:  # noqa: BLE001 - no CUDA headers here: units that need them fail by name
        pass
    return [d for d in out if d.is_dir()]


def _run(cmd: list[str], what: str) -> str | None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode == 0:
        return None
    tail = "\n    ".join((r.stderr or r.stdout).strip().splitlines()[-12:])
    return f"{what}: does not compile with {' '.join(WARN)}:\n    {tail}"


def _cuda_shim_source(out: Path) -> None:
    """libcuda.so.1's whole C text, assembled as cuda_intercept/build.py assembles it, emitted by cffi."""
    import cffi

    from rgpu.cuda_intercept import build, cgen, header, model
    api = model.parse(header.load())
    ffi = cffi.FFI()
    ffi.cdef(api.types_text + build.C_API + cgen.extern_python(api))
    ffi.embedding_api("")
    ffi.embedding_init_code("pass")
    ffi.set_source(build.MODULE, "\n".join([
        "#include <stdint.h>\n#include <stddef.h>", '#define RGPU_LIBPYTHON "libpython.so"',
        api.header.text, cgen.tables(api), *((build.HERE / f).read_text() for f in build.C_SOURCES),
        cgen.wrappers(api)]))
    with contextlib.redirect_stdout(io.StringIO()):  # cffi says "generating ..."
        ffi.emit_c_code(str(out))


def check(root: Path, files: list[Path], cxx: bool = True) -> list[str]:
    """One entry per unit that fails, and one per C/C++ file of the package no unit compiles."""
    from .layers import package_dirs
    cc, cxx_cmd = os.environ.get("CC", "cc"), os.environ.get("CXX", "c++")
    package = [f for f in files if any(d in f.parents for d in package_dirs(root).values())] \
        if (root / "pyproject.toml").exists() else files
    folders = _folders(root)
    inc = [f"-I{d}" for d in folders]
    cfiles = [f for f in package if f.suffix == ".c"]
    included = {q.resolve() for f in cfiles for q in _includes(f)}
    shim = sorted(f for f in cfiles if str(f.relative_to(root)) in _shim_sources())
    units = [f for f in cfiles if f.resolve() not in included and f not in shim]
    cpps = sorted(p for part in TORCH_PARTS for p in (root / part).glob("*.cpp")) if cxx else []
    covered = _covered(units + shim + cpps, folders)
    kinds = (".c", ".cpp", ".h") if cxx else (".c", ".h")
    problems = [f"{f.relative_to(root)}: compiled by no unit of tools/house/compiled.py (add its unit)"
                for f in package if f.suffix in kinds and f.resolve() not in covered
                and not (not cxx and any(part in str(f.relative_to(root)) for part in TORCH_PARTS))]
    jobs = [([cc, "-fsyntax-only", *WARN, *EXTRA.get(str(u.relative_to(root)), []), f"-I{u.parent}", *inc, str(u)],
             str(u.relative_to(root))) for u in units]
    with tempfile.TemporaryDirectory(prefix="rgpu-house-") as tmp:
        if shim:
            out = Path(tmp) / "libcuda_shim.c"
            _cuda_shim_source(out)
            jobs.append(([cc, "-fsyntax-only", *WARN, f"-I{shim[0].parent}", *inc, str(out)],
                         "the CUDA route's libcuda.so.1 (shim*.c as cffi emits it)"))
        if cpps:
            pch = _torch_pch(Path(tmp), cxx_cmd)
            jobs += [([cxx_cmd, "-fsyntax-only", *pch, *WARN, f"-I{p.parent}", *inc, str(p)], str(p.relative_to(root)))
                     for p in cpps]
        with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
            problems += [p for p in pool.map(lambda j: _run(*j), jobs) if p]
    return problems


def _torch_flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths
    return [*CXX_FLAGS, *(f"-isystem{p}" for p in include_paths()), f"-isystem{sysconfig.get_paths()['include']}"]


def _torch_pch(tmp: Path, cxx: str) -> list[str]:
    """<torch/extension.h> parsed once (a precompiled header): each unit then takes seconds, not half a minute."""
    head = tmp / "torch_pch.h"
    head.write_text("#include <torch/extension.h>\n")
    flags = _torch_flags()
    r = subprocess.run([cxx, *flags, *WARN, "-x", "c++-header", str(head), "-o", f"{head}.gch"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        print(f"house: torch's precompiled header failed, each unit parses it ({r.stderr[-300:]})", file=sys.stderr)
        return flags
    return [*flags, "-include", str(head)]
