"""The drivers behind the cuda route: the real one (ctypes over libcuda.so.1) on a GPU host, the fake one elsewhere.

``open_driver("auto" | "real" | "fake")`` picks; ``auto`` takes the real driver
when a real libcuda.so.1 loads and sees a device, and the fake one otherwise.
"""
from __future__ import annotations

import logging

from rgpu.errors import ConfigError

from .base import CudaDriverError, Driver

log = logging.getLogger("rgpu.server.cuda")


def open_driver(kind: str = "auto", devices: int = 1) -> Driver:
    """The driver ``kind`` names: ``"fake"`` (``devices`` pretend ones), ``"real"`` (``ConfigError`` naming
    why when libcuda.so.1 does not load or sees no device) or ``"auto"`` (the real one, else the fake);
    ``ConfigError`` for any other name."""
    if kind == "fake":
        from .fake import FakeDriver
        return FakeDriver(devices)
    if kind not in ("auto", "real"):
        raise ConfigError(f"cuda driver {kind!r}: expected auto, real or fake")
    from . import real
    try:
        return real.RealDriver()
    except (OSError, CudaDriverError, ConfigError) as exc:
        if kind == "real":
            raise ConfigError(f"the real CUDA driver is not usable here: {exc}") from exc
        log.info("no usable CUDA driver (%s); the cuda route uses the fake driver", exc)
        from .fake import FakeDriver
        return FakeDriver(devices)
