"""A session's profilers (``Msg.PROFILE``): ``Calls``, a cProfile of the executor's Python, and ``Trace``,
torch.profiler over the executor's CPU and the GPU with each message a named span.

``rgpu bench train --profile`` starts the first with ``[Msg.PROFILE, "start"]``, ``--trace FILE`` the
second with ``[Msg.PROFILE, "start", "trace"]``; ``[Msg.PROFILE, "stop", N]`` ends either (``stop``:
the text, and the trace's gzipped Chrome trace as the reply's one buffer, which ``rgpu.bench.timeline``
reads); ``cancel`` ends one and drops what it recorded. A trace's spans are added only while it runs:
the handlers are wrapped then and put back after, so the hot path pays nothing otherwise.
"""
from __future__ import annotations

import cProfile
import gzip
import io
import os
import pstats
import tempfile

import torch

from rgpu.protocol.ops import Msg

SPAN_PREFIX = "rgpu "  # a span per message: "rgpu OP", "rgpu RUN", "rgpu DOWNLOAD", ...


class Calls:
    def __init__(self):
        self._prof = cProfile.Profile()
        self._prof.enable()

    def cancel(self) -> None:
        self._prof.disable()

    def stop(self, top: int) -> tuple[str, list]:
        """The top ``top`` functions by their own time, as text; no buffers."""
        self.cancel()
        text = io.StringIO()
        pstats.Stats(self._prof, stream=text).sort_stats("tottime").print_stats(top)
        return text.getvalue(), []


class Trace:
    def __init__(self, handlers: dict, cuda: bool):
        self._handlers = handlers
        self._originals = dict(handlers)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities)
        for kind, handler in self._originals.items():
            if kind is not Msg.PROFILE:
                handlers[kind] = _spanned(SPAN_PREFIX + Msg(kind).name, handler)
        self._prof.__enter__()

    def cancel(self) -> None:
        """End the trace and drop what it recorded; the handlers are put back."""
        self._prof.__exit__(None, None, None)
        self._handlers.update(self._originals)

    def stop(self, top: int) -> tuple[str, list]:
        """The profiler's table of the top ``top`` ops by self CPU time, and [the gzipped Chrome trace]."""
        self.cancel()
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            self._prof.export_chrome_trace(path)
            with open(path, "rb") as f:
                data = gzip.compress(f.read(), compresslevel=3)
        finally:
            os.unlink(path)
        text = self._prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
        return text, [data]


def _spanned(name: str, handler):
    record = torch.profiler.record_function

    def spanned(meta, buffers):
        with record(name):
            return handler(meta, buffers)
    return spanned
