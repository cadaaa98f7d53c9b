"""The ``echo`` route: returns what it gets; transport tests and benchmarks use it.

meta: {"op": "echo"}            -> the same buffers back
      {"op": "sizes"}           -> [len, ...] of the buffers, none back
      {"op": "checksum", "stride": k} -> sum of every k-th byte of each buffer (proves arrival)
      {"op": "fail", "message"} -> raises (error-path tests)
      {"op": "crash"}           -> ends the worker process at once (isolation tests)
      {"op": "sleep", "s": x}   -> waits x seconds (timeout tests)
      {"op": "note", "v": x}    -> remembers x (ordering tests; usually a post)
      {"op": "notes"}           -> {"notes": [x, ...]} in arrival order, and forgets them
      {"op": "fill", "n": n}    -> one buffer of n bytes from memory the worker reuses (download benchmarks)
"""
from __future__ import annotations

import os
import time

import numpy as np

from .route import Executor as BaseExecutor, OpFailed


class Executor(BaseExecutor):
    def __init__(self, session):
        super().__init__(session)
        self.posts = 0
        self.notes: list = []
        self._fill = np.zeros(0, np.uint8)

    def welcome(self) -> dict:
        return {"route": "echo", "pid": os.getpid()}

    def handle(self, meta, buffers, reply):
        op = meta.get("op") if isinstance(meta, dict) else None
        if not reply:
            self.posts += 1
        if op == "echo":
            return {"posts": self.posts}, buffers
        if op == "sizes":
            return {"sizes": [b.nbytes for b in buffers], "posts": self.posts}, []
        if op == "checksum":
            stride = int(meta.get("stride", 4099))
            return {"sums": [int(np.frombuffer(b, np.uint8)[::stride].sum(dtype=np.uint64)) for b in buffers]}, []
        if op == "fail":
            raise OpFailed("echo.fail", str(meta.get("message", "failed on purpose")))
        if op == "crash":
            os._exit(3)
        if op == "sleep":
            time.sleep(float(meta.get("s", 0)))
            return {}, []
        if op == "note":
            self.notes.append(meta.get("v"))
            return {}, []
        if op == "notes":
            notes, self.notes = self.notes, []
            return {"notes": notes}, []
        if op == "fill":
            n = int(meta["n"])
            if self._fill.nbytes < n:
                self._fill = np.arange(n, dtype=np.uint8)  # the byte at i is i % 256
            return {}, [memoryview(self._fill)[:n]]
        raise OpFailed(f"echo.{op}", f"unknown echo op {op!r}")
