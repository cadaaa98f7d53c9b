"""rgpu's one native build: the cache, the build key, the lock, the install and the reason a build failed.

Every C and C++ part (the device's C++ part, the server's op path, shm's C
modules, the CUDA route's libraries, the server's launch batcher) is built
through this module, by ``rgpu build`` ahead of time or on first use:

    cache_root()            $XDG_CACHE_HOME/rgpu, else ~/.cache/rgpu (read when called)
    key(*parts)             a short hash of sources, generated text, compiler and versions
    cached(name, key, ...)  build once into <cache>/native/<name>/<key>/ under an fcntl lock
                            (concurrent processes build once), installed atomically, with a
                            progress line on stderr and the time it took
    build_library(...)      plain C sources to a shared library (soname, version node)
    attempt(name, build)    build() or None (RGPU_NATIVE=off, or it failed); why_not(name) says why
    built(build)            whether build() would find everything built (it compiles nothing)

A failed build raises ``BuildError`` with the compiler's last lines. It sits at
the bottom layer: the standard library, ``rgpu.config`` and ``rgpu.errors`` only
(torch, cffi and setuptools are imported by the parts that need them).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from . import config
from .errors import BuildError

T = TypeVar("T")

_failed: dict[str, str] = {}          # part name -> why its build (or load) failed in this process
_built: list[tuple[str, float]] = []  # (part name, seconds) of every compile this process ran
_waited: list[tuple[str, float]] = []  # (folder, seconds) this process waited for another's build


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/rgpu``, else ``~/.cache/rgpu``; read when called."""
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "rgpu"


def enabled() -> bool:
    """Whether native parts are used at all (``RGPU_NATIVE=auto``); ``off``: every Python reference path."""
    return config.settings().native != "off"


