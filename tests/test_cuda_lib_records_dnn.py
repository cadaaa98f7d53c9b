"""cuDNN's per-execution records run in C beside the launches (server/cuda/libs/cudnn_records.c): a convolution's
variant pack (created, set, finalized, destroyed) and the execute of a plain plan on it, with the same calls,
values and stream setting as the Python path; a plan run there only once Python found it plain (and no longer
once it changes), a by-value execute rebuilt by Python from the pack C kept, destroyed or unknown ids, short
records and attributes a pack never takes refused with clear errors, the packs left destroyed at the end; the
legacy tensor descriptors around a batch norm made, set, derived and destroyed in C, the batch norm run there on
them (its scalars by the x tensor's type), an unknown tensor's left to Python, which refuses it.

As in test_cuda_lib_records.py: NVIDIA's libraries are the bench's stand-in, each test in a forked child.
"""
from __future__ import annotations

import struct

import pytest
from cuda_lib_fixtures import (CTX, HANDLE, PACK, PACK2, PLAN, PLAN2, S1, S2, call, dnn_session, gemm, isolated,
                               launch, run)
from cuda_lib_fixtures import folder, pytestmark  # noqa: F401 (the stand-in's fixture, its skip)

from rgpu.bench import cuda_lib_records as bench
from rgpu.protocol.cuda import LIB_KIND, OP
from rgpu.protocol.cuda_libs import BY_NAME
from rgpu.protocol.lib_cudnn import PATCH

PACK3 = 0x5247_0016

def _execute(plan=bench.PLAN, pack=bench.PACK, stream=S1, handle=bench.DNN_HANDLE, tail=b"") -> bytes:
    return bench.record("cudnnBackendExecute", handle, stream,
                        bench.pack("cudnnBackendExecute", plan=plan, pack=pack, tail=tail), ctx=CTX)


STEP = b"".join([_execute(), gemm("cublasSgemm_v2"), _execute(stream=S2), _execute(PLAN2, PACK2, S2),
                 launch(0x100, S2), _execute(pack=PACK2)])


def _logs_on_each_path(folder, monkeypatch, records: bytes, python_calls: dict, check_c=lambda native, lib: None):
    """``records`` run on each path named in ``python_calls`` ("auto": the C walker; "off": Python's; "walker off":
    every record through Libraries.run, what C owns still C's, as a trace runs), each sending the number of calls
    to Python given there; ``check_c(path, lib)`` before its session closes. Each path's stand-in log."""
    logs = {}
    for native, expected in python_calls.items():
        session = dnn_session(folder, monkeypatch, "off" if native == "off" else "auto")
        if native == "walker off":
            monkeypatch.setattr(session.libs, "records_table", lambda: None)
        logs[native], through_python = run(session, records, monkeypatch)
        assert session.executor.deferred == []
        assert through_python == expected, native
        check_c(native, session.libs.library("cudnn"))
        session.libs.close()
    return logs


@isolated
def test_the_c_walker_and_the_python_path_make_the_same_dnn_calls(folder, monkeypatch):
    def held(native, lib):
        if native == "auto":
            assert [lib.c.rgpu_cudnn_count(lib.fast, k) for k in (HANDLE, PACK, PLAN)] == [1, 2, 2]

    # in C: all but each plan's first execute
    logs = _logs_on_each_path(folder, monkeypatch, STEP * 2, {"auto": 2, "off": 10}, held)
    assert logs["auto"] == logs["off"]
    kinds = [line.split()[0] for line in logs["auto"]]
    assert kinds[:9] == ["ctx", "dnn_stream", "dnn_execute", "stream", "sgemm", "dnn_stream", "dnn_execute",
                         "dnn_execute", "launch"]
    assert logs["auto"][1].split()[2] == f"{S1:x}" and logs["auto"][5].split()[2] == f"{S2:x}"
    assert kinds.count("dnn_stream") == 5          # when it changed: S1, S2, S1, then S2, S1 in the second step


