"""The fake CUDA driver: host memory behind one or more pretend devices, so the whole CUDA route runs without a GPU.

It keeps the real driver's shape and error codes: contexts (primary and
created), allocations, copies, memsets, streams, events, PTX modules whose
kernels come from fake_kernels.py, links, libraries, stream capture into
graphs and graph launches.  Work runs at once, in call order, which is one of
the orders the real driver could have picked; a captured stream records
instead of running, and its graph replays the records.
"""
from __future__ import annotations

import itertools
import time

from .base import (CU_STREAM_LEGACY, CU_STREAM_PER_THREAD, CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_DEVICE,
                   CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_READY,
                   CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, Driver,
                   check)
from .fake_code import FakeCode
from .fake_memory import FakeMemory

GiB = 1 << 30
# Device attributes of the pretend device (cuda.h numbering), H100-like; others read 0.
ATTRS = {1: 1024, 2: 1024, 3: 1024, 4: 64, 5: 2147483647, 6: 65535, 7: 65535, 8: 49152, 9: 65536, 10: 32,
         11: 2147483647, 12: 65536, 13: 1755000, 14: 512, 15: 1, 16: 132, 20: 0, 30: 512, 31: 1, 33: 0, 34: 0,
         36: 2619000, 37: 5120, 38: 52428800, 39: 2048, 40: 3, 41: 1, 50: 0, 75: 9, 76: 0, 78: 1, 79: 1, 80: 1,
         81: 233472, 82: 65536, 95: 1, 97: 232448, 106: 32, 115: 1}


