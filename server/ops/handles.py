"""One session's handle table: storages by client-minted id, their poison, and tensor views of them.

Two implementations of one interface: the C++ class ``handle_table.h`` (built with the C++ op path,
which uses it directly; the server's Python uses its Python face) and ``HandleTable`` here, the same
table in Python where the C++ part is not built (``RGPU_NATIVE=off``, no compiler, a build still
running) or a session has a memory quota. ``table()`` picks one; tests/test_handle_table.py runs both
against the same cases.

The client mints storage ids and never tells the server when it allocates: the
first message that names an id materialises its storage (uninitialised, like
CUDA memory). Tensors are rebuilt from descriptors as strided views of a
per-(storage, dtype) flat tensor, so a view costs one ``as_strided``.

The op path (``view``) also keeps the views it built, per storage, keyed by the
rest of the descriptor (dtype code, sizes, strides, offset): a storage read by
op after op costs a dict lookup. A cached view lives exactly as long as its
entry: a free, a re-bind, a poisoning or storage growth (a new id) drops it
with the entry. An op that could change a view's layout in place (the ops that
write an argument) has its written views checked afterwards (``keep``); a
failed op's written views are dropped (``forget``). An id whose storage a CUDA
graph is about to overwrite moves to a copy, with a new entry (``evict``).
"""
from __future__ import annotations

import torch

from rgpu.protocol.ops import DTYPES, EVENT_FIELDS, Event

from .. import quotas

DTYPE_BY_CODE = tuple(getattr(torch, name, None) for name in DTYPES)
# The dtypes a table's tensor may have: all of those but the quantized, which need a quantizer the wire does
# not carry (torch crashed the worker copying a qint32 view the table had made: the live fuzz found it)
QUANTIZED = frozenset(name for name in DTYPES if name.startswith(("qint", "quint")))
TENSOR_DTYPE_BY_CODE = tuple(None if name in QUANTIZED else d for name, d in zip(DTYPES, DTYPE_BY_CODE))
MAX_VIEWS = 16  # cached views per storage; past it the storage's cache starts again (x[i] for every i)
_FREE, _COPY = int(Event.FREE), int(Event.COPY)


_CONTIGUOUS: dict[tuple, tuple] = {}  # sizes -> (their contiguous strides, element count)


def _contiguous(size: tuple) -> tuple:
    strides, n = [], 1
    for d in reversed(size):
        strides.append(n)
        n *= d
    if len(_CONTIGUOUS) >= 4096:
        _CONTIGUOUS.clear()
    got = _CONTIGUOUS[size] = (strides[::-1], n)
    return got


def _check_id(sid) -> None:
    """A new entry's id is an int of 64 bits (what the C++ table holds); anything else is refused by name."""
    if not isinstance(sid, int) or not -(1 << 63) <= sid < (1 << 63):
        raise TypeError(f"a storage id is an int of 64 bits, not {sid!r}"[:200])


def dtype_of(code) -> torch.dtype:
    """The torch dtype of a descriptor's dtype code; a clear error for a code this torch lacks or a quantized one."""
    known = type(code) is int and 0 <= code < len(DTYPE_BY_CODE)
    dtype = TENSOR_DTYPE_BY_CODE[code] if known else None
    if dtype is None:   # (the C++ table's words, too)
        if known:
            raise ValueError(f"dtype code {code} is not a dtype rgpu's tensors can have "
                             "(quantized, or unknown to this torch)")
        raise ValueError(f"unknown dtype code {code!r}")
    return dtype


class Poisoned(Exception):
    """An input was produced by an op that failed; carries that first failure."""

    def __init__(self, op: str, message: str):
        super().__init__(message)
        self.op = op


class Entry:
    __slots__ = ("storage", "device", "flat", "views", "poison", "ptr")

    def __init__(self, storage, device, poison: Poisoned | None = None):
        self.storage, self.device, self.flat, self.views, self.poison = storage, device, {}, {}, poison
        self.ptr = storage.data_ptr() if storage is not None else 0  # read once: untyped_storage() is slow


