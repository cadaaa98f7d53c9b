"""The library redirector: a stock CUDA library asked for by absolute path or through DT_RPATH loads rgpu's file instead.

Decoys stand in for NVIDIA's files: small libraries with the stock SONAMEs and version nodes, built here
with cc in a folder of their own. The programs ask for them as torch does (dlopen of an absolute path,
a DT_NEEDED found through DT_RPATH) and print which file the symbol came from (dladdr) and whether the
decoy is mapped at all (/proc/self/maps).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import clean_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("cc") is None,
                                reason="LD_AUDIT redirection is glibc's, built with cc")

DECOY_C = textwrap.dedent("""
    /* a stand-in for NVIDIA's library: if this runs, the redirection failed */
    #include <stddef.h>
    size_t cublasGetCudartVersion(void) { return 424242; }
    size_t cudnnGetVersion(void) { return 424242; }
""")

PROBE_C = textwrap.dedent("""
    #define _GNU_SOURCE
    #include <dlfcn.h>
    #include <stdio.h>
    #include <string.h>
    #include <stddef.h>

    static void mapped(const char *decoys) {
        char line[4096];
        FILE *f = fopen("/proc/self/maps", "r");
        int found = 0;
        while (f && fgets(line, sizeof line, f))
            if (strstr(line, decoys)) found = 1;
        if (f) fclose(f);
        printf("decoy mapped: %d\\n", found);
    }

    #ifdef LINKED
    size_t cublasGetCudartVersion(void);
    int main(int argc, char **argv) {
        Dl_info info;
        size_t v = cublasGetCudartVersion();
        dladdr((void *)&cublasGetCudartVersion, &info);
        printf("linked: %s version %zu\\n", info.dli_fname, v);
        mapped(argv[1]);
        return 0;
    }
    #else
    int main(int argc, char **argv) {
        Dl_info info;
        for (int i = 2; i < argc; i++) {
            void *h = dlopen(argv[i], RTLD_NOW | RTLD_GLOBAL);
            if (!h) { printf("dlopen %s: %s\\n", argv[i], dlerror()); return 3; }
            void *sym = dlsym(h, strstr(argv[i], "cudnn") ? "cudnnGetVersion" : "cublasGetCudartVersion");
            size_t (*fn)(void) = (size_t (*)(void))sym;
            dladdr(sym, &info);
            printf("dlopen: %s -> %s version %zu\\n", argv[i], info.dli_fname, fn ? fn() : 0);
        }
        mapped(argv[1]);
        return 0;
    }
    #endif