@isolated
def test_a_changed_or_destroyed_plan_or_pack_is_no_longer_run_in_c(folder, monkeypatch):
    session = dnn_session(folder, monkeypatch, "auto")
    lib = session.libs.library("cudnn")
    _, through_python = run(session, _execute() * 3, monkeypatch)
    assert through_python == 1 and lib.c.rgpu_cudnn_count(lib.fast, PLAN) == 1
    assert call(session, "cudnnBackendSetAttribute", bench.PLAN, name=0, type=3, count=0) == [0, None]
    assert lib.c.rgpu_cudnn_count(lib.fast, PLAN) == 0          # changed: Python looks at it again
    _, through_python = run(session, _execute() * 3, monkeypatch)
    assert through_python == 1
    assert call(session, "cudnnBackendDestroyDescriptor", bench.PACK) == [0, None]
    assert lib.c.rgpu_cudnn_count(lib.fast, PACK) == 1
    log, through_python = run(session, _execute() + _execute(pack=PACK2), monkeypatch)
    assert through_python == 1                                   # the destroyed pack's: Python, which refuses it
    assert f"{bench.PACK:#x} is not a backend descriptor of this session" in session.executor.deferred[0][2]
    assert [line.split()[0] for line in log].count("dnn_execute") == 1
    session.libs.close()


@isolated
def test_malformed_and_unknown_dnn_records_are_refused_with_clear_errors(folder, monkeypatch):
    for native in ("auto", "off"):
        session = dnn_session(folder, monkeypatch, native)
        short = OP.pack(OP.size + 8, LIB_KIND, CTX, S1, BY_NAME["cudnnBackendExecute"].id, bench.DNN_HANDLE, 8) \
            + bytes(8)
        records = _execute() + short + _execute(handle=0x99) + _execute(plan=0x98) + _execute()
        log, _ = run(session, records, monkeypatch)
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
    session = dnn_session(folder, monkeypatch, "auto")
    run(session, _execute(), monkeypatch)                         # the plan found plain
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


def _conv(pack=PACK3, plan=bench.PLAN, ptrs=(0xA000, 0xB000, 0xC000), stream=S1) -> bytes:
    """One convolution's records as cudnn-frontend queues them: a variant pack made, its workspace, unique ids
    and data pointers set, finalized, executed, destroyed."""
    return bench.conv_records(bench.DNN_HANDLE, stream, plan, pack, ptrs, ctx=CTX)


@isolated
def test_a_convolutions_variant_pack_runs_in_c_with_the_python_paths_calls_and_values(folder, monkeypatch):
    steps = _conv() + gemm("cublasSgemm_v2") + _conv(ptrs=(0xA100, 0xB100, 0xC100), stream=S2) + launch(0x100, S2)
    def held(native, lib):
        if native == "auto":
            assert [lib.c.rgpu_cudnn_count(lib.fast, k) for k in (HANDLE, PACK, PLAN)] == [1, 2, 1]

    # in C: all but the plan's first execute; walker off: the packs still C's
    logs = _logs_on_each_path(folder, monkeypatch, steps * 2, {"auto": 1, "off": 30, "walker off": 30}, held)
    assert logs["auto"] == logs["off"] == logs["walker off"]
    conv = [line.split() for line in logs["auto"][:9]]
    assert [w[0] for w in conv] == ["ctx", "dnn_desc", "dnn_set", "dnn_set", "dnn_set", "dnn_finalize",
                                    "dnn_stream", "dnn_execute", "dnn_desc_destroy"]
    pack = conv[2][1]                                       # the real pack, as the stand-in minted it
    assert conv[1][1:] == ["16"]
    assert [w[1:] for w in conv[2:5]] == [[pack, "1001", "6", "3", "a000", "b000", "c000"],
                                          [pack, "1000", "3", "3", "1", "2", "3"], [pack, "1003", "6", "1", "e000"]]
    assert conv[5][1] == conv[7][3] == conv[8][1] == pack   # finalized, executed and destroyed: the same pack
    second = [line for line in logs["auto"] if line.startswith("dnn_set") and line.split()[2] == "1001"][1]
    assert second.split()[5:] == ["a100", "b100", "c100"]


