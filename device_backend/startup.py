"""The device's start-up: ``register()`` when rgpu is imported, ``start()`` at the first use of the device.

The top of ``device_backend``: it imports the parts below it (``registration``,
``session``, ``fallback``, ``torch_rgpu``, ``build``) and none of them imports it.
The parts that meet the first use (the fallback, ``torch.rgpu``, the compile
backend) call ``session.get()``, which runs the starter ``register()`` handed to
``session``. A start is, in order: load the C++ part, connect, build the
session, install the fast path, claim the composite ops, send the seeds set
before it. Importing this module imports no torch (``import rgpu`` stays cheap).
"""
from __future__ import annotations

import atexit
import importlib.util
import sys


def register() -> bool:
    """Make ``device="rgpu"`` usable; False (and nothing done) where torch is not installed."""
    from . import registration

    if not registration.register():
        return False
    from . import session

    session.starter = start
    return True


def register_with_torch() -> None:
    """``register()`` now if torch is imported, else the moment it is (``import rgpu`` stays torch-free)."""
    if "torch" in sys.modules:
        register()
    elif not any(isinstance(f, _TorchWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchWatcher())


class _TorchWatcher:
    """A meta-path finder that runs ``register()`` right after ``import torch`` finishes."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            register()

        spec.loader.exec_module = exec_module
        return spec


def start():
    """The first use of the device: load the C++ part, connect (``RGPU_SERVER`` or a local server), start."""
    import torch

    from rgpu.transport.client import connect

    from . import build

    from rgpu import config

    C = build.load()
    options = {"torch": torch.__version__, "python": sys.version.split()[0]}
    addresses = config.settings().server_addresses()
    if len(addresses) <= 1:
        return use(connect("ops", options=options), C)
    conns, wheres = connect_all(connect, addresses, options)
    return use(conns, C, wheres)


def connect_all(connect, addresses: list, options: dict) -> tuple[list, list]:
    """One session per server of ``RGPU_SERVER``, each told where its devices start: (connections, addresses).

    A server that cannot be reached ends the start, naming it; the ones reached are closed.
    """
    from rgpu.errors import RgpuError

    conns: list = []
    wheres = [f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in addresses]
    first = 0
    for where in wheres:
        try:
            conn = connect("ops", server=where, options={**options, "device_offset": first, "peer": True})
        except RgpuError as exc:
            for c in conns:
                c.close()
            raise type(exc)(f"server {where} of RGPU_SERVER: {exc}") from None
        conns.append(conn)
        first += int(((conn.welcome or {}).get("info") or {}).get("device_count", 1))
    return conns, wheres


def use(conn, C=None, wheres=None):
    """Make ``conn`` (or a list, one per server) the session's connection, closing the previous one.

    Tests run the executor in-process through this.
    """
    from rgpu import config

    from . import build, meta, registration, session, torch_rgpu

    with session.lock:
        s = session.Session(conn, C or build.load(), wheres)
        old = session.install(s)
        fast = config.settings().fast_path  # RGPU_FAST_PATH, read when a session starts
        fast_path(s, fast)
        if old is not None:
            old.close()
            meta.clear()
        else:
            claim_composites(s.C, fast)
            atexit.register(session.close_current)
            atexit.register(registration.settle_autograd_at_exit)  # runs first (last in, first out)
        torch_rgpu.send_pending_seeds(s)
    return s


def fast_path(s, on: bool) -> None:
    """A session starts: with ``on``, C++ (fast_path.cpp) streams the ops whose plan it knows.

    Why the Python fallback's registration goes: PyTorch takes one fallback per
    dispatch key, and the C++ one hands Python every call it cannot replay itself.
    Once installed, it stays; a session with the fast path off passes every call on.
    """
    from . import fallback, registration

    if on:
        registration.drop_python_fallback()
    if not registration.has_python_fallback():
        s.C.fast_install(fallback.from_cpp)
    # C++ posts under the session's lock, as post_op does; small uploads too (their bytes copied at the post),
    # and calls for small downloads and .item()s. Each op to its device's server; with several, through
    # Servers.sender, with the events due there (and their downloads Python's, which names a failed server)
    servers = s.servers
    targets = [(0, s.conn.post_packed, None, s.conn.call)] if not s.several else [
        (server.first, servers.sender(server), server.events, None) for server in servers.all]
    s.C.fast_session(s.lock, targets, on, s.conn.settings.post_copy_bytes)


def claim_composites(C=None, fast: bool = False) -> None:
    """Register the fallback as the PrivateUse1 kernel of ``optable.CLAIMED`` ops (once, at session start).

    With ``fast``, the kernel is the C++ fast path's (it hands Python what it cannot replay).
    """
    import torch

    from . import fallback, optable, registration

    names = set(optable.CLAIMED)
    for full in torch._C._dispatch_get_all_op_names():  # "aten::_foreach_add_.Scalar"
        ns, _, qualified = full.partition("::")
        if ns == "aten" and qualified.startswith(optable.CLAIMED_PREFIXES):
            names.add(qualified if "." in qualified else f"{qualified}.default")
    if fast:  # after fast_path(): the C++ kernel hands its misses to fallback.from_cpp
        C.fast_claim([q if not q.endswith(".default") else q[:-8] for q in sorted(names)])
        return
    lib = torch.library.Library("aten", "IMPL")
    for qualified in sorted(names):
        name, overload = qualified.split(".")
        op = getattr(getattr(torch.ops.aten, name), overload)
        lib.impl(qualified if overload != "default" else name, _kernel(fallback.fallback, op), "PrivateUse1")
    registration.keep(lib)


def _kernel(fallback, op):
    return lambda *args, **kwargs: fallback(op, *args, **kwargs)
