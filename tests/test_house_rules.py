"""The house's rules hold themselves: each check of tools/check_house.py fails on a planted breach, naming it."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from house import budget, compiled, generated, layers, lint  # noqa: E402

PYPROJECT = '''
[tool.setuptools.package-dir]
"rgpu" = "rgpu"
"rgpu.transport" = "transport"
"rgpu.server" = "server"
"rgpu.device_backend" = "device_backend"
'''


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in {"pyproject.toml": PYPROJECT, "rgpu/__init__.py": "", "rgpu/errors.py": "",
                      "transport/__init__.py": "", "server/__init__.py": "", "device_backend/__init__.py": "",
                      **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_a_layered_tree_passes_the_layer_check(tmp_path):
    root = _tree(tmp_path, {"server/worker.py": "from rgpu.transport import x\nfrom rgpu import errors\n",
                            "transport/x.py": "from ..errors import E\n", "rgpu/cli.py": "import rgpu.server.worker\n"})
    assert layers.check(root) == []


def test_an_upward_import_fails_naming_file_line_and_both_modules(tmp_path):
    root = _tree(tmp_path, {"transport/x.py": "import os\n\ndef f():\n    from rgpu.server import worker\n",
                            "server/worker.py": ""})
    assert layers.check(root) == ["transport/x.py:4: rgpu.transport.x -> rgpu.server.worker "
                                  "(rgpu.transport sits below rgpu.server)"]


def test_one_route_importing_another_fails(tmp_path):
    root = _tree(tmp_path, {"server/worker.py": "from rgpu.device_backend import session\n",
                            "device_backend/session.py": ""})
    [problem] = layers.check(root)
    assert problem.startswith("server/worker.py:1: rgpu.server.worker -> rgpu.device_backend.session")
    assert "independent routes" in problem


def test_the_package_top_may_import_only_the_bottom_at_module_level(tmp_path):
    lazy = "from .errors import E\n\ndef __getattr__(name):\n    from .device_backend import register\n"
    assert layers.check(_tree(tmp_path, {"rgpu/__init__.py": lazy})) == []
    [problem] = layers.check(_tree(tmp_path, {"rgpu/__init__.py": "from .device_backend import register\n"}))
    assert problem.startswith("rgpu/__init__.py:1: rgpu -> rgpu.device_backend")


def test_an_import_of_a_module_that_is_gone_fails(tmp_path):
    [problem] = layers.check(_tree(tmp_path, {"server/codec.py": "from rgpu.ops_protocol import Msg\n"}))
    assert "no such module" in problem


def test_a_file_over_its_budget_fails_and_its_exception_lets_it_through(tmp_path, monkeypatch):
    big = tmp_path / "server" / "big.py"
    big.parent.mkdir(parents=True)
    big.write_text("x = 1\n" * (budget.LIMIT + 1))
    monkeypatch.setattr(budget, "EXCEPTIONS", {})
    [problem] = budget.check(tmp_path, [big])
    assert problem.startswith(f"server/big.py: {budget.LIMIT + 1} lines, over the budget of {budget.LIMIT}")
    monkeypatch.setattr(budget, "EXCEPTIONS", {"server/big.py": (budget.LIMIT + 10, "why")})
    assert budget.check(tmp_path, [big]) == []
    big.write_text("x = 1\n")
    assert "remove its exception" in budget.check(tmp_path, [big])[0]


def test_a_lint_error_fails_naming_the_rule(tmp_path):
    pytest.importorskip("ruff", reason="ruff is in the test extra")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "ok.py").write_text("import os\n\nprint(os.sep)\n")
    assert lint.check(tmp_path) == []
    (tmp_path / "bad.py").write_text("def f():\n    return undefined_name\n")
    [problem] = lint.check(tmp_path)
    assert problem.startswith("bad.py:2:") and "F821" in problem


@pytest.mark.parametrize("path", ["docs/config.md", "README.md"])
def test_a_stale_generated_file_fails_and_write_makes_it_current(tmp_path, path):
    [entry] = [g for g in generated.GENERATED if g.path == path]
    copy = tmp_path / path
    copy.parent.mkdir(parents=True, exist_ok=True)
    text = (ROOT / path).read_text()
    assert generated.check(ROOT, only=(entry,)) == [], f"{path} is stale in the tree itself"
    needle = "| `RGPU_MAX_FRAME` |" if path == "docs/config.md" else "| `RGPU_PORT` |"
    copy.write_text(text.replace(needle, "| `RGPU_PORT_THAT_WAS` |"))
    [problem] = generated.check(tmp_path, only=(entry,))
    assert problem.startswith(f"{path}: stale")
    assert generated.check(tmp_path, write=True, only=(entry,)) == []
    assert copy.read_text() == text


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) here")
def test_a_c_warning_fails_the_compiled_check_and_so_does_a_header_no_unit_includes(tmp_path):
    unit = tmp_path / "transport" / "shm_fast.c"
    unit.parent.mkdir(parents=True)
    unit.write_text('#include "part.c"\nint f(void) { return g(); }\n')
    part = tmp_path / "transport" / "part.c"
    part.write_text("static int g(void) { return 0; }\n")
    assert compiled.check(tmp_path, [unit, part], cxx=False) == []
    part.write_text("static int g(void) { int unused; return 0; }\n")
    [problem] = compiled.check(tmp_path, [unit, part], cxx=False)
    assert "transport/shm_fast.c: does not compile with -Wall -Werror" in problem and "unused" in problem
    part.write_text("static int g(void) { return 0; }\n")
    stray = tmp_path / "transport" / "stray.h"
    stray.write_text("int h(void);\n")
    assert compiled.check(tmp_path, [unit, part, stray], cxx=False) == [
        "transport/stray.h: compiled by no unit of tools/house/compiled.py (add its unit)"]


def test_the_runner_exits_nonzero_and_names_the_breach(tmp_path):
    big = tmp_path / "bench" / "big.py"
    big.parent.mkdir(parents=True)
    big.write_text("x = 1\n" * 600)
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "check_house.py"), "budget", "--root", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "budget: bench/big.py: 600 lines" in r.stdout
