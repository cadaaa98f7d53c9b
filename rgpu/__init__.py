"""rgpu: a PyTorch program runs here while its tensors and GPU work live on a remote GPU host."""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    AuthenticationError, ConfigError, ConnectError, ConnectionLost, ProtocolError, RemoteError, RgpuError,
    SessionLost, Timeout, VersionMismatch,
)

__all__ = ["RgpuError", "ConnectError", "AuthenticationError", "VersionMismatch", "ProtocolError",
           "ConnectionLost", "SessionLost", "Timeout", "RemoteError", "ConfigError", "__version__"]

# The "rgpu" torch device: registered now if torch is imported, else when it is (no build, no server).
from .device_backend import register_with_torch as _register_device  # noqa: E402
from .device_backend import stats  # noqa: E402,F401  (rgpu.stats(): messages, round trips, bytes)

_register_device()
