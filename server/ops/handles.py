"""One session's handle table: storages by client-minted id, their poison, and tensor views of them.

The client mints storage ids and never tells the server when it allocates: the
first message that names an id materialises its storage (uninitialised, like
CUDA memory). Tensors are rebuilt from descriptors as strided views of a
per-(storage, dtype) flat tensor, so a view costs one ``as_strided``.
"""
from __future__ import annotations

import torch

from rgpu.ops_protocol import DTYPES, EVENT_FIELDS, Event

DTYPE_BY_CODE = tuple(getattr(torch, name, None) for name in DTYPES)


class Poisoned(Exception):
    """An input was produced by an op that failed; carries that first failure."""

    def __init__(self, op: str, message: str):
        super().__init__(message)
        self.op = op


class Entry:
    __slots__ = ("storage", "device", "flat", "poison", "ptr")

    def __init__(self, storage, device, poison: Poisoned | None = None):
        self.storage, self.device, self.flat, self.poison = storage, device, {}, poison
        self.ptr = storage.data_ptr() if storage is not None else 0  # read once: untyped_storage() is slow


class HandleTable:
    def __init__(self, devices: list[torch.device]):
        self.devices = devices
        self.entries: dict[int, Entry] = {}
        self.allocated = [0] * len(devices)
        self.peak = [0] * len(devices)

    def device(self, index: int) -> torch.device:
        if not 0 <= index < len(self.devices):
            raise IndexError(f"rgpu:{index} does not exist (the server has {len(self.devices)} devices)")
        return self.devices[index]

    def _account(self, index: int, nbytes: int) -> None:
        self.allocated[index] += nbytes
        self.peak[index] = max(self.peak[index], self.allocated[index])

    def entry(self, sid: int, nbytes: int, dev: int) -> Entry:
        e = self.entries.get(sid)
        if e is None:
            storage = torch.empty(nbytes, dtype=torch.uint8, device=self.device(dev)).untyped_storage()
            e = self.entries[sid] = Entry(storage, dev)
            self._account(dev, nbytes)
        elif e.poison is not None:
            raise e.poison
        return e

    def tensor(self, desc, ptrs: list | None = None) -> torch.Tensor:
        """The tensor a descriptor names; ``ptrs`` collects the base addresses of the storages read."""
        sid, nbytes, code, size, stride, offset, dev = desc
        dtype = DTYPE_BY_CODE[code]
        if sid == 0:  # a storage of no bytes: nothing to keep
            return torch.empty_strided(size, stride, dtype=dtype, device=self.device(dev))
        e = self.entry(sid, nbytes, dev)
        if ptrs is not None:
            ptrs.append(e.ptr)
        flat = e.flat.get(dtype)
        if flat is None:
            flat = e.flat[dtype] = torch.empty(0, dtype=dtype, device=e.storage.device).set_(e.storage)
        # as_strided checks the geometry against the storage: a descriptor cannot reach past it
        return flat.as_strided(size, stride, offset)

    def bind(self, sid: int, storage, dev: int) -> None:
        """Make ``sid`` name ``storage`` (an op's fresh output)."""
        self.free(sid)
        self.entries[sid] = Entry(storage, dev)
        self._account(dev, storage.nbytes())

    def poison(self, sid: int, dev: int, cause: Poisoned) -> None:
        self.free(sid)
        self.entries[sid] = Entry(None, dev, cause)

    def free(self, sid: int) -> None:
        e = self.entries.pop(sid, None)
        if e is not None and e.storage is not None:
            self.allocated[e.device] -= e.storage.nbytes()

    def apply_events(self, events: list[int]) -> None:
        i, n = 0, len(events)
        while i < n:
            kind = events[i]
            if kind == Event.FREE:
                self.free(events[i + 1])
            elif kind == Event.COPY:
                self._grow(*events[i + 1:i + 6])
            else:
                raise ValueError(f"unknown allocator event {kind}")
            i += 1 + EVENT_FIELDS[kind]

    def _grow(self, dst: int, nbytes: int, dev: int, src: int, count: int) -> None:
        old = self.entries.get(src)
        if old is not None and old.poison is not None:
            self.poison(dst, dev, old.poison)
            return
        fresh = self.entry(dst, nbytes, dev)
        if old is not None:
            as_bytes = lambda s: torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)  # noqa: E731
            as_bytes(fresh.storage)[:count].copy_(as_bytes(old.storage)[:count])

    def close(self) -> None:
        self.entries.clear()
        self.allocated = [0] * len(self.devices)
