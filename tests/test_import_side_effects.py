"""Importing rgpu's parts registers nothing; only ``import rgpu`` (the user's entry) names the device.

The server's worker and the CUDA route's embedded init reach rgpu through its
submodules: they must leave PrivateUse1 unnamed (a named one breaks CUDA
autograd in that process) and never load the client's device code. Inside
``device_backend`` the imports go one way, with ``startup`` at the top.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEVICE_BACKEND = ROOT / "device_backend"


def _python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=full,
                          cwd=str(ROOT))


@pytest.mark.parametrize("module", ["rgpu.errors", "rgpu.config", "rgpu.protocol.ops", "rgpu.protocol.header",
                                    "rgpu.cuda_intercept.registry", "rgpu.transport.wire", "rgpu.server.worker",
                                    "rgpu.server.ops.executor"])
def test_importing_a_part_of_rgpu_with_torch_imported_leaves_privateuse1_unnamed(module):
    r = _python(f"import sys, torch, {module}\n"
                "print(torch._C._get_privateuse1_backend_name(), hasattr(torch, 'rgpu'),\n"
                "      [m for m in sys.modules if m.startswith('rgpu.device_backend')])\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["privateuseone", "False", "[]"], r.stdout


def test_from_a_part_of_rgpu_import_leaves_privateuse1_unnamed_too():
    r = _python("import torch\nfrom rgpu.config import settings\nfrom rgpu.errors import RgpuError\n"
                "import rgpu\nprint(torch._C._get_privateuse1_backend_name(), rgpu.RgpuError is RgpuError)")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["privateuseone", "True"]


def test_rgpu_register_names_the_device_where_rgpu_was_first_loaded_as_a_parent():
    r = _python("import torch, rgpu.errors, rgpu\nrgpu.register()\n"
                "print(torch._C._get_privateuse1_backend_name(), hasattr(torch, 'rgpu'))")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["rgpu", "True"]


def test_import_rgpu_names_the_device_and_its_top_is_lazy():
    r = _python("import sys, rgpu\nassert 'rgpu.errors' not in sys.modules and 'torch' not in sys.modules\n"
                "err = rgpu.RemoteError\nimport torch\n"
                "print(torch._C._get_privateuse1_backend_name(), err.__module__)")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["rgpu", "rgpu.errors"]


SITECUSTOMIZE = """
import atexit, json, os, sys

def _report():
    if not sys.argv or not sys.argv[0].endswith(os.path.join("server", "worker.py")):
        return
    torch = sys.modules.get("torch")
    with open(os.path.join(os.environ["IMPORT_REPORT_DIR"], f"{os.getpid()}.json"), "w") as f:
        json.dump({"privateuse1": torch._C._get_privateuse1_backend_name() if torch is not None else None,
                   "device_code": sorted(m for m in sys.modules if m.startswith("rgpu.device_backend")),
                   "ran_ops": "rgpu.server.ops.executor" in sys.modules}, f)

atexit.register(_report)
"""


def test_a_server_worker_running_ops_never_imports_the_device_code_and_leaves_privateuse1_unnamed(
        start_server, tmp_path):
    site, reports = tmp_path / "site", tmp_path / "reports"
    site.mkdir()
    reports.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)  # each of the server's processes reports at its exit
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    server = start_server(env={"PYTHONPATH": path, "IMPORT_REPORT_DIR": str(reports)})
    client = _python(textwrap.dedent("""
        import rgpu, torch
        x = torch.ones(2, device="rgpu")
        print(torch._C._get_privateuse1_backend_name(), (x + 1).cpu().tolist())
    """), env={"RGPU_SERVER": server.address, "RGPU_TOKEN": server.token})
    assert client.returncode == 0, client.stderr[-2000:]
    assert client.stdout.split("\n")[0] == "rgpu [2.0, 2.0]"
    deadline = time.monotonic() + 60
    while not list(reports.glob("*.json")) and time.monotonic() < deadline:  # the session's worker exits
        time.sleep(0.1)
    found = [json.loads(p.read_text()) for p in reports.glob("*.json")]
    assert found, f"no worker reported:\n{server.stderr[-2000:]}"
    worker = next(r for r in found if r["ran_ops"])
    assert worker == {"privateuse1": "privateuseone", "device_code": [], "ran_ops": True}


def _edges() -> dict[str, set[str]]:
    """device_backend's module -> the sibling modules it imports (at the top or inside functions)."""
    names = {p.stem for p in DEVICE_BACKEND.glob("*.py")}
    edges: dict[str, set[str]] = {n: set() for n in names}
    for name in names:
        for node in ast.walk(ast.parse((DEVICE_BACKEND / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1 and node.module:
                    targets = [node.module.split(".")[0]]
                elif node.level == 1:
                    targets = [a.name for a in node.names]
                elif node.module == "rgpu.device_backend":
                    targets = [a.name for a in node.names]
                elif (node.module or "").startswith("rgpu.device_backend."):
                    targets = [node.module.split(".")[2]]
                else:
                    continue
                edges[name].update(t for t in targets if t in names and t != name)
    return edges


def test_device_backend_imports_go_one_way_with_startup_at_the_top():
    edges = _edges()
    assert {n for n, to in edges.items() if "startup" in to} == {"__init__"}
    assert edges["session"] <= {"transfers", "servers"}, edges["session"]  # a leaf: startup builds and installs it
    assert edges["servers"] == set(), edges["servers"]  # session's servers: below it, importing none of the device's
    for low in ("fallback", "torch_rgpu", "compile", "session"):
        assert "registration" not in edges[low], low
    seen: dict[str, int] = {}

    def visit(n: str, path: tuple) -> None:  # depth-first: a module met again on its own path is a circle
        if n in path:
            raise AssertionError(f"import circle: {' -> '.join(path[path.index(n):] + (n,))}")
        if seen.get(n):
            return
        for m in sorted(edges[n]):
            visit(m, path + (n,))
        seen[n] = 1

    for n in sorted(edges):
        visit(n, ())


@pytest.mark.parametrize("module", sorted(p.stem for p in DEVICE_BACKEND.glob("*.py") if p.stem != "__init__"))
def test_each_device_backend_module_imports_alone_and_registers_nothing(module):
    r = _python(f"import torch, importlib\nimportlib.import_module('rgpu.device_backend.{module}')\n"
                "print(torch._C._get_privateuse1_backend_name())")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["privateuseone"]
