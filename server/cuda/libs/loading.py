"""Finding and loading the real math libraries on a GPU host (for ``<lib>_real.py``).

Looked for, in order: ``RGPU_CUDA_LIB_DIR`` (a folder holding them), the NVIDIA wheels of the server's
Python (``site-packages/nvidia/cu13/lib``, ``nvidia/<lib>/lib``: what torch's CUDA build installs),
torch's own ``lib`` folder, then the dynamic linker's search path. The first that loads wins; none
raises ``LibraryMissing`` naming every place tried, which the library turns into the status its
create call answers, so the client's error names the fix.
"""
from __future__ import annotations

import ctypes
import glob
import os
import site
import sys

from rgpu import config


class LibraryMissing(OSError):
    pass


def candidates(soname: str) -> list[str]:
    """Where ``soname`` (``libcublas.so.13``) may be, best first."""
    out = []
    folder = config.settings().cuda_lib_dir              # RGPU_CUDA_LIB_DIR
    if folder:
        out.append(os.path.join(folder, soname))
    roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    for root in dict.fromkeys(r for r in roots if r and os.path.isdir(r)):
        out += sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "lib", soname)), reverse=True)
        out += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", soname)))
        out.append(os.path.join(root, "torch", "lib", soname))
    out.append(soname)                       # the linker's own search (ld.so.cache, LD_LIBRARY_PATH)
    return [p for p in dict.fromkeys(out) if os.sep not in p or os.path.exists(p)]


def load(soname: str) -> ctypes.CDLL:
    """The real ``soname``, loaded globally (cuBLASLt and cuDNN's sublibraries find each other)."""
    tried = []
    for path in candidates(soname):
        try:
            return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            tried.append(f"{path}: {exc}")
    raise LibraryMissing(f"{soname} is not installed on the server (tried {'; '.join(tried) or 'nothing'}); "
                         f"install NVIDIA's wheel there (pip install nvidia-{soname.split('.')[0][3:].lower()}) "
                         "or set RGPU_CUDA_LIB_DIR")
