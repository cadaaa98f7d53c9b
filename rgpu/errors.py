"""The one error family of rgpu.

    RgpuError                     anything rgpu raises on purpose
    ├── ConnectError              no server answers at the address (refused, unreachable, DNS)
    ├── AuthenticationError       the token (or the server's proof of it) did not match
    ├── VersionMismatch           the two ends speak different rgpu protocol versions
    ├── ProtocolError             a frame broke the wire format (names the field); that connection closes
    ├── ConnectionLost            an established connection dropped (peer died, socket reset)
    │   └── SessionLost           the server ended the session (worker crash, fatal device error), or a
    │                             dropped tcp connection could not resume it (its grace passed, the replay
    │                             bound was crossed, the server refused the resume): the message says which
    ├── Timeout                   no answer within the configured time
    ├── RemoteError               the server ran the call and it failed (names the op and the message)
    ├── ConfigError               a setting or flag has a value rgpu cannot use
    ├── BuildError                (rgpu/native.py) a C or C++ part did not build; carries the compiler's
    │                             last lines, or the command that installs a compiler
    ├── CudaDriverError           (server/cuda/base.py) a driver call on the server failed; carries the
    │                             CUresult; the cuda route turns it into the reply's code, never an ERROR frame
    └── CudaCallError             (cuda_intercept/registry.py) a call the interceptor answers with a CUresult;
                                  the registry wrapper returns the code to the program, it never escapes into C

Every OSError, msgpack decode failure and foreign library error is translated into
one of these at the boundary where it happens (see ``translate_os_error``).
"""
from __future__ import annotations

import errno
import socket


class RgpuError(Exception):
    """Base class of every error rgpu raises on purpose."""


class ConnectError(RgpuError):
    """No rgpu server answers at the address."""


class AuthenticationError(RgpuError):
    """The shared token did not match on one side or the other."""


class VersionMismatch(RgpuError):
    """The client and the server speak different protocol versions."""


class ProtocolError(RgpuError):
    """A frame broke the wire format; the connection that sent it is closed."""


class ConnectionLost(RgpuError):
    """An established connection dropped."""


class SessionLost(ConnectionLost):
    """The session is gone: the server ended it (its worker died or hit a fatal device error), or a dropped
    connection could not be resumed (``RGPU_SESSION_GRACE`` passed, ``RGPU_REPLAY_BYTES`` crossed)."""


class Timeout(RgpuError):
    """No answer arrived within the configured time."""


class RemoteError(RgpuError):
    """A call failed on the server.

    ``op`` names what failed (an aten op, a CUDA entry point, an echo call),
    ``remote_type`` the exception type on the server.
    """

    def __init__(self, message: str, *, op: str | None = None, remote_type: str | None = None):
        self.op = op
        self.remote_type = remote_type
        prefix = f"{op}: " if op else ""
        super().__init__(f"{prefix}{message}")


class ConfigError(RgpuError):
    """A setting or flag has a value rgpu cannot use."""


class BuildError(RgpuError):
    """A C or C++ part did not build: ``output`` holds the compiler's last lines, ``install`` the command
    that installs a compiler where none was found."""

    def __init__(self, message: str, *, output: str = "", install: str | None = None):
        self.output = "\n".join(output.strip().splitlines()[-25:])
        self.install = install
        text = message + (f"; install one with: {install}" if install else "")
        super().__init__(text + (f"\n{self.output}" if self.output else ""))


_LOST = {errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED, errno.ENOTCONN, errno.ESHUTDOWN, errno.EBADF}


def translate_os_error(exc: BaseException, *, connecting: bool = False, where: str = "") -> RgpuError:
    """Map an OSError (or socket.timeout) to the rgpu error a caller can act on."""
    if isinstance(exc, RgpuError):
        return exc
    suffix = f" ({where})" if where else ""
    if connecting or isinstance(exc, (ConnectionRefusedError, socket.gaierror)):
        return ConnectError(f"cannot connect{suffix}: {exc or type(exc).__name__}")  # a connect timeout too
    if isinstance(exc, OSError) and exc.errno == errno.ETIMEDOUT:   # the kernel gave the peer up (keepalive,
        return ConnectionLost(f"connection lost{suffix}: the peer stopped answering: {exc}")   # TCP_USER_TIMEOUT)
    if isinstance(exc, (socket.timeout, TimeoutError)):   # a socket's own timeout ran out (errno None)
        return Timeout(f"timed out{suffix}: {exc}")
    if isinstance(exc, OSError) and (exc.errno in _LOST or isinstance(exc, ConnectionError)):
        return ConnectionLost(f"connection lost{suffix}: {exc}")
    if isinstance(exc, OSError):
        return ConnectionLost(f"connection failed{suffix}: {exc}")
    return RgpuError(f"{type(exc).__name__}{suffix}: {exc}")
