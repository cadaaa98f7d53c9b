"""What libcuda.so.1's init code runs, once per process: attach a Python function to every export, then say ready.

Runs inside the host interpreter when the program is Python (numba, torch)
and inside a fresh embedded one otherwise.  At interpreter exit the queued
work is flushed, the connection closed, and C told never to enter Python
again: destructors that call the driver after that get an answer from C.
"""
from __future__ import annotations

import atexit

from . import calls_code, calls_device, calls_launch, calls_link, calls_memory, calls_order, calls_pointer  # noqa: F401 (register)
from . import calls_libs, client
from .registry import CUDA_SUCCESS, _guard, handler

_connect_override = None     # tests: a factory of in-process connections


def attach(ffi, lib, names) -> None:
    c = client.attach(ffi, lib, _connect_override)
    for name in names:
        ffi.def_extern(name=f"_py_{name}", error=999)(handler(name))

    def flush():
        with c.lock:
            if c.conn is not None:
                c.drain()
        return CUDA_SUCCESS

    ffi.def_extern(name="_py_rgpu_flush", error=999)(handler_for_flush(flush))
    ffi.def_extern(name="_py_rgpu_lib_call", error=999)(
        _guard("rgpu_lib_call", lambda *args: calls_libs.lib_call(c, ffi, *args)))
    atexit.register(_at_exit, c)
    from rgpu import config
    settings = config.settings()
    # RGPU_NATIVE=off: memsets, events, waits, frees, small copies and graph launches posted by Python (the reference)
    lib.rgpu_records_native(int(settings.native != "off"))
    limit = max(1, settings.cuda_queue_bytes)    # RGPU_CUDA_QUEUE_BYTES, RGPU_CUDA_QUEUE_FIRST_BYTES: when it is posted
    lib.rgpu_queue_limit(limit, max(1, settings.cuda_queue_first_bytes or limit))
    lib.rgpu_set_ready()


def handler_for_flush(flush):
    return _guard("rgpu_flush", flush)


def _at_exit(c) -> None:
    c.lib.rgpu_set_finalized()
    from rgpu import config
    if config.settings().cuda_wait_report and c.waits:
        import sys
        top = ", ".join(f"{name} {n}" for name, n in c.waits.most_common(12))
        print(f"rgpu: {sum(c.waits.values())} answered calls (round trips) in all; the most: {top}", file=sys.stderr)
    try:
        c.close()
    except Exception:        # the process is ending; the server cleans up a dropped session
        pass
