"""rgpu: a PyTorch program runs here while its tensors and GPU work live on a remote GPU host.

``import rgpu`` makes ``device="rgpu"`` usable (cheap: no build, no server until
the first op). Everything else at the top is lazy (``__getattr__``): the error
classes, ``stats()``, ``register()``.

Who registers the device, and why so: Python runs this file before any
submodule, so ``import rgpu.errors`` runs it too. The device (PrivateUse1
renamed "rgpu") is registered only when the package is imported by its own
name (``import rgpu``, ``from rgpu import config``): the user's entry point.
Loaded as the parent of a submodule (``import rgpu.errors``,
``from rgpu.config import settings``, ``python -m rgpu.server.worker``,
``python -m rgpu``, the ``rgpu`` command), it registers nothing. Why it matters:

- the server's worker must leave PrivateUse1 unnamed and never load the
  client's device code (it runs ops with torch's own devices);
- the CUDA route's ``libcuda.so.1`` runs ``rgpu.cuda_intercept.embed`` inside an
  unchanged CUDA PyTorch program, and a named PrivateUse1 breaks CUDA autograd
  in that process (PyTorch issue #161129; see ``device_backend/README.md``).

Why not later, on first use: torch parses ``"rgpu"`` in C++ and knows the name
only once PrivateUse1 is renamed; there is no hook at the first ``.to("rgpu")``.
Why not an environment variable: the two processes that must not register
reach this file only as a submodule's parent already, and nothing in rgpu reads
the environment at import (``rgpu.config`` does, when asked). Where the package was loaded as a parent first
and the device is wanted after all (the ``rgpu bench`` command running the
device in its own process), ``rgpu.register()`` registers it.
"""
from __future__ import annotations

__version__ = "0.1.0"

_ERRORS = ("RgpuError", "ConnectError", "AuthenticationError", "VersionMismatch", "ProtocolError",
           "ConnectionLost", "SessionLost", "Timeout", "RemoteError", "ConfigError")
__all__ = [*_ERRORS, "register", "stats", "__version__"]


def register() -> None:
    """Make ``device="rgpu"`` usable: now if torch is imported, else the moment it is (no build, no server)."""
    from .device_backend import register_with_torch

    register_with_torch()


def stats(reset: bool = False) -> dict:
    """Counts since import: transport, messages, round_trips, bytes_out, bytes_in (``reset`` starts over)."""
    from .device_backend import stats as _stats

    return _stats(reset)


def __getattr__(name: str):
    if name in _ERRORS:
        from . import errors

        return getattr(errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _loaded_as_parent() -> bool:
    """True while this file runs because a submodule of rgpu is being imported (or run with ``-m``).

    Why frames: the import system says nothing else about why a package's
    ``__init__`` runs. Its own frames hold the name being imported:
    ``_find_and_load_unlocked(name)`` imports a dotted name's parent first, and
    runpy's ``_get_module_details(mod_name)`` does for ``python -m``.
    """
    import sys

    f = sys._getframe(1)
    while f is not None:
        code = f.f_code.co_name
        if code in ("_find_and_load_unlocked", "_get_module_details"):
            name = f.f_locals.get("name" if code == "_find_and_load_unlocked" else "mod_name")
            if isinstance(name, str) and name.startswith(__name__ + "."):
                return True
        f = f.f_back
    return False


if not _loaded_as_parent():
    register()