@isolated
def test_a_by_value_execute_on_a_pack_kept_in_c_is_rebuilt_by_python_with_the_clients_bytes(folder, monkeypatch):
    session = dnn_session(folder, monkeypatch, "auto")
    lib = session.libs.library("cudnn")
    lib.by_value.of[PLAN2] = {2: 4}                         # as a finalize finds an attention's scale (uid 2)
    scale = PATCH.pack(2, 4) + struct.pack("<f", 0.125) + bytes(4)
    records = bench.conv_records(bench.DNN_HANDLE, S1, PLAN2, PACK3, (0xA000, 0xF0F0, 0xC000), ctx=CTX,
                                 tail=scale)
    log, through_python = run(session, records, monkeypatch)
    assert session.executor.deferred == [] and through_python == 1
    sets = [line.split() for line in log if line.startswith("dnn_set")]
    made, rebuilt = sets[:3], sets[3:]
    assert [s[2:] for s in rebuilt[1:]] == [s[2:] for s in made[1:]]      # the unique ids, the workspace
    ptrs = rebuilt[0][5:]
    assert ptrs[0] == "a000" and ptrs[2] == "c000" and ptrs[1] != "f0f0"    # the scale: a copy here, not the client's
    executed = next(line.split() for line in log if line.startswith("dnn_execute"))
    assert executed[3] == rebuilt[0][1] != made[0][1]        # on the rebuilt pack
    assert lib.c.rgpu_cudnn_count(lib.fast, PACK) == 2
    session.libs.close()


@isolated
def test_a_packs_unusual_records_are_refused_by_python_with_clear_errors(folder, monkeypatch):
    session = dnn_session(folder, monkeypatch, "auto")
    handle_attr = bench.record("cudnnBackendSetAttribute", PACK2, 0, struct.pack("<iiq", 1001, 0, 1) + bytes(8), CTX)
    short_set = bench.record("cudnnBackendSetAttribute", PACK2, 0, struct.pack("<iiq", 1001, 6, 2) + bytes(8), CTX)
    twice = bench.record("cudnnBackendCreateDescriptor", PACK2, 0, bench.pack("cudnnBackendCreateDescriptor", type=16),
                         ctx=CTX)
    destroy = bench.record("cudnnBackendDestroyDescriptor", PACK2, 0, b"", ctx=CTX)
    gone = bench.record("cudnnBackendFinalizeQueued", PACK2, 0, b"", ctx=CTX)
    log, through_python = run(session, handle_attr + short_set + twice + destroy + gone + _conv(), monkeypatch)
    messages = [message for _, _, message in session.executor.deferred]
    assert len(messages) == 4, messages
    assert "a variant pack's attribute 1001 of type 0 with 8 bytes for 1 elements" in messages[0]
    assert "a variant pack's attribute 1001 of type 6 with 8 bytes for 2 elements" in messages[1]
    assert f"backend descriptor {PACK2:#x} exists already" in messages[2]
    assert f"{PACK2:#x} is not a backend descriptor of this session" in messages[3]
    assert [line.split()[0] for line in log].count("dnn_execute") == 1 and through_python == 5
    session.libs.close()


@isolated
def test_the_packs_c_holds_are_destroyed_when_the_session_ends(folder, monkeypatch):
    session = dnn_session(folder, monkeypatch, "auto")
    run(session, bench.conv_records(bench.DNN_HANDLE, S1, bench.PLAN, PACK3, ctx=CTX, destroy=False), monkeypatch)
    lib = session.libs.library("cudnn")
    assert lib.c.rgpu_cudnn_count(lib.fast, PACK) == 3
    session.std.standin_take()
    session.libs.close()
    destroyed = [line for line in session.std.standin_take().decode().splitlines() if line.startswith("dnn_desc_destroy")]
    assert len(destroyed) == 5                              # the three packs (C's), then the two plans
    assert lib.fast is None


T_X, T_BN, T_Y = 0x5247_0021, 0x5247_0022, 0x5247_0023


def _tensor(tid, dtype=0, dims=(2, 3, 4, 4)) -> bytes:
    strides = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        strides[i] = strides[i + 1] * dims[i + 1]
    return (bench.record("cudnnCreateTensorDescriptor", tid, 0, b"", CTX)
            + bench.record("cudnnSetTensorNdDescriptor", tid, 0, struct.pack(f"<ii{2 * len(dims)}i", dtype, len(dims),
                                                                             *dims, *strides), CTX))


