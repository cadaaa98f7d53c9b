"""The C and C++ parts compiled with warnings as errors (-Wall -Werror, syntax only: no object is kept).

Each unit is compiled as its real build sees it: shm's extension with Python's headers,
the CUDA route's libcuda.so.1 as cffi emits it (the generated declarations, shim*.c and the
wrappers in one file), the torch C++ parts against the installed torch (one precompiled
<torch/extension.h> shared by them). A C or C++ file that no unit compiles, directly or by
#include, fails the check: add its unit here.
"""
from __future__ import annotations

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
TORCH_PARTS = ("device_backend", "server/ops")   # every .cpp there is one unit
PLAIN_C = (                                       # (unit, include folders)
    ("transport/shm_native.c", ("transport", "<python>")),
    ("transport/shm_fast.c", ()),
    ("cuda_intercept/demo_vecadd.c", ("<cuda>",)),
)
CUDA_SHIM = "cuda_intercept"                      # shim*.c: compiled as one cffi module


def _includes(path: Path) -> list[Path]:
    return [path.parent / m for m in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.M)]


def _covered(root: Path, units: list[Path]) -> set[Path]:
    seen, todo = set(), [u.resolve() for u in units]
    while todo:
        p = todo.pop()
        if p in seen or not p.exists():
            continue
        seen.add(p)
        todo += [q.resolve() for q in _includes(p)]
    return seen


def _folder(token: str, root: Path) -> str:
    if token == "<python>":
        return sysconfig.get_paths()["include"]
    if token == "<cuda>":
        from rgpu.cuda_intercept import header
        return str(header.find_include_dir())
    return str(root / token)


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
    ffi.emit_c_code(str(out))


def check(root: Path, files: list[Path], cxx: bool = True) -> list[str]:
    """One entry per unit that fails, and one per C/C++ file no unit compiles."""
    cc, cxx_cmd = os.environ.get("CC", "cc"), os.environ.get("CXX", "c++")
    problems: list[str] = []
    units = [root / u for u, _ in PLAIN_C if (root / u).exists()]
    shim = sorted((root / CUDA_SHIM).glob("shim*.c"))
    cpps = sorted(p for part in TORCH_PARTS for p in (root / part).glob("*.cpp")) if cxx else []
    covered = _covered(root, units + shim + cpps)
    kinds = (".c", ".cpp", ".h") if cxx else (".c",)
    for f in files:
        if f.suffix in kinds and f.resolve() not in covered:
            problems.append(f"{f.relative_to(root)}: compiled by no unit of tools/house/compiled.py (add its unit)")
    jobs = [([cc, "-fsyntax-only", *WARN, *(f"-I{_folder(i, root)}" for i in inc), str(root / u)], u)
            for u, inc in PLAIN_C if (root / u).exists()]
    with tempfile.TemporaryDirectory(prefix="rgpu-house-") as tmp:
        if shim:
            out = Path(tmp) / "libcuda_shim.c"
            _cuda_shim_source(out)
            jobs.append(([cc, "-fsyntax-only", *WARN, f"-I{sysconfig.get_paths()['include']}", str(out)],
                         "the CUDA route's libcuda.so.1 (shim*.c as cffi emits it)"))
        if cpps:
            pch = _torch_pch(Path(tmp), cxx_cmd)
            jobs += [([cxx_cmd, "-fsyntax-only", *pch, *WARN, f"-I{p.parent}", str(p)], str(p.relative_to(root)))
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
