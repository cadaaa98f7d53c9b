"""Builds rgpu's libcuda.so.1 with cffi: the generated header text, shim*.c, and the exported wrappers.

    python -m rgpu.cuda_intercept.build [OUT_DIR]     (or: rgpu intercept build)

The result is cached by ``rgpu.native`` under ``$XDG_CACHE_HOME/rgpu/intercept/<key>/`` (``~/.cache``)
(key: header, sources, compiler, Python and cffi versions), beside a ``libcuda.so`` link for linkers;
``rgpu build`` builds it ahead.
"""
from __future__ import annotations

import os
import shutil
import site
import sys
import sysconfig
from pathlib import Path

from rgpu import native, protocol
from rgpu.errors import ConfigError

from . import cgen, header, model
from .annotations import C_ONLY

HERE = Path(__file__).resolve().parent
C_SOURCES = ("shim.c", "export_tables.c", "shim_ctx.c", "shim_launch.c", "shim_ptr.c", "shim_capture.c", "shim_queue.c",
             "shim_libs.c")
MODULE = "_rgpu_libcuda"

# What Python may call in the C half (shim*.c); the rest of the cdef is the header's types.
C_API = """
void rgpu_set_ready(void);
void rgpu_set_finalized(void);
int rgpu_is_embedded(void);
const char *rgpu_self_path(void);
void rgpu_set_devices(int ndev, int nattr, const int *attrs);
int rgpu_ctx_note(uint64_t h, int device);
void rgpu_ctx_forget(uint64_t h);
uint64_t rgpu_ctx_current(void);
int rgpu_ctx_device(uint64_t h);
int rgpu_ctx_push(uint64_t h);
void rgpu_func_note(uint64_t func, uint32_t nparams, const uint32_t *offsets, const uint32_t *sizes, uint32_t argbytes);
int rgpu_alloc_note(uint64_t base, uint64_t size, uint64_t ctx, int dev, uint64_t id);
int rgpu_alloc_forget(uint64_t base);
int rgpu_alloc_find(uint64_t p, uint64_t *out);
void rgpu_records_native(int on);
void rgpu_primary_note(int dev, int retains, unsigned flags);
uint64_t rgpu_capture_note(uint64_t stream, uint64_t graph);
void rgpu_capture_forget(uint64_t stream);
char *rgpu_queue_take(size_t *len, size_t *count);
void rgpu_queue_free(char *q);
void rgpu_queue_limit(size_t bytes, size_t first);
uint64_t rgpu_work_note(void);
void rgpu_idle_note(uint64_t ctx, uint64_t stream, uint64_t gen);
extern "Python" CUresult _py_rgpu_flush(void);
extern "Python" CUresult _py_rgpu_lib_call(uint32_t call, uint64_t stream, uint64_t handle, const void *payload,
                                           size_t n, void *out, size_t cap, int64_t *status, size_t *got);
"""

# Runs once, in whichever interpreter first calls us: the host's when the
# program is Python, a fresh embedded one otherwise.
INIT_CODE = """
import sys, site
from {module} import ffi, lib
if lib.rgpu_is_embedded():
    # a fresh interpreter inside a C program: it knows no executable (a local server is
    # started with it), no argv, and maybe not the site folders the build saw
    sys.executable = {python!r}
    sys.argv = getattr(sys, "argv", None) or [""]
    for _d in {site_dirs!r}:
        if _d not in sys.path:
            site.addsitedir(_d)
from rgpu.cuda_intercept import embed
embed.attach(ffi, lib, {names!r})
"""


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/rgpu/intercept (~/.cache when unset), read when called."""
    return native.cache_root() / "intercept"


def _libpython() -> tuple[str, str]:
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    soname = sysconfig.get_config_var("INSTSONAME") or sysconfig.get_config_var("LDLIBRARY") or ""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        raise ConfigError(f"{sys.executable} is not a shared-library build of Python (Py_ENABLE_SHARED=0): "
                          "the embedded interpreter of libcuda.so.1 needs libpython")
    return libdir, os.path.join(libdir, soname)


def _dev_link(tmp: str, libpython: str) -> str:
    """A folder with libpythonX.Y.so for -lpythonX.Y where only the runtime .so.1.0 is installed (no -dev package)."""
    name = f"libpython{sys.version_info[0]}.{sys.version_info[1]}{getattr(sys, 'abiflags', '')}.so"
    folder = os.path.join(tmp, "pylib")
    os.makedirs(folder, exist_ok=True)
    if os.path.exists(libpython) and not os.path.exists(os.path.join(os.path.dirname(libpython), name)):
        os.symlink(libpython, os.path.join(folder, name))
    return folder


def build_key(api: model.Api) -> str:
    import cffi

    return native.key(api.header.text, sys.version, cffi.__version__, native.compiler_identity(native.compiler()),
                      *(HERE / f for f in C_SOURCES + ("export_tables.h", "cgen.py", "build.py", "annotations.py", "model.py")),
                      protocol.HEADER)


def build(out_dir: str | os.PathLike | None = None, *, cuda_home: str | None = None, force: bool = False) -> Path:
    """Build (or find cached) libcuda.so.1 and return its path (a ``BuildError`` when the compiler fails, a
    ``ConfigError`` without CUDA's headers or a shared libpython)."""
    api = model.parse(header.load(cuda_home))
    key = build_key(api)
    out = Path(out_dir) if out_dir else default_cache_dir() / key
    native.cached("intercept", key, ["libcuda.so.1"], lambda staging: _compile(api, staging), folder=out,
                  force=force, what="the CUDA route's libcuda.so.1 (once)")
    link = out / "libcuda.so"
    try:
        link.symlink_to("libcuda.so.1")     # for linkers (-lcuda)
    except FileExistsError:                # there already, or a concurrent build made it
        pass
    return out / "libcuda.so.1"


def _compile(api: model.Api, staging: Path) -> None:
    """libcuda.so.1 built with cffi's embedding into ``staging``: the header's types, shim*.c, the wrappers."""
    import cffi

    libdir, libpython = _libpython()
    names = tuple(n for n in api.functions if n not in C_ONLY)
    ffi = cffi.FFI()
    ffi.cdef(api.types_text + C_API + cgen.extern_python(api))
    ffi.embedding_api("")
    site_dirs = [d for d in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(d)]
    ffi.embedding_init_code(INIT_CODE.format(site_dirs=site_dirs, module=MODULE, names=names, python=sys.executable))
    source = "\n".join([
        "#include <stdint.h>\n#include <stddef.h>",
        f'#define RGPU_LIBPYTHON "{libpython}"',
        api.header.text, cgen.tables(api),
        *((HERE / f).read_text() for f in C_SOURCES),
        cgen.wrappers(api),
    ])
    ffi.set_source(MODULE, source, libraries=["pthread", "dl"], library_dirs=[libdir, _dev_link(str(staging), libpython)],
                   include_dirs=[str(protocol.HEADER_DIR), str(HERE)],
                   extra_compile_args=["-O2", "-Wno-unused-function", "-Wno-unused-variable"],
                   extra_link_args=[f"-Wl,-rpath,{libdir}", "-Wl,-soname,libcuda.so.1"])
    with native.capturing("building libcuda.so.1"):
        built = Path(ffi.compile(tmpdir=str(staging / "cffi"), target="libcuda.so.1"))
    shutil.copyfile(built, staging / "libcuda.so.1")


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else None, force=True))
