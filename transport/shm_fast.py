"""shm's hot path in C (``shm_fast.c``), built with cffi on first use and cached (and tcp's spin before a read).

A 64 B round trip over shm is nothing but both ends' per-message work, and in
Python that was the whole of it, against a target of a fifth of tcp's
(docs/perf/transport-history.md, "shm's hot path in C"). In C the ring's writes, waits and reads cost well
under a microsecond each, and a waiting thread spins without the GIL.

``load()`` returns the compiled module or None (no cffi, no C compiler,
``RGPU_NATIVE=off``, not x86-64); ``why_not()`` says which. Either end may have
it or not: the records are the same, so the Python path stays the reference.
``build()`` (``rgpu build``, or the first ``load()``) builds both modules with
``rgpu.native`` into ``<cache>/native/shm/<key>/``; key: the C sources, the cdef,
the compiler, Python and cffi versions.
"""
from __future__ import annotations

import importlib.util
import platform
import shutil
import struct
import sys
import sysconfig
import threading
from pathlib import Path

import numpy as np

from rgpu import native, protocol

HERE = Path(__file__).resolve().parent
MODULE = "_rgpu_shm_fast"
NATIVE = "_rgpu_shm_native"      # shm_native.c: the per-message calls, Python objects in and out
NATIVE_SOURCES = ("shm_native.c", "shm_ends.c", "shm_lone.c")   # one extension: shm_native.c includes both
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
CDEF = """
typedef struct {
    volatile uint64_t *q;
    uint8_t *ring_out, *ring_in;
    uint64_t ring_bytes, record_max, inline_max;
    uint32_t tail_out, head_out, asleep_out;
    uint32_t tail_in, head_in, waiting_in;
    int data_out, space_in;
    uint32_t magic, version;
} rgpu_ring;
typedef struct {
    uint64_t head, next, seq, ack, kind, meta_len, nbufs, meta_off;
    uint64_t buf_off[8], buf_len[8];
    uint64_t tail;
} rgpu_frame;
void rgpu_shm_publish(const rgpu_ring *r, uint64_t tail);
int64_t rgpu_shm_put(const rgpu_ring *r, uint64_t tail, uint32_t kind, uint32_t flags, uint64_t seq, uint64_t ack,
                     const char *meta, uint32_t meta_len, uint32_t nbufs, const char *const *bufs,
                     const uint64_t *lens);
int rgpu_shm_wait(const rgpu_ring *r, uint64_t head, double busy_s, double spin_s, int yield_core);
int rgpu_shm_take(const rgpu_ring *r, uint64_t head, uint32_t max_meta, uint32_t max_bufs, uint64_t max_frame,
                  rgpu_frame *f);
void rgpu_shm_consume(const rgpu_ring *r, uint64_t head);
int rgpu_fd_spin(int fd, double spin_s);
uint64_t rgpu_tls_read(uintptr_t read_ex, uintptr_t ssl, char *buf, uint64_t n);
"""
FAST_BUFS = 8
# rgpu_frame as Python reads it: head, next, seq, ack, kind, meta length, buffers, meta offset; then
# FAST_BUFS buffer offsets and FAST_BUFS lengths (read only when there are buffers); then
# shm_native.c's tail (read as the struct's field)
FRAME_HEAD = struct.Struct("<8Q")
FRAME_BUFS = struct.Struct(f"<{2 * FAST_BUFS}Q")

_lock = threading.Lock()
_module = None          # the loaded module, or False once it failed
_why_not = "not loaded yet"


def cache_dir() -> Path:
    """Where the builds live: one folder per key."""
    return native.cache_root() / "native" / "shm"


def build(force: bool = False) -> Path:
    """Both modules built (or found) in the cache: their folder (a ``BuildError`` when they cannot be built)."""
    import cffi

    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"shm's C path is x86-64 only; this is {platform.machine()}")
    sources = [HERE / "shm_fast.c", *(HERE / f for f in NATIVE_SOURCES), protocol.HEADER]
    key = native.key(*sources, CDEF, sys.version, cffi.__version__, platform.machine(),
                     native.compiler_identity(native.compiler()))
    return native.cached("shm", key, [MODULE + SUFFIX, NATIVE + SUFFIX], _produce, folder=cache_dir() / key,
                         what="shm's C path (once for this Python)", force=force)


