"""The interceptor's client lives inside someone else's program: no numba compile in a background thread there."""
from __future__ import annotations

import subprocess
import sys

import pytest


def test_memcpy_only_keeps_the_parallel_copy_from_ever_compiling():
    # a fresh process: fastcopy's state is per process; MIN_CORES=1 stands for a GPU host's 16 cores
    code = """
import threading
from rgpu.transport import fastcopy
fastcopy.MIN_CORES = 1
fastcopy.memcpy_only()
fastcopy.warm_up()
fastcopy.copy(memoryview(bytearray(8 << 20)), bytes(8 << 20))   # a big copy would warm up lazily too
assert not [t for t in threading.enumerate() if t.name == "rgpu-fastcopy-warmup"], threading.enumerate()
assert fastcopy.backend() == "memcpy", fastcopy.backend()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_interceptors_connection_turns_the_compile_off_before_connecting(monkeypatch):
    from rgpu.cuda_intercept import client as cclient
    from rgpu.transport import client as tclient, fastcopy

    order = []
    monkeypatch.setattr(fastcopy, "memcpy_only", lambda: order.append("memcpy_only"))
    monkeypatch.setattr(tclient, "connect", lambda route, **kw: order.append(("connect", route)) or "conn")

    class Lib:
        @staticmethod
        def rgpu_self_path():
            return b"/nowhere/libcuda.so.1"

    class Ffi:
        @staticmethod
        def string(p):
            return p

    c = cclient.Client(Ffi(), Lib())
    assert c.connection() == "conn"
    assert order == ["memcpy_only", ("connect", "cuda")]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_no_process_ever_compiles_the_parallel_copy_in_a_background_thread():
    # the first big copy compiles in the caller's thread (numba caches it), never behind its back
    code = """
import threading
from rgpu.transport import fastcopy
fastcopy.MIN_CORES = 1
fastcopy.copy(memoryview(bytearray(8 << 20)), bytes(8 << 20))
assert threading.active_count() == 1, threading.enumerate()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
