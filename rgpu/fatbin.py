"""The CUDA fatbin container (what nvcc embeds and cuModuleLoadData takes): its entries read, a container rebuilt from some.

Both ends use it and it imports nothing of rgpu: the client trims images to the
server's GPU before upload (``cuda_intercept/fatbin.py``), the fake driver reads
their PTX (``server/cuda/fake_code.py``). Layout, little-endian (NVIDIA
does not document it; the fields read here are checked against nvcc 13's output
in ``tests/test_fatbin.py``)::

    wrapper    u32 magic 0x466243b1, u32 version, u64 -> container    (__fatBinC_Wrapper_t, in memory only)
    container  u32 magic 0xBA55ED50, u16 version, u16 header_size, u64 bytes of entries after the header
    entry      u16 kind (1 PTX, 2 ELF cubin), u16 ?, u32 header_size, u64 payload bytes,
               u32 compressed bytes, u32 ?, u16 minor, u16 major (format version), u32 arch (90 = sm_90),
               u32 name offset, u32 name length, u64 flags, u64 ?, u64 uncompressed bytes, more header, payload
    flags      0x1 64-bit, 0x10 Linux, 0x2000 / 0x8000 compressed (LZ4 / zstd),
               0x100000 arch-specific target ('a': sm_90a), 0x200000 family target ('f': sm_100f)

Every length is checked against the bytes there are: a malformed container
raises ``FatbinError``, never reads past its end.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = 0xBA55ED50
WRAPPER_MAGIC = 0x466243B1
KIND_PTX, KIND_ELF = 1, 2
FLAG_COMPRESSED = 0x2000 | 0x8000
FLAG_ARCH_SPECIFIC, FLAG_FAMILY = 0x100000, 0x200000
MAX_ENTRIES = 4096                # torch's largest fatbins hold a few dozen

_HEAD = struct.Struct("<IHHQ")    # container: magic, version, header_size, entries' bytes
_ENTRY = struct.Struct("<HHIQ")   # entry: kind, ?, header_size, payload bytes
_ENTRY_ARCH = struct.Struct("<I")  # at byte 28
_ENTRY_FLAGS = struct.Struct("<Q")  # at byte 40
FULL_ENTRY_HEADER = 64            # arch and flags are read only from headers this long


class FatbinError(ValueError):
    """The bytes are not a fatbin container this module can read."""


@dataclass(frozen=True)
class Entry:
    kind: int            # KIND_PTX, KIND_ELF, or another (LTO IR ...), kept as a number
    arch: int            # 90 for sm_90 / compute_90, 100 for sm_100; 0 when the header is too short to say
    flags: int
    offset: int          # where the entry's header starts in the image
    header_size: int
    size: int            # payload bytes after the header

    @property
    def compressed(self) -> bool:
        return bool(self.flags & FLAG_COMPRESSED)

    @property
    def variant(self) -> str:
        """'a' (arch-specific), 'f' (family) or '' (portable within its major)."""
        return "a" if self.flags & FLAG_ARCH_SPECIFIC else "f" if self.flags & FLAG_FAMILY else ""

    @property
    def end(self) -> int:
        return self.offset + self.header_size + self.size

    def name(self) -> str:
        kind = {KIND_PTX: "compute", KIND_ELF: "sm"}.get(self.kind, f"kind{self.kind}")
        return f"{kind}_{self.arch}{self.variant}" + (" (compressed)" if self.compressed else "")

    def payload(self, image) -> memoryview:
        return memoryview(image)[self.offset + self.header_size:self.end]


def is_container(image) -> bool:
    return len(image) >= _HEAD.size and struct.unpack_from("<I", image)[0] == MAGIC


def container_size(head) -> int:
    """The whole container's bytes, from its first 16 (header plus entries)."""
    magic, _, header_size, size = _HEAD.unpack_from(head)
    if magic != MAGIC:
        raise FatbinError(f"not a fatbin container (magic {magic:#x})")
    return header_size + size


def entries(image) -> list[Entry]:
    """The entries of the container at the start of ``image`` (bytes after the container are ignored)."""
    if len(image) < _HEAD.size:
        raise FatbinError(f"{len(image)} bytes: too short for a fatbin header")
    magic, _, header_size, size = _HEAD.unpack_from(image)
    if magic != MAGIC:
        raise FatbinError(f"not a fatbin container (magic {magic:#x})")
    end = header_size + size
    if header_size < _HEAD.size or end > len(image):
        raise FatbinError(f"fatbin header says {end} bytes, the image has {len(image)}")
    out, pos = [], header_size
    while pos < end:
        if pos + _ENTRY.size > end or len(out) >= MAX_ENTRIES:
            raise FatbinError(f"fatbin entry at byte {pos} is cut short (or there are too many)")
        kind, _, head, payload = _ENTRY.unpack_from(image, pos)
        if head < _ENTRY.size or pos + head + payload > end:
            raise FatbinError(f"fatbin entry at byte {pos} claims {head} + {payload} bytes past the container")
        full = head >= FULL_ENTRY_HEADER
        arch = _ENTRY_ARCH.unpack_from(image, pos + 28)[0] if full else 0
        flags = _ENTRY_FLAGS.unpack_from(image, pos + 40)[0] if full else 0
        out.append(Entry(kind, arch, flags, pos, head, payload))
        pos += head + payload
    return out


def rebuild(image, keep: list[Entry]) -> bytes:
    """A container with ``image``'s header and only the entries ``keep``, each copied whole (compressed or not)."""
    header_size = _HEAD.unpack_from(image)[2]
    parts = [bytes(memoryview(image)[:header_size])]
    for e in keep:
        parts.append(bytes(memoryview(image)[e.offset:e.end]))
    body = sum(len(p) for p in parts[1:])
    head = bytearray(parts[0])
    struct.pack_into("<Q", head, 8, body)
    parts[0] = bytes(head)
    return b"".join(parts)


def ptx_text(image, entry: Entry) -> str:
    """An uncompressed PTX entry's text (its payload up to the first NUL: entries are padded)."""
    return bytes(entry.payload(image)).split(b"\0", 1)[0].decode()
