"""The server's module images by content (sha256): a disk store shared by every session and worker process.

A client names an image by its digest first and sends the bytes only when the
store does not have them, so an image crosses the network once per server
(torch registers hundreds of fatbins; a second run of the same program sends
none). Files are ``<folder>/<digest>``, written to a temporary name and renamed
into place (a reader never sees half an image), checked against their digest
when read back; the folder is kept under ``limit`` bytes by dropping the least
recently used. This process also keeps the images it loaded in memory (up to
``MEMORY``), so a session that reloads one never reads the disk.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
import tempfile
from collections import OrderedDict
from pathlib import Path

from rgpu import fatbin

log = logging.getLogger("rgpu.server.cuda")

MEMORY = 256 << 20
_DIGEST = re.compile(r"[0-9a-f]{64}")


def image_problem(data) -> str | None:
    """Why the real driver must not be handed ``data`` (it trusts an image's own lengths), or None.

    A fatbin's entries must lie inside the bytes sent, an ELF's header tables too, and PTX must
    end in a NUL within them: the driver reads each by what it says of itself, past our buffer if
    it lies, in the session's process.
    """
    n = len(data)
    head = bytes(data[:4])
    if fatbin.is_container(data):
        try:
            fatbin.entries(data)
        except fatbin.FatbinError as exc:
            return f"malformed fatbin: {exc}"
        return None
    if n >= 4 and struct.unpack("<I", head)[0] == fatbin.WRAPPER_MAGIC:
        return "a fatbin wrapper holds a pointer into the client's memory: send the container"
    if head == b"\x7fELF":
        if n < 64:
            return "ELF image shorter than its header"
        phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
        if phoff + phentsize * phnum > n or shoff + shentsize * shnum > n:
            return f"ELF image of {n} bytes whose header tables lie past its end"
        return None
    if b"\0" not in bytes(data):
        return "PTX text without its terminating NUL"
    return None


def digest_of(data) -> str:
    return hashlib.sha256(data).hexdigest()


def valid_digest(digest) -> bool:
    """A sha256 in lowercase hex: nothing else ever becomes a file name."""
    return isinstance(digest, str) and _DIGEST.fullmatch(digest) is not None


class ImageStore:
    def __init__(self, folder: Path | None, limit: int):
        self.folder = Path(folder) if folder is not None and limit > 0 else None
        self.limit = limit
        self.memory: OrderedDict[str, bytes] = OrderedDict()
        self.memory_bytes = 0

    def get(self, digest: str) -> bytes | None:
        if not valid_digest(digest):
            return None
        data = self.memory.get(digest)
        if data is not None:
            self.memory.move_to_end(digest)
            return data
        if self.folder is None:
            return None
        path = self.folder / digest
        try:
            data = path.read_bytes()
            os.utime(path)                       # recently used: the last to be dropped
        except OSError:
            return None
        if digest_of(data) != digest:            # a damaged file is dropped, and the client sends the bytes
            log.warning("image store: %s does not match its digest; dropped", path)
            self._remove(path)
            return None
        self._remember(digest, data)
        return data

    def put(self, digest: str, data) -> bytes:
        """Keep ``data`` (already checked against ``digest``); returns it as bytes."""
        data = bytes(data)
        self._remember(digest, data)
        if self.folder is not None and len(data) <= self.limit:
            try:
                self._write(digest, data)
                self._trim()
            except OSError as exc:               # a full or read-only disk costs uploads, never the load
                log.warning("image store: cannot write %s: %s", self.folder / digest, exc)
        return data

    def _remember(self, digest: str, data: bytes) -> None:
        if digest in self.memory or len(data) > MEMORY:
            return
        self.memory[digest] = data
        self.memory_bytes += len(data)
        while self.memory_bytes > MEMORY:
            _, old = self.memory.popitem(last=False)
            self.memory_bytes -= len(old)

    def _write(self, digest: str, data: bytes) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / digest
        if path.exists():
            return
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)               # atomic: another worker sees the whole file or none
        except BaseException:
            self._remove(Path(tmp))
            raise

    def _trim(self) -> None:
        files = []
        with os.scandir(self.folder) as it:
            for e in it:
                if valid_digest(e.name):
                    try:
                        st = e.stat()
                    except OSError:
                        continue
                    files.append((st.st_mtime, st.st_size, e.path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.limit:
                break
            self._remove(Path(path))
            total -= size

    @staticmethod
    def _remove(path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass
