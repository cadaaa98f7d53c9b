"""An rgpu error that ends a program ends in one clear line; rgpu's own frames show only with RGPU_DEBUG=1.

``install()`` is called where a client first meets the server or the compiler (``transport/client.py``,
``rgpu/toolchain.py``); it replaces only Python's own hook, never one a program or IPython set. For an
uncaught ``RgpuError`` the traceback keeps the program's frames (and torch's), leaves out rgpu's, and
the last line is ``rgpu: <ErrorType>: <what failed, where, the fix>``; anything else is printed as
Python would.
"""
from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path


def install() -> None:
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _hook


def _debug() -> bool:
    try:
        from . import config

        return config.settings().debug
    except Exception:   # a bad setting must not hide the error being reported
        return True


def _our_folders() -> tuple[str, ...]:
    """The folders rgpu's loaded modules live in (the package and, in a checkout, its mapped subfolders)."""
    folders = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) if name == "rgpu" or name.startswith("rgpu.") else None
        if path:
            folders.add(str(Path(path).resolve().parent) + os.sep)
    return tuple(folders)


def _hook(kind, exc, tb) -> None:
    from .errors import RgpuError

    if not isinstance(exc, RgpuError) or _debug():
        sys.__excepthook__(kind, exc, tb)
        return
    ours = _our_folders()
    frames = [f for f in traceback.extract_tb(tb) if not str(Path(f.filename).resolve()).startswith(ours)]
    first, *rest = str(exc).splitlines() or [""]
    text = ["Traceback (most recent call last; rgpu's own frames left out, RGPU_DEBUG=1 shows them):\n",
            *traceback.format_list(frames), *(line + "\n" for line in rest),   # (a build's compiler lines)
            f"rgpu: {kind.__name__}: {first}\n"]
    sys.stderr.write("".join(text))
    sys.stderr.flush()
