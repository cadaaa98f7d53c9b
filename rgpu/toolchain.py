"""What a C++ build needs, found before it starts: a compiler, Python's headers, torch's headers, ninja.

    find_compiler()       the C++ compiler's path ($CXX, else c++, g++, clang++), or a BuildError naming
                          the command that installs one on Debian/Ubuntu, Fedora and macOS
    check_torch_build()   everything a torch C++ extension needs (the compiler, Python.h, torch's
                          headers, ninja); the compiler's path, or one BuildError listing what is missing
    install_hint(part)    those commands for one missing part, in words

Without this, a missing compiler shows as pages of torch's extension-build output;
``rgpu.native`` (and ``rgpu.torch_ext``) call ``check_torch_build()`` before compiling.
Standard library, ``rgpu.errors`` and (in ``check_torch_build``) torch only.
"""
from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

from .errors import BuildError

# part -> (Debian/Ubuntu, Fedora, macOS): the command that installs it
INSTALL = {
    "compiler": ("sudo apt-get install -y g++", "sudo dnf install -y gcc-c++", "xcode-select --install"),
    "python headers": (f"sudo apt-get install -y python{sys.version_info[0]}.{sys.version_info[1]}-dev",
                       "sudo dnf install -y python3-devel",
                       "xcode-select --install (or a Python from python.org or Homebrew, which bring them)"),
}
COMPILERS = ("c++", "g++", "clang++")


def install_hint(part: str) -> str:
    debian, fedora, macos = INSTALL[part]
    return f"Debian/Ubuntu: {debian}; Fedora: {fedora}; macOS: {macos}"


def find_compiler() -> str:
    """The C++ compiler torch's builder will run: ``$CXX`` if set (and found), else the first of c++, g++, clang++."""
    cxx = os.environ.get("CXX")
    if cxx:
        found = shutil.which(cxx.split()[0])
        if found is None:
            raise BuildError(f"CXX={cxx!r} names no program on PATH", install=install_hint("compiler"))
        return found
    for name in COMPILERS:
        found = shutil.which(name)
        if found:
            return found
    raise BuildError("no C++ compiler found ($CXX unset; no c++, g++ or clang++ on PATH)",
                     install=install_hint("compiler"))


def python_headers() -> Path | None:
    """The folder holding ``Python.h`` for this interpreter, or None where it is missing."""
    folder = Path(sysconfig.get_paths()["include"])
    return folder if (folder / "Python.h").exists() else None


def torch_headers() -> Path | None:
    """The folder holding ``torch/extension.h`` for the torch in use, or None (a torch installed without them)."""
    from torch.utils import cpp_extension

    for folder in cpp_extension.include_paths():
        if (Path(folder) / "torch" / "extension.h").exists():
            return Path(folder)
    return None


def ensure_ninja() -> str | None:
    """The ``ninja`` torch's builder runs; the pip package's copy put on PATH when only that one is there."""
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja  # the pip package: its binary sits in the venv, which may not be on PATH (an unactivated venv)
    except ImportError:
        return None
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return shutil.which("ninja")


def check_torch_build() -> str:
    """The C++ compiler's path once everything a torch extension needs is here; else one BuildError naming
    each missing part and the command that installs it."""
    from . import excepthook

    excepthook.install()   # a build that cannot run ends the program in one clear line
    missing = []
    try:
        compiler = find_compiler()
    except BuildError as exc:
        compiler, missing = "", [str(exc)]
    if python_headers() is None:
        missing.append(f"no Python.h for this Python ({sysconfig.get_paths()['include']}); install the headers: "
                       + install_hint("python headers"))
    if torch_headers() is None:
        import torch

        missing.append(f"torch {torch.__version__} has no C++ headers (torch/extension.h); reinstall it: "
                       f"pip install --force-reinstall torch=={torch.__version__.split('+')[0]}")
    if ensure_ninja() is None:
        missing.append("no ninja (torch builds extensions with it): pip install ninja")
    if missing:
        raise BuildError("cannot build rgpu's C++ parts here: " + "; ".join(missing))
    return compiler
