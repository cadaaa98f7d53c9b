"""The driver API model: every export parsed from cuda.h, and cuGetProcAddress's table from cudaTypedefs.h."""
from __future__ import annotations

import pytest

from test_cuda_support import cuda_headers_or_skip


@pytest.fixture(scope="module")
def api():
    cuda_headers_or_skip()
    from rgpu.cuda_intercept import header, model
    return model.parse(header.load())


def test_every_entry_point_is_in_the_model_with_its_versioned_and_per_thread_names(api):
    names = set(api.functions)
    assert len(names) >= 600
    for name in ("cuInit", "cuMemAlloc", "cuMemAlloc_v2", "cuMemcpyHtoD_v2_ptds", "cuLaunchKernel_ptsz",
                 "cuCtxCreate_v4", "cuGetProcAddress_v2", "cuStreamGetCaptureInfo_v3", "cuLinkAddData_v2"):
        assert name in names, name


def test_a_function_keeps_its_parameter_names_and_types(api):
    fn = api.functions["cuMemcpyHtoD_v2"]
    assert [p.name for p in fn.params] == ["dstDevice", "srcHost", "ByteCount"]
    assert fn.prototype() == "CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)"
    assert (fn.base, fn.revision, fn.stream) == ("cuMemcpyHtoD", 2, "")


def test_every_export_is_reachable_through_cuGetProcAddress(api):
    assert {e.export for e in api.proc_table} == set(api.functions)


def _resolve(api, base, version, per_thread=False):
    entries = [e for e in api.proc_table if e.base == base and e.version <= version]
    pt = [e for e in entries if e.per_thread]
    pick = pt if per_thread and pt else [e for e in entries if not e.per_thread]
    return max(pick, key=lambda e: e.version).export if pick else None


def test_proc_table_picks_the_newest_version_the_caller_was_built_for(api):
    assert _resolve(api, "cuMemAlloc", 3020) == "cuMemAlloc_v2"
    assert _resolve(api, "cuMemAlloc", 2000) == "cuMemAlloc"
    assert _resolve(api, "cuCtxCreate", 12000) == "cuCtxCreate_v3"
    assert _resolve(api, "cuCtxCreate", 13000) == "cuCtxCreate_v4"
    assert _resolve(api, "cuGetProcAddress", 12000) == "cuGetProcAddress_v2"
    assert _resolve(api, "cuMemcpyHtoD", 13000, per_thread=True) == "cuMemcpyHtoD_v2_ptds"
    assert _resolve(api, "cuLaunchKernel", 13000, per_thread=True) == "cuLaunchKernel_ptsz"
    assert _resolve(api, "cuStreamBeginCapture", 12000) == "cuStreamBeginCapture_v2"


def test_error_codes_carry_their_names_and_a_description(api):
    errors = {name: (code, text) for name, code, text in api.header.errors}
    assert errors["CUDA_SUCCESS"][0] == 0
    assert errors["CUDA_ERROR_NOT_SUPPORTED"][0] == 801
    assert "memory" in errors["CUDA_ERROR_ILLEGAL_ADDRESS"][1]


def test_the_cdef_keeps_the_types_and_drops_the_prototypes(api):
    assert "typedef struct CUlaunchConfig_st" in api.types_text
    assert "cuMemAlloc_v2(" not in api.types_text
    assert "sizeof" not in api.header.text          # array sizes fixed up for cffi
