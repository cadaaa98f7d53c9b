"""cuBLASLt's queued matmul records run in C beside cuBLAS's GEMMs (server/cuda/libs/cublaslt_records.c): the
same calls and arguments as the Python path (scalars by pointer mode, the algo, workspace, stream, the device
addresses set only when they change), a state handed to C once, the rest refused with a clear error.

As in test_cuda_lib_records.py: NVIDIA's libraries are the bench's stand-in, each test in a forked child.
"""
from __future__ import annotations

import struct

import pytest
from cuda_lib_fixtures import CTX, S1, S2, gemm, isolated, launch, run, session_of
from cuda_lib_fixtures import folder, pytestmark  # noqa: F401 (the stand-in's fixture, its skip)

from rgpu.bench import cuda_lib_records as bench
from rgpu.protocol.cuda import LIB_KIND, OP
from rgpu.protocol.cuda_libs import BY_NAME

ALGO = struct.pack("<Q", 0xA160) + bytes(56)


def _state(bias: int = 0xB100, mode: int = 0) -> bytes:
    state = bench._lt_state().replace(struct.pack("<Q", 0xBEEF00), struct.pack("<Q", bias))
    if mode:        # the desc's pointer mode (attribute 2) beside its others: another state
        i32 = struct.pack("<i", mode)
        desc_len = struct.unpack_from("<I", state, 4)[0]
        state = (struct.pack("<II", 1, desc_len + 8 + 4) + state[8:8 + desc_len] + struct.pack("<II", 2, 4) + i32
                 + state[8 + desc_len:])
    return state


def _short_bias() -> bytes:
    """A state whose bias pointer (attribute 8) is 4 bytes, not an address's 8."""
    body = b"".join(struct.pack("<II", a, len(v)) + v for a, v in
                    ((0, struct.pack("<i", 68)), (1, struct.pack("<i", 0)), (8, struct.pack("<I", 0xB100))))
    return struct.pack("<II", 1, len(body)) + body + bench._lt_state()[8 + struct.unpack_from("<I", _state(), 4)[0]:]


def _matmul(handle=bench.HANDLE, stream=S1, tail=None, **over) -> bytes:
    f = dict(alpha=bench.SCALAR, beta=struct.pack("<f", 0.5).ljust(16, b"\0"), a=0xA000, b=0xB000, c=0xC000,
             d=0xD000, workspace=0xE000, workspace_size=1 << 20)
    f.update(over)
    return bench.record("cublasLtMatmul", handle, stream, bench.pack("cublasLtMatmul", tail=_state() if tail is None
                                                                      else tail, **f), ctx=CTX)


STEP = b"".join([            # host scalars, a new bias, an algo, device scalars, beta host, a second stream
    _matmul(),
    gemm("cublasSgemm_v2"),
    _matmul(tail=_state(0xB200), algo=ALGO, has_algo=1),
    launch(0x100, S1),
    _matmul(tail=_state(mode=1), alpha_ptr=0xA1F0, beta_ptr=0xBE70),
    _matmul(tail=_state(mode=4), alpha_ptr=0xA1F0, beta_ptr=0xBE70, stream=S2),
    _matmul(tail=_state(0xB200)),
    _matmul(handle=bench.LT_HANDLE),              # a cublasLtCreate handle: Python's, either way
])


def _lt_session(folder, monkeypatch, native):
    session = session_of(folder, monkeypatch, native)
    out = session.libs.run(BY_NAME["cublasLtCreate"].id, bench.LT_HANDLE, 0,
                           memoryview(bench.pack("cublasLtCreate", client_version=130100)), answered=True)
    assert out[-2:] == [0, None], out
    return session


@isolated
def test_the_c_walker_and_the_python_path_make_the_same_lt_calls(folder, monkeypatch):
    logs = {}
    for native in ("auto", "off"):
        session = _lt_session(folder, monkeypatch, native)
        logs[native], through_python = run(session, STEP * 2, monkeypatch)
        assert session.executor.deferred == []
        # in C: all but each new state's first record (four states) and the cublasLtCreate handle's two
        assert through_python == (6 if native == "auto" else 14)
        lib = session.libs.library("cublaslt")
        assert (lib.c.rgpu_cublaslt_states(lib.fast) if native == "auto" else lib.fast) == (4 if native == "auto"
                                                                                             else None)
        session.libs.close()
    assert logs["auto"] == logs["off"]
    matmuls = [line.split() for line in logs["auto"] if line.startswith("lt_matmul")]
    assert len(matmuls) == 12
    one, half = (struct.unpack("<Q", struct.pack("<f", v).ljust(8, b"\0"))[0] for v in (1.0, 0.5))
    # handle desc alpha A Adesc B Bdesc beta C Cdesc D Ddesc has_algo algo[0] workspace size stream
    first, algo, device, beta_host = matmuls[:4]
    assert [first[3], first[4], first[8], first[9], first[11]] == [f"{one:x}", "a000", f"{half:x}", "c000", "d000"]
    assert first[13:] == ["0", "0", "e000", str(1 << 20), f"{S1:x}"]
    assert algo[13:15] == ["1", "a160"]
    assert device[3] == "a1f0" and device[8] == "be70"                 # both device addresses
    assert beta_host[3] == "a1f0" and beta_host[8] == f"{half:x}" and beta_host[-1] == f"{S2:x}"
    biases = [line.split()[3] for line in logs["auto"] if line.startswith("desc_set") and line.split()[2] == "8"]
    # set when it changed on that descriptor (the two other pointer modes: two more descriptors)
    assert biases == ["b100", "b200", "b100", "b100", "b100"] + ["b200", "b100"]
    assert matmuls[5][1] != matmuls[0][1]                             # cublasLtCreate's handle, not cuBLAS's


