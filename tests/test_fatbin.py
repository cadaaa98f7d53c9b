"""The fatbin container read and trimmed to a device: synthetic containers, malformed ones, and nvcc 13's own output."""
from __future__ import annotations

import struct
import subprocess

import pytest
from hypothesis import given, settings, strategies as st

from cuda_programs import build, kernels_fatbin, nvcc_or_skip
from rgpu import fatbin
from rgpu.cuda_intercept.fatbin import choose, loadable, trim

ELF, PTX = fatbin.KIND_ELF, fatbin.KIND_PTX
A, F, ZSTD = fatbin.FLAG_ARCH_SPECIFIC, fatbin.FLAG_FAMILY, 0x8000


def entry(kind: int, arch: int, payload: bytes, flags: int = 0x11, header: int = 64) -> bytes:
    head = bytearray(header)
    struct.pack_into("<HHIQ", head, 0, kind, 0x101, header, len(payload))
    struct.pack_into("<I", head, 28, arch)
    struct.pack_into("<Q", head, 40, flags)
    return bytes(head) + payload


def container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", fatbin.MAGIC, 1, 16, len(body)) + body


def names(image: bytes) -> list[str]:
    return [e.name() for e in fatbin.entries(image)]


TORCH_LIKE = container(entry(ELF, 80, b"\x7fELF80" * 10), entry(ELF, 86, b"\x7fELF86" * 10),
                       entry(ELF, 90, b"\x7fELF90" * 10), entry(ELF, 90, b"\x7fELF9a" * 10, 0x11 | A),
                       entry(ELF, 100, b"\x7fELF100" * 10, header=96), entry(PTX, 90, b"zstd-ptx", 0x11 | ZSTD, 80),
                       entry(PTX, 120, b".version 9.0\0\0\0", header=80))


def test_entries_are_read_with_kind_architecture_and_variant():
    assert names(TORCH_LIKE) == ["sm_80", "sm_86", "sm_90", "sm_90a", "sm_100", "compute_90 (compressed)",
                                 "compute_120"]
    assert fatbin.container_size(TORCH_LIKE[:16]) == len(TORCH_LIKE)


def test_a_device_gets_its_own_cubins_and_nothing_else():
    assert names(trim(TORCH_LIKE, (9, 0))) == ["sm_90", "sm_90a"]
    assert names(trim(TORCH_LIKE, (10, 0))) == ["sm_100"]


def test_without_its_exact_cubin_a_device_gets_the_newest_older_minor_of_its_major():
    assert names(trim(TORCH_LIKE, (8, 9))) == ["sm_86"]
    assert names(trim(TORCH_LIKE, (9, 5))) == ["sm_90"]        # sm_90a runs only on 9.0 itself


def test_without_a_cubin_it_gets_the_newest_ptx_at_or_below_its_capability():
    assert names(trim(TORCH_LIKE, (12, 1))) == ["compute_120"]
    assert names(trim(TORCH_LIKE, (11, 0))) == ["compute_90 (compressed)"]   # copied whole, still compressed
    kept = fatbin.entries(trim(TORCH_LIKE, (11, 0)))[0]
    assert bytes(kept.payload(trim(TORCH_LIKE, (11, 0)))) == b"zstd-ptx"


def test_a_server_with_two_kinds_of_gpu_gets_what_each_needs():
    assert names(trim(TORCH_LIKE, [(9, 0), (8, 6), (9, 0)])) == ["sm_86", "sm_90", "sm_90a"]
    assert trim(TORCH_LIKE, [(9, 0), (7, 5)]) is TORCH_LIKE           # one fits nothing: all of it goes


def test_an_image_nothing_in_which_fits_travels_unchanged():
    assert trim(TORCH_LIKE, (7, 5)) is TORCH_LIKE
    assert trim(TORCH_LIKE, None) is TORCH_LIKE
    assert trim(b".version 8.0\n.target sm_90\0", (9, 0)) == b".version 8.0\n.target sm_90\0"


def test_arch_specific_and_family_targets_load_only_where_they_may():
    e = fatbin.entries(container(entry(ELF, 90, b"x", 0x11 | A), entry(ELF, 100, b"x", 0x11 | F),
                                 entry(PTX, 90, b"x", 0x11 | A)))
    assert loadable(e[0], 9, 0) and not loadable(e[0], 9, 1)
    assert loadable(e[1], 10, 3) and not loadable(e[1], 11, 0) and not loadable(e[1], 9, 0)
    assert loadable(e[2], 9, 0) and not loadable(e[2], 10, 0)
    assert choose(e, 12, 0) == []


