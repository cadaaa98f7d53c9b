"""Generated files stay generated: each is rebuilt from its source and compared with the tree's copy.

A whole file, or a section of one between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``
(the README's settings table, a perf page's current figures). Adding a generated file is one line
of ``GENERATED``; ``python tools/check_house.py --write`` rewrites them all.
"""
from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PY = sys.executable


@dataclass(frozen=True)
class Generated:
    path: str                 # relative to the root
    command: tuple[str, ...]  # prints the generated text; run in the root
    section: str = ""         # "" for the whole file, else the marker's NAME


GENERATED: tuple[Generated, ...] = (
    Generated("docs/cuda_coverage.md", (PY, "-m", "rgpu", "intercept", "coverage")),
    Generated("rgpu/protocol/rgpu_protocol.h",
              (PY, "-c", "from rgpu.protocol import header; print(header.render(), end='')")),
    Generated("rgpu/protocol/rgpu_protocol_libs.h",
              (PY, "-c", "from rgpu.protocol import header; print(header.render_libs(), end='')")),
    Generated("docs/config.md", (PY, "-m", "rgpu.config", "--docs")),
    Generated("README.md", (PY, "-m", "rgpu.config", "--readme"), section="settings"),
    Generated("docs/perf/transport.md", (PY, "tools/perf_tables.py", "transport"), section="current figures"),
    Generated("docs/perf/fast_path.md", (PY, "tools/perf_tables.py", "fast_path"), section="current figures"),
    Generated("docs/perf/device_route.md", (PY, "tools/perf_tables.py", "device_route"), section="current figures"),
    Generated("docs/perf/cuda_route.md", (PY, "tools/perf_tables.py", "cuda_route"), section="current figures"),
)


def _shown(command: tuple[str, ...]) -> str:
    return " ".join(("python",) + command[1:] if command[0] == PY else command)


def _span(text: str, name: str) -> tuple[int, int] | None:
    """Where a section's body lies (after its opening marker's line, up to its closing marker)."""
    m = re.search(rf"^<!-- generated: {re.escape(name)}\b.*?-->\n(.*?)^<!-- end generated -->$", text, re.M | re.S)
    return (m.start(1), m.end(1)) if m else None


def expected(root: Path, g: Generated) -> str:
    r = subprocess.run(g.command, cwd=root, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{_shown(g.command)} failed: {r.stderr.strip()[-500:]}")
    return r.stdout if r.stdout.endswith("\n") else r.stdout + "\n"


def check(root: Path, write: bool = False, only: tuple[Generated, ...] = GENERATED) -> list[str]:
    problems = []
    for g in only:
        path = root / g.path
        if not path.exists() and (g.section or not write):
            problems.append(f"{g.path}: missing; generate it with: python tools/check_house.py --write")
            continue
        text = path.read_text() if path.exists() else ""
        try:
            want = expected(root, g)
        except RuntimeError as exc:
            problems.append(f"{g.path}: {exc}")
            continue
        if g.section:
            span = _span(text, g.section)
            if span is None:
                problems.append(f"{g.path}: no '<!-- generated: {g.section} -->' ... '<!-- end generated -->' section")
                continue
            new = text[:span[0]] + want + text[span[1]:]
        else:
            new = want
        if new != text:
            if write:
                path.write_text(new)
            else:
                where = f"its '{g.section}' section" if g.section else "it"
                problems.append(f"{g.path}: stale; regenerate {where} with: "
                                f"python tools/check_house.py --write (runs {_shown(g.command)})")
    return problems
