"""The CUDA driver header as C text: found, preprocessed and fixed up so cffi can parse it.

One preprocessing of ``cudaTypedefs.h`` (which includes ``cuda.h``) with
``__CUDA_API_VERSION_INTERNAL`` defined gives every entry point the real
``libcuda.so.1`` exports -- current names (``cuMemAlloc_v2``), legacy ones
(``cuMemAlloc``) and per-thread-stream ones (``cuMemcpy_ptds``) -- plus the
``PFN_<name>_v<version>`` typedefs that ``cuGetProcAddress`` resolves against.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rgpu.errors import ConfigError

# Array sizes cffi cannot evaluate ("8 - sizeof(CUlaunchAttributeID)"): the
# sizes of what may appear under sizeof in them, on every Linux target CUDA has.
_SIZEOF_ENUM = 4
_SIZEOF_POINTER = 8
_SIZEOF_EXPR = re.compile(r"\[\s*(\d+)\s*-\s*sizeof\s*\(\s*([\w\s]+?)\s*(\*?)\s*\)\s*\]")


@dataclass(frozen=True)
class Header:
    """The preprocessed driver API: ``text`` is valid C and valid cffi cdef."""

    text: str
    include_dir: Path
    cuda_version: int          # CUDA_VERSION, e.g. 13000
    errors: tuple[tuple[str, int, str], ...]   # CUresult (name, value, first sentence of its doc)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


def find_include_dir(cuda_home: str | None = None) -> Path:
    """The CUDA toolkit's include folder: ``CUDA_HOME``, then ``nvcc``'s, then /usr/local/cuda."""
    candidates = []
    home = cuda_home or os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        candidates.append(Path(home) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(os.path.realpath(nvcc))
        candidates += [real.parent.parent / "include", Path(nvcc).parent.parent / "include"]
    candidates.append(Path("/usr/local/cuda/include"))
    for c in candidates:
        if (c / "cuda.h").is_file() and (c / "cudaTypedefs.h").is_file():
            return c
    raise ConfigError("cuda.h not found: set CUDA_HOME to a CUDA toolkit (tried "
                      + ", ".join(str(c) for c in candidates) + ")")


def _compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    raise ConfigError("no C compiler found (set CC): needed to preprocess cuda.h")


def preprocess(include_dir: Path) -> str:
    """cudaTypedefs.h through the C preprocessor, system headers stubbed out.

    Stubbing stdlib.h/stdint.h keeps glibc's declarations out of the text;
    cffi knows uint32_t, uint64_t and size_t by itself.
    """
    with tempfile.TemporaryDirectory(prefix="rgpu-cuda-h-") as stub:
        for name in ("stdlib.h", "stdint.h"):
            Path(stub, name).write_text("")
        cmd = [_compiler(), "-E", "-P", "-nostdinc", "-I", stub, "-I", str(include_dir),
               "-D__CUDA_API_VERSION_INTERNAL", str(include_dir / "cudaTypedefs.h")]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"preprocessing cuda.h failed: {done.stderr.strip()[:2000]}")
    return fix_up(done.stdout)


def fix_up(text: str) -> str:
    """Replace the ``N - sizeof(T)`` array sizes with their value."""
    enums = set(re.findall(r"\}\s*(\w+)\s*;", text)) & set(re.findall(r"typedef\s+enum\s+\w*\s*\{[^}]*\}\s*(\w+)", text))

    def size(match: re.Match) -> str:
        n, typ, star = int(match.group(1)), match.group(2).strip(), match.group(3)
        if star:
            return f"[{n - _SIZEOF_POINTER}]"
        if typ in enums:
            return f"[{n - _SIZEOF_ENUM}]"
        raise ConfigError(f"cuda.h: cannot size array [{match.group(0)}]; add {typ} to header.fix_up")

    text = _SIZEOF_EXPR.sub(size, text)
    return "\n".join(line for line in text.splitlines() if line.strip()) + "\n"


def error_codes(include_dir: Path) -> tuple[tuple[str, int, str], ...]:
    """CUresult names, values and the first sentence of each one's doc comment."""
    raw = (include_dir / "cuda.h").read_text()
    body = raw[raw.index("typedef enum cudaError_enum"):]
    body = body[:body.index("} CUresult;")]
    out = []
    for m in re.finditer(r"/\*\*(.*?)\*/\s*(CUDA_\w+)\s*=\s*(\d+)", body, re.S):
        doc = " ".join(part.strip(" *") for part in m.group(1).splitlines()).strip()
        doc = re.sub(r"::|\\p |\\ref ", "", re.sub(r"\s+", " ", doc))
        sentence = doc.split(". ")[0].rstrip(".")
        out.append((m.group(2), int(m.group(3)), sentence))
    return tuple(out)


def load(cuda_home: str | None = None) -> Header:
    """Find, preprocess and fix up the driver header of the installed toolkit."""
    inc = find_include_dir(cuda_home)
    version = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", (inc / "cuda.h").read_text())
    if not version:
        raise ConfigError(f"{inc / 'cuda.h'}: no CUDA_VERSION")
    return Header(preprocess(inc), inc, int(version.group(1)), error_codes(inc))
