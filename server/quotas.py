"""One session's quotas: the device memory it may hold (``RGPU_MAX_SESSION_BYTES``) and the frames it may post
in a row without waiting (``RGPU_MAX_FRAMES_IN_FLIGHT``), on both routes.

A session is a process of its own, so what it holds is what its route counts: the ops route's handle
table (``Allocated``: its per-device counts, which the C++ op path updates too) and the cuda route's
allocations (``CudaHeld``). An allocation past the quota fails that op with ``QuotaExceeded``, whose
message names the setting and its value; the session goes on, holding what it held. A post past the
frames in flight fails likewise (its error raised at the client's next wait) until the client waits for an
answer. (Sessions per token are the acceptor's: ``serve.py``.)
"""
from __future__ import annotations

SETTING = "RGPU_MAX_SESSION_BYTES"


class QuotaExceeded(RuntimeError):
    """An op would take the session past one of its quotas (the message names the setting)."""


def _over(held: int, asked: int, limit: int) -> QuotaExceeded:
    return QuotaExceeded(f"{SETTING}: this session holds {held} bytes of device memory and asks for {asked} more, "
                         f"past its quota of {limit} bytes ({SETTING}={limit} on the server); free some, or ask the "
                         "server's operator for a larger quota")


def check(held: int, asked: int, limit: int | None) -> None:
    """Raise ``QuotaExceeded`` when ``asked`` more bytes would take ``held`` past ``limit`` (None: no quota)."""
    if limit is not None and asked > 0 and held + asked > limit:
        raise _over(held, asked, limit)


class Allocated(list):
    """The ops route's bytes per device, with a quota over their sum: a rise past it raises after the count
    is set (the C++ op path counts after it allocates, so the table stays true to what it holds)."""

    def __init__(self, devices: int, limit: int | None):
        super().__init__([0] * devices)
        self.limit = limit

    def __setitem__(self, index, value) -> None:
        was = list.__getitem__(self, index)
        list.__setitem__(self, index, value)
        if self.limit is not None and value > was:
            total = sum(self)
            if total > self.limit:
                raise _over(total - (value - was), value - was, self.limit)

    def check(self, nbytes: int) -> None:
        """Before an allocation of ``nbytes``: refuse it when it would pass the quota."""
        check(sum(self), nbytes, self.limit)


def counts(devices: int, limit: int | None) -> list:
    """The handle table's counts: a plain list without a quota (nothing on the hot path), else ``Allocated``."""
    return [0] * devices if limit is None else Allocated(devices, limit)


class CudaHeld:
    """The cuda route's allocations by address and context: what a session holds, checked before each one."""

    ALLOCS = ("mem_alloc", "mem_alloc_async")
    FREES = ("mem_free", "mem_free_async")
    CONTEXT_ENDS = ("ctx_destroy", "primary_ctx_reset")

    def __init__(self, limit: int | None):
        self.limit = limit
        self.held: dict[int, tuple[int, int | None]] = {}   # address -> (bytes, context)
        self.total = 0

    def before(self, op: str, args) -> None:
        if op in self.ALLOCS and args and isinstance(args[0], int):
            check(self.total, args[0], self.limit)

    def after(self, op: str, ctx, args, value) -> None:
        if op in self.ALLOCS and isinstance(value, int) and args and isinstance(args[0], int):
            self.held[value] = (args[0], ctx)
            self.total += args[0]
        elif op in self.FREES and args:
            size, _ = self.held.pop(args[0], (0, None))
            self.total -= size
        elif op in self.CONTEXT_ENDS:     # the context's memory goes with it
            gone = [p for p, (_, c) in self.held.items() if c == ctx or (args and c == args[0])]
            for p in gone:
                self.total -= self.held.pop(p)[0]


class InFlight:
    """Posts since the client last waited for an answer (a request), at most ``limit``: past it each post fails
    with ``QuotaExceeded`` instead of running, until a request; None from ``of`` without a limit."""

    def __init__(self, limit: int):
        self.limit, self.posted = limit, 0

    @classmethod
    def of(cls, settings) -> "InFlight | None":
        limit = getattr(settings, "max_frames_in_flight", None)
        return None if limit is None else cls(limit)

    def note(self, is_request: bool) -> None:
        if is_request:
            self.posted = 0
            return
        self.posted += 1
        if self.posted > self.limit:
            raise QuotaExceeded(f"RGPU_MAX_FRAMES_IN_FLIGHT: this session posted {self.posted} frames without waiting "
                                f"for an answer, past its quota of {self.limit} on the server; this one was not run. "
                                "Wait for an answer now and then (a .item(), a synchronize), or ask the server's "
                                "operator for a larger quota")