def key(*parts: str | bytes | os.PathLike) -> str:
    """A 16-hex-digit hash of ``parts``: texts, bytes, or paths (hashed by name and content)."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, os.PathLike):
            part = Path(part)
            h.update(part.name.encode() + b"\0" + part.read_bytes())
        else:
            h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0\1")
    return h.hexdigest()[:16]


def compiler() -> str:
    """``$CC``, else the first of cc, gcc, clang on PATH; a ``BuildError`` naming how to install one if none."""
    cc = os.environ.get("CC")
    if cc:
        return cc
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    raise BuildError("no C compiler found ($CC unset; no cc, gcc or clang on PATH)", install=_install_hint())


@functools.cache
def compiler_identity(cc: str) -> str:
    """The first line of ``cc --version`` (part of a build key, so a new compiler rebuilds)."""
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{cc}: {exc}"
    return f"{cc}: {out.splitlines()[0] if out else ''}"


def _install_hint() -> str:
    if sys.platform == "darwin":
        return "xcode-select --install"
    for tool, command in (("apt-get", "sudo apt-get install -y build-essential"), ("dnf", "sudo dnf install -y gcc"),
                          ("yum", "sudo yum install -y gcc"), ("apk", "apk add build-base"),
                          ("pacman", "sudo pacman -S base-devel"), ("conda", "conda install -c conda-forge c-compiler")):
        if shutil.which(tool):
            return command
    return "install gcc or clang, or set $CC"


def why_not(name: str) -> str | None:
    """Why part ``name`` failed to build or load: in this process, else in the last process that tried
    (a server's background build, an earlier ``rgpu build``); None when it did not fail."""
    if name in _failed:
        return _failed[name]
    note = _failure_note(name)
    return note.read_text() if note.exists() else None


def _failure_note(name: str) -> Path:
    return cache_root() / "native" / ".failed" / name


def builds() -> list[tuple[str, float]]:
    """(part, seconds) of every compile this process ran, in order (``rgpu build`` tells built from cached)."""
    return list(_built)


def waits() -> list[tuple[str, float]]:
    """(folder name, seconds) of every wait for another process's build of what this one wanted, in order."""
    return list(_waited)


def attempt(name: str, build: Callable[[], T], *, wanted: bool | None = None) -> T | None:
    """``build()``, or None where ``RGPU_NATIVE=off`` or it raises; ``why_not(name)`` then says which.

    For the parts with a Python twin: a failed build never stops rgpu, the Python path runs instead.
    ``wanted``: the caller's own decision (from its settings) instead of reading ``RGPU_NATIVE`` here.
    """
    if not (enabled() if wanted is None else wanted):
        _failed[name] = "RGPU_NATIVE=off"
        return None
    try:
        with recording(name):
            return build()
    except Exception:  # noqa: BLE001  (no compiler, no cffi, a read-only cache: the Python twin works)
        return None


@contextlib.contextmanager
def recording(name: str) -> Iterator[None]:
    """Notes why the block raised as ``why_not(name)`` (and lets it raise); forgets it when the block succeeds."""
    note = _failure_note(name)
    try:
        yield
    except NotBuilt:
        raise
    except Exception as exc:
        _failed[name] = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(OSError):   # a read-only cache: this process still knows
            note.parent.mkdir(parents=True, exist_ok=True)
            note.write_text(_failed[name])
        raise
    _failed.pop(name, None)
    with contextlib.suppress(OSError):
        note.unlink(missing_ok=True)


class NotBuilt(Exception):
    """Raised by ``cached()`` inside ``built()``: the part is not built (nothing was compiled)."""


_probe = threading.local()


def built(build: Callable[[], object]) -> bool:
    """Whether ``build()`` would find everything built: it runs with every compile refused."""
    _probe.on = True
    try:
        build()
    except NotBuilt:
        return False
    finally:
        _probe.on = False
    return True


@contextlib.contextmanager
def locked(folder: Path, what: str = "") -> Iterator[None]:
    """An exclusive inter-process lock on ``folder`` (a ``.lock`` file beside it), held for the block;
    with ``what``, a line on stderr when another process holds it (building what this one wants)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if what:
                print(f"rgpu: waiting for another process building {what} ...", file=sys.stderr, flush=True)
            start = time.monotonic()
            fcntl.flock(lock, fcntl.LOCK_EX)
            _waited.append((folder.name, time.monotonic() - start))
        yield


@contextlib.contextmanager
def progress(name: str, what: str) -> Iterator[None]:
    """A first-use build's two lines on stderr (``rgpu: building <what> ...``, ``... built in 41.2 s``)."""
    print(f"rgpu: building {what} ...", file=sys.stderr, flush=True)
    start = time.monotonic()
    yield
    seconds = time.monotonic() - start
    _built.append((name, seconds))
    print(f"rgpu: ... built in {seconds:.1f} s", file=sys.stderr, flush=True)


def install(built: Path, target: Path) -> Path:
    """``built`` copied to ``target`` atomically: a concurrent build or load never sees half a file."""
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    shutil.copyfile(built, partial)
    os.chmod(partial, 0o755)
    os.replace(partial, target)
    return target


def ready(folder: Path, name: str, build_key: str, outputs: Sequence[str]) -> bool:
    """Whether ``folder`` holds every one of ``outputs``, built from ``build_key``."""
    stamp = folder / f".{name}.key"   # the key inside the folder (in the cache it is in the path too)
    return all((folder / o).exists() for o in outputs) and stamp.exists() and stamp.read_text() == build_key


def cached(name: str, build_key: str, outputs: Sequence[str], produce: Callable[[Path], object], *, what: str,
           folder: Path | None = None, force: bool = False, keep: bool = False) -> Path:
    """The folder that holds ``outputs``, each built once by ``produce(staging)`` and installed atomically.

    ``folder`` defaults to ``<cache>/native/<name>/<build_key>/``. ``produce`` writes every name of
    ``outputs`` into the empty ``staging`` folder; it runs under an inter-process lock, after a second
    look, so concurrent processes build once. ``force`` rebuilds. ``keep``: staging is ``<folder>/build``
    and stays (a build's logs, what a torch extension's builder loads from). Raises what ``produce`` raises.
    """
    folder = Path(folder) if folder is not None else cache_root() / "native" / name / build_key
    if not force and ready(folder, name, build_key, outputs):
        return folder
    if getattr(_probe, "on", False):
        raise NotBuilt(name)
    folder.mkdir(parents=True, exist_ok=True)
    with locked(folder, what):
        if force or not ready(folder, name, build_key, outputs):
            with progress(name, what), _staging(folder, name, keep) as staging:
                produce(staging)
                for o in outputs:
                    install(staging / o, folder / o)
                stamp = staging / f".{name}.key"
                stamp.write_text(build_key)
                os.replace(stamp, folder / stamp.name)   # last: the outputs are whole before it says so
    return folder


@contextlib.contextmanager
def _staging(folder: Path, name: str, keep: bool) -> Iterator[Path]:
    if not keep:
        with tempfile.TemporaryDirectory(prefix=f".build-{name}-", dir=folder) as tmp:
            yield Path(tmp)
        return
    staging = folder / "build"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    yield staging


@contextlib.contextmanager
def capturing(what: str) -> Iterator[None]:
    """For a builder that runs the compiler on this process's own stdout and stderr (cffi, setuptools,
    torch): what it writes is kept aside, and a failure is one ``BuildError`` carrying its last lines.

    Why the file descriptors, not ``sys.stdout``: the compiler is a child process writing to them. Another
    thread's output while a build runs is kept aside too (a build is short, and once per machine).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile() as log:
        saved = os.dup(1), os.dup(2)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        failure: BaseException | None = None
        try:
            yield
        except BuildError:
            raise
        except Exception as exc:
            failure = exc
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        if failure is not None:
            log.seek(0)
            first = (str(failure).splitlines() or [""])[0][:300]
            output = log.read().decode(errors="replace") + f"\n{failure}"
            raise BuildError(f"{what}: {type(failure).__name__}: {first}", output=output) from failure


def run_compiler(command: Sequence[str], what: str) -> None:
    """Run one compiler command; a ``BuildError`` with its last lines when it fails."""
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise BuildError(f"{what}: compiler {command[0]!r} not found", install=_install_hint()) from None
    if done.returncode != 0:
        raise BuildError(f"{what}: the compiler failed (exit {done.returncode})", output=done.stdout + done.stderr)


def build_library(name: str, sources: Iterable[str | os.PathLike], *, out_dir: str | os.PathLike | None = None,
                  soname: str | None = None, version_node: str | None = None,
                  include_dirs: Iterable[str | os.PathLike] = (), library_dirs: Iterable[str | os.PathLike] = (),
                  libraries: Iterable[str] = (), rpath: Iterable[str | os.PathLike] = (),
                  extra_cflags: Iterable[str] = (), extra_ldflags: Iterable[str] = (),
                  generated: Mapping[str, str] | None = None, key_extra: str = "", force: bool = False) -> Path:
    """Plain C ``sources`` (and ``generated``: file name -> C text) compiled into one shared library; its path.

    ``cc -O2 -fPIC -shared`` (``$CC``, else cc, gcc, clang), ``-Wl,-soname,<soname>`` when given, and a
    version script ``<version_node> { global: *; };`` when given, so every export carries that node.
    The file is named ``soname`` (else ``lib<name>.so``) and lands in ``<cache>/native/<name>/<key>/``,
    or in ``out_dir``; the key hashes the sources, the ``.h`` files beside them, ``generated``, the
    flags, the compiler's identity and ``key_extra``. Generated ``.h`` files are on the include path,
    generated ``.c`` files compiled. Raises ``BuildError`` with the compiler's last lines.
    """
    sources = [Path(s).resolve() for s in sources]
    generated = dict(generated or {})
    include_dirs, library_dirs = [str(d) for d in include_dirs], [str(d) for d in library_dirs]
    libraries, rpath = list(libraries), [str(r) for r in rpath]
    extra_cflags, extra_ldflags = list(extra_cflags), list(extra_ldflags)
    cc = compiler()
    filename = soname or f"lib{name}.so"
    headers = sorted({h for s in sources for h in s.parent.glob("*.h")})
    build_key = key(*sources, *headers, *(f"{n}\0{t}" for n, t in sorted(generated.items())), compiler_identity(cc),
                    repr((filename, version_node, include_dirs, library_dirs, libraries, rpath, extra_cflags,
                          extra_ldflags)), key_extra)

    def produce(staging: Path) -> None:
        gen = staging / "generated"
        gen.mkdir()
        for n, text in generated.items():
            (gen / n).write_text(text)
        command = [cc, "-O2", "-fPIC", "-shared", *extra_cflags, f"-I{gen}", *(f"-I{d}" for d in include_dirs),
                   *(str(s) for s in sources), *(str(gen / n) for n in generated if n.endswith(".c")),
                   "-o", str(staging / filename)]
        if soname:
            command.append(f"-Wl,-soname,{soname}")
        if version_node:
            script = staging / "exports.map"
            script.write_text(f"{version_node} {{ global: *; }};\n")
            command.append(f"-Wl,--version-script={script}")
        command += [*(f"-L{d}" for d in library_dirs), *(f"-Wl,-rpath,{r}" for r in rpath),
                    *(f"-l{lib}" for lib in libraries), *extra_ldflags]
        run_compiler(command, f"building {filename}")

    folder = cached(name, build_key, [filename], produce, what=f"{filename} (once)",
                    folder=Path(out_dir) if out_dir is not None else None, force=force)
    return folder / filename
