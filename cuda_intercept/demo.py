"""The driver-API demo program (demo_vecadd.c): built with the C compiler against cuda.h, run natively or intercepted.

    python -m rgpu.cuda_intercept.demo [check | bench N]     builds it, runs it through the interceptor

Linked against rgpu's ``libcuda.so`` (any libcuda.so.1 satisfies it at run
time), so the same binary runs on the real driver and through rgpu.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from rgpu.errors import ConfigError

from . import header

SOURCE = Path(__file__).resolve().parent / "demo_vecadd.c"


def build_program(out_dir: str | os.PathLike, shim_dir: str | os.PathLike, source: Path = SOURCE) -> Path:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise ConfigError("no C compiler (gcc or cc) to build the demo program")
    exe = Path(out_dir) / source.stem
    done = subprocess.run([cc, "-O1", "-o", str(exe), str(source), f"-I{header.find_include_dir()}",
                           f"-L{shim_dir}", "-lcuda", "-ldl"], capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"building {source.name} failed: {done.stderr.strip()[:2000]}")
    return exe


def main(argv: list[str]) -> int:
    from .build import build
    from .cli import environment
    lib = build()
    exe = build_program(lib.parent, lib.parent)
    return subprocess.call([str(exe), *argv], env=environment(str(lib.parent)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
