"""Builds and loads a C++ torch extension once per torch version and source tree (``rgpu.native``'s cache and lock).

Used by the client's device (``device_backend/build.py``) and the server's op path
(``server/ops/fast_op.py``); neither imports the other. ``torch.utils.cpp_extension``
drives the compiler; ``rgpu.native`` owns the key (the sources, the headers, the
torch and Python versions, the C++ compiler), the cache folder
(``<cache>/native/<kind>/<name>/``, the builder's files in ``build/`` beside the
``.so``), the lock, the progress line and the reason a build failed, so an upgrade
or an edit rebuilds and an unchanged tree loads the cached ``.so`` directly.
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

from . import native, protocol


class Extension:
    """One extension: ``kind`` names its cache folder and its module, ``sources`` are compiled, ``headers``
    only hashed; both relative to ``here``."""

    def __init__(self, kind: str, here: Path, sources: tuple, headers: tuple = (), note: str = ""):
        self.kind, self.here, self.sources, self.headers, self.note = kind, here, sources, headers, note
        self.module: ModuleType | None = None

    def cache_root(self) -> Path:
        return native.cache_root() / "native" / self.kind

    def key(self) -> str:
        import torch

        cxx = os.environ.get("CXX") or shutil.which("c++") or ""
        return native.key(*(self.here / n for n in self.sources + self.headers), torch.__version__, sys.version,
                          native.compiler_identity(cxx) if cxx else "no c++")

    def name(self) -> str:
        """The module's name (and its folder's): the torch and Python versions and the key."""
        import torch

        tag = re.sub(r"[^A-Za-z0-9]", "_", f"{torch.__version__}_py{sys.version_info[0]}{sys.version_info[1]}")
        return f"rgpu_{self.kind}_{tag}_{self.key()[:10]}"

    def _where(self) -> tuple[str, str, Path]:
        key, name = self.key(), self.name()
        return key, name, self.cache_root() / name

    def built(self) -> bool:
        """Whether it is built for this torch and these sources (loading it then takes a millisecond)."""
        key, name, folder = self._where()
        return native.ready(folder, self.kind, key, [f"{name}.so"])

    def load(self, verbose: bool = False, force: bool = False) -> ModuleType:
        """The loaded module, built first where it is not (a ``BuildError`` or torch's own error when it fails)."""
        if self.module is not None and not force:
            return self.module
        import torch  # noqa: F401  (the .so links against libtorch, already in the process)

        key, name, folder = self._where()
        built: list[ModuleType] = []

        def produce(staging: Path) -> None:
            from torch.utils import cpp_extension

            from .toolchain import check_torch_build

            check_torch_build()  # a missing compiler, header or ninja named with its install command, not torch's pages
            # torch's builder loads what it built (from staging): this process keeps that module, as
            # a second copy of the library from the cache would register its kernels twice
            with contextlib.nullcontext() if verbose else native.capturing(f"building {self.note or self.kind}"):
                built.append(cpp_extension.load(name=name, sources=[str(self.here / s) for s in self.sources],
                                                 extra_cflags=["-O2"], extra_include_paths=[str(protocol.HEADER_DIR)],
                                                 build_directory=str(staging), verbose=verbose,
                                                 is_python_module=True))

        with native.recording(self.kind):
            native.cached(self.kind, key, [f"{name}.so"], produce, folder=folder, force=force, keep=True,
                          what=f"{self.note or self.kind} (once for this torch)")
        self.module = built[0] if built else _import_so(name, folder / f"{name}.so")
        return self.module


def _import_so(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