class FakeDriver(Driver):
    name = "fake"

    def __init__(self, devices: int = 1, memory: int = 4 * GiB):
        self.ndev = max(1, devices)
        self.mem = FakeMemory(memory)
        self._ids = itertools.count(0x1000, 0x10)   # one counter: a handle of one kind is never another's
        self.contexts: dict[int, dict] = {}
        self.primary: dict[int, dict] = {}           # device -> {"ctx", "refs", "flags"}
        self.current = 0
        self.streams: dict[int, dict] = {}
        self.events: dict[int, float | None] = {}
        self.graphs: dict[int, list] = {}
        self.execs: dict[int, list] = {}
        self.capturing: dict[int, int] = {}          # stream -> graph being recorded
        self.nodes: dict[int, list[int]] = {}        # graph -> a handle for each recorded work, minted when asked
        self.pools: dict[int, dict] = {}             # memory pool -> {"device", "attrs", "used", "high"}
        self.pool_of: dict[int, tuple[dict, int]] = {}   # stream-ordered allocation -> (its pool, size)
        self.code = FakeCode(self)                   # modules, libraries, links, launches (base.Driver hands them)

    def _new(self) -> int:
        return next(self._ids)

    # ---- devices and contexts --------------------------------------------------------
    def init(self, nattr: int) -> dict:
        dev = {"name": "rgpu fake device", "total_mem": self.mem.total, "uuid": b"rgpu-fake-device",
               "pci_bus_id": "0000:00:00.0", "attrs": [ATTRS.get(a, 0) for a in range(nattr)]}
        return {"driver": self.name, "version": 13000, "devices": [dict(dev, pci_bus_id=f"0000:{i:02x}:00.0")
                                                                     for i in range(self.ndev)]}

    def _device(self, dev: int) -> int:
        check(0 <= dev < self.ndev, CUDA_ERROR_INVALID_DEVICE, f"no device {dev}")
        return dev

    def primary_ctx_retain(self, dev: int) -> int:
        p = self.primary.setdefault(self._device(dev), {"ctx": 0, "refs": 0, "flags": 0})
        if not p["ctx"]:
            p["ctx"] = self._new()
            self.contexts[p["ctx"]] = {"device": dev, "flags": p["flags"], "primary": True}
        p["refs"] += 1
        return p["ctx"]

    def primary_ctx_release(self, dev: int) -> None:
        p = self.primary.get(self._device(dev))
        check(p is not None and p["refs"] > 0, CUDA_ERROR_INVALID_CONTEXT, f"device {dev}: primary context not retained")
        p["refs"] -= 1

    def primary_ctx_reset(self, dev: int) -> None:
        p = self.primary.get(self._device(dev))
        if p and p["ctx"]:
            self.contexts.pop(p["ctx"], None)
            p["ctx"] = 0

    def primary_ctx_get_state(self, dev: int) -> list:
        p = self.primary.get(self._device(dev), {"ctx": 0, "refs": 0, "flags": 0})
        return [p["flags"], int(bool(p["ctx"]) and p["refs"] > 0)]

    def primary_ctx_set_flags(self, dev: int, flags: int) -> None:
        self.primary.setdefault(self._device(dev), {"ctx": 0, "refs": 0, "flags": 0})["flags"] = flags

    def ctx_create(self, dev: int, flags: int) -> int:
        h = self._new()
        self.contexts[h] = {"device": self._device(dev), "flags": flags, "primary": False}
        return h

    def ctx_destroy(self, ctx: int) -> None:
        check(ctx in self.contexts and not self.contexts[ctx]["primary"], CUDA_ERROR_INVALID_CONTEXT,
              f"cuCtxDestroy: {ctx:#x} is not a created context")
        del self.contexts[ctx]

    def set_current(self, ctx: int) -> None:
        check(ctx == 0 or ctx in self.contexts, CUDA_ERROR_INVALID_CONTEXT, f"context {ctx:#x} does not exist")
        self.current = ctx

    def _need_ctx(self) -> None:
        check(self.current in self.contexts, CUDA_ERROR_INVALID_CONTEXT, "no current context")

    def ctx_synchronize(self) -> None:
        self._need_ctx()

    def ctx_get_flags(self) -> int:
        self._need_ctx()
        return self.contexts[self.current]["flags"]

    def ctx_get_limit(self, limit: int) -> int:
        return {0: 1024, 1: 1 << 20, 2: 8 << 20}.get(limit, 0)

    def ctx_set_limit(self, limit: int, value: int) -> None:
        self._need_ctx()

    def ctx_get_stream_priority_range(self) -> list:
        return [0, -5]

    def ctx_set_cache_config(self, config: int) -> None:
        self._need_ctx()

    # ---- memory ----------------------------------------------------------------------
    def mem_alloc(self, size: int) -> int:
        self._need_ctx()
        return self.mem.alloc(size)

    def mem_free(self, ptr: int) -> None:
        self.mem.free(ptr)

    def mem_get_info(self) -> list:
        return [self.mem.total - self.mem.used, self.mem.total]

    def mem_get_address_range(self, ptr: int) -> list:
        return list(self.mem.range_of(ptr))

    def memcpy_htod(self, dst: int, stream: int | None, data: memoryview) -> None:
        data = bytes(data)
        self._run(stream, lambda: self.mem.view(dst, len(data)).__setitem__(slice(None), data))

    def memcpy_dtoh(self, src: int, nbytes: int, stream: int | None) -> bytes:
        self._not_capturing(stream)
        return self.mem.view(src, nbytes)

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: int | None) -> None:
        self._run(stream, lambda: self.mem.view(dst, nbytes).__setitem__(slice(None), bytes(self.mem.view(src, nbytes))))

    def memset(self, dst: int, value: int, elem: int, count: int, stream: int | None) -> None:
        pattern = int(value).to_bytes(elem, "little")
        self._run(stream, lambda: self.mem.view(dst, elem * count).__setitem__(slice(None), pattern * count))

    # ---- stream-ordered allocation: one default pool per device, allocations made at once ----
    def device_get_default_mem_pool(self, dev: int) -> int:
        self._device(dev)
        for h, p in self.pools.items():
            if p["device"] == dev:
                return h
        h = self._new()
        self.pools[h] = {"device": dev, "attrs": {1: 1, 2: 1, 3: 1, 4: 0}, "used": 0, "high": 0}
        return h

    def _pool(self, pool: int | None) -> dict:
        if pool is None:
            self._need_ctx()
            pool = self.device_get_default_mem_pool(self.contexts[self.current]["device"])
        check(pool in self.pools, CUDA_ERROR_INVALID_VALUE, f"memory pool {pool:#x} does not exist")
        return self.pools[pool]

    def mem_alloc_async(self, size: int, stream: int, pool: int | None = None) -> int:
        p = self._pool(pool)
        self._stream(stream)
        ptr = self.mem_alloc(size)
        p["used"] += size
        p["high"] = max(p["high"], p["used"])
        self.pool_of[ptr] = (p, size)
        return ptr

    def mem_free_async(self, ptr: int, stream: int) -> None:
        # a free captured into a graph leaves the memory to the graph's replays (the driver's free node
        # and alloc node would hand back the same address each time)
        if self._stream(stream) in self.capturing:
            return
        p, size = self.pool_of.pop(ptr, (None, 0))
        self.mem.free(ptr)
        if p is not None:
            p["used"] -= size

    def mem_pool_set_attribute(self, pool: int, attr: int, value: int) -> None:
        check(1 <= attr <= 8 and attr not in (5, 7), CUDA_ERROR_INVALID_VALUE, f"pool attribute {attr} is not settable")
        p = self._pool(pool)
        if attr in (6, 8):                          # the high-water marks reset to the current use
            p["high"] = p["used"]
        else:
            p["attrs"][attr] = value

    def mem_pool_get_attribute(self, pool: int, attr: int) -> int:
        p = self._pool(pool)
        check(1 <= attr <= 8, CUDA_ERROR_INVALID_VALUE, f"no pool attribute {attr}")
        return {5: p["used"], 6: p["high"], 7: p["used"], 8: p["high"]}.get(attr, p["attrs"].get(attr, 0))

    def mem_pool_trim_to(self, pool: int, keep: int) -> None:
        self._pool(pool)                             # allocations here go straight back: nothing is held

    # ---- order: streams, events, capture, graphs ------------------------------------
    def _stream(self, stream: int | None) -> int:
        s = stream or 0
        check(s in (0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) or s in self.streams, CUDA_ERROR_INVALID_HANDLE,
              f"stream {s:#x} does not exist")
        return s

    def _run(self, stream: int | None, work) -> None:
        """Run ``work`` now, or record it when its stream is being captured."""
        s = self._stream(stream)
        if s in self.capturing:
            self.graphs[self.capturing[s]].append(work)
        else:
            work()

    def _not_capturing(self, stream: int | None) -> None:
        s = self._stream(stream)
        check(s not in self.capturing, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
              "a synchronising call on a stream being captured")

    def stream_create(self, flags: int, priority: int) -> int:
        self._need_ctx()
        h = self._new()
        self.streams[h] = {"flags": flags, "priority": priority, "ctx": self.current}
        return h

    def stream_destroy(self, stream: int) -> None:
        check(stream in self.streams, CUDA_ERROR_INVALID_HANDLE, f"stream {stream:#x} does not exist")
        del self.streams[stream]
        self.capturing.pop(stream, None)

    def stream_synchronize(self, stream: int) -> None:
        self._not_capturing(stream)

    def stream_query(self, stream: int) -> None:
        self._stream(stream)

    def stream_get_flags(self, stream: int) -> int:
        return self.streams[stream]["flags"] if stream in self.streams else 0

    def stream_get_priority(self, stream: int) -> int:
        return self.streams[stream]["priority"] if stream in self.streams else 0

    def stream_wait_event(self, stream: int, event: int, flags: int) -> None:
        self._stream(stream)
        check(event in self.events, CUDA_ERROR_INVALID_HANDLE, f"event {event:#x} does not exist")

    def event_create(self, flags: int) -> int:
        self._need_ctx()
        h = self._new()
        self.events[h] = None
        return h

    def event_destroy(self, event: int) -> None:
        check(self.events.pop(event, 0) != 0, CUDA_ERROR_INVALID_HANDLE, f"event {event:#x} does not exist")

    def event_record(self, event: int, stream: int, flags: int = 0) -> None:
        check(event in self.events, CUDA_ERROR_INVALID_HANDLE, f"event {event:#x} does not exist")
        self._run(stream, lambda: self.events.__setitem__(event, time.perf_counter()))

    def event_synchronize(self, event: int) -> None:
        check(event in self.events, CUDA_ERROR_INVALID_HANDLE, f"event {event:#x} does not exist")

    def event_query(self, event: int) -> None:
        self.event_synchronize(event)

    def event_elapsed_time(self, start: int, end: int) -> float:
        t0, t1 = self.events.get(start), self.events.get(end)
        check(t0 is not None and t1 is not None, CUDA_ERROR_NOT_READY, "an event has not been recorded")
        return (t1 - t0) * 1000.0

    def stream_begin_capture(self, stream: int, mode: int) -> None:
        s = self._stream(stream)
        check(s not in (0, CU_STREAM_LEGACY), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
              "the legacy NULL stream cannot be captured")
        check(s not in self.capturing, CUDA_ERROR_INVALID_VALUE, "the stream is already capturing")
        g = self._new()
        self.graphs[g] = []
        self.capturing[s] = g

    def stream_end_capture(self, stream: int) -> int:
        g = self.capturing.pop(self._stream(stream), None)
        check(g is not None, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "the stream is not capturing")
        return g

    def stream_is_capturing(self, stream: int) -> int:
        return 1 if self._stream(stream) in self.capturing else 0

    def stream_get_capture_info(self, stream: int) -> list:
        """[status, capture id, graph, dependencies]: a capture here is a chain, so its last node."""
        g = self.capturing.get(self._stream(stream))
        if g is None:
            return [0, 0, 0, []]
        nodes = self.graph_get_nodes(g)
        return [1, g, g, nodes[-1:]]

    def graph_get_nodes(self, graph: int) -> list:
        check(graph in self.graphs, CUDA_ERROR_INVALID_HANDLE, f"graph {graph:#x} does not exist")
        nodes = self.nodes.setdefault(graph, [])
        nodes += [self._new() for _ in range(len(self.graphs[graph]) - len(nodes))]
        return list(nodes)

    def graph_instantiate(self, graph: int, flags: int) -> int:
        check(graph in self.graphs, CUDA_ERROR_INVALID_HANDLE, f"graph {graph:#x} does not exist")
        h = self._new()
        self.execs[h] = list(self.graphs[graph])
        return h

    def graph_launch(self, exec_: int, stream: int) -> None:
        check(exec_ in self.execs, CUDA_ERROR_INVALID_HANDLE, f"graph exec {exec_:#x} does not exist")
        for work in self.execs[exec_]:
            self._run(stream, work)

    def graph_upload(self, exec_: int, stream: int) -> None:
        check(exec_ in self.execs, CUDA_ERROR_INVALID_HANDLE, f"graph exec {exec_:#x} does not exist")

    def graph_exec_destroy(self, exec_: int) -> None:
        check(self.execs.pop(exec_, None) is not None, CUDA_ERROR_INVALID_HANDLE, "no such graph exec")

    def graph_destroy(self, graph: int) -> None:
        check(self.graphs.pop(graph, None) is not None, CUDA_ERROR_INVALID_HANDLE, "no such graph")
        self.nodes.pop(graph, None)
