"""``rgpu intercept build | run | coverage``: build rgpu's CUDA libraries, run an unchanged program with them.

    rgpu intercept build [--out DIR] [--force]     builds the library set, prints each file's path
    rgpu intercept run [--preload] -- PROGRAM ...  runs PROGRAM with rgpu's libraries redirected in
                                                   (LD_AUDIT; --preload: the LD_PRELOAD fallback)
    rgpu intercept coverage [--out FILE]           writes docs/cuda_coverage.md's table

The exit status of PROGRAM is ``rgpu intercept run``'s (the program replaces it).
"""
from __future__ import annotations

import os
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("intercept", help="run unchanged CUDA programs against the remote GPU (rgpu's CUDA libraries)")
    sub = p.add_subparsers(dest="intercept_command", required=True)
    b = sub.add_parser("build", help="build (or find cached) rgpu's CUDA libraries and print their paths")
    b.add_argument("--out", default=None, help="folder to build into (default ~/.cache/rgpu/intercept/<key>)")
    b.add_argument("--force", action="store_true", help="rebuild even when a cached build exists")
    b.set_defaults(func=_build)
    r = sub.add_parser("run", help="run a program with rgpu's CUDA libraries in place of NVIDIA's: rgpu intercept run -- prog args")
    r.add_argument("--preload", action="store_true",
                   help="LD_PRELOAD rgpu's libraries instead of redirecting with LD_AUDIT (where the loader has no audit interface)")
    r.add_argument("argv", nargs="+", help="the program and its arguments (after --)")
    r.set_defaults(func=_run)
    c = sub.add_parser("coverage", help="write the per-function coverage table (implemented, queued, refused)")
    c.add_argument("--out", default=None, help="file to write (default: print)")
    c.set_defaults(func=_coverage)


def _build(args) -> int:
    from .libraries import REDIRECTOR, REPLACED, build
    folder = build(args.out, force=args.force)
    for name in (REDIRECTOR, *REPLACED[1:], REPLACED[0]):     # libcuda.so.1 last: scripts take the last line
        if (folder / name).exists():
            print(folder / name)
    return 0


def environment(lib_dir: str, env: dict | None = None, *, preload: bool = False) -> dict:
    """The environment a program runs in (``libraries.environment``): our libraries redirected in."""
    from .libraries import environment as redirected
    return redirected(lib_dir, env, preload=preload)


def _run(args) -> int:
    from .libraries import audit_available, build
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        print("rgpu intercept run: name a program to run", file=sys.stderr)
        return 2
    if not args.preload and not audit_available():
        print("rgpu intercept run: this loader has no audit interface (not glibc): LD_PRELOAD instead, "
              "so a stock library opened by absolute path still loads beside rgpu's", file=sys.stderr)
    env = environment(str(build()), preload=args.preload)
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
        print(text, end="")     # the text ends its last line; the page and stdout must match
    return 0
