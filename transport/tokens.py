"""The shared token: read from RGPU_TOKEN or the token file, created 0600 by the server."""
from __future__ import annotations

import os
import secrets
from pathlib import Path

from rgpu.errors import AuthenticationError, ConfigError


def read_token(settings) -> bytes:
    """The client's token: ``RGPU_TOKEN`` if set, else the token file; a clear error if neither."""
    if settings.token:
        return settings.token.strip().encode()
    path = settings.token_path
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        raise AuthenticationError(
            f"no token: set RGPU_TOKEN or RGPU_TOKEN_FILE, or copy the server's token to {path} "
            "(`rgpu serve` prints where it keeps it)") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {path}: {exc}") from None
    if not text:
        raise ConfigError(f"the token file {path} is empty")
    return text.encode()


def ensure_token(settings) -> tuple[bytes, Path | None, bool]:
    """The server's token; creates the token file (mode 0600) when there is none.

    Returns (token, path or None when it came from RGPU_TOKEN, whether it was created).
    """
    if settings.token:
        return settings.token.strip().encode(), None, False
    path: Path = settings.token_path
    if path.exists():
        return read_token(settings), path, False
    token = secrets.token_urlsafe(32)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another server made it a moment ago: use theirs
        return read_token(settings), path, False
    except OSError as exc:
        raise ConfigError(f"cannot create the token file {path}: {exc}") from None
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token.encode(), path, True
