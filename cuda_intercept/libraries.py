"""rgpu's CUDA library set, built into one folder, and the environment that points a program (not a server) at it.

    python -m rgpu.cuda_intercept.libraries [FOLDER]      (or: rgpu intercept build)

The folder holds ``libcuda.so.1`` (cffi, ``build.py``), ``libcudart.so.13`` (``cudart_build.py``), the
stand-ins ``libcublas.so.13``, ``libcublasLt.so.13``, ``libcudnn.so.9`` (``stubs.py``) and the redirector
``librgpu_redirect.so`` (``redirect.c``), an ``LD_AUDIT`` module that answers every look-up of those five
with the file here, by name, by absolute path or through ``DT_RPATH``, so the stock copies never load; a
copy a wheel vendored under a hashed name (torchvision's ``libcudart.<hash>.so.13``) is one of them.
It refuses NVML (``libnvidia-ml.so.1``): NVML describes this machine's GPUs, and torch's
``device_count()`` asks it before the runtime; refused, torch counts rgpu's devices.

Where ``LD_AUDIT`` is unavailable, ``LD_PRELOAD`` of the five is the fallback: the libc is not glibc
(musl has no audit interface), or the program runs in secure-execution mode (set-user-ID or file
capabilities: the loader drops an ``LD_AUDIT`` that names a path), or ``--preload`` asks for it. It is
weaker: preloaded libraries win by SONAME, but a stock copy loaded by absolute path still loads beside
ours and runs its constructor; and every child (a compiler too) gets all five loaded.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REDIRECTOR = "librgpu_redirect.so"
REPLACED = ("libcuda.so.1", "libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcudnn.so.9")

# What rgpu leaves stock, and what becomes of it. The math and communication libraries load and stay
# inert; their first call asks the driver for its private tables, which rgpu's driver refuses with a line
# naming the library. The compilers need no GPU and run here.
_REFUSED = "loads; its first call fails, naming it"
STOCK = {
    "libcufft.so.12": f"cuFFT: {_REFUSED}", "libcusparse.so.12": f"cuSPARSE: {_REFUSED}",
    "libcurand.so.10": f"cuRAND: {_REFUSED}", "libcusolver.so.12": f"cuSOLVER: {_REFUSED}",
    "libnccl.so.2": f"NCCL: {_REFUSED}", "libcupti.so.13": f"CUPTI: {_REFUSED}",
    "libcusparseLt.so.0": f"cuSPARSELt: {_REFUSED}", "libcufile.so.0": f"cuFile: {_REFUSED}",
    "libnvrtc.so.13": "NVRTC: compiles on this machine", "libnvJitLink.so.13": "nvJitLink: links on this machine",
}

NVML = "libnvidia-ml.so.1"    # refused by the redirector (redirect.c says why)

# The variables a program run through rgpu gets, and a server it starts must not.
LIBRARY_DIR = "RGPU_LIBRARY_DIR"


def build(folder: str | os.PathLike | None = None, *, force: bool = False) -> Path:
    """Build (or find built) the whole set into ``folder`` (default: libcuda.so.1's cache folder); the folder."""
    from rgpu import native

    from . import build as driver_build
    from . import stubs
    out = driver_build.build(folder, force=force).parent
    try:
        from . import cudart_build
    except ImportError as exc:     # the runtime is built by its own module; without it torch's runtime is stock
        print(f"rgpu: libcudart.so.13 not built ({exc}): the stock runtime would load", file=sys.stderr)
    else:
        cudart_build.build(out, force=force)
    stubs.build_all(out, force=force)
    native.build_library("redirect", [HERE / "redirect.c"], out_dir=out, soname=REDIRECTOR, libraries=["dl"],
                         extra_cflags=["-std=gnu11", "-Wall"], force=force)
    return out


def audit_available() -> bool:
    """Whether this platform's loader has the audit interface (glibc's); a program's own secure mode aside."""
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):
        return False


def _entries(value: str | None) -> list[str]:
    return [p for p in (value or "").replace(" ", ":").split(":") if p]


def environment(folder: str | os.PathLike, env: dict | None = None, *, preload: bool = False) -> dict:
    """The environment a program runs in: the redirector (or the preload fallback), our folder first on
    LD_LIBRARY_PATH, RGPU_LIBRARY_DIR and TRITON_LIBCUDA_PATH (Triton links its launcher against the driver
    it finds there, else ldconfig's). Children (compile workers, ptxas) inherit it."""
    folder = str(folder)
    env = dict(os.environ if env is None else env)
    env["LD_LIBRARY_PATH"] = ":".join([folder, *(p for p in _entries(env.get("LD_LIBRARY_PATH")) if p != folder)])
    env[LIBRARY_DIR] = folder
    env["TRITON_LIBCUDA_PATH"] = folder
    redirector = os.path.join(folder, REDIRECTOR)
    if preload or not audit_available():
        ours = [os.path.join(folder, n) for n in REPLACED if os.path.exists(os.path.join(folder, n))]
        env["LD_PRELOAD"] = ":".join([*ours, *(p for p in _entries(env.get("LD_PRELOAD")) if p not in ours)])
    elif os.path.exists(redirector):       # a folder with libcuda.so.1 alone (demo.py's) needs LD_LIBRARY_PATH only
        env["LD_AUDIT"] = ":".join([redirector, *(p for p in _entries(env.get("LD_AUDIT")) if p != redirector)])
    return env


