"""rgpu: a PyTorch program runs here while its tensors and GPU work live on a remote GPU host."""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    AuthenticationError, ConfigError, ConnectError, ConnectionLost, ProtocolError, RemoteError, RgpuError,
    SessionLost, Timeout, VersionMismatch,
)

__all__ = ["RgpuError", "ConnectError", "AuthenticationError", "VersionMismatch", "ProtocolError",
           "ConnectionLost", "SessionLost", "Timeout", "RemoteError", "ConfigError", "__version__"]
