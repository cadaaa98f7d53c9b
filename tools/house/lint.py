"""ruff over the tree, with the rule set pyproject.toml's [tool.ruff] chooses."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def check(root: Path) -> list[str]:
    try:
        r = subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", "--no-cache",
                            "--output-format", "concise", "."], cwd=root, capture_output=True, text=True)
    except OSError as exc:
        return [f"ruff could not run ({exc}); it is in the test extra: pip install -e '.[test]'"]
    if r.returncode == 0:
        return []
    if "No module named ruff" in r.stderr:
        return ["ruff is not installed; it is in the test extra: pip install -e '.[test]'"]
    return [line for line in (r.stdout + r.stderr).splitlines() if line.strip() and not line.startswith("Found ")]
