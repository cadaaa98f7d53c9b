"""The server's routes: each module here (but ``base``) is one route, named by its file."""
from __future__ import annotations

import importlib
import pkgutil


def available() -> set[str]:
    """Route names, found without importing them (the acceptor never imports torch)."""
    return {m.name for m in pkgutil.iter_modules(__path__) if m.name != "base" and not m.name.startswith("_")}


def executor_class(route: str):
    if route not in available():
        raise KeyError(f"unknown route {route!r}")
    return importlib.import_module(f"{__name__}.{route}").Executor
