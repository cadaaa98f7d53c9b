"""Registers the rgpu device with torch, cheaply: no C++ build, no server, until first use.

``register()`` renames PrivateUse1 to "rgpu", installs ``torch.rgpu`` and the
Python boxed fallback. The first op on the device reaches the fallback, which
starts the session (``startup.start``: the C++ part, the connection, the
composite ops the server should run whole).
"""
from __future__ import annotations

import sys
import time

NAME = "rgpu"
AUTOGRAD_SETTLE_S = 0.02  # at exit, how long the autograd engine's device threads get the GIL to themselves
_libs: list = []  # torch.library registrations live as long as these objects
_fallback_lib = None  # the Python fallback's registration, until the C++ fast path takes its place


def register() -> bool:
    """Make ``device="rgpu"`` usable; False (and nothing done) where torch is not installed."""
    try:
        import torch
    except ImportError:
        return False
    if torch._C._get_privateuse1_backend_name() == NAME and hasattr(torch, NAME):
        return True
    from . import fallback, torch_rgpu

    torch.utils.rename_privateuse1_backend(NAME)
    torch._register_device_module(NAME, torch_rgpu)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
    global _fallback_lib
    _fallback_lib = torch.library.Library("_", "IMPL")
    _fallback_lib.fallback(fallback.fallback, dispatch_key="PrivateUse1")
    _copies_read_math_bits(torch)
    _patch_printing(torch)
    _placeholder_guard(torch)
    _load_if_built()
    _explain_cuda_autograd(torch)
    from . import compile as _compile

    _compile.register_backend()  # torch.compile(backend="rgpu"), registered when dynamo loads
    return True


def _copies_read_math_bits(torch) -> None:
    """``_copy_from`` reaches the device with its conjugate/negative bits (``copies`` applies them).

    Why: PyTorch resolves a conjugate view by cloning it, a clone copies, and a
    copy to or from a third-party device is ``_copy_from``; left to the
    conjugate fallback, that would clone again, without end (a stack overflow).
    """
    lib = torch.library.Library("aten", "IMPL")
    for key in ("Conjugate", "Negative"):
        for name in ("_copy_from", "_copy_from_and_resize"):
            lib.impl(name, torch.library.fallthrough_kernel, key)
    _libs.append(lib)


CUDA_AUTOGRAD_NOTE = (
    "rgpu: CUDA autograd does not work in a process where the rgpu device is registered (`import rgpu`): "
    "PyTorch then takes PrivateUse1 as the process's accelerator and its autograd engine fails on CUDA "
    "tensors (PyTorch issue #161129). Run native CUDA training in a process that never imports rgpu "
    "(rgpu's own benchmarks do: rgpu/bench/native_step.py); rgpu tensors and CPU tensors are not affected.")


def _explain_cuda_autograd(torch) -> None:
    """Where it bites, say why: a CUDA backward in this process fails in the engine with an internal assert.

    Why: ``rename_privateuse1_backend`` marks PrivateUse1 registered, after which
    ``at::getAccelerator()`` answers PrivateUse1 before CUDA; autograd nodes then
    find no stream for CUDA inputs and ``engine.cpp`` asserts
    ``opt_ready_stream && opt_parent_stream`` (#161129). There is no way to
    register a named PrivateUse1 backend without that mark, so the failure stays;
    this wraps the engine entry that ``torch.autograd.backward`` and ``grad``
    call to re-raise it with the cause and the workaround.
    """
    ag = torch.autograd
    run = getattr(ag, "_engine_run_backward", None)
    if run is None or getattr(run, "_rgpu_explained", False):
        return

    def _engine_run_backward(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        except RuntimeError as e:
            if "opt_ready_stream" in str(e):
                raise RuntimeError(f"{CUDA_AUTOGRAD_NOTE}\n(original error: {e})") from e
            raise

    _engine_run_backward._rgpu_explained = True
    ag._engine_run_backward = _engine_run_backward


def settle_autograd_at_exit() -> None:
    """At exit (registered with the first session): a moment without the GIL for autograd's device threads.

    Why: the engine's thread for our device drops its last graph task only after the backward that waited
    on it has returned, and the task's thread-local state holds a Python object, so that drop takes the
    GIL. Taken once the interpreter is finalizing, the GIL ends the thread mid-unwind through C++ and the
    process aborts ("terminate called without an active exception"; 3-4 exits in 40 right after an rgpu
    backward, none with this sleep). Sleeping releases the GIL, so the drop happens before finalization.
    """
    time.sleep(AUTOGRAD_SETTLE_S)


def _load_if_built() -> None:
    """Load the C++ part now when it is already built (a millisecond), never in the server.

    Why: ``torch.Generator("rgpu")`` and ``pin_memory()`` ask for the device's
    hooks before any op has reached the fallback; without them PyTorch refuses.
    On a cold cache the build waits for the first op (``torch.rgpu.init()`` forces it).
    """
    if "rgpu.server" in sys.modules:
        return
    from . import build

    if build.built():
        build.load()


def _placeholder_guard(torch) -> None:
    """A Python device guard until the C++ one replaces it on first use.

    Why: ``.to("rgpu")`` asks the guard for the current device before any op
    reaches the fallback, so without a guard the very first ``.to`` would fail.
    Where torch has no Python guard API, the C++ part loads now (except in the
    server, which never loads it).
    """
    acc = getattr(torch._C, "_acc", None)
    if acc is not None and hasattr(acc, "register_python_privateuseone_device_guard"):
        class Placeholder(acc.DeviceGuard):
            def type_(self):
                return torch._C._autograd.DeviceType.PrivateUse1

        _libs.append(Placeholder())
        acc.register_python_privateuseone_device_guard(_libs[-1])
    elif "rgpu.server" not in sys.modules:
        from . import build

        build.load()


def keep(lib) -> None:
    """Keep a ``torch.library.Library`` registration alive for the process."""
    _libs.append(lib)


def has_python_fallback() -> bool:
    """Whether the Python fallback is PrivateUse1's registered fallback (until the C++ one takes its place)."""
    return _fallback_lib is not None


def drop_python_fallback() -> None:
    """Unregister the Python fallback, so that the C++ fast path's can be installed (PyTorch takes one per key)."""
    global _fallback_lib
    if _fallback_lib is not None:
        _fallback_lib._destroy()
        _fallback_lib = None


def _patch_printing(torch) -> None:
    """Printing a device tensor downloads it once, instead of a round trip per statistic."""
    import torch._tensor_str as ts

    inner = ts._tensor_str

    def _tensor_str(self, indent):
        if self.device.type == NAME:
            self = self.cpu()
        return inner(self, indent)

    ts._tensor_str = _tensor_str