@isolated
def test_the_c_table_forgets_its_states_when_python_destroys_a_descriptor(folder, monkeypatch):
    from rgpu.server.cuda.libs import cublaslt_real
    monkeypatch.setattr(cublaslt_real, "MAX_KEPT", 1)        # each new layout or desc destroys the last
    logs = {}
    for native in ("auto", "off"):
        session = _lt_session(folder, monkeypatch, native)
        records = _matmul() + _matmul(tail=_state(mode=1)) + _matmul() + _matmul()
        logs[native], through_python = run(session, records, monkeypatch)
        assert session.executor.deferred == []
        assert through_python == (3 if native == "auto" else 4)       # the third: its state made again
        session.libs.close()
    assert logs["auto"] == logs["off"]


@isolated
def test_malformed_and_unknown_lt_records_are_refused_with_clear_errors(folder, monkeypatch):
    for native in ("auto", "off"):
        session = _lt_session(folder, monkeypatch, native)
        short = OP.pack(OP.size + 24, LIB_KIND, CTX, S1, BY_NAME["cublasLtMatmul"].id, bench.HANDLE, 20) + bytes(24)
        bad_state = _matmul(tail=b"\x01\0\0\0\xff\0\0\0")
        bad_address = _matmul(tail=_short_bias())
        records = _matmul() + short + _matmul(handle=0x99) + bad_state + _matmul()
        log, _ = run(session, records, monkeypatch)
        messages = [message for _, _, message in session.executor.deferred]
        assert len(messages) == 3, messages
        assert "cublasLtMatmul: a payload of 20 bytes, expected at least 164" in messages[0]
        assert "0x99 is not a cuBLAS or cuBLASLt handle of this session" in messages[1]
        assert "cublasLtMatmul: object 0: kind 1, 255 bytes past the state's end" in messages[2]
        assert [line.split()[0] for line in log].count("lt_matmul") == 2     # the rest still ran, in order
        session.executor.deferred.clear()
        if native == "auto":
            run(session, bad_address, monkeypatch)
            assert "a device address is 8 bytes" in session.executor.deferred[0][2]
        session.libs.close()


def test_the_lt_table_refuses_short_payloads_and_unknown_states_itself(folder, monkeypatch):
    from rgpu.server.cuda import real_batch
    if real_batch.library() is None:
        pytest.skip("the server's C part does not build here")
    _lt_table_refuses(folder, monkeypatch)


@isolated
def _lt_table_refuses(folder, monkeypatch):
    from rgpu.server.cuda import real_batch
    c = real_batch.library()
    session = _lt_session(folder, monkeypatch, "auto")
    run(session, _matmul(), monkeypatch)                    # its state handed to C
    lt, cublas = session.libs.library("cublaslt").fast, session.libs.records_table()
    payload = bench.pack("cublasLtMatmul", a=0xA000, tail=_state())
    other = bench.pack("cublasLtMatmul", a=0xA000, tail=_state(0xB300))
    assert c.rgpu_cublaslt_record(lt, cublas, bench.HANDLE, S1, payload, len(payload)) == 0
    assert c.rgpu_cublaslt_record(lt, cublas, bench.HANDLE, S1, payload, 100) == -1
    assert c.rgpu_cublaslt_record(lt, cublas, bench.HANDLE, S1, other, len(other)) == -2    # an unknown state
    assert c.rgpu_cublaslt_record(lt, cublas, 0x99, S1, payload, len(payload)) == -2
    assert c.rgpu_cublaslt_record(lt, cublas, bench.LT_HANDLE, S1, payload, len(payload)) == -2
    assert c.rgpu_cublaslt_record(None, cublas, bench.HANDLE, S1, payload, len(payload)) == -2
    call = BY_NAME["cublasLtMatmul"].id          # through cuBLAS's table, the walker's entry
    assert c.rgpu_cublas_record(cublas, call, bench.HANDLE, S1, payload, len(payload)) == 0
    session.libs.close()


@isolated
def test_a_heuristic_query_after_a_matmul_is_answered_with_the_c_table_on_as_with_it_off(folder, monkeypatch):
    """A heuristic query names six objects (a desc, four layouts, a preference), a matmul's state five: only
    the matmul's goes to the C table. (The H200 host's ladder failed every cuBLASLt rung when the query's six
    were put in the C table's array of five: CUBLAS_STATUS_NOT_INITIALIZED at cublasLtMatmulAlgoGetHeuristic.)"""
    heur = BY_NAME["cublasLtMatmulAlgoGetHeuristic"]
    pref = struct.pack("<II", 3, 16) + struct.pack("<IIQ", 1, 8, 1 << 20)      # kind 3: the workspace limit
    query = memoryview(heur.format.pack(4) + _state() + pref)
    answers, logs = {}, {}
    for native in ("auto", "off"):
        session = _lt_session(folder, monkeypatch, native)
        run(session, _matmul(), monkeypatch)                  # a matmul's state first: with C on, in the C table
        answers[native] = [session.libs.run(heur.id, bench.HANDLE, 0, query, answered=True) for _ in range(2)]
        logs[native], _ = run(session, _matmul(), monkeypatch)
        assert session.executor.deferred == []
        session.libs.close()
    for native in answers:
        for out, status, message in answers[native]:
            assert (status, message, len(out)) == (0, None, 96), (native, status, message)
    assert answers["auto"] == answers["off"]
    assert logs["auto"] == logs["off"]
