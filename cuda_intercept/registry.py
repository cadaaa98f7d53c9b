"""The Python implementations of driver entry points, registered by export name, and what every call is wrapped in.

``@implements("cuMemAlloc_v2")`` registers a function taking the export's
arguments (cffi values) and returning a CUresult; it may raise ``CudaCallError``.
``handler(name)`` gives what libcuda.so.1's ``_py_<name>`` runs: the
implementation, or a refusal, or "not supported" (logged once per name), with
the garbage collector held off and every exception turned into a CUresult --
cffi would otherwise answer 0, which is CUDA_SUCCESS.
"""
from __future__ import annotations

import gc
import logging
import traceback
from typing import Callable

from rgpu.errors import AuthenticationError, ConnectError, ConnectionLost, RgpuError, Timeout
from rgpu.protocol.cuda import (  # noqa: F401  (the CUresult numbers: one table for both ends)
    CUDA_ERROR_DEVICE_UNAVAILABLE, CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NO_DEVICE, CUDA_ERROR_NOT_FOUND, CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_ERROR_UNKNOWN, CUDA_SUCCESS,
)

from .annotations import REFUSED, base_of

log = logging.getLogger("rgpu.cuda")

STREAM_PER_THREAD = 0x2

IMPLS: dict[str, Callable] = {}
STREAM_ARG: dict[str, int] = {}          # export -> index of its CUstream parameter
_said: set[str] = set()


class CudaCallError(RgpuError):
    """A call the interceptor answers with ``code``; ``message`` (if any) is logged once per text."""

    def __init__(self, code: int, message: str = ""):
        self.code = code
        super().__init__(message)


def implements(*names: str, stream: int | None = None):
    """Register the decorated function for these exports; ``stream``: index of the CUstream argument."""
    def register(fn):
        for name in names:
            IMPLS[name] = fn
            if stream is not None:
                STREAM_ARG[name] = stream
        return fn
    return register


def say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.warning("rgpu: %s", message)


def _transport_code(exc: RgpuError) -> int:
    if isinstance(exc, (ConnectError, AuthenticationError)):
        return CUDA_ERROR_NO_DEVICE       # what a program expects when there is no GPU to be had
    if isinstance(exc, (ConnectionLost, Timeout)):
        return CUDA_ERROR_DEVICE_UNAVAILABLE
    return CUDA_ERROR_UNKNOWN


def _guard(name: str, impl: Callable) -> Callable:
    def call(*args):
        held = gc.isenabled()
        if held:
            gc.disable()   # a collection here could run finalizers that call back into the driver
        try:
            return impl(*args)
        except CudaCallError as exc:
            if str(exc):
                say_once(f"{name}: {exc}")
            return exc.code
        except RgpuError as exc:
            say_once(f"{name}: {type(exc).__name__}: {exc}")
            return _transport_code(exc)
        except Exception:
            say_once(f"{name} failed inside rgpu:\n{traceback.format_exc()}")
            return CUDA_ERROR_UNKNOWN
        finally:
            if held:
                gc.enable()
    call.__name__ = name
    return call


def _per_thread(impl: Callable, index: int) -> Callable:
    """The _ptsz/_ptds flavour: a NULL stream means the per-thread default stream."""
    def call(*args):
        if index < len(args) and not args[index]:
            args = args[:index] + (STREAM_PER_THREAD,) + args[index + 1:]
        return impl(*args)
    return call


def _refuse(reason: str) -> Callable:
    def call(*args):
        raise CudaCallError(CUDA_ERROR_NOT_SUPPORTED, f"refused: {reason}")
    return call


def _missing(name: str) -> Callable:
    def call(*args):
        raise CudaCallError(CUDA_ERROR_NOT_SUPPORTED, f"{name} is not implemented by rgpu's libcuda.so.1 "
                                                      "(returning CUDA_ERROR_NOT_SUPPORTED)")
    return call


def status(name: str) -> str:
    """"implemented", "refused" or "missing", for the coverage page."""
    if name in IMPLS:
        return "implemented"
    return "refused" if base_of(name) in REFUSED else "missing"


def handler(name: str) -> Callable:
    impl = IMPLS.get(name)
    if impl is None:
        base = base_of(name)
        impl = _refuse(REFUSED[base]) if base in REFUSED else _missing(name)
    elif name in STREAM_ARG and name.endswith(("_ptsz", "_ptds")):
        impl = _per_thread(impl, STREAM_ARG[name])
    return _guard(name, impl)
