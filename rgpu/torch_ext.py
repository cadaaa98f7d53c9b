"""Builds and loads a C++ torch extension once per torch version and source tree, under a file lock.

Used by the client's device (``device_backend/build.py``) and the server's op path
(``server/ops/fast_op.py``); neither imports the other. A build lands in
``~/.cache/rgpu/<kind>/`` (or ``$XDG_CACHE_HOME``) under a name that carries the
torch version, the Python version and a hash of the sources, so an upgrade or an
edit rebuilds and an unchanged tree loads the cached ``.so`` directly.
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


class Extension:
    """One extension: ``kind`` names its cache folder and its module, ``sources`` are compiled, ``headers``
    only hashed; both relative to ``here``."""

    def __init__(self, kind: str, here: Path, sources: tuple, headers: tuple = (), note: str = ""):
        self.kind, self.here, self.sources, self.headers, self.note = kind, here, sources, headers, note
        self.module: ModuleType | None = None

    def cache_root(self) -> Path:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        return Path(base) / "rgpu" / self.kind

    def name(self) -> str:
        import torch

        digest = hashlib.sha256()
        for name in self.sources + self.headers:
            digest.update((self.here / name).read_bytes())
        tag = re.sub(r"[^A-Za-z0-9]", "_", f"{torch.__version__}_py{sys.version_info[0]}{sys.version_info[1]}")
        return f"rgpu_{self.kind}_{tag}_{digest.hexdigest()[:10]}"

    def built(self) -> bool:
        """Whether it is built for this torch and these sources (loading it then takes a millisecond)."""
        return (self.cache_root() / self.name() / "ready").exists()

    def load(self, verbose: bool = False) -> ModuleType:
        if self.module is not None:
            return self.module
        import torch  # noqa: F401  (the .so links against libtorch, already in the process)

        name = self.name()
        build_dir = self.cache_root() / name
        # Why a marker, not the .so: the linker writes the .so in place, so another
        # process could see it half-written; the marker appears only after a build.
        ready = build_dir / "ready"
        if not ready.exists():
            build_dir.mkdir(parents=True, exist_ok=True)
            # Why our own lock: several processes (pytest workers, scripts) can reach this line at once.
            with open(self.cache_root() / f"{name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not ready.exists():
                    self._compile(name, build_dir, verbose)
                    ready.touch()
        self.module = _import_so(name, build_dir / f"{name}.so")
        return self.module

    def _compile(self, name: str, build_dir: Path, verbose: bool) -> None:
        from torch.utils import cpp_extension

        if not verbose and self.note:
            print(f"rgpu: building {self.note} for this torch (once; ~30-60 s)...", file=sys.stderr)
        cpp_extension.load(name=name, sources=[str(self.here / s) for s in self.sources], extra_cflags=["-O2"],
                           build_directory=str(build_dir), verbose=verbose, is_python_module=True)


def _import_so(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
