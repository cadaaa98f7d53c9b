"""Builds and loads the C++ part of the rgpu device, once per torch version (``rgpu.torch_ext``).

The sources sit beside this file; the build lands in ``~/.cache/rgpu/native/device_backend``
(or ``$XDG_CACHE_HOME``), keyed by the torch and Python versions, the compiler and a hash of
the sources, so an upgrade or an edit rebuilds and an unchanged tree loads the cached ``.so``.
``rgpu build`` builds it ahead; else the first use does.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

from rgpu import protocol
from rgpu.torch_ext import Extension

SOURCES = ("allocator.cpp", "guard.cpp", "hooks.cpp", "pinned.cpp", "metadata_ops.cpp", "attention.cpp",
           "autocast.cpp", "fast_encode.cpp", "fast_path.cpp", "fast_copies.cpp", "graph_call.cpp", "bindings.cpp")
HEADERS = ("rgpu_device.h", "msgpack.h", "fast_path.h", str(protocol.HEADER))  # the last on the include path

_EXTENSION = Extension("device_backend", Path(__file__).resolve().parent, SOURCES, HEADERS, "the device's C++ part")


def built() -> bool:
    """Whether the C++ part for this torch and these sources is built (loading it then takes a millisecond)."""
    return _EXTENSION.built()


def load(verbose: bool = False, force: bool = False) -> ModuleType:
    """The loaded C++ module (registers the allocator, guard, hooks and kernels on load); ``force`` rebuilds."""
    return _EXTENSION.load(verbose, force)
