"""A C++ build's prerequisites are found before it starts, and the client's C++ part builds with clang too."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rgpu import toolchain
from rgpu.errors import BuildError

ROOT = Path(__file__).resolve().parent.parent


def _says_every_install_command(text: str) -> None:
    assert "Debian/Ubuntu: sudo apt-get install" in text and "Fedora: sudo dnf install" in text
    assert "xcode-select --install" in text


def test_a_missing_compiler_is_named_with_the_command_that_installs_it(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BuildError) as caught:
        toolchain.find_compiler()
    assert "no C++ compiler found" in str(caught.value)
    _says_every_install_command(str(caught.value))


def test_a_cxx_that_names_no_program_is_said_so(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler++")
    with pytest.raises(BuildError, match="CXX='no-such-compiler\\+\\+' names no program"):
        toolchain.find_compiler()


def test_missing_python_and_torch_headers_are_named_before_building(monkeypatch, tmp_path):
    import sysconfig

    from torch.utils import cpp_extension

    paths = dict(sysconfig.get_paths(), include=str(tmp_path))
    monkeypatch.setattr(sysconfig, "get_paths", lambda: paths)
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **k: [str(tmp_path)])
    with pytest.raises(BuildError) as caught:
        toolchain.check_torch_build()
    text = str(caught.value)
    assert "no Python.h" in text and "-dev" in text and "python3-devel" in text
    assert "has no C++ headers" in text and "pip install --force-reinstall torch==" in text


def test_a_torch_build_here_finds_everything_it_needs():
    assert os.path.exists(toolchain.check_torch_build())


def test_ninja_from_pip_is_found_where_its_folder_is_not_on_path(monkeypatch, tmp_path):
    ninja = pytest.importorskip("ninja", reason="the pip package ninja is not installed")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert toolchain.ensure_ninja() == shutil.which("ninja", path=ninja.BIN_DIR)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("clang++") is None, reason="clang++ is not installed (apt-get install clang)")
def test_the_clients_cpp_part_builds_and_loads_with_clang(tmp_path):
    # a fresh cache, so the build really runs with clang and not a cached g++ build
    env = dict(os.environ, CXX="clang++", XDG_CACHE_HOME=str(tmp_path))
    code = "from rgpu.device_backend import build; m = build.load(); print('loaded', m.__name__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loaded rgpu_device_backend" in done.stdout
    logs = list(tmp_path.rglob("build.ninja"))
    assert logs and all("clang++" in p.read_text() for p in logs)
