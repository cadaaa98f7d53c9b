"""Which tensors a cuDNN graph passes by value (an attention's scale), and a variant pack rebuilt around their bytes.

A by-value tensor's pointer in the client's variant pack is a host address of the client's; its bytes travel in
the Execute record and the server points the library at a copy of them instead. Shared by the real and the
fake cuDNN (``cudnn_real.py``, ``cudnn_fake.py``).
"""
from __future__ import annotations

import ctypes
import struct

from rgpu.protocol.lib_cudnn import BY_VALUE, PATCH, TYPE_BACKEND_DESCRIPTOR

from . import LibError

BAD_PARAM = 2000                        # CUDNN_STATUS_BAD_PARAM
# cudnnDataType_t -> bytes per element (a by-value tensor's size)
DATA_BYTES = {0: 4, 1: 8, 2: 2, 3: 1, 4: 4, 6: 1, 9: 2, 10: 8, 11: 1, 12: 1, 13: 1, 15: 1, 19: 4, 20: 8, 21: 16}


class ByValue:
    """Which tensors a descriptor's graph passes by value, from what the client set: computed when each
    descriptor is finalized or filled (a tensor, then its op, graph, heuristic, config, engine, plan), so
    a descriptor destroyed early takes nothing with it. A variant pack's attributes are kept to rebuild it."""

    def __init__(self):
        self.sets: dict[int, dict[int, tuple[int, int, bytes]]] = {}   # id -> name -> (type, count, bytes)
        self.of: dict[int, dict[int, int]] = {}                         # id -> {uid: bytes}

    def set(self, desc: int, name: int, type_: int, count: int, data) -> None:
        self.sets.setdefault(desc, {})[name] = (type_, count, bytes(data))

    def finalized(self, desc: int) -> None:
        found: dict[int, int] = {}
        attrs = self.sets.get(desc, {})
        if attrs.get(908, (0, 0, b"\0"))[2][:1] == b"\1" and {906, 901, 902} <= attrs.keys():    # a by-value tensor
            dims = struct.unpack(f"<{attrs[902][1]}q", attrs[902][2])
            n = DATA_BYTES.get(struct.unpack("<i", attrs[901][2])[0], 8)
            for d in dims:
                n *= d
            found[struct.unpack("<q", attrs[906][2])[0]] = n
        for type_, count, data in attrs.values():
            if type_ == TYPE_BACKEND_DESCRIPTOR:
                for ref in struct.unpack(f"<{count}Q", data):
                    found.update(self.of.get(ref, {}))
        if found:
            self.of[desc] = found

    def filled(self, target: int, source: int) -> None:
        if source in self.of:
            self.of[target] = dict(self.of[source])

    def forget(self, desc: int) -> None:
        self.sets.pop(desc, None)
        self.of.pop(desc, None)

    def entry(self, plan: int) -> list:
        """The plan's dump entry of its by-value tensors, if any."""
        pairs = [v for uid, n in sorted(self.of.get(plan, {}).items()) for v in (uid, n)]
        return [(BY_VALUE, 3, len(pairs), struct.pack(f"<{len(pairs)}q", *pairs))] if pairs else []

    def patched(self, plan: int, pack: int, tail, attrs: dict | None = None) -> tuple[dict, list]:
        """The pack's attributes (``attrs``, name -> (type, count, bytes), where another than this keeps them)
        with the by-value tensors' pointers turned to host copies of the client's bytes (the Execute's tail),
        and those copies (alive until the execution is made). Every by-value tensor of the plan must come with
        its bytes: its pointer is the client's, never to be dereferenced here."""
        attrs = dict(self.sets.get(pack, {}) if attrs is None else attrs)
        if 1000 not in attrs or 1001 not in attrs:
            raise LibError(BAD_PARAM, "cudnnBackendExecute: the variant pack has no unique ids or data pointers")
        uids = list(struct.unpack(f"<{attrs[1000][1]}q", attrs[1000][2]))
        ptrs = list(struct.unpack(f"<{attrs[1001][1]}Q", attrs[1001][2]))
        keep, done, pos = [], set(), 0
        while pos + PATCH.size <= len(tail):
            uid, n = PATCH.unpack_from(tail, pos)
            pos += PATCH.size
            if uid not in uids or n < 0 or pos + n > len(tail):
                raise LibError(BAD_PARAM, f"cudnnBackendExecute: a by-value tensor {uid} the variant pack does not hold")
            buf = ctypes.create_string_buffer(bytes(tail[pos:pos + n]), max(n, 1))
            keep.append(buf)
            ptrs[uids.index(uid)] = ctypes.addressof(buf)
            done.add(uid)
            pos += (n + 7) // 8 * 8
        missing = sorted(set(self.of.get(plan, {})) & set(uids) - done)
        if missing:
            raise LibError(BAD_PARAM, f"cudnnBackendExecute: by-value tensor(s) {missing} came without their bytes")
        attrs[1001] = (attrs[1001][0], len(ptrs), struct.pack(f"<{len(ptrs)}Q", *ptrs))
        return attrs, keep
