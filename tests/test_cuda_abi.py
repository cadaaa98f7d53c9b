"""rgpu's CUDA libraries export what stock torch 2.11+cu130 imports, under the stock version nodes.

Python loads torch's extension ``RTLD_NOW``: one import missing, or under another version node, and
``import torch`` fails. The import lists were taken from the wheel on the GPU host
(``cuda_intercept/abi/``); rgpu's exports are read from the built files with ``readelf``.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ABI_DIR = ROOT / "cuda_intercept" / "abi"
ABI = json.loads((ABI_DIR / "stock_cuda_13_torch_2_11.json").read_text())
STUBS = ("libcublas.so.13", "libcublasLt.so.13", "libcudnn.so.9")
DRIVER, RUNTIME = "libcuda.so.1", "libcudart.so.13"

pytestmark = pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) reads the exports")


def exported(path: Path) -> set[tuple[str, str]]:
    """(name, version node) of every function ``path`` defines; node '' when unversioned."""
    out = subprocess.run(["readelf", "--dyn-syms", "-W", str(path)], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 8 and f[0].endswith(":") and f[6] != "UND" and f[3] in ("FUNC", "IFUNC"):
            name, _, node = re.sub(r"\s*\(\d+\)$", "", f[7]).partition("@")
            found.add((name, node.lstrip("@")))
    return found


def torch_imports(node: str) -> dict[str, list[str]]:
    """torch/lib object -> the names it imports under ``node`` ('' : unversioned cu* the stock driver defines)."""
    driver = set(ABI["exports"][DRIVER])
    wanted = {}
    for obj, entry in ABI["imports"].items():
        if not obj.startswith("torch/"):
            continue
        names = []
        for symbol in entry["symbols"]:
            name, _, at = symbol.partition("@")
            if at == node and (node or name in driver):   # cuFile*, cusparseLt* come from their own libraries
                names.append(name)
        if names:
            wanted[obj] = names
    return wanted


def missing(have: set[tuple[str, str]], node: str) -> dict[str, list[str]]:
    return {obj: gaps for obj, names in torch_imports(node).items() if (gaps := [n for n in names if (n, node) not in have])}


@pytest.fixture(scope="module")
def stubs_dir(tmp_path_factory):
    """The stand-ins alone: they need neither the CUDA toolkit nor cffi."""
    from rgpu.cuda_intercept import stubs
    out = tmp_path_factory.mktemp("rgpu-stubs")
    stubs.build_all(out)
    return out


@pytest.fixture(scope="module")
def library_set():
    """The whole set, as ``rgpu intercept build`` makes it (needs cuda.h and cffi for libcuda.so.1)."""
    from test_cuda_support import cuda_headers_or_skip
    cuda_headers_or_skip()
    pytest.importorskip("cffi", reason="cffi builds libcuda.so.1")
    from rgpu.cuda_intercept import libraries
    return libraries.build()


@pytest.mark.parametrize("soname", STUBS)
def test_every_symbol_torch_imports_from_a_math_library_is_in_rgpus_under_its_node(stubs_dir, soname):
    assert torch_imports(soname), f"the committed lists name no import of {soname}"
    assert missing(exported(stubs_dir / soname), soname) == {}


@pytest.mark.parametrize("soname", STUBS)
def test_a_stand_in_exports_every_function_of_the_stock_library_and_only_those(stubs_dir, soname):
    have = exported(stubs_dir / soname)
    stock = {(name, soname) for name in ABI["exports"][soname]}
    assert ABI["nodes"][soname] == [soname]
    assert sorted(n for n, _ in stock - have) == []
    assert sorted(n for n, _ in have - stock) == [], "exports the stock library does not have"


def test_a_stand_in_says_soname_and_node_as_the_stock_library_does(stubs_dir):
    for soname in STUBS:
        dynamic = subprocess.run(["readelf", "-d", "-V", "-W", str(stubs_dir / soname)],
                                 capture_output=True, text=True, check=True).stdout
        assert f"Library soname: [{soname}]" in dynamic
        assert re.search(rf"Name: {re.escape(soname)}\b", dynamic), dynamic


def test_every_cu_symbol_torch_imports_unversioned_is_in_rgpus_driver(library_set):
    assert torch_imports(""), "the committed lists name no driver import"
    assert missing(exported(library_set / DRIVER), "") == {}


def test_every_runtime_symbol_torch_imports_is_in_rgpus_libcudart_under_its_node(library_set):
    if not (library_set / RUNTIME).exists():
        pytest.skip("libcudart.so.13 is not built (cuda_intercept/cudart_build.py, the translated runtime)")
    assert missing(exported(library_set / RUNTIME), RUNTIME) == {}


def test_the_committed_lists_come_from_the_documented_collector():
    readme = (ABI_DIR / "README.md").read_text()
    tool = ROOT / "tools" / "collect_cuda_abi.py"
    assert "tools/collect_cuda_abi.py" in readme and "stock_cuda_13_torch_2_11.json" in readme
    assert "OUT=" in readme and ABI["info"]["torch"] in readme
    spec = importlib.util.spec_from_file_location("collect_cuda_abi", tool)
    collector = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(collector)
    assert set(collector.LIBS) == set(ABI["exports"]) == set(ABI["nodes"])
    assert "tests/test_cuda_abi.py" in collector.__doc__


def test_the_collector_reads_exports_as_this_test_does(stubs_dir):
    """Its readelf parser and ours agree on a built library, so the lists and the check speak alike."""
    spec = importlib.util.spec_from_file_location("collect_cuda_abi", ROOT / "tools" / "collect_cuda_abi.py")
    collector = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(collector)
    path = stubs_dir / "libcudnn.so.9"
    theirs = {(s, v) for t, n, s, v in collector.dynsyms(str(path)) if n != "UND" and t in ("FUNC", "IFUNC")}
    assert theirs == exported(path)
