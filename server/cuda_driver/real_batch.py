"""The real driver's batch launcher: a few lines of C that walk the interceptor's launch records and launch each.

A ctypes call costs more than the launch itself (about 1.5 us against 2-3),
so a batch of records goes to C in one call.  Built with the host's C
compiler on first use and cached; where there is none, the executor walks the
records in Python instead (``load()`` returns None).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <stdint.h>
#include <string.h>
typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                         void **, void **);
typedef int (*set_ctx_fn)(void *);
/* Launch records [pos, len) (layout in rgpu/server/routes/cuda.py, LAUNCH) in order, each with its packed
 * arguments passed through `extra`.  Stops at the first failure: returns its CUresult and leaves *pos at
 * that record; returns 0 with *pos == len when all ran.  *ctx is the current context, kept up to date. */
int rgpu_launch_records(launch_fn launch, set_ctx_fn set_ctx, const char *rec, size_t len, size_t *pos,
                        uint64_t *ctx) {
    size_t size_arg = 0;
    void *extra[5] = {(void *)1, 0, (void *)2, &size_arg, 0};
    while (*pos + 64 <= len) {
        const char *r = rec + *pos;
        uint32_t size, dims[8];
        uint64_t func, c, stream;
        memcpy(&size, r, 4);
        memcpy(&func, r + 8, 8);
        memcpy(&c, r + 16, 8);
        memcpy(&stream, r + 24, 8);
        memcpy(dims, r + 32, 32);
        if (size < 64 + dims[7] || *pos + size > len) return -1;
        if (c != *ctx) {
            int rc = set_ctx((void *)(uintptr_t)c);
            if (rc) return rc;
            *ctx = c;
        }
        extra[1] = (void *)(r + 64);
        size_arg = dims[7];
        int rc = launch((void *)(uintptr_t)func, dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6],
                        (void *)(uintptr_t)stream, 0, dims[7] ? extra : 0);
        if (rc) return rc;
        *pos += size;
    }
    return 0;
}
"""


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "rgpu" / "server"


def load():
    """The compiled ``rgpu_launch_records`` (typed), or None when no C compiler is at hand."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    target = _cache_dir() / f"launch_records-{hashlib.sha256(SOURCE.encode()).hexdigest()[:12]}.so"
    if not target.exists():
        if not cc:
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src, out = Path(tmp, "launch_records.c"), Path(tmp, "launch_records.so")
            src.write_text(SOURCE)
            if subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)],
                              capture_output=True).returncode != 0:
                return None
            partial = target.with_name(f"{target.name}.{os.getpid()}")
            shutil.copyfile(out, partial)
            os.replace(partial, target)      # atomic: another worker never loads half a file
    fn = ctypes.CDLL(str(target)).rgpu_launch_records
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                   ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_uint64)]
    fn.restype = ctypes.c_int
    return fn
