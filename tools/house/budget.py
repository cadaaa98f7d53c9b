"""A size budget per source file: most modules are short, and a long one is split at its second concern."""
from __future__ import annotations

from pathlib import Path

LIMIT = 500
SUFFIXES = (".py", ".c", ".cpp", ".h", ".sh")

# path -> (lines allowed, why this file may be longer for now)
EXCEPTIONS: dict[str, tuple[int, str]] = {
    "tests/test_connection.py": (520, "one suite over every transport's connection; to split by capability "
                                      "(posts, requests, the lone call, losing the transport)"),
}

# Generated files are read by compilers, not people, and checked for staleness instead (house/generated.py).
GENERATED = ("rgpu/protocol/rgpu_protocol.h", "rgpu/protocol/rgpu_protocol_libs.h")


def check(root: Path, files: list[Path]) -> list[str]:
    problems = []
    for f in files:
        if f.suffix not in SUFFIXES or not f.is_file():
            continue
        rel = str(f.relative_to(root))
        if rel in GENERATED:
            continue
        allowed, why = EXCEPTIONS.get(rel, (LIMIT, ""))
        n = f.read_bytes().count(b"\n")
        if n > allowed:
            extra = f" (its exception allows {allowed}: {why})" if why else ""
            problems.append(f"{rel}: {n} lines, over the budget of {allowed}{extra}; split it at its second concern")
    for rel in EXCEPTIONS:
        f = root / rel
        if not f.is_file() or f.read_bytes().count(b"\n") <= LIMIT:
            problems.append(f"{rel}: within {LIMIT} lines now (or gone): remove its exception from tools/house/budget.py")
    return problems