class HandleTable:
    """One session's storages by client-minted id, in Python: the reference, and the table of a session with a
    quota; the C++ one (``handle_table.h``, its Python face ``handle_table.cpp``) has the same methods and errors.
    A descriptor is ``[id, storage bytes, dtype code, sizes, strides, offset, device]`` (``rgpu.protocol.ops``)."""

    def __init__(self, devices: list[torch.device], max_bytes: int | None = None):
        """``devices``: what rgpu:0.. are here; ``max_bytes``: the session's quota (``QuotaExceeded`` past it)."""
        self.devices = devices
        self.entries: dict[int, Entry] = {}
        self.max_bytes = max_bytes     # RGPU_MAX_SESSION_BYTES: over it an allocation fails (quotas.py)
        self.allocated = quotas.counts(len(devices), max_bytes)
        self.peak = [0] * len(devices)

    def device(self, index: int) -> torch.device:
        """The torch device of rgpu:``index``; ``IndexError`` naming it when this server has no such device."""
        if not 0 <= index < len(self.devices):
            raise IndexError(f"rgpu:{index} does not exist (the server has {len(self.devices)} devices)")
        return self.devices[index]

    def _account(self, index: int, nbytes: int) -> None:
        self.allocated[index] += nbytes
        self.peak[index] = max(self.peak[index], self.allocated[index])

    def entry(self, sid: int, nbytes: int, dev: int) -> Entry:
        """``sid``'s entry, a new storage of ``nbytes`` (uninitialised) on ``dev`` when the id is new; raises its
        ``Poisoned`` when an op that failed made it, ``QuotaExceeded`` past the quota, ``TypeError`` for an id
        that is not a 64-bit int."""
        e = self.entries.get(sid)
        if e is None:
            _check_id(sid)
            if self.max_bytes is not None:
                self.allocated.check(nbytes)
            storage = torch.empty(nbytes, dtype=torch.uint8, device=self.device(dev)).untyped_storage()
            e = self.entries[sid] = Entry(storage, dev)
            self._account(dev, nbytes)
        elif e.poison is not None:
            raise e.poison
        return e

    def tensor(self, desc, ptrs: list | None = None) -> torch.Tensor:
        """The tensor a descriptor names, a view of its own; ``ptrs`` collects the base addresses of the storages read."""
        sid, nbytes, code, size, stride, offset, dev = desc
        dtype = dtype_of(code)
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

    def view(self, desc, ptrs: list) -> torch.Tensor:
        """``tensor()`` for an op's argument: the view built for the same descriptor before, if any.

        The view may be handed to op after op: an op that changes its layout must ``keep`` it afterwards."""
        sid, nbytes, code, size, stride, offset, dev = desc
        e = self.entries.get(sid)
        if e is None:
            if sid == 0:  # a storage of no bytes: nothing to keep
                return self.tensor(desc, ptrs)
            return self._fresh(desc, ptrs)
        if e.poison is not None:
            raise e.poison
        key = (code, tuple(size), tuple(stride), offset)
        v = e.views.get(key)
        if v is None:
            v = self.tensor(desc, ptrs)  # checks the geometry against the storage
            views = e.views
            if len(views) >= MAX_VIEWS:
                views.clear()
            views[key] = v
            return v
        ptrs.append(e.ptr)
        return v

    def view_list(self, wire: list, ptrs: list) -> list | None:
        """``view`` of every item of a list of wire tensors (``{"t": descriptor}``: a _foreach_ op's list of
        ~100 parameters), the cache looked up in one loop; None if an item is anything else (the caller
        then decodes the list item by item)."""
        out = []
        entries, append, push = self.entries, out.append, ptrs.append
        for x in wire:
            desc = x.get("t") if type(x) is dict and len(x) == 1 else None
            if desc is None:
                return None
            e = entries.get(desc[0])
            if e is not None and e.poison is None:
                v = e.views.get((desc[2], tuple(desc[3]), tuple(desc[4]), desc[5]))
                if v is not None:
                    push(e.ptr)
                    append(v)
                    continue
            append(self.view(desc, ptrs))
        return out

    def _fresh(self, desc, ptrs: list) -> torch.Tensor:
        """A storage first named by an op (its output, mostly): allocated as the tensor the descriptor names
        when that is a contiguous tensor of exactly the storage's bytes, else as bytes and viewed."""
        sid, nbytes, code, size, stride, offset, dev = desc
        dtype = dtype_of(code)
        _check_id(sid)
        size_key = tuple(size)
        contiguous = _CONTIGUOUS.get(size_key) or _contiguous(size_key)
        if offset == 0 and stride == contiguous[0] and contiguous[1] * dtype.itemsize == nbytes:
            if self.max_bytes is not None:
                self.allocated.check(nbytes)
            v = torch.empty(size, dtype=dtype, device=self.device(dev))
            e = self.entries[sid] = Entry(v.untyped_storage(), dev)
            self._account(dev, nbytes)
            e.views[(code, size_key, tuple(stride), 0)] = v
            ptrs.append(e.ptr)
            return v
        self.entry(sid, nbytes, dev)
        return self.view(desc, ptrs)

    def keep(self, desc, v: torch.Tensor) -> bool:
        """After an op that wrote ``v`` (from ``view(desc)``): whether it still has the descriptor's layout
        (sizes, strides, offset, storage, no conjugate/negative bit); a cached view that changed is dropped."""
        sid, _, code, size, stride, offset, _ = desc
        size, stride = tuple(size), tuple(stride)
        e = self.entries.get(sid)
        if (v.shape == size and v.stride() == stride and v.storage_offset() == offset and not v.is_conj()
                and not v.is_neg() and (e is None or v.untyped_storage().data_ptr() == e.ptr)):
            return True
        if e is not None:
            key = (code, size, stride, offset)
            if e.views.get(key) is v:
                del e.views[key]
        return False

    def forget(self, sid) -> None:
        """Drop the cached views of ``sid``'s storage (a failed op may have left one changed)."""
        e = self.entries.get(sid) if type(sid) is int else None
        if e is not None:
            e.views.clear()

    def bind(self, sid: int, storage, dev: int, view: tuple | None = None) -> None:
        """Make ``sid`` name ``storage`` (an op's fresh output); ``view``: (descriptor, the tensor it names)."""
        _check_id(sid)
        self.free(sid)
        e = self.entries[sid] = Entry(storage, dev)
        self._account(dev, storage.nbytes())
        if view is not None:
            desc, t = view
            e.views[(desc[2], tuple(desc[3]), tuple(desc[4]), desc[5])] = t

    def evict(self, sid: int, ptr: int) -> bool:
        """If ``sid`` still names the storage at ``ptr`` (memory a CUDA graph's replay is about to overwrite),
        move it to a copy of its bytes; its cached views go with the old entry. Whether it did."""
        e = self.entries.get(sid)
        if e is None or e.ptr != ptr or e.storage is None:
            return False
        copy = torch.empty(e.storage.nbytes(), dtype=torch.uint8, device=e.storage.device).untyped_storage()
        copy.copy_(e.storage)
        self.bind(sid, copy, e.device)
        return True

    def poison(self, sid: int, dev: int, cause: Poisoned) -> None:
        """Make ``sid`` name the failure ``cause`` (its storage freed): reading it raises ``cause``."""
        _check_id(sid)
        self.free(sid)
        self.entries[sid] = Entry(None, dev, cause)

    def free(self, sid: int) -> None:
        """Forget ``sid`` and give its bytes back to the counts (an id it does not hold: nothing)."""
        e = self.entries.pop(sid, None)
        if e is not None and e.storage is not None:
            self.allocated[e.device] -= e.storage.nbytes()

    def address(self, sid) -> int | None:
        """The storage address ``sid`` names; None when it names nothing or a failure (a CUDA graph's replay
        checks so that an input it captured is still the one the client names)."""
        e = self.entries.get(sid)
        return None if e is None or e.poison is not None else e.ptr

    def apply_events(self, events: list[int]) -> None:
        """The client allocator's events, in order: frees, and growths (a new storage with the old one's first
        bytes); ``ValueError`` for an unknown kind."""
        i, n = 0, len(events)
        while i < n:
            kind = events[i]
            if kind == _FREE:
                self.free(events[i + 1])
            elif kind == _COPY:
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
        """Drop every storage (the session ends); the table is empty and usable after."""
        self.entries.clear()
        self.allocated = quotas.counts(len(self.devices), self.max_bytes)


def table(devices: list[torch.device], max_bytes: int | None, native=None):
    """A session's handle table: the C++ one when ``native`` (the C++ op path's module) is there, else this
    module's. A session with a quota keeps this one: its counts raise past the quota (quotas.Allocated)."""
    if native is None or max_bytes is not None:
        return HandleTable(devices, max_bytes)
    return native.HandleTable(devices, TENSOR_DTYPE_BY_CODE, MAX_VIEWS)
