"""``rgpu build``: every native part of rgpu built ahead, one line each; the parts as data.

    rgpu build                  build what is missing (first use would otherwise build it)
    rgpu build --list           each part's status: built, not built (and why not), skipped (and why)
    rgpu build --only NAME      one part;  --force  rebuild even what is cached

A part is a row of ``PARTS``: its name, what it is in words, what it needs (a check that
raises when the host lacks it: the part is then skipped with that reason), and the
``module:function`` that builds it (called with ``force=``). A new part is one more row.
The builds themselves (key, cache, lock, progress line) are ``rgpu.native``'s.
"""
from __future__ import annotations

import importlib
import platform
import sys
import time
from dataclasses import dataclass

from . import native


def _torch() -> None:
    import torch  # noqa: F401


def _cffi_on_x86() -> None:
    import cffi  # noqa: F401

    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"shm's C path is x86-64 only; this is {platform.machine()}")


def _cuda_headers() -> None:
    from rgpu.cuda_intercept import header

    header.find_include_dir()


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Part:
    name: str
    what: str
    needs: object          # a callable that raises when the host lacks what the part needs
    build: object          # "module:function" (or the function itself), called with force=
    built: object = ""     # the same, saying whether it is built; else native.built(build)
    native_name: str = ""  # the name its first-use build has in rgpu.native (why_not), where not the same


PARTS: tuple[Part, ...] = (
    Part("device", "the device's C++ part", _torch, "rgpu.device_backend.build:load",
         "rgpu.device_backend.build:built", "device_backend"),
    Part("server_ops", "the server's op path (C++)", _torch, "rgpu.server.ops.fast_op:build",
         "rgpu.server.ops.fast_op:built"),
    Part("shm", "shm's C modules", _cffi_on_x86, "rgpu.transport.shm_fast:build"),
    Part("launch_records", "the real driver's batch launcher (C)", _nothing, "rgpu.server.cuda.real_batch:build"),
    Part("cuda", "the CUDA route's libraries", _cuda_headers, "rgpu.cuda_intercept.libraries:build",
         native_name="intercept"),   # libcuda.so.1, libcudart.so.13, the stand-ins, the redirector: one folder
)


def _resolve(target):
    if callable(target):
        return target
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def _missing(part: Part) -> str | None:
    try:
        part.needs()
    except Exception as exc:  # noqa: BLE001  (whatever the host lacks, in its own words)
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def status(part: Part) -> str:
    """``built``, ``not built`` (with why it last failed), or ``skipped: <what the host lacks>``."""
    missing = _missing(part)
    if missing:
        return f"skipped: {missing}"
    try:
        done = _resolve(part.built)() if part.built else native.built(_resolve(part.build))
    except Exception as exc:  # noqa: BLE001
        return f"not built: {type(exc).__name__}: {exc}".splitlines()[0]
    if done:
        return "built"
    why = native.why_not(part.name) or native.why_not(part.native_name or part.name)
    return "not built" + (f" (last try: {why.splitlines()[0][:200]})" if why else "")


def build(part: Part, force: bool = False) -> tuple[bool, str]:
    """Build one part: (whether it is usable now, its line's text)."""
    missing = _missing(part)
    if missing:
        return True, f"skipped: {missing}"
    before, waits, start = len(native.builds()), len(native.waits()), time.monotonic()
    try:
        with native.recording(part.name):
            _resolve(part.build)(force=force)
    except Exception as exc:  # noqa: BLE001  (each part's failure is reported, the others still build)
        first, *rest = str(exc).splitlines() or [""]
        return False, "\n".join([f"FAILED: {type(exc).__name__}: {first}", *(f"    {line}" for line in rest[-15:])])
    seconds = time.monotonic() - start
    if len(native.builds()) > before:
        return True, f"built in {seconds:.1f} s"
    if len(native.waits()) > waits:
        return True, f"cached (another process built it meanwhile; waited {seconds:.0f} s)"
    return True, "cached"


def _run(args) -> int:
    chosen = [p for p in PARTS if args.only in (None, p.name)]
    if not chosen:
        print(f"rgpu build: no part named {args.only!r}; the parts: {', '.join(p.name for p in PARTS)}",
              file=sys.stderr)
        return 2
    width, what = max(len(p.name) for p in chosen), max(len(p.what) for p in chosen)
    ok = True
    for part in chosen:
        print(f"{part.name:{width}}  {part.what:{what}}  ", end="", flush=True)
        if args.list:
            line = status(part)
        else:
            usable, line = build(part, args.force)
            ok = ok and usable
        print(line, flush=True)
    if not native.enabled():
        print("note: RGPU_NATIVE=off: rgpu runs the Python path wherever a part has one (shm, the server's op path, "
              "the launch batcher, the device's fast path)", flush=True)
    return 0 if ok else 1


def add_parser(sub) -> None:
    p = sub.add_parser("build", help="build every native part ahead (first use would otherwise build it)")
    p.add_argument("--list", action="store_true", help="show each part's status and why it is not built")
    p.add_argument("--only", default=None, metavar="NAME", help=f"one part: {', '.join(q.name for q in PARTS)}")
    p.add_argument("--force", action="store_true", help="rebuild even what is cached")
    p.set_defaults(func=_run)
