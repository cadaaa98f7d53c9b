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


class _Reply:
    meta, buffers = (0, "answer", []), []

    def release(self):
        pass


def _client_over(conn):
    from rgpu.cuda_intercept import client as cclient

    class Lib:
        rgpu_queue_take = staticmethod(lambda n, count: None)
        rgpu_work_note = staticmethod(lambda: 7)
        rgpu_ctx_current = staticmethod(lambda: 1)

    class Ffi:
        NULL = None
        new = staticmethod(lambda kind: 0)   # drain() reads nothing: the queue is empty

    c = cclient.Client(Ffi(), Lib(), connect=lambda: conn)
    return c


def test_a_call_holds_the_order_lock_for_its_send_only_so_other_threads_go_on_while_it_waits():
    import threading

    seen = {}

    class Conn:
        def call(self, meta, buffers=(), reply_into=None, sent=None):
            seen["held while sending"] = c.lock._is_owned()
            sent()                                        # written: the wait for the answer follows
            other = threading.Thread(target=lambda: seen.update(other=c.lock.acquire(timeout=5) and c.lock.release()
                                                                 is None))
            other.start()
            other.join(10)
            seen["held while waiting"] = c.lock._is_owned()
            return _Reply()

    c = _client_over(Conn())
    assert c.call("stream_synchronize", 0) == ("answer", [])
    assert seen == {"held while sending": True, "other": True, "held while waiting": False}
    assert not c.lock._is_owned()


def test_a_call_refused_before_its_send_leaves_the_lock_free():
    class Conn:
        def call(self, meta, buffers=(), reply_into=None, sent=None):
            raise TypeError("cannot encode")             # before anything is sent: sent() never called

    c = _client_over(Conn())
    with pytest.raises(TypeError, match="cannot encode"):
        c.call("init", 1)
    assert not c.lock._is_owned() and c.lock.acquire(blocking=False)
    c.lock.release()


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