def without(folder: str | os.PathLike, env: dict) -> dict:
    """``env`` with every trace of ``folder`` removed: what a local server started from the program gets,
    so it loads the real driver and libraries, never ours."""
    folder = str(folder)
    env = dict(env)
    for var in ("LD_LIBRARY_PATH", "LD_AUDIT", "LD_PRELOAD"):
        if var in env:
            kept = [p for p in _entries(env[var]) if p != folder and os.path.dirname(p) != folder]
            if kept:
                env[var] = ":".join(kept)
            else:
                del env[var]
    for var in (LIBRARY_DIR, "TRITON_LIBCUDA_PATH"):
        if env.get(var) == folder:
            del env[var]
    return env


def default_folder() -> Path:
    """Where ``rgpu intercept run`` builds the set: libcuda.so.1's cache folder (keyed by cuda.h and the sources)."""
    from . import build as driver_build
    from . import header, model
    return driver_build.default_cache_dir() / driver_build.build_key(model.parse(header.load()))


def _stock_path(name: str) -> str | None:
    """Where the stock ``name`` is, if anywhere: a pip wheel's nvidia/*/lib or torch/lib, else ldconfig's cache."""
    import glob
    import site
    import subprocess
    for d in [*site.getsitepackages(), site.getusersitepackages(), *sys.path]:
        found = sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", name)) + glob.glob(os.path.join(d, "torch", "lib", name)))
        if found:
            return found[0]
    try:
        cache = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in cache.splitlines():
        if line.strip().startswith(name + " ") and "=>" in line:
            return line.split("=>")[-1].strip()
    return None


def _vendored_copies() -> list[tuple[str, str]]:
    """Copies of the replaced libraries that wheels vendor under a hashed name (auditwheel's ``<package>.libs/``:
    torchvision's ``libcudart.<hash>.so.13``), with the replaced library each stands for; the redirector
    answers each with rgpu's file (redirect.c's ``vendored``)."""
    import glob
    import re
    import site
    found: dict[str, str] = {}
    for ours in REPLACED:
        stem, major = ours.split(".so.")
        pattern = re.compile(re.escape(stem) + r"[.-][0-9A-Za-z]{4,}\.so\." + re.escape(major) + r"(\..*)?$")
        for d in [*site.getsitepackages(), site.getusersitepackages(), *sys.path]:
            for path in glob.glob(os.path.join(d, "*.libs", stem + "*")):
                if pattern.match(os.path.basename(path)):
                    found.setdefault(os.path.realpath(path), ours)
    return sorted(found.items())


def report(folder: str | os.PathLike | None = None) -> dict:
    """What a run through ``rgpu intercept run`` would load, and from where (for ``rgpu doctor``)."""
    try:
        folder = Path(folder) if folder is not None else default_folder()
    except Exception as exc:     # noqa: BLE001  (no cuda.h: nothing can be built, and the report says why)
        return {"folder": None, "why": f"{type(exc).__name__}: {exc}", "libraries": []}
    rows = [{"name": n, "from": "rgpu", "path": str(folder / n), "built": (folder / n).exists()} for n in REPLACED]
    rows += [{"name": n, "from": "stock", "what": what, "path": _stock_path(n)} for n, what in STOCK.items()]
    rows += [{"name": os.path.basename(path), "from": "vendored", "path": path, "ours": ours,
              "what": f"a copy {Path(path).parent.name} vendors: rgpu's {ours} loads instead"}
             for path, ours in _vendored_copies()]
    rows.append({"name": NVML, "from": "refused", "what": "NVML would describe this machine's GPUs; torch counts rgpu's",
                 "path": None})
    return {"folder": str(folder), "built": (folder / REDIRECTOR).exists(), "how": "LD_AUDIT" if audit_available() else "LD_PRELOAD",
            "libraries": rows}


def describe(rep: dict) -> list[str]:
    """The report as lines of text."""
    if rep["folder"] is None:
        return [f"rgpu's CUDA libraries cannot be built here: {rep['why']}"]
    lines = [f"a run through `rgpu intercept run` loads ({rep['how']}{'' if rep['built'] else '; not built yet: rgpu intercept build'}):"]
    for r in rep["libraries"]:
        if r["from"] == "rgpu":
            lines.append(f"  {r['name']:20} rgpu   {r['path']}{'' if r['built'] else '  (not built)'}")
        elif r["from"] == "refused":
            lines.append(f"  {r['name']:20} none   (not loaded: {r['what']})")
        elif r["from"] == "vendored":
            lines.append(f"  {r['name']:20} rgpu   ({r['what']}: {r['path']})")
        else:
            lines.append(f"  {r['name']:20} stock  {r['path'] or '(not found here)'}  ({r['what']})")
    return lines


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else None, force=True))
