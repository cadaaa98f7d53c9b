"""Shared pieces of the CUDA route tests (no tests here): the shim build, an in-process loopback, a C program.

The loopback connection runs the cuda route's executor on the fake driver
inside the test process, so the shim loaded with ctypes exercises C, the
Python client and the executor without sockets.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import msgpack
import pytest

HERE = Path(__file__).resolve().parent


def cuda_headers_or_skip():
    from rgpu.cuda_intercept import header
    from rgpu.errors import ConfigError
    try:
        return header.find_include_dir()
    except ConfigError as exc:
        pytest.skip(f"no CUDA toolkit headers here: {exc}")


def build_shim_or_skip() -> Path:
    cuda_headers_or_skip()
    pytest.importorskip("cffi", reason="cffi builds libcuda.so.1")
    from rgpu.cuda_intercept import build
    return build.build()


class _Reply:
    def __init__(self, meta, buffers):
        self.meta, self.buffers = meta, buffers

    def release(self):
        pass


class _Future:
    def __init__(self, reply):
        self._reply = reply

    def result(self, timeout=None):
        return self._reply


class Loopback:
    """A Connection look-alike that hands every frame to a cuda route executor in this process.

    Metadata goes through msgpack both ways, as on the wire, so only wire types pass.
    """

    def __init__(self, driver: str = "fake"):
        from rgpu import config
        from rgpu.server.route import Session
        from rgpu.server.cuda.executor import Executor
        self.executor = Executor(Session("loopback", "cuda", config.settings(cuda_driver=driver)))
        self.welcome = self.executor.welcome()
        self.stats = {"messages": 0, "round_trips": 0, "posts": 0}

    def _wire(self, meta):
        return msgpack.unpackb(msgpack.packb(meta, use_bin_type=True), raw=False)

    def post(self, meta, buffers=()):
        self.stats["messages"] += 1
        self.stats["posts"] += 1
        self.executor.handle(self._wire(meta), [memoryview(bytes(b)) for b in buffers], False)

    def request(self, meta, buffers=(), reply_into=None):
        self.stats["messages"] += 1
        self.stats["round_trips"] += 1
        meta, bufs = self.executor.handle(self._wire(meta), [memoryview(bytes(b)) for b in buffers], True)
        assert all(isinstance(b, memoryview) for b in bufs), "the transport sends memoryviews only"
        bufs = [memoryview(bytes(b)) for b in bufs]
        if reply_into is not None and [v.nbytes for v in reply_into] == [b.nbytes for b in bufs]:
            for dest, src in zip(reply_into, bufs):
                dest[:] = src
            bufs = list(reply_into)
        return _Future(_Reply(self._wire(meta), bufs))

    def call(self, meta, buffers=(), reply_into=None, timeout=None, sent=None):
        fut = self.request(meta, buffers, reply_into)
        if sent is not None:              # as Connection.call: once the request is out, before its answer
            sent()
        return fut.result()

    def flush(self):
        pass

    def close(self):
        self.executor.close()


VECADD_C = HERE.parent / "cuda_intercept" / "demo_vecadd.c"


def compile_c_program(source: Path, out_dir: Path, shim_dir: Path) -> Path:
    """Build a driver-API C program against the toolkit's cuda.h, linked to our libcuda.so."""
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler")
    include = cuda_headers_or_skip()
    exe = out_dir / source.stem
    cc = shutil.which("gcc") or shutil.which("cc")
    subprocess.run([cc, "-O1", "-o", str(exe), str(source), f"-I{include}", f"-L{shim_dir}", "-lcuda", "-ldl"],
                   check=True, capture_output=True, text=True)
    return exe


_in_process: ctypes.CDLL | None = None


def shim_in_process() -> ctypes.CDLL:
    """rgpu's libcuda.so.1 loaded into this process once, its client talking to a Loopback, cuInit done."""
    global _in_process
    if _in_process is None:
        path = build_shim_or_skip()
        from rgpu.cuda_intercept import embed
        embed._connect_override = Loopback
        lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW)
        assert lib.cuInit(0) == 0
        _in_process = lib
    return _in_process
