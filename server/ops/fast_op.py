"""The ops route's common op in C++ (``fast_op.cpp``) and the session's handle table it uses (``handle_table.h``,
with a Python face: ``module.HandleTable``, which ``handles.table()`` hands the executor), built with torch and cached.

On the GPU host the executor's Python around each aten call was most of the server's
time per streamed op. ``FastOps.run`` decodes, runs and binds the common op without it
and answers False for anything else, which the Python executor (the reference) then
does.

A session never waits for the compiler: ``for_session()`` (each executor asks) loads the
build, or starts it in a process of its own when this torch and these sources have
none yet (~30 s, once per machine), and sessions run everything in Python meanwhile;
``rgpu build`` builds it ahead. ``RGPU_NATIVE=off`` turns it off.

    python -m rgpu.server.ops.fast_op          # build it now (what the background process runs)
"""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from rgpu import protocol
from rgpu.torch_ext import Extension

log = logging.getLogger("rgpu.server.fast_op")

EXTENSION = Extension("server_ops", Path(__file__).resolve().parent, ("fast_op.cpp", "handle_table.cpp"),
                      ("fast_schema.h", "handle_table.h", "fast_substitutes.h", "fast_copies.h", str(protocol.HEADER)),
                      "the server's op path")
_failed: str | None = None
_building = False


def load(enabled: bool = True, build: bool = True) -> ModuleType | None:
    """The compiled module, or None: turned off, not built yet (``build=False``), or it cannot be built here
    (no compiler: one warning, then the Python path does everything)."""
    global _failed
    if not enabled or _failed is not None or not (build or EXTENSION.module is not None or EXTENSION.built()):
        return None
    try:
        return EXTENSION.load()
    except Exception as exc:
        _failed = f"{type(exc).__name__}: {exc}"
        log.warning("the server's C++ op path is unavailable (%s); ops run through Python", _failed.splitlines()[0])
        return None


def for_session(enabled: bool = True) -> ModuleType | None:
    """The module if it is built (a session's executor asks); else None, and a build started in the
    background for later sessions, once per process: never in a session's way."""
    global _building
    module = load(enabled, build=False)
    if module is None and enabled and _failed is None and not _building:
        _building = True
        log.info("building the server's C++ op path in the background; ops run through Python until it is built")
        subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    return module


def describe(module: ModuleType | None, enabled: bool) -> str:
    """What a session's ops run through, in words (the ops route's welcome; ``rgpu doctor`` shows it)."""
    if module is not None:
        return "C++"
    if not enabled:
        return "Python (RGPU_NATIVE=off)"
    if _failed is not None:
        return f"Python (the C++ op path cannot be built here: {_failed.splitlines()[0][:200]})"
    return "Python (the C++ op path is being built in the background; later sessions use it)"


def build(force: bool = False) -> ModuleType:
    """Build it now (or find it built) and load it (``rgpu build``); raises what the build raises."""
    return EXTENSION.load(force=force)


def built() -> bool:
    """Whether it is built for this torch and these sources."""
    return EXTENSION.built()


def why_not() -> str | None:
    """Why ``load()`` gave None after it tried to build, or None."""
    return _failed


if __name__ == "__main__":
    raise SystemExit(0 if load() is not None else 1)
