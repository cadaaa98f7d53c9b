"""One session's math libraries on the cuda route: cuBLAS, cuBLASLt and cuDNN, run where the GPU is.

The client's rgpu libraries forward whole calls, numbered (``rgpu.protocol.cuda_libs``); the executor
hands each here (``lib_call`` answered, ``lib_record`` from the C queue, in order with the launches).
A call's payload is unpacked by its protocol fields and run by the library's implementation, loaded at
its first call: ``<lib>_real.py`` (the real library through ctypes, on the session's thread, in its
current context) beside the real driver, ``<lib>_fake.py`` (torch on the CPU, over the fake driver's
memory) beside the fake one. The handles and descriptors the client minted are mapped there and freed
when the session ends.

An implementation is a class ``Library(driver, owner)`` with one method per call, named as the call
(``cublasGemmEx(self, handle, stream, tail, **fields)``), returning the library's status, or
``(status, output bytes)``; ``LibError(status, message)`` fails a call with a message the client shows;
``status_name(status)`` names a status; ``close()`` frees everything. cuBLAS's also has
``records_table()``: its C table (a pointer) through which the executor's C walker runs queued GEMMs
beside the launches, or None (``records_table`` here hands it out).

``RGPU_CUDA_LIB_TRACE=1`` in the server's environment writes one line per call run here to stderr: the
call, queued or answered, its fields, its status and message (what a GPU run needs to name the failing call).
"""
from __future__ import annotations

import importlib
import logging
import sys

from rgpu.protocol.cuda import NO_STREAM
from rgpu.protocol.cuda_libs import CALLS

from ..base import CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_LAUNCH_FAILED, CUDA_ERROR_NOT_SUPPORTED, CudaDriverError

log = logging.getLogger("rgpu.server.cuda")

# id range -> the library's module prefix here (its protocol module is rgpu.protocol.lib_<prefix>)
RANGES = ((0x100, 0x200, "cublas"), (0x200, 0x300, "cublaslt"), (0x300, 0x400, "cudnn"))


class LibError(Exception):
    """A library call that fails with ``status``; ``message`` reaches the client."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _trace(name, answered, handle, fields, tail, status, message) -> None:
    """One traced call: ``rgpu lib: cudnnBackendFinalize answered h=0x.. {fields} +tail -> status message``."""
    shown = " ".join(f"{k}={v:#x}" if isinstance(v, int) and v > 0xFFFF else f"{k}={v}"
                     for k, v in list(fields.items())[:6])
    result = "raised" if status is None else str(status)
    sys.stderr.write(f"rgpu lib: {name} {'answered' if answered else 'queued'} h={handle:#x} {shown} +{tail}B"
                     f" -> {result}{': ' + message if message else ''}\n")
    sys.stderr.flush()


class Libraries:
    def __init__(self, driver):
        self.driver = driver
        self.flavour = "fake" if getattr(driver, "name", "") == "fake" else "real"
        self.open: dict[str, object] = {}        # prefix -> its implementation, once loaded
        self._specs: dict[int, tuple] = {}       # call id -> what run() needs of its spec (_spec)
        from rgpu import config
        self.trace = config.settings().cuda_lib_trace
        from .trace import recorder
        self.recorder = recorder(driver)        # RGPU_CUDA_LIB_RECORD: every call and the GEMMs' bytes, to a file

    def library(self, prefix: str):
        """The implementation of ``prefix`` (cublas, cublaslt, cudnn), loaded at its first use."""
        lib = self.open.get(prefix)
        if lib is None:
            module = importlib.import_module(f"{__name__}.{prefix}_{self.flavour}")
            lib = self.open[prefix] = module.Library(self.driver, self)
        return lib

    def records_table(self) -> int | None:
        """cuBLAS's C table (``cublas_records.c``), through which the executor's C walker runs queued GEMMs
        without coming here; None where there is none, and while a trace or a recording is on (they see
        every call here)."""
        lib = self.open.get("cublas")
        return None if lib is None or self.trace or self.recorder else lib.records_table()

    def _spec(self, call: int):
        """``(spec, its fixed fields' struct, their names, the library's prefix)`` of a call id, made once."""
        spec = CALLS.get(call)
        prefix = next((p for lo, hi, p in RANGES if lo <= call < hi), None) if spec else None
        if spec is None or prefix is None:
            raise CudaDriverError(CUDA_ERROR_NOT_SUPPORTED, f"unknown math library call {call!r}")
        entry = self._specs[call] = (spec, spec.format, tuple(name for name, _ in spec.fields), prefix)
        return entry

    @staticmethod
    def call_name(call: int) -> str:
        """The library function a call id names (``call <id>`` for an unknown one)."""
        spec = CALLS.get(call)
        return spec.name if spec else f"call {call}"

    def run(self, call: int, handle: int, stream: int, payload=None, *, answered: bool):
        """Run one forwarded call: ``[status, message]`` (or ``[output, status, message]``) when answered;
        a queued call that fails raises, so the executor defers its error to the next synchronisation."""
        spec, fixed, names, prefix = self._specs.get(call) or self._spec(call)
        payload = memoryview(b"") if payload is None else payload
        if payload.nbytes < fixed.size:
            raise CudaDriverError(CUDA_ERROR_INVALID_VALUE,
                                  f"{spec.name}: a payload of {payload.nbytes} bytes, expected at least {fixed.size}")
        lib = self.library(prefix)
        method = getattr(lib, spec.name, None)
        if method is None:
            raise CudaDriverError(CUDA_ERROR_NOT_SUPPORTED, f"{spec.name} is not forwarded by this server's {prefix}")
        fields = dict(zip(names, fixed.unpack_from(payload)))
        out, message = None, None
        rec = self.recorder and self.recorder.before(spec, handle, stream, payload, fields, answered)
        try:
            result = method(handle=handle, stream=None if stream == NO_STREAM else stream,
                            tail=payload[fixed.size:], **fields)
        except LibError as exc:
            result, message = exc.status, str(exc)
        except Exception as exc:
            if self.trace:
                _trace(spec.name, answered, handle, fields, payload.nbytes - fixed.size, None, repr(exc))
            raise
        status, out = (result if isinstance(result, tuple) else (result, None))
        status = int(status or 0)
        if status and message is None:
            message = f"{lib.status_name(status)} ({status})"
        if self.trace:
            _trace(spec.name, answered, handle, fields, payload.nbytes - fixed.size, status, message)
        if rec:
            self.recorder.after(rec, status, out, message)
        if not answered:
            if status:
                raise CudaDriverError(CUDA_ERROR_LAUNCH_FAILED, f"{spec.name}: {message}", op=spec.name)
            return None
        return [out, status, message] if out is not None else [status, message]

    def close(self) -> None:
        if self.recorder:
            self.recorder.close(self)
            self.recorder = None
        for prefix, lib in reversed(list(self.open.items())):   # cuDNN, then cuBLASLt, then cuBLAS
            try:
                lib.close()
            except Exception:
                log.exception("closing %s failed", prefix)
        self.open.clear()
