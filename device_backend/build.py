"""Builds and loads the C++ part of the rgpu device, once per torch version, under a file lock.

The sources sit beside this file; the build lands in ``~/.cache/rgpu`` (or
``$XDG_CACHE_HOME/rgpu``) under a name that carries the torch version, the
Python version and a hash of the sources, so an upgrade or an edit rebuilds
and an unchanged tree loads the cached ``.so`` directly (no compiler run).
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType

SOURCES = ("allocator.cpp", "guard.cpp", "hooks.cpp", "pinned.cpp", "metadata_ops.cpp", "attention.cpp",
           "autocast.cpp", "fast_encode.cpp", "fast_path.cpp", "graph_call.cpp", "bindings.cpp")
HEADERS = ("rgpu_device.h", "msgpack.h", "fast_path.h")
HERE = Path(__file__).resolve().parent

_module: ModuleType | None = None


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "rgpu" / "device_backend"


def extension_name() -> str:
    import torch

    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((HERE / name).read_bytes())
    tag = re.sub(r"[^A-Za-z0-9]", "_", f"{torch.__version__}_py{sys.version_info[0]}{sys.version_info[1]}")
    return f"rgpu_device_{tag}_{digest.hexdigest()[:10]}"


def _import_so(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def built() -> bool:
    """Whether the C++ part for this torch and these sources is built (loading it then takes a millisecond)."""
    return (cache_root() / extension_name() / "ready").exists()


def load(verbose: bool = False) -> ModuleType:
    """The loaded C++ module (registers the allocator, guard, hooks and kernels on load)."""
    global _module
    if _module is not None:
        return _module
    import torch  # noqa: F401  (the .so links against libtorch, already in the process)

    name = extension_name()
    build_dir = cache_root() / name
    so = build_dir / f"{name}.so"
    # Why a marker, not the .so: the linker writes the .so in place, so another
    # process could see it half-written; the marker appears only after a build.
    ready = build_dir / "ready"
    if not ready.exists():
        build_dir.mkdir(parents=True, exist_ok=True)
        # Why our own lock: several client processes (pytest workers, scripts)
        # can reach this line at once on a cold cache.
        with open(cache_root() / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not ready.exists():
                _compile(name, build_dir, verbose)
                ready.touch()
    _module = _import_so(name, so)
    return _module


def _compile(name: str, build_dir: Path, verbose: bool) -> None:
    from torch.utils import cpp_extension

    if not verbose:
        print("rgpu: building the device's C++ part for this torch (once; ~30-60 s)...", file=sys.stderr)
    cpp_extension.load(
        name=name,
        sources=[str(HERE / s) for s in SOURCES],
        extra_cflags=["-O2"],
        build_directory=str(build_dir),
        verbose=verbose,
        is_python_module=True,
    )
