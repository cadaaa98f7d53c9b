"""cuDNN's queued executes run in C beside the launches (server/cuda/libs/cudnn_records.c) for a plain plan on a
variant pack of the session: the same calls and stream setting as the Python path, a plan run there only once
Python found it plain (and no longer once it changes), destroyed or unknown ids and short records refused.

As in test_cuda_lib_records.py: NVIDIA's libraries are the bench's stand-in, each test in a forked child.
"""
from __future__ import annotations

import pytest
from test_cuda_lib_records import CTX, S1, S2, _gemm, _launch, _run, _session, isolated
from test_cuda_lib_records import folder, pytestmark  # noqa: F401 (the stand-in's fixture, its skip)

from rgpu.bench import cuda_lib_records as bench
from rgpu.protocol.cuda import LIB_KIND, OP
from rgpu.protocol.cuda_libs import BY_NAME

PLAN2, PACK2 = 0x5247_0014, 0x5247_0015
HANDLE, PACK, PLAN = 0, 1, 2          # cudnn_real's kinds in the C table


def _call(session, call, handle, **f):
    spec = BY_NAME[call]
    payload = spec.format.pack(*(f[n] for n, _ in spec.fields))      # (bench.pack: a field "name" clashes)
    return session.libs.run(spec.id, handle, 0, memoryview(payload), answered=True)


def _dnn_session(folder, monkeypatch, native):
    session = _session(folder, monkeypatch, native)
    assert _call(session, "cudnnBackendCreateDescriptor", PLAN2, type=5) == [0, None]
    assert _call(session, "cudnnBackendCreateDescriptor", PACK2, type=16) == [0, None]
    return session


def _execute(plan=bench.PLAN, pack=bench.PACK, stream=S1, handle=bench.DNN_HANDLE, tail=b"") -> bytes:
    return bench.record("cudnnBackendExecute", handle, stream,
                        bench.pack("cudnnBackendExecute", plan=plan, pack=pack, tail=tail), ctx=CTX)


STEP = b"".join([_execute(), _gemm("cublasSgemm_v2"), _execute(stream=S2), _execute(PLAN2, PACK2, S2),
                 _launch(0x100, S2), _execute(pack=PACK2)])


@isolated
def test_the_c_walker_and_the_python_path_make_the_same_dnn_calls(folder, monkeypatch):
    logs = {}
    for native in ("auto", "off"):
        session = _dnn_session(folder, monkeypatch, native)
        logs[native], through_python = _run(session, STEP * 2, monkeypatch)
        assert session.executor.deferred == []
        assert through_python == (2 if native == "auto" else 10)     # in C: all but each plan's first execute
        lib = session.libs.library("cudnn")
        if native == "auto":
            assert [lib.c.rgpu_cudnn_count(lib.fast, k) for k in (HANDLE, PACK, PLAN)] == [1, 2, 2]
        session.libs.close()
    assert logs["auto"] == logs["off"]
    kinds = [line.split()[0] for line in logs["auto"]]
    assert kinds[:9] == ["ctx", "dnn_stream", "dnn_execute", "stream", "sgemm", "dnn_stream", "dnn_execute",
                         "dnn_execute", "launch"]
    assert logs["auto"][1].split()[2] == f"{S1:x}" and logs["auto"][5].split()[2] == f"{S2:x}"
    assert kinds.count("dnn_stream") == 5          # when it changed: S1, S2, S1, then S2, S1 in the second step


@isolated
def test_a_changed_or_destroyed_plan_or_pack_is_no_longer_run_in_c(folder, monkeypatch):
    session = _dnn_session(folder, monkeypatch, "auto")
    lib = session.libs.library("cudnn")
    _, through_python = _run(session, _execute() * 3, monkeypatch)
    assert through_python == 1 and lib.c.rgpu_cudnn_count(lib.fast, PLAN) == 1
    assert _call(session, "cudnnBackendSetAttribute", bench.PLAN, name=0, type=3, count=0) == [0, None]
    assert lib.c.rgpu_cudnn_count(lib.fast, PLAN) == 0          # changed: Python looks at it again
    _, through_python = _run(session, _execute() * 3, monkeypatch)
    assert through_python == 1
    assert _call(session, "cudnnBackendDestroyDescriptor", bench.PACK) == [0, None]
    assert lib.c.rgpu_cudnn_count(lib.fast, PACK) == 1
    log, through_python = _run(session, _execute() + _execute(pack=PACK2), monkeypatch)
    assert through_python == 1                                   # the destroyed pack's: Python, which refuses it
    assert f"{bench.PACK:#x} is not a backend descriptor of this session" in session.executor.deferred[0][2]
    assert [line.split()[0] for line in log].count("dnn_execute") == 1
    session.libs.close()


@isolated
def test_malformed_and_unknown_dnn_records_are_refused_with_clear_errors(folder, monkeypatch):
    for native in ("auto", "off"):
        session = _dnn_session(folder, monkeypatch, native)
        short = OP.pack(OP.size + 8, LIB_KIND, CTX, S1, BY_NAME["cudnnBackendExecute"].id, bench.DNN_HANDLE, 8) \
            + bytes(8)
        records = _execute() + short + _execute(handle=0x99) + _execute(plan=0x98) + _execute()
        log, _ = _run(session, records, monkeypatch)
        messages = [message for _, _, message in session.executor.deferred]
        assert len(messages) == 3, messages
        assert "cudnnBackendExecute: a payload of 8 bytes, expected at least 16" in messages[0]
        assert "0x99 is not a cuDNN handle of this session" in messages[1]
        assert "0x98 is not a backend descriptor of this session" in messages[2]
        assert [line.split()[0] for line in log].count("dnn_execute") == 2
        session.libs.close()


def test_the_dnn_table_refuses_short_payloads_by_value_bytes_and_unknown_ids_itself(folder, monkeypatch):
    from rgpu.server.cuda import real_batch
    if real_batch.library() is None:
        pytest.skip("the server's C part does not build here")
    _dnn_table_refuses(folder, monkeypatch)


@isolated
def _dnn_table_refuses(folder, monkeypatch):
    from rgpu.server.cuda import real_batch
    c = real_batch.library()
    session = _dnn_session(folder, monkeypatch, "auto")
    _run(session, _execute(), monkeypatch)                         # the plan found plain
    dnn, cublas = session.libs.library("cudnn").fast, session.libs.records_table()
    payload = bench.pack("cudnnBackendExecute", plan=bench.PLAN, pack=bench.PACK)
    by_value = payload + bytes(16)
    assert c.rgpu_cudnn_record(dnn, bench.DNN_HANDLE, S1, payload, len(payload)) == 0
    assert c.rgpu_cudnn_record(dnn, bench.DNN_HANDLE, S1, payload, 8) == -1
    assert c.rgpu_cudnn_record(dnn, bench.DNN_HANDLE, S1, by_value, len(by_value)) == -2
    assert c.rgpu_cudnn_record(dnn, 0x99, S1, payload, len(payload)) == -2
    other = bench.pack("cudnnBackendExecute", plan=PLAN2, pack=bench.PACK)    # a plan not yet found plain
    assert c.rgpu_cudnn_record(dnn, bench.DNN_HANDLE, S1, other, len(other)) == -2
    assert c.rgpu_cudnn_record(None, bench.DNN_HANDLE, S1, payload, len(payload)) == -2
    assert c.rgpu_cublas_record(cublas, BY_NAME["cudnnBackendExecute"].id, bench.DNN_HANDLE, S1, payload,
                                len(payload)) == 0                  # through cuBLAS's table, the walker's entry
    session.libs.close()