""")


VENDORED = "libcublas.faf08d9a.so.13"   # auditwheel's name for a bundled copy (the hash of its contents)


def cc(*args: str) -> None:
    done = subprocess.run(["cc", *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def rgpu_dir(tmp_path_factory):
    """The redirector and the stubs, built alone (no libcuda.so.1 needed for these tests)."""
    from rgpu import native
    from rgpu.cuda_intercept import libraries, stubs
    out = tmp_path_factory.mktemp("rgpu-libs")
    stubs.build_all(out)
    native.build_library("redirect", [libraries.HERE / "redirect.c"], out_dir=out, soname=libraries.REDIRECTOR,
                         libraries=["dl"])
    return out


@pytest.fixture(scope="module")
def decoys(tmp_path_factory):
    """Stock-named libraries in a folder of their own, and probes that reach them as torch does."""
    out = tmp_path_factory.mktemp("decoys")
    lib = out / "nvidia" / "lib"
    lib.mkdir(parents=True)
    (out / "decoy.c").write_text(DECOY_C)
    (out / "probe.c").write_text(PROBE_C)
    for soname in ("libcublas.so.13", "libcudnn.so.9", "libcudnn_graph.so.9.19.0", "libcublas.so.12", "libnvidia-ml.so.1"):
        node = soname.split(".so")[0] + ".so." + soname.split(".so.")[1].split(".")[0]
        (out / f"{soname}.map").write_text(f"{node} {{ global: *; }};\n")
        script = [] if "-" in node else [f"-Wl,--version-script={out / f'{soname}.map'}"]   # NVML has no node
        cc("-shared", "-fPIC", "-o", str(lib / soname), str(out / "decoy.c"), f"-Wl,-soname,{soname}", *script)
    # a copy vendored by a wheel (torchvision.libs/libcudart.faf08d9a.so.13): a hashed name, the stock node
    vendored = lib / VENDORED
    (out / "vendored.map").write_text("libcublas.so.13 { global: *; };\n")
    cc("-shared", "-fPIC", "-o", str(vendored), str(out / "decoy.c"), f"-Wl,-soname,{VENDORED}",
       f"-Wl,--version-script={out / 'vendored.map'}")
    cc("-DLINKED", "-o", str(out / "vendored_probe"), str(out / "probe.c"), f"-L{lib}", f"-l:{VENDORED}",
       f"-Wl,-rpath,{lib}", "-Wl,--disable-new-dtags", "-ldl")
    # torchvision's _C.so: a library linked to the vendored copy, its symbols bound to the stock node
    (out / "user.c").write_text("#include <stddef.h>\nsize_t cublasGetCudartVersion(void);\n"
                                "size_t user_version(void) { return cublasGetCudartVersion(); }\n")
    cc("-shared", "-fPIC", "-o", str(out / "libvendored_user.so"), str(out / "user.c"), f"-L{lib}", f"-l:{VENDORED}",
       f"-Wl,-rpath,{lib}", "-Wl,--disable-new-dtags")
    cc("-o", str(out / "dlopen_probe"), str(out / "probe.c"), "-ldl")
    # DT_RPATH (not RUNPATH), as libtorch_cuda.so has: searched before LD_LIBRARY_PATH
    cc("-DLINKED", "-o", str(out / "linked_probe"), str(out / "probe.c"), f"-L{lib}", "-l:libcublas.so.13",
       f"-Wl,-rpath,{lib}", "-Wl,--disable-new-dtags", "-ldl")
    return out


def run(argv, env):
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env, timeout=60)


def redirected(rgpu_dir, **extra):
    from rgpu.cuda_intercept.libraries import environment
    return environment(rgpu_dir, clean_env(**extra))


def test_the_probe_loads_the_decoy_without_the_redirector(decoys):
    """The control: the decoys win when nothing redirects (else the tests below prove nothing)."""
    done = run([decoys / "linked_probe", decoys / "nvidia"], clean_env())
    assert done.returncode == 0, done.stderr
    assert "version 424242" in done.stdout and "decoy mapped: 1" in done.stdout


def test_an_absolute_path_to_a_stock_library_loads_rgpus_file(rgpu_dir, decoys):
    stock = decoys / "nvidia" / "lib" / "libcublas.so.13"
    done = run([decoys / "dlopen_probe", decoys / "nvidia", stock], redirected(rgpu_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"-> {rgpu_dir / 'libcublas.so.13'} version 13000" in done.stdout, done.stdout + done.stderr
    assert "decoy mapped: 0" in done.stdout


def test_a_library_found_through_dt_rpath_is_rgpus(rgpu_dir, decoys):
    done = run([decoys / "linked_probe", decoys / "nvidia"], redirected(rgpu_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"linked: {rgpu_dir / 'libcublas.so.13'} version 13000" in done.stdout, done.stdout + done.stderr
    assert "decoy mapped: 0" in done.stdout


def test_cudnn_sub_libraries_never_load_they_get_rgpus_libcudnn(rgpu_dir, decoys):
    graph = decoys / "nvidia" / "lib" / "libcudnn_graph.so.9.19.0"
    done = run([decoys / "dlopen_probe", decoys / "nvidia", graph, "libcudnn_ops.so.9"], redirected(rgpu_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(f"-> {rgpu_dir / 'libcudnn.so.9'} version 91900") == 2, done.stdout
    assert "decoy mapped: 0" in done.stdout


def test_a_copy_a_wheel_vendored_under_a_hashed_name_loads_rgpus_file(rgpu_dir, decoys):
    """torchvision bundles libcudart.<hash>.so.13 and links it: the stock runtime loaded beside rgpu's (run20)."""
    assert "version 424242" in run([decoys / "vendored_probe", decoys / "nvidia"], clean_env()).stdout   # control
    done = run([decoys / "vendored_probe", decoys / "nvidia"], redirected(rgpu_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    # rgpu's file, mapped under the name its search was offered (the loader names the object so; its
    # contents and mapping are rgpu's): the importer's version need on that name is met
    assert f"linked: {decoys / 'nvidia' / 'lib' / VENDORED} version 13000" in done.stdout, done.stdout + done.stderr
    assert "decoy mapped: 0" in done.stdout
    done = run([decoys / "dlopen_probe", decoys / "nvidia", decoys / "nvidia" / "lib" / VENDORED], redirected(rgpu_dir))
    assert f"-> {rgpu_dir / 'libcublas.so.13'} version 13000" in done.stdout, done.stdout + done.stderr   # by path
    done = run([decoys / "dlopen_probe", decoys / "nvidia", "libcublas-0a1b2c3d.so.13"], redirected(rgpu_dir))
    assert "version 13000" in done.stdout, done.stdout + done.stderr     # by name, auditwheel's '-' form
    other = run([decoys / "dlopen_probe", decoys / "nvidia", "libcublas.faf08d9a.so.12"], redirected(rgpu_dir))
    assert "-> " not in other.stdout    # another major, vendored or not, is left alone (here: not found at all)


def test_a_library_linked_to_a_vendored_copy_loads_after_rgpus_file_is_loaded(rgpu_dir, decoys):
    """torch loads libcublas.so.13 (rgpu's) before torchvision's _C.so asks for libcublas.<hash>.so.13 with a
    version need on that file name: the loader must find a loaded object by that name (run21: ld.so's
    `_dl_check_map_versions: Assertion needed != NULL` killed the ResNet rung)."""
    done = run([decoys / "dlopen_probe", decoys / "nvidia", "libcublas.so.13", decoys / "libvendored_user.so"],
               redirected(rgpu_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"libvendored_user.so -> {rgpu_dir / 'libcublas.so.13'} version 13000" in done.stdout, done.stdout
    assert "decoy mapped: 0" in done.stdout


def test_another_major_version_is_left_alone(rgpu_dir, decoys):
    """libcudart.so.12's symbols carry another version node: ours could not bind them."""
    other = decoys / "nvidia" / "lib" / "libcublas.so.12"
    done = run([decoys / "dlopen_probe", decoys / "nvidia", other], redirected(rgpu_dir))
    assert f"-> {other} version 424242" in done.stdout, done.stdout + done.stderr


def test_nvml_does_not_load_so_torch_counts_rgpus_devices_not_this_machines(rgpu_dir, decoys):
    """torch.cuda.device_count() asks NVML first; without it, torch asks the runtime (rgpu's)."""
    nvml = decoys / "nvidia" / "lib" / "libnvidia-ml.so.1"
    assert "version 424242" in run([decoys / "dlopen_probe", decoys / "nvidia", nvml], clean_env()).stdout
    done = run([decoys / "dlopen_probe", decoys / "nvidia", nvml], redirected(rgpu_dir))
    assert done.returncode == 3 and f"dlopen {nvml}:" in done.stdout, done.stdout + done.stderr


def test_the_redirector_finds_its_folder_without_the_variable(rgpu_dir, decoys):
    env = redirected(rgpu_dir)
    del env["RGPU_LIBRARY_DIR"]
    done = run([decoys / "linked_probe", decoys / "nvidia"], env)
    assert f"linked: {rgpu_dir / 'libcublas.so.13'}" in done.stdout, done.stdout + done.stderr


def test_a_missing_rgpu_library_lets_the_stock_one_load_and_says_so(rgpu_dir, decoys, tmp_path):
    shutil.copy(rgpu_dir / "librgpu_redirect.so", tmp_path)     # a folder with the redirector only
    done = run([decoys / "linked_probe", decoys / "nvidia"], redirected(tmp_path))
    assert "version 424242" in done.stdout
    assert "libcublas.so.13 is not built in rgpu's library folder" in done.stderr


def test_the_preload_fallback_wins_a_dt_rpath_lookup_by_soname(rgpu_dir, decoys):
    from rgpu.cuda_intercept.libraries import environment
    env = environment(rgpu_dir, clean_env(), preload=True)
    assert "LD_AUDIT" not in env and str(rgpu_dir / "libcublas.so.13") in env["LD_PRELOAD"]
    done = run([decoys / "linked_probe", decoys / "nvidia"], env)
    assert f"linked: {rgpu_dir / 'libcublas.so.13'} version 13000" in done.stdout, done.stdout + done.stderr


def test_children_inherit_the_redirection(rgpu_dir, decoys):
    done = run(["sh", "-c", f"exec {decoys / 'linked_probe'} {decoys / 'nvidia'}"], redirected(rgpu_dir))
    assert f"linked: {rgpu_dir / 'libcublas.so.13'}" in done.stdout, done.stdout + done.stderr


def test_a_server_started_from_the_program_gets_none_of_it(rgpu_dir):
    from rgpu.cuda_intercept.libraries import environment, without
    base = {"LD_LIBRARY_PATH": "/opt/x", "LD_PRELOAD": "/opt/y.so", "PATH": "/bin"}
    env = environment(rgpu_dir, base)
    assert without(rgpu_dir, env) == {**base, "LD_PRELOAD": "/opt/y.so"}
    env = environment(rgpu_dir, base, preload=True)
    assert without(rgpu_dir, env) == base


STOCK_C = textwrap.dedent("""
    /* a stand-in for a library rgpu leaves stock (cuFFT): like NVIDIA's, it asks the driver for a private table */
    int cuGetExportTable(const void **table, const void *id);
    int cufftCreate(void *plan) { const void *t = 0; static const char id[16]; (void)plan; return cuGetExportTable(&t, id); }
""")

CALLER_C = textwrap.dedent("""
    #include <dlfcn.h>
    #include <stdio.h>
    int main(int argc, char **argv) {
        void *h = dlopen(argv[1], RTLD_NOW);
        if (!h) { printf("dlopen: %s\\n", dlerror()); return 3; }
        int (*create)(void *) = (int (*)(void *))dlsym(h, "cufftCreate");
        printf("cufftCreate=%d\\n", create(0));
        return 0;
    }
""")


def test_a_library_rgpu_leaves_stock_fails_when_called_and_names_itself(tmp_path):
    """cuFFT, cuSPARSE, NCCL ... load stock and stay inert; their first call asks for the driver's private
    tables, which rgpu's driver refuses with a line on stderr naming the library."""
    from test_cuda_support import build_shim_or_skip
    build_shim_or_skip()
    from rgpu.cuda_intercept import libraries
    folder = libraries.build()
    stock = tmp_path / "nvidia" / "cufft" / "lib"
    stock.mkdir(parents=True)
    (tmp_path / "cufft.c").write_text(STOCK_C)
    (tmp_path / "caller.c").write_text(CALLER_C)
    cc("-shared", "-fPIC", "-o", str(stock / "libcufft.so.12"), str(tmp_path / "cufft.c"), "-Wl,-soname,libcufft.so.12",
       f"-L{folder}", "-l:libcuda.so.1")
    cc("-o", str(tmp_path / "caller"), str(tmp_path / "caller.c"), "-ldl")
    done = run([sys.executable, "-m", "rgpu", "intercept", "run", "--", tmp_path / "caller", stock / "libcufft.so.12"],
               clean_env())
    assert "cufftCreate=801" in done.stdout, done.stdout + done.stderr          # CUDA_ERROR_NOT_SUPPORTED
    assert "rgpu: libcufft.so.12 asked for the driver's private tables: FFTs (cuFFT) are not supported" in done.stderr


def test_the_report_names_rgpus_file_for_the_five_and_the_stock_path_for_the_rest(rgpu_dir):
    """What ``rgpu doctor`` prints under "CUDA route"."""
    from rgpu.cuda_intercept import libraries
    rep = libraries.report(rgpu_dir)
    rows = {r["name"]: r for r in rep["libraries"] if r["from"] != "vendored"}   # (a wheel's copies: below)
    assert set(libraries.REPLACED) | set(libraries.STOCK) | {libraries.NVML} == set(rows)
    assert rows[libraries.NVML]["from"] == "refused"
    assert rows["libcublas.so.13"] == {"name": "libcublas.so.13", "from": "rgpu",
                                       "path": str(rgpu_dir / "libcublas.so.13"), "built": True}
    assert rows["libcuda.so.1"]["built"] is False            # this folder holds the stand-ins only
    assert all(rows[n]["from"] == "stock" for n in libraries.STOCK)
    text = "\n".join(libraries.describe(rep))
    assert "libcuda.so.1" in text and "(not built)" in text and "cuFFT" in text


def test_the_report_names_the_copies_wheels_vendor_and_what_loads_instead(rgpu_dir, tmp_path, monkeypatch):
    import site

    from rgpu.cuda_intercept import libraries
    libs = tmp_path / "torchvision.libs"
    libs.mkdir()
    for name in ("libcudart.faf08d9a.so.13", "libnvjpeg.e0a1b2c3.so.13", "libcudart.12ab34cd.so.12"):
        (libs / name).write_bytes(b"")
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(tmp_path)])
    monkeypatch.setattr(site, "getusersitepackages", lambda: str(tmp_path / "none"))
    monkeypatch.setattr(libraries.sys, "path", [])
    vendored = [r for r in libraries.report(rgpu_dir)["libraries"] if r["from"] == "vendored"]
    assert [(r["name"], r["ours"]) for r in vendored] == [("libcudart.faf08d9a.so.13", "libcudart.so.13")]
    text = "\n".join(libraries.describe(libraries.report(rgpu_dir)))
    assert "libcudart.faf08d9a.so.13" in text and "torchvision.libs vendors: rgpu's libcudart.so.13 loads" in text


def test_while_the_client_connects_the_environment_holds_none_of_rgpus_loading(monkeypatch, tmp_path):
    """A local server started from inside the program inherits os.environ at that moment."""
    import os
    import types

    from rgpu.cuda_intercept.client import Client
    from rgpu.cuda_intercept.libraries import environment
    folder = str(tmp_path)
    (tmp_path / "librgpu_redirect.so").write_bytes(b"")
    ffi = types.SimpleNamespace(string=lambda p: p)
    lib = types.SimpleNamespace(rgpu_self_path=lambda: f"{folder}/libcuda.so.1".encode())
    for k, v in environment(folder, {"LD_LIBRARY_PATH": "/opt/lib", "PATH": os.environ["PATH"]}).items():
        monkeypatch.setenv(k, v)
    before = dict(os.environ)
    with Client(ffi, lib)._without_us():
        inside = dict(os.environ)
    assert dict(os.environ) == before
    assert inside["LD_LIBRARY_PATH"] == "/opt/lib"
    assert not {"LD_AUDIT", "RGPU_LIBRARY_DIR", "TRITON_LIBCUDA_PATH"} & set(inside)


TORCH_PROBE = textwrap.dedent("""
    import json, torch
    names = ("libcuda.", "libcudart.", "libcublas.", "libcublasLt.", "libcudnn")
    maps = sorted({l.split()[-1] for l in open("/proc/self/maps") if "/" in l
                   and l.split()[-1].rsplit("/", 1)[-1].startswith(names)})
    out = {"torch": torch.__version__, "maps": maps, "cudnn": torch.backends.cudnn.version(),
           "available": torch.cuda.is_available()}
    a = torch.arange(16, dtype=torch.float32).reshape(4, 4) / 8
    try:                                   # through rgpu's cuBLAS to the server's: the CPU's answer
        out["matmul"] = torch.equal((a.cuda() @ a.cuda()).cpu(), a @ a)
    except RuntimeError as exc:
        out["matmul"] = str(exc).splitlines()[0]
    print(json.dumps(out))
""")


def test_stock_torch_binds_to_rgpus_five_libraries_and_loads_none_of_nvidias(tmp_path):
    """Stock torch 2.11+cu130 (ctypes preloads by absolute path, DT_RPATH, RTLD_NOW) through ``rgpu intercept run``."""
    import json
    import os
    python = os.environ.get("RGPU_TEST_CUDA_TORCH_PYTHON")
    if not python:
        pytest.skip("set RGPU_TEST_CUDA_TORCH_PYTHON to a Python with stock torch 2.11+cu130 and rgpu importable")
    (tmp_path / "probe.py").write_text(TORCH_PROBE)
    done = subprocess.run([sys.executable, "-m", "rgpu", "intercept", "run", "--", python, str(tmp_path / "probe.py")],
                          capture_output=True, text=True, timeout=600, env=clean_env(), stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    from rgpu.cuda_intercept.libraries import REPLACED, default_folder
    folder = default_folder()
    assert out["maps"] == sorted(str(folder / n) for n in REPLACED), out["maps"]
    assert out["cudnn"] == 91900 and out["available"] is True
    assert out["matmul"] is True, out["matmul"]     # small integers over 8: exact in fp32 on any GEMM kernel