def _bn(dtype=0) -> bytes:
    """A batch norm's records as torch queues them: x and y described, the BN parameters' derived, the
    forward pass, the three destroyed."""
    derive = bench.record("cudnnDeriveBNTensorDescriptor", T_BN, 0, struct.pack("<Qi", T_X, 2), CTX)
    forward = bench.record("cudnnBatchNormalizationForwardTrainingEx", bench.DNN_HANDLE, S1, bench.pack(
        "cudnnBatchNormalizationForwardTrainingEx", mode=2, alpha=1.0, x=T_X, x_data=0xA000, y=T_Y, y_data=0xC000,
        bn=T_BN, scale=0xD000, bias=0xD100, factor=0.1, epsilon=1e-5), CTX)
    gone = b"".join(bench.record("cudnnDestroyTensorDescriptor", t, 0, b"", CTX) for t in (T_X, T_BN, T_Y))
    return (_tensor(T_X, dtype) + bench.record("cudnnCreateTensorDescriptor", T_BN, 0, b"", CTX) + derive
            + _tensor(T_Y, dtype) + forward + gone)


@isolated
def test_a_batch_norm_and_its_tensor_descriptors_run_in_c_with_the_python_paths_calls(folder, monkeypatch):
    def destroyed(native, lib):
        if native != "off":
            assert lib.c.rgpu_cudnn_count(lib.fast, 3) == 0            # each destroyed

    # in C: all, the batch norms too; walker off: Python's batch norm on the C table's tensors
    logs = _logs_on_each_path(folder, monkeypatch, _bn() + _bn(dtype=9), {"auto": 0, "off": 20, "walker off": 20},
                              destroyed)
    assert logs["auto"] == logs["off"] == logs["walker off"]
    one = [line.split() for line in logs["auto"][:11]]
    assert [w[0] for w in one] == ["ctx", "dnn_tensor", "dnn_tensor_set", "dnn_tensor", "dnn_derive", "dnn_tensor",
                                   "dnn_tensor_set", "dnn_stream", "dnn_bn_forward", "dnn_tensor_destroy",
                                   "dnn_tensor_destroy"]
    x, bn, y = one[2][1], one[4][1], one[6][1]
    assert one[2][2:] == ["0", "4", "2x48", "3x16", "4x4", "4x1"] and one[4][2:] == [x, "2"]
    one_f = f"{struct.unpack('<I', struct.pack('<f', 1.0))[0]:x}"
    assert one[8][4:] == [one_f, "0", x, "0", y, bn]               # alpha a float (fp32 x), the tensors C made
    bf16 = next(line.split() for line in logs["auto"][11:] if line.startswith("dnn_bn_forward"))
    assert bf16[4] == one_f                                        # a bf16 x: float scalars too


@isolated
def test_a_tensors_unusual_records_are_refused_by_python_and_c_s_tensors_destroyed_at_the_end(folder, monkeypatch):
    session = dnn_session(folder, monkeypatch, "auto")
    nine = bench.record("cudnnSetTensorNdDescriptor", T_X, 0, struct.pack("<ii", 0, 9) + bytes(72), CTX)
    gone = bench.record("cudnnDestroyTensorDescriptor", T_Y, 0, b"", CTX)
    derive = bench.record("cudnnDeriveBNTensorDescriptor", T_BN, 0, struct.pack("<Qi", T_Y, 2), CTX)
    bn = bench.record("cudnnBatchNormalizationForwardInference", bench.DNN_HANDLE, S1, bench.pack(
        "cudnnBatchNormalizationForwardInference", x=T_X, y=T_Y, bn=T_X), CTX)
    _, through_python = run(session, _tensor(T_X) + _tensor(T_X) + nine + gone + derive + bn, monkeypatch)
    messages = [message for _, _, message in session.executor.deferred]
    assert len(messages) == 5 and through_python == 5, messages
    assert f"tensor descriptor {T_X:#x} exists already" in messages[0]
    assert "cudnnSetTensorNdDescriptor: 72 bytes for 9 dims and strides" in messages[1]
    assert f"{T_Y:#x} is not a tensor descriptor of this session" in messages[2]
    assert f"{T_BN:#x} is not a tensor descriptor of this session" in messages[3]
    assert f"{T_Y:#x} is not a tensor descriptor of this session" in messages[4]
    lib = session.libs.library("cudnn")
    assert lib.c.rgpu_cudnn_count(lib.fast, 3) == 1
    session.std.standin_take()
    session.libs.close()
    assert "dnn_tensor_destroy" in session.std.standin_take().decode()
