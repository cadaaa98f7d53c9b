"""The ops route's executor, driven in-process through ``handle()``: ids, poison, limits, devices."""
from __future__ import annotations

import pytest
import torch
from device_helpers import op_path, ops_settings, run_python  # noqa: F401  (op_path: every test on both op paths)

from rgpu.server.ops.codec import CODE_BY_DTYPE
from rgpu.protocol.ops import Event, Msg
from rgpu.server.route import OpFailed, Session
from rgpu.server.ops.executor import Executor

F32 = CODE_BY_DTYPE[torch.float32]


def executor(**settings) -> Executor:
    return Executor(Session(id="t", route="ops", settings=ops_settings(**settings)))


def desc(sid, n, size=None, stride=None, offset=0, dev=0):
    size = [n] if size is None else size
    return [sid, 4 * n, F32, size, stride or [1], offset, dev]


def define(ex, index, op):
    ex.handle([Msg.DEFINE, index, f"{op._schema.name[6:]}.{op._overloadname}", str(op._schema)], [], False)


def upload(ex, sid, values):
    data = torch.tensor(values, dtype=torch.float32)
    ex.handle([Msg.UPLOAD, [], desc(sid, len(values))], [memoryview(data.numpy()).cast("B")], False)


def download(ex, d) -> torch.Tensor:
    _, bufs = ex.handle([Msg.DOWNLOAD, [], d], [], True)
    return torch.frombuffer(bytearray(bufs[0]), dtype=torch.float32)


def test_an_op_binds_its_output_to_the_id_the_client_minted():
    ex = executor()
    define(ex, 1, torch.ops.aten.add.Tensor)
    upload(ex, 10, [1.0, 2.0])
    ex.handle([Msg.OP, [], 1, [{"t": desc(10, 2)}, {"t": desc(10, 2)}], {}, [desc(11, 2)]], [], False)
    assert download(ex, desc(11, 2)).tolist() == [2.0, 4.0]
    ex.handle([Msg.EVENTS, [Event.FREE, 11]], [], False)
    assert 11 not in ex.table.entries


def test_storage_growth_copies_the_old_bytes_then_frees_them():
    ex = executor()
    upload(ex, 20, [5.0, 6.0])
    ex.handle([Msg.EVENTS, [Event.COPY, 21, 16, 0, 20, 8, Event.FREE, 20]], [], False)
    assert download(ex, desc(21, 2, offset=0)).tolist() == [5.0, 6.0] and 20 not in ex.table.entries


def test_a_failure_poisons_outputs_and_written_inputs_and_names_the_op():
    ex = executor()
    define(ex, 1, torch.ops.aten.index_select.default)
    define(ex, 2, torch.ops.aten.mul.Tensor)
    upload(ex, 30, [1.0, 2.0])
    idx = torch.tensor([7])
    ex.handle([Msg.UPLOAD, [], [31, 8, CODE_BY_DTYPE[torch.int64], [1], [1], 0, 0]],
              [memoryview(idx.numpy()).cast("B")], False)
    with pytest.raises(OpFailed) as info:
        ex.handle([Msg.OP, [], 1, [{"t": desc(30, 2)}, 0, {"t": [31, 8, 4, [1], [1], 0, 0]}], {}, [desc(32, 1)]], [], False)
    assert info.value.op == "aten.index_select.default"
    # a dependent op fails quietly and passes the poison on; reading names the first failure
    ex.handle([Msg.OP, [], 2, [{"t": desc(32, 1)}, {"t": desc(32, 1)}], {}, [desc(33, 1)]], [], False)
    with pytest.raises(OpFailed, match="index") as info:
        ex.handle([Msg.DOWNLOAD, [], desc(33, 1)], [], True)
    assert info.value.op == "aten.index_select.default"


def test_a_descriptor_cannot_reach_past_its_storage():
    ex = executor()
    upload(ex, 40, [1.0, 2.0])
    with pytest.raises(RuntimeError, match="out of bounds"):
        ex.handle([Msg.DOWNLOAD, [], [40, 8, F32, [4], [1], 0, 0]], [], True)


def test_only_aten_ops_by_valid_name_are_defined():
    ex = executor()
    for name in ("os.system", "add", "../add.Tensor", "add.Tensor; rm"):
        ex.handle([Msg.DEFINE, 5, name, "x"], [], False)
        with pytest.raises(OpFailed):
            ex.handle([Msg.OP, [], 5, [], {}, None], [], False)


def test_the_cpu_executor_exposes_as_many_devices_as_asked():
    ex = executor(devices=3)
    w = ex.welcome()
    assert w["device"] == "cpu" and w["device_count"] == 3 and len(w["names"]) == 3
    with pytest.raises(IndexError):
        ex.table.device(3)


def test_two_server_devices_behave_like_two_gpus(start_server):
    server = start_server("--device", "cpu", "--devices", "2")
    code = (
        "import torch, rgpu, pytest\n"
        "assert torch.rgpu.device_count() == 2\n"
        "a = torch.arange(4.0, device='rgpu:1')\n"
        "b = a.to('rgpu:0') * 2\n"
        "assert a.device.index == 1 and b.device.index == 0 and b.cpu().tolist() == [0, 2, 4, 6]\n"
        "with pytest.raises(RuntimeError, match='same device'):\n"
        "    a + b\n"
        "assert a[a > 1].device.index == 1 and a[a > 1].cpu().tolist() == [2, 3]  # server-sized, on rgpu:1\n"
        "with torch.rgpu.device(1):\n"
        "    assert torch.empty(1, device='rgpu').device.index == 1\n"
        "print('ok')\n")
    r = run_python(code, env={"RGPU_SERVER": server.address, "RGPU_TOKEN": server.token})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_a_list_of_tensors_reads_cached_views_and_a_mixed_list_is_decoded_item_by_item():
    from rgpu.server.ops.codec import Decoder

    ex = executor()
    define(ex, 1, torch.ops.aten._foreach_add.List)
    upload(ex, 10, [1.0, 2.0])
    upload(ex, 12, [10.0, 20.0])
    tensors = [{"t": desc(10, 2)}, {"t": desc(12, 2)}]
    for outs in ([desc(13, 2), desc(14, 2)], [desc(15, 2), desc(16, 2)]):
        ex.handle([Msg.OP, [], 1, [tensors, tensors], {}, outs], [], False)
        assert [download(ex, d).tolist() for d in outs] == [[2.0, 4.0], [20.0, 40.0]]
    dec = Decoder(ex.table, True)
    first, again = dec.value(tensors), dec.value(tensors)
    assert all(a is b for a, b in zip(first, again))  # one view per descriptor, built once
    assert dec.device == 0 and len(dec.inputs) == 4
    mixed = [{"t": desc(10, 2)}, None, {"t": desc(12, 2)}]
    assert ex.table.view_list(mixed, []) is None
    got = Decoder(ex.table, True).value(mixed)
    assert got[1] is None and got[0].tolist() == [1.0, 2.0] and got[2].tolist() == [10.0, 20.0]
