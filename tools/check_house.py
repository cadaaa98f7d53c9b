"""The house's rules, checked before the tests: lint, C/C++ warnings, layers, file sizes, generated files.

    python tools/check_house.py                 every check (CI runs this)
    python tools/check_house.py layers budget   some of them: lint, compiled, layers, budget, generated
    python tools/check_house.py --write         regenerate every generated file (docs/config.md, tables)
    python tools/check_house.py --no-cxx        the torch C++ parts left out of 'compiled' (a minute less)

Each failure names what broke and where (file:line); the exit status is 1 when any did.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from house import budget, compiled, generated, layers, lint  # noqa: E402

CHECKS = ("lint", "layers", "budget", "generated", "compiled")


def files(root: Path) -> list[Path]:
    """The tree's files: git's tracked ones where the root is a checkout, else every file under it."""
    if (root / ".git").exists():
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
        found = [root / p for p in out.decode().split("\0") if p]
    else:
        found = [p for p in root.rglob("*") if p.is_file()]
    return [p for p in found if p.is_file() and not any(part.startswith(".") or part in ("__pycache__", "build")
                                                         or part.endswith(".egg-info")
                                                         for part in p.relative_to(root).parts)]


def run(root: Path, names: tuple[str, ...], write: bool = False, cxx: bool = True) -> dict[str, list[str]]:
    tree = files(root)
    how = {
        "lint": lambda: lint.check(root),
        "layers": lambda: layers.check(root),
        "budget": lambda: budget.check(root, tree),
        "generated": lambda: generated.check(root, write=write),
        "compiled": lambda: compiled.check(root, tree, cxx=cxx),
    }
    results = {}
    for name in names:
        t0 = time.perf_counter()
        results[name] = how[name]()
        state = "ok" if not results[name] else f"{len(results[name])} failure(s)"
        print(f"house: {name:9s} {state} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checks", nargs="*", choices=CHECKS + ((),), default=())
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    p.add_argument("--write", action="store_true", help="regenerate the generated files instead of failing")
    p.add_argument("--no-cxx", action="store_true", help="leave the torch C++ parts out of 'compiled'")
    args = p.parse_args(argv)
    names = tuple(args.checks) or CHECKS
    if args.write:
        names = tuple(n for n in names if n == "generated") or ("generated",)
    results = run(args.root.resolve(), names, write=args.write, cxx=not args.no_cxx)
    for name, problems in results.items():
        for line in problems:
            print(f"{name}: {line}")
    return 1 if any(results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