def _produce(staging: Path) -> None:
    with native.capturing("building shm's C path"):
        _compile(staging)


def _compile(staging: Path) -> None:
    """``shm_fast.c`` through cffi and ``shm_native.c`` as a CPython extension (setuptools builds it, as it builds
    cffi's), both written into ``staging``."""
    import cffi
    from setuptools import Distribution, Extension

    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source(MODULE, (HERE / "shm_fast.c").read_text(), include_dirs=[str(protocol.HEADER_DIR)],
                   extra_compile_args=["-O2"])
    shutil.copyfile(ffi.compile(tmpdir=str(staging / "cffi"), verbose=False), staging / (MODULE + SUFFIX))
    ext = Extension(NATIVE, [str(HERE / "shm_native.c")], include_dirs=[str(HERE), str(protocol.HEADER_DIR)],
                    extra_compile_args=["-O2"])
    tmp = str(staging / "ext")
    dist = Distribution({"name": NATIVE, "ext_modules": [ext], "script_args": ["build_ext", "--build-lib", tmp,
                                                                                 "--build-temp", tmp]})
    dist.parse_command_line()
    dist.run_commands()
    shutil.copyfile(dist.get_command_obj("build_ext").get_ext_fullpath(NATIVE), staging / (NATIVE + SUFFIX))


def _import(path: Path, name: str = MODULE):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load():
    folder = build()
    module = _import(folder / (MODULE + SUFFIX))
    module.native = _import(folder / (NATIVE + SUFFIX), NATIVE)
    return module


def load(enabled: bool = True):
    """The compiled module (``.ffi``, ``.lib``), or None; built once per machine, loaded once per process."""
    global _module, _why_not
    if not enabled:
        return None
    if _module is not None:
        return _module or None
    with _lock:
        if _module is None:   # no cffi, no compiler, a read-only cache, RGPU_NATIVE=off: the Python path works
            _module = native.attempt("shm", _load, wanted=True) or False   # the caller's settings said yes
            _why_not = native.why_not("shm")
    return _module or None


def why_not() -> str | None:
    """None when the C path is loaded, else why it is not."""
    return _why_not


def address(buffer) -> int:
    """The address of a writable buffer's first byte (an mmap, a memoryview)."""
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def ring(ffi, control_mm, out: int, data_out: int, space_in: int, inline_max: int | None = None):
    """The ``rgpu_ring`` of one end of the control segment: direction ``out`` is the one it writes.

    Holds raw addresses into ``control_mm``: valid while the transport holds the mapping, and used
    only under its send and receive locks, which closing waits for. ``inline_max``: the biggest buffer
    ``rgpu_shm_put`` copies into a record (default ``INLINE_MAX``; bigger ones go through the heap).
    """
    from .shm_ring import INLINE_MAX, RECORD_MAX, RING_BYTES, RINGS_OFF, _words
    from .wire import MAGIC, PROTOCOL_VERSION

    base = address(control_mm)
    inn = 1 - out
    r = ffi.new("rgpu_ring *")
    r.q = ffi.cast("uint64_t *", base)
    r.ring_out = ffi.cast("uint8_t *", base + RINGS_OFF + out * RING_BYTES)
    r.ring_in = ffi.cast("uint8_t *", base + RINGS_OFF + inn * RING_BYTES)
    r.ring_bytes, r.record_max, r.inline_max = RING_BYTES, RECORD_MAX, INLINE_MAX if inline_max is None else inline_max
    r.tail_out, r.head_out, r.asleep_out, _ = _words(out)
    r.tail_in, r.head_in, _, r.waiting_in = _words(inn)
    r.data_out, r.space_in = data_out, space_in
    r.magic, r.version = struct.unpack("<I", MAGIC)[0], PROTOCOL_VERSION
    return r
