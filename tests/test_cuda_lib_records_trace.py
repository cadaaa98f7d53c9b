"""A recorded cuDNN session replayed through the server's C record path: the conv program's calls (its variant pack
made, set, finalized, executed and destroyed among them) as rgpu's client library sent them, run into a stand-in
session with the C walker and with ``RGPU_NATIVE=off``: the same library calls with the same values, the packs'
records, the batch norms and their legacy tensor descriptors never reaching Python in C.

The trace is recorded here (``RGPU_CUDA_LIB_RECORD``, server/cuda/libs/trace.py) from ``lib_programs/cudnn_conv_bn.c``
run through rgpu against the fake server; its payloads are replayed in order, the queued ones as the records the
client's queue carries (consecutive ones in one buffer, through the executor's door), the answered ones through
``Libraries.run``. NVIDIA's libraries are the bench's stand-in (tests/cuda_lib_fixtures.py).
"""
from __future__ import annotations

import struct

import pytest
from cuda_lib_fixtures import CTX, isolated, session_of
from cuda_lib_fixtures import folder, pytestmark  # noqa: F401 (the stand-in's fixture, its skip)
from test_cuda_lib_cudnn import compile_program, libraries  # noqa: F401 (fixture)
from test_cuda_programs import run

from rgpu.bench import cuda_lib_records as bench
from rgpu.protocol.cuda import NO_STREAM
from rgpu.protocol.cuda_libs import BY_NAME

PACK_CALLS = {BY_NAME[n].id for n in ("cudnnBackendCreateDescriptor", "cudnnBackendSetAttribute",
                                      "cudnnBackendFinalizeQueued", "cudnnBackendDestroyDescriptor")}
TENSOR_CALLS = {BY_NAME[n].id for n in ("cudnnCreateTensorDescriptor", "cudnnSetTensorNdDescriptor",
                                        "cudnnDestroyTensorDescriptor", "cudnnDeriveBNTensorDescriptor",
                                        "cudnnBatchNormalizationForwardTrainingEx", "cudnnBatchNormalizationBackwardEx",
                                        "cudnnBatchNormalizationForwardInference")}


@pytest.fixture(scope="module")
def conv_trace(libraries, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    """The conv program's trace, recorded against the fake server."""
    from conftest import RunningServer
    from rgpu.server.cuda.libs import trace
    work = tmp_path_factory.mktemp("conv-trace")
    exe = compile_program(work, [libraries], ["libcudnn.so.9", "libcudart.so.13"])
    server = RunningServer(work / "server", ("--cuda-driver", "fake"), env={"RGPU_CUDA_LIB_RECORD": str(work / "t")})
    try:
        done = run([exe], server)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    finally:
        server.stop()
    paths = sorted((work / "t").glob("*.rgputrace"))
    assert len(paths) == 1, server.stderr[-2000:]
    return trace.load(paths[0])[1]


def _replay(session, calls, monkeypatch) -> tuple[list[str], list[tuple[int, int]]]:
    """The stand-in's log of ``calls`` replayed, and the (call id, handle) of each that reached ``Libraries.run``."""
    seen, libs_run = [], session.libs.run
    monkeypatch.setattr(session.libs, "run", lambda *a, **k: seen.append(a[:2]) or libs_run(*a, **k))
    session.std.standin_take()
    queued = b""
    for c in calls + [None]:
        if c is not None and not c["answered"]:
            stream = NO_STREAM if c["stream"] is None else c["stream"]
            queued += bench.record(c["name"], c["handle"], stream, c["payload"], ctx=CTX)
            continue
        if queued:          # the client's queue, sent before the answered call that follows it
            session.executor._launches(memoryview(bytearray(queued)))
            queued = b""
        if c is not None:
            out = session.libs.run(c["call"], c["handle"], NO_STREAM, memoryview(c["payload"]), answered=True)
            assert out[-2] == 0, (c["name"], out)
    assert session.executor.deferred == []
    return session.std.standin_take().decode().splitlines(), seen


@isolated
def test_the_conv_programs_trace_makes_the_same_calls_in_c_and_in_python_its_pack_never_in_python(
        folder, monkeypatch, conv_trace):
    names = [c["name"] for c in conv_trace]
    assert "cudnnBackendExecute" in names and "cudnnBackendFinalizeQueued" in names
    logs, seen = {}, {}
    for native in ("auto", "off"):
        session = session_of(folder, monkeypatch, native)
        logs[native], seen[native] = _replay(session, conv_trace, monkeypatch)
        session.libs.close()
    assert logs["auto"] == logs["off"] and len(logs["auto"]) > 50
    packs = {c["handle"] for c in conv_trace if c["name"] == "cudnnBackendFinalizeQueued"}
    pack_calls = [c for c in conv_trace if c["handle"] in packs and c["call"] in PACK_CALLS]
    assert len(packs) == 3 and len(pack_calls) == 6 * 3     # forward, data and filter gradients: made, 3 sets, ...
    tensor_calls = [c for c in conv_trace if c["call"] in TENSOR_CALLS]
    assert len(tensor_calls) >= 4 and all(not c["answered"] for c in tensor_calls)
    assert not {(c["call"], c["handle"]) for c in pack_calls + tensor_calls} & set(seen["auto"])
    assert len(seen["off"]) == len(conv_trace)
    assert len(seen["auto"]) == len(conv_trace) - len(pack_calls) - len(tensor_calls)
    assert any(line.startswith("dnn_bn_forward") for line in logs["auto"])
    assert {"cudnnBatchNormalizationForwardTrainingEx", "cudnnBatchNormalizationBackwardEx"} <= set(names)
    # value by value: the data pointers the program set reached the library as it sent them
    ptrs = next(c for c in pack_calls if c["name"] == "cudnnBackendSetAttribute"
                and struct.unpack_from("<i", c["payload"])[0] == 1001)
    sent = struct.unpack_from("<3Q", ptrs["payload"], 16)
    got = next(line.split() for line in logs["auto"] if line.startswith("dnn_set") and line.split()[2] == "1001")
    assert [int(v, 16) for v in got[5:]] == list(sent) and all(sent)
    assert names.count("cudnnBackendExecute") == 3           # each plan's first: Python's, either way
