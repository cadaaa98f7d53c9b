"""rgpu.native: one build for every C part (key, cache, lock, atomic install, the reason a build failed)."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import threading

import pytest

from rgpu import native
from rgpu.errors import BuildError, RgpuError

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler on this machine")

ADD = "int rgpu_test_add(int a, int b) { return a + b; }\n"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "rgpu"


def source(tmp_path, text=ADD, name="add.c"):
    path = tmp_path / name
    path.write_text(text)
    return path


def dyn_syms(path) -> str:
    tool = shutil.which("readelf")
    if tool is None:
        pytest.skip("no readelf on this machine")
    return subprocess.run([tool, "--dyn-syms", "-W", str(path)], capture_output=True, text=True, check=True).stdout


def test_a_library_is_built_into_the_cache_under_its_soname_and_loads(tmp_path, cache):
    lib = native.build_library("addlib", [source(tmp_path)], soname="libadd.so.3")
    assert lib.name == "libadd.so.3"
    assert lib.parent.parent == cache / "native" / "addlib"
    assert ctypes.CDLL(str(lib)).rgpu_test_add(2, 3) == 5
    readelf = shutil.which("readelf")
    if readelf:
        dynamic = subprocess.run([readelf, "-d", str(lib)], capture_output=True, text=True, check=True).stdout
        assert "[libadd.so.3]" in dynamic


def test_every_export_carries_the_version_node(tmp_path, cache):
    lib = native.build_library("versioned", [source(tmp_path)], soname="libversioned.so.1", version_node="libv_1.0")
    line = next(line for line in dyn_syms(lib).splitlines() if "rgpu_test_add" in line)
    assert "rgpu_test_add@@libv_1.0" in line


def test_without_a_soname_the_file_is_lib_name_so(tmp_path, cache):
    assert native.build_library("plain", [source(tmp_path)]).name == "libplain.so"


def test_a_second_call_is_a_cache_hit_that_runs_no_compiler(tmp_path, cache, monkeypatch):
    first = native.build_library("hit", [source(tmp_path)])
    monkeypatch.setattr(native, "run_compiler", lambda *a, **k: pytest.fail("compiled again"))
    assert native.build_library("hit", [source(tmp_path)]) == first


def test_the_key_changes_when_a_source_a_header_or_generated_text_changes(tmp_path, cache):
    src = source(tmp_path)
    first = native.build_library("keyed", [src])
    src.write_text(ADD + "int rgpu_test_more(void) { return 7; }\n")
    second = native.build_library("keyed", [src])
    (tmp_path / "beside.h").write_text("#define X 1\n")
    third = native.build_library("keyed", [src])
    fourth = native.build_library("keyed", [src], generated={"gen.c": "int rgpu_gen(void) { return 1; }\n"})
    assert len({first.parent, second.parent, third.parent, fourth.parent}) == 4
    assert ctypes.CDLL(str(fourth)).rgpu_gen() == 1


def test_generated_headers_are_on_the_include_path(tmp_path, cache):
    src = source(tmp_path, '#include "consts.h"\nint rgpu_seven(void) { return SEVEN; }\n')
    lib = native.build_library("gen", [src], generated={"consts.h": "#define SEVEN 7\n"})
    assert ctypes.CDLL(str(lib)).rgpu_seven() == 7


def test_an_out_dir_gets_the_file_and_a_changed_source_rebuilds_it(tmp_path, cache):
    src, out = source(tmp_path), tmp_path / "out"
    lib = native.build_library("outdir", [src], out_dir=out, soname="libout.so.1")
    assert lib == out / "libout.so.1" and not (cache / "native" / "outdir").exists()
    before = lib.stat().st_mtime_ns
    assert native.build_library("outdir", [src], out_dir=out, soname="libout.so.1").stat().st_mtime_ns == before
    src.write_text(ADD.replace("a + b", "a - b"))
    assert ctypes.CDLL(str(native.build_library("outdir", [src], out_dir=out, soname="libout.so.1"))) \
        .rgpu_test_add(5, 3) == 2


def test_a_compile_error_raises_one_build_error_with_the_compilers_message(tmp_path, cache):
    src = source(tmp_path, "int broken(void) { return undeclared_name; }\n", "broken.c")
    with pytest.raises(BuildError) as info:
        native.build_library("broken", [src])
    assert isinstance(info.value, RgpuError)
    assert "undeclared_name" in str(info.value) and "undeclared_name" in info.value.output
    assert not list((cache / "native" / "broken").rglob("*.so"))   # nothing half-written left visible


def test_no_compiler_names_the_command_that_installs_one(tmp_path, cache, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native.shutil, "which", lambda name: "/usr/bin/apt-get" if name == "apt-get" else None)
    with pytest.raises(BuildError) as info:
        native.build_library("nocc", [source(tmp_path)])
    assert info.value.install == "sudo apt-get install -y build-essential"
    assert "build-essential" in str(info.value)


def test_why_not_says_why_an_attempt_failed_and_forgets_it_once_it_works(tmp_path, cache):
    bad = source(tmp_path, "int x(void) { return nope; }\n", "bad.c")
    assert native.attempt("attempted", lambda: native.build_library("attempted", [bad])) is None
    assert "BuildError" in native.why_not("attempted") and "nope" in native.why_not("attempted")
    assert native.attempt("attempted", lambda: native.build_library("attempted", [source(tmp_path)])) is not None
    assert native.why_not("attempted") is None


def test_rgpu_native_off_attempts_nothing(monkeypatch):
    monkeypatch.setenv("RGPU_NATIVE", "off")
    assert native.attempt("switched", lambda: pytest.fail("built")) is None
    assert native.why_not("switched") == "RGPU_NATIVE=off"


def test_a_first_build_prints_a_progress_line_with_its_time(tmp_path, cache, capsys):
    native.build_library("loud", [source(tmp_path)])
    err = capsys.readouterr().err
    assert "rgpu: building libloud.so" in err and " built in " in err
    native.build_library("loud", [source(tmp_path)])
    assert capsys.readouterr().err == ""


def test_concurrent_builds_of_one_library_compile_once(tmp_path, cache):
    src, results = source(tmp_path), []
    before = len(native.builds())
    threads = [threading.Thread(target=lambda: results.append(native.build_library("racy", [src]))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 4
    assert [n for n, _ in native.builds()[before:]] == ["racy"]


# ---- rgpu build: every part ahead, one line each ----

def test_rgpu_build_builds_one_part_and_then_finds_it_cached(cache, capsys):
    from rgpu import cli

    assert cli.main(["build", "--only", "launch_records"]) == 0
    assert "launch_records" in (out := capsys.readouterr().out) and "built in" in out
    assert cli.main(["build", "--only", "launch_records"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("cached")
    assert cli.main(["build", "--list", "--only", "launch_records"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("built")


def test_rgpu_build_names_the_parts_when_asked_for_one_it_does_not_have(capsys):
    from rgpu import cli, parts

    assert cli.main(["build", "--only", "nope"]) == 2
    err = capsys.readouterr().err
    assert all(p.name in err for p in parts.PARTS)


def test_a_part_that_fails_is_reported_with_the_compilers_lines_and_the_command_fails(cache, capsys, monkeypatch):
    from rgpu import cli, parts

    def broken(force=False):
        raise BuildError("building libx.so: the compiler failed (exit 1)", output="x.c:1: error: expected ';'")

    monkeypatch.setattr(parts, "PARTS", (parts.Part("x", "a broken part", lambda: None, broken),
                                         parts.Part("y", "a part this host lacks", lambda: 1 / 0, "nowhere:none")))
    assert cli.main(["build"]) == 1
    out = capsys.readouterr().out
    assert "x  a broken part" in out and "FAILED: BuildError" in out and "expected ';'" in out
    assert "skipped: ZeroDivisionError" in out
    assert "BuildError" in native.why_not("x")


def test_rgpu_build_list_shows_every_part_without_building_any(tmp_path):
    import os
    import sys

    from rgpu import parts

    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "rgpu", "build", "--list"], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines[:len(parts.PARTS)]] == [p.name for p in parts.PARTS]
    assert all("not built" in line or "skipped" in line for line in lines[:len(parts.PARTS)])
    assert "rgpu: building" not in done.stderr
    assert not list(tmp_path.rglob("*.so*"))


def test_a_torch_extension_that_fails_to_compile_is_one_build_error_with_the_compilers_lines(tmp_path, cache):
    pytest.importorskip("torch", reason="torch builds the C++ parts")
    from rgpu import toolchain, torch_ext

    try:
        toolchain.check_torch_build()
    except BuildError as exc:
        pytest.skip(f"this host cannot build torch extensions: {exc}")
    (tmp_path / "broken.cpp").write_text('#error "rgpu test: this part does not compile"\n')
    ext = torch_ext.Extension("broken_ext", tmp_path, ("broken.cpp",), note="a broken test part")
    with pytest.raises(BuildError) as info:
        ext.load()
    assert "this part does not compile" in str(info.value)
    assert "BuildError" in native.why_not("broken_ext") and not ext.built()