@pytest.mark.parametrize("bad", [
    b"", b"\x50\xed\x55\xba", TORCH_LIKE[:40], TORCH_LIKE[:-1],
    struct.pack("<IHHQ", fatbin.MAGIC, 1, 16, 1 << 60),                   # a size past the image
    container(struct.pack("<HHIQ", ELF, 0, 4, 0)),                         # an entry header shorter than itself
    container(struct.pack("<HHIQ", ELF, 0, 64, 1 << 62) + bytes(48)),     # an entry past the container
])
def test_a_malformed_container_is_an_error_here_and_travels_unchanged(bad):
    with pytest.raises(fatbin.FatbinError):
        fatbin.entries(bad)
    assert trim(bad, (9, 0)) == bad


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 1 << 64 - 1))
def test_any_bytes_behind_the_magic_read_or_fail_as_fatbin_errors_only(tail, size):
    image = struct.pack("<IHHQ", fatbin.MAGIC, 1, 16, size % 512) + tail
    try:
        found = fatbin.entries(image)
    except fatbin.FatbinError:
        return
    assert all(e.end <= len(image) for e in found)
    trim(image, (9, 0))


# ---- nvcc 13's own containers ----------------------------------------------------------------------
def test_a_multi_architecture_nvcc_build_trims_to_one_cubin():
    image = kernels_fatbin(build("saxpy", "multi"))
    assert names(image)[:1] == ["sm_80"] and "sm_90" in names(image) and "sm_100" in names(image)
    assert any(n.startswith("compute_90") for n in names(image))
    for cc, want in (((9, 0), ["sm_90"]), ((8, 6), ["sm_80"]), ((10, 0), ["sm_100"]), ((12, 0), None)):
        got = names(trim(image, cc))
        assert got == want if want else len(got) == 1 and got[0].startswith("compute_90"), (cc, got)
    assert len(trim(image, (9, 0))) < len(image) / 2


def test_variants_from_nvcc_are_told_apart(tmp_path):
    compiler = nvcc_or_skip()
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void k(float *p) { p[0] = 1; }\n')
    out = tmp_path / "k.fatbin"
    subprocess.run([compiler, "-fatbin", "-o", str(out), str(src), "-gencode", "arch=compute_90a,code=sm_90a",
                    "-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_100f,code=sm_100f",
                    "-gencode", "arch=compute_86,code=compute_86"], check=True, capture_output=True)
    image = out.read_bytes()
    assert sorted(n.split(" ")[0] for n in names(image)) == ["compute_86", "sm_100f", "sm_90", "sm_90a"]
    assert names(trim(image, (9, 0))) == ["sm_90a", "sm_90"]
    assert names(trim(image, (10, 3))) == ["sm_100f"]
    assert names(trim(image, (8, 9)))[0].startswith("compute_86")


def test_a_ptx_only_uncompressed_build_keeps_its_ptx_readable():
    image = kernels_fatbin(build("constant", "ptx"))
    (e,) = fatbin.entries(image)
    assert e.kind == PTX and e.arch == 90 and not e.compressed
    text = fatbin.ptx_text(image, e)
    assert ".entry poly3" in text and "coeffs" in text


def _stock_torch_cuda_library():
    import importlib.util
    from pathlib import Path
    spec = importlib.util.find_spec("torch")
    lib = Path(spec.origin).parent / "lib" / "libtorch_cuda.so" if spec and spec.origin else None
    if lib is None or not lib.exists():
        pytest.skip("needs a CUDA build of torch (its libtorch_cuda.so carries the fatbins; the GPU host has one)")
    return lib


def test_every_fatbin_of_stock_torch_reads_and_trims_to_a_fraction():
    import mmap
    with open(_stock_torch_cuda_library(), "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]
    off, size = next((s[4], s[5]) for s in sections if data[names_at + s[0]:names_at + s[0] + 11] == b".nv_fatbin\0")
    pos, count, whole, trimmed = off, 0, 0, 0
    while pos + 16 <= off + size:
        if struct.unpack_from("<I", data, pos)[0] != fatbin.MAGIC:
            pos += 8                                        # padding between containers
            continue
        image = bytes(data[pos:pos + fatbin.container_size(data[pos:pos + 16])])
        assert fatbin.entries(image)
        count, whole, trimmed = count + 1, whole + len(image), trimmed + len(trim(image, (9, 0)))
        pos = (pos + len(image) + 7) // 8 * 8
    assert count > 100 and trimmed < whole / 3, (count, whole, trimmed)   # torch 2.11+cu130: 444, 298 MB -> 51 MB
