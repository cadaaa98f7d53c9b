"""CUDA runtime test programs (``*.cu`` here), built with nvcc once, and what each must print (numpy's answer).

    PROGRAMS                   the program names: saxpy, reduce, streams, constant, graph
    build(name, variant)       the executable, built once per source and flags (a cache under the pytest temp root)
    cuda_program(name, variant) the same, as a pytest fixture factory's value (``cuda_programs`` fixture)
    fatbin_of(exe), kernels_fatbin(exe)  its .nv_fatbin section; the container holding its kernels
    parse(stdout)              {label: numpy array} from the programs' "label v v v ..." lines
    check(name, stdout)        assert a run's output equals numpy's computation of the same thing

Variants (every one ``nvcc -cudart shared``, so the program imports ``libcudart.so.13``):

    "ptx"    PTX only for compute_90, fatbin uncompressed: what the fake driver reads (CI, no GPU)
    "sm_90"  the sm_90 cubin only: a GPU host's native build
    "multi"  sm_80, sm_90 and sm_100 cubins plus compute_90 PTX, compressed as nvcc does by default:
             a multi-architecture image for the trimming path on a GPU host

Skips (with the reason) when nvcc is not installed.  The programs are plain
user-style CUDA: ``extern "C"`` kernels, ``<<<>>>`` launches, every call checked.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent
PROGRAMS = ("saxpy", "reduce", "streams", "constant", "graph")
VARIANTS = {
    "ptx": ["-gencode", "arch=compute_90,code=compute_90", "-no-compress"],
    "sm_90": ["-gencode", "arch=compute_90,code=sm_90"],
    "multi": ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
              "-gencode", "arch=compute_100,code=sm_100", "-gencode", "arch=compute_90,code=compute_90"],
}
_out_dir: Path | None = None


def nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    path = Path(home) / "bin" / "nvcc"
    return str(path) if path.exists() else None


def nvcc_or_skip() -> str:
    found = nvcc()
    if found is None:
        pytest.skip("nvcc is not installed (CUDA toolkit 13 builds the runtime test programs)")
    return found


def _folder() -> Path:
    global _out_dir
    if _out_dir is None:
        import tempfile
        _out_dir = Path(tempfile.mkdtemp(prefix="rgpu-cuda-programs-"))
    return _out_dir


def build(name: str, variant: str = "ptx", out_dir: Path | None = None) -> Path:
    """Build program ``name`` (``name.cu`` here) as ``variant``; built once per source, flags and folder."""
    if name not in PROGRAMS or variant not in VARIANTS:
        raise ValueError(f"no test program {name!r} / variant {variant!r}")
    compiler = nvcc_or_skip()
    flags = ["-cudart", "shared", "-O2", *VARIANTS[variant]]
    source = HERE / f"{name}.cu"
    key = hashlib.sha256(source.read_bytes() + (HERE / "check.h").read_bytes() + " ".join(flags).encode())
    exe = (out_dir or _folder()) / f"{name}-{variant}-{key.hexdigest()[:12]}"
    if not exe.exists():
        tmp = exe.with_suffix(".tmp")
        done = subprocess.run([compiler, *flags, f"-I{HERE}", "-o", str(tmp), str(source)],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"nvcc failed for {name} ({variant}):\n{done.stderr}")
        tmp.replace(exe)       # whole or absent: a second test never runs a half-written program
    return exe


@pytest.fixture(scope="session")
def cuda_programs(tmp_path_factory):
    """A builder: ``cuda_programs("saxpy")`` or ``cuda_programs("graph", "sm_90")`` -> the executable's path."""
    nvcc_or_skip()
    out = tmp_path_factory.mktemp("cuda-programs")
    return lambda name, variant="ptx": build(name, variant, out)


def fatbin_of(exe: Path) -> bytes:
    """The ``.nv_fatbin`` section of a built program (the fatbin container its registration hands over)."""
    import struct
    data = exe.read_bytes()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    def section(i):
        return struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
    names_off = section(shstrndx)[4]
    for i in range(shnum):
        name_at, _, _, _, offset, size = section(i)
        name = data[names_off + name_at:data.index(b"\0", names_off + name_at)]
        if name == b".nv_fatbin":
            return data[offset:offset + size]
    raise ValueError(f"{exe} has no .nv_fatbin section")


def kernels_fatbin(exe: Path) -> bytes:
    """The fatbin container of the program's own kernels (the section's last non-empty one: nvcc
    puts an empty or runtime-internal container before it; each has its own registration)."""
    import struct
    section, found, off = fatbin_of(exe), [], 0
    while off + 16 <= len(section):
        magic, _, header, size = struct.unpack_from("<IHHQ", section, off)
        if magic != 0xBA55ED50:
            break
        if size:
            found.append(section[off:off + header + size])
        off = (off + header + size + 7) // 8 * 8
    if not found:
        raise ValueError(f"{exe}: no fatbin container with entries")
    return found[-1]


# ---- what each program must print ---------------------------------------------------------------
def parse(stdout: str) -> dict[str, np.ndarray]:
    out = {}
    for line in stdout.splitlines():
        label, *values = line.split()
        if label == "error":
            raise AssertionError(f"the program failed: {line}")
        try:
            out[label] = np.array([float(v) for v in values], dtype=np.float64)
        except ValueError:
            continue
    return out


def expected(name: str) -> dict[str, np.ndarray]:
    f32 = np.float32
    if name == "saxpy":
        i = np.arange(1000)
        x, y = (i % 17).astype(f32) * f32(0.25), (i % 5).astype(f32) - f32(2)
        return {"y": f32(3) * x + y}
    if name == "reduce":
        i = np.arange(10000)
        x = ((i * 7) % 13).astype(f32) * f32(0.5) - f32(3)
        parts = np.pad(x, (0, 40 * 256 - x.size)).reshape(40, 256).sum(axis=1, dtype=np.float64)
        return {"partials": parts, "total": np.array([parts.sum()])}
    if name == "streams":
        i = np.arange(6 * 512)
        x = (i % 29).astype(f32) * f32(0.125)
        return {"elapsed_positive": np.array([1.0]), "x": f32(2) * x + (i // 512).astype(f32)}
    if name == "constant":
        x = (np.arange(300) - 150).astype(f32) * f32(0.01)
        c = np.array([1.0, -0.5, 0.25, 2.0], dtype=f32)
        return {"coeffs": c, "y": ((c[3] * x + c[2]) * x + c[1]) * x + c[0]}
    if name == "graph":
        i = np.arange(700)
        x, y = (i % 11).astype(f32) * f32(1.5), -(i % 3).astype(f32)
        for _ in range(10):
            x = f32(0.5) * x + f32(1)
            y = f32(2) * x + y
        return {"nodes": np.array([2.0]), "x": x, "y": y}
    raise ValueError(f"no test program {name!r}")


def check(name: str, stdout: str) -> None:
    """Assert that a run of program ``name`` printed numpy's values (to float32 rounding: a GPU fuses a*x+b)."""
    got, want = parse(stdout), expected(name)
    for label, values in want.items():
        assert label in got, f"{name}: no {label!r} line in its output:\n{stdout[-2000:]}"
        assert got[label].shape == values.shape, f"{name}: {label} has {got[label].size} values, not {values.size}"
        np.testing.assert_allclose(got[label], values.astype(np.float64), rtol=2e-6, atol=1e-5,
                                   err_msg=f"{name}: {label}")
