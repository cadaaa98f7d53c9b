"""``rgpu intercept build | run | coverage``: build rgpu's libcuda.so.1, run a program with it in front of any real driver.

    rgpu intercept build [--out DIR] [--force]     prints the library's path
    rgpu intercept run -- PROGRAM [ARGS...]        runs PROGRAM with LD_LIBRARY_PATH naming it first
    rgpu intercept coverage [--out FILE]           writes docs/cuda_coverage.md's table
"""
from __future__ import annotations

import os
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("intercept", help="run unchanged CUDA programs against the remote GPU (libcuda.so.1)")
    sub = p.add_subparsers(dest="intercept_command", required=True)
    b = sub.add_parser("build", help="build (or find cached) rgpu's libcuda.so.1 and print its path")
    b.add_argument("--out", default=None, help="folder to build into (default ~/.cache/rgpu/intercept/<key>)")
    b.add_argument("--force", action="store_true", help="rebuild even when a cached build exists")
    b.set_defaults(func=_build)
    r = sub.add_parser("run", help="run a program with rgpu's libcuda.so.1 in front: rgpu intercept run -- prog args")
    r.add_argument("argv", nargs="+", help="the program and its arguments (after --)")
    r.set_defaults(func=_run)
    c = sub.add_parser("coverage", help="write the per-function coverage table (implemented, queued, refused)")
    c.add_argument("--out", default=None, help="file to write (default: print)")
    c.set_defaults(func=_coverage)


def _build(args) -> int:
    from .build import build
    print(build(args.out, force=args.force))
    return 0


def environment(lib_dir: str, env: dict | None = None) -> dict:
    """The environment a program runs in: our folder first on LD_LIBRARY_PATH."""
    env = dict(os.environ if env is None else env)
    paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and p != lib_dir]
    env["LD_LIBRARY_PATH"] = ":".join([lib_dir, *paths])
    return env


def _run(args) -> int:
    from .build import build
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        print("rgpu intercept run: name a program to run", file=sys.stderr)
        return 2
    lib = build()
    env = environment(str(lib.parent))
    sys.stdout.flush()
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        print(f"rgpu intercept run: cannot run {argv[0]}: {exc}", file=sys.stderr)
        return 127
    return 0


def _coverage(args) -> int:
    from .coverage import markdown
    text = markdown()
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0
