"""The rgpu device registers cheaply, behaves as a real torch device, and mirrors torch.cuda."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
from device_helpers import rgpu_device, run_python, tiny_gpt  # noqa: F401

from rgpu.protocol.ops import DTYPES


def test_import_rgpu_server_neither_registers_the_device_nor_builds_nor_loads_the_cpp_part():
    r = run_python(
        # the server's processes import rgpu.server before torch (a client's `import rgpu` with
        # torch already there loads a built C++ part at once: generators need its hooks)
        "import sys, rgpu.server, torch, rgpu.server.ops.executor\n"
        "assert not [m for m in sys.modules if m.startswith('rgpu.device_backend')], 'device code imported'\n"
        "assert not [m for m in sys.modules if m.startswith('rgpu_device_')], 'extension in sys.modules'\n"
        "assert torch._C._get_privateuse1_backend_name() == 'privateuseone'\n"
        "print('ok')\n")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_the_client_never_imports_the_server_package():
    # both ends share rgpu.protocol and rgpu.ops_substitutes; neither imports the other
    r = run_python(
        "import sys, torch, rgpu\n"
        "from rgpu.device_backend import compile, copies, encode, fallback, meta, optable, session, torch_rgpu\n"
        "assert (torch.ones(3, device='rgpu') * 2).cpu().tolist() == [2.0] * 3\n"
        "bad = [m for m in sys.modules if m.startswith('rgpu.server')]\n"
        "assert not bad, bad\n"
        "print('ok')\n")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_import_rgpu_before_torch_registers_the_device_when_torch_arrives():
    r = run_python("import rgpu, sys\nassert 'torch' not in sys.modules\nimport torch\n"
                   "assert torch._C._get_privateuse1_backend_name() == 'rgpu' and hasattr(torch, 'rgpu')\nprint('ok')")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_tensors_and_parameters_keep_their_types_after_model_to(rgpu_device):
    model = tiny_gpt()
    x = torch.randint(0, 97, (2, 16))
    model(x, x)[1].backward()  # a grad-tracking forward (and backward) on the CPU first
    model.to("rgpu")
    for p in model.parameters():
        assert type(p) is nn.Parameter and p.device.type == "rgpu"
    t = torch.ones(3).to("rgpu")
    assert type(t) is torch.Tensor and t.device == torch.device("rgpu", 0)


def test_module_to_keeps_tied_weights_tied(rgpu_device):
    model = tiny_gpt().to("rgpu")
    assert model.wte.weight is model.lm_head.weight


@pytest.mark.filterwarnings("ignore")  # creating the experimental dtypes warns
def test_the_dtype_codes_match_this_torch(rgpu_device):
    for code, name in enumerate(DTYPES):
        dtype = getattr(torch, name, None)
        if dtype is not None:
            assert rgpu_device.C.dtype_code(torch.empty(0, dtype=dtype)) == code, name


def test_torch_rgpu_mirrors_torch_cuda(rgpu_device):
    assert torch.rgpu.is_available() and torch.rgpu.device_count() == 1
    assert torch.rgpu.current_device() == 0
    name = torch.rgpu.get_device_name(0)
    assert name and name != "rgpu"  # the server's device name (a GPU's, or the CPU executor's)
    gc.collect()
    torch.rgpu.synchronize()
    before = torch.rgpu.memory_allocated()
    big = torch.ones(1 << 16, device="rgpu")
    torch.rgpu.synchronize()
    assert torch.rgpu.memory_allocated() == before + big.numel() * 4
    del big
    torch.rgpu.synchronize()
    assert torch.rgpu.memory_allocated() == before
    assert torch.rgpu.max_memory_allocated() >= torch.rgpu.memory_allocated()
    with torch.rgpu.device(0):
        assert torch.rgpu.current_device() == 0


def test_seeding_gives_the_same_random_numbers_run_to_run(rgpu_device):
    torch.manual_seed(123)
    a = torch.randn(5, device="rgpu").cpu()
    d1 = torch.nn.functional.dropout(torch.ones(64, device="rgpu"), 0.5).cpu()
    torch.manual_seed(123)
    b = torch.randn(5, device="rgpu").cpu()
    d2 = torch.nn.functional.dropout(torch.ones(64, device="rgpu"), 0.5).cpu()
    assert torch.equal(a, b) and torch.equal(d1, d2)
    assert not torch.equal(a, torch.randn(5, device="rgpu").cpu())


def test_torch_save_of_a_device_tensor_loads_back_on_the_cpu(rgpu_device, tmp_path):
    t = torch.arange(6.0).to("rgpu")
    torch.save({"t": t}, tmp_path / "t.pt")
    back = torch.load(tmp_path / "t.pt", map_location="cpu")["t"]
    assert back.device.type == "cpu" and torch.equal(back, torch.arange(6.0))


def test_backward_on_the_cpu_before_the_device_is_used_leaves_its_backward_working(rgpu_server):
    # The autograd engine sizes its per-device queues once, at the first backward of the process.
    r = run_python("import torch, rgpu\nm = torch.nn.Linear(4, 2)\nm(torch.randn(3, 4)).sum().backward()\n"
                   "m.to('rgpu')\nm(torch.randn(3, 4).to('rgpu')).sum().backward()\n"
                   "assert m.weight.grad.device.type == 'rgpu'\nprint('ok')",
                   env={"RGPU_SERVER": rgpu_server.address, "RGPU_TOKEN": rgpu_server.token})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_a_script_that_ends_right_after_a_backward_exits_cleanly(rgpu_server):
    # autograd's thread for the device drops its last graph task after backward returns, taking the GIL:
    # during finalization that aborted ~1 exit in 12 ("terminate called without an active exception")
    script = ("import torch, rgpu\nm = torch.nn.Linear(4, 2).to('rgpu')\n"
              "m(torch.randn(3, 4).to('rgpu')).sum().backward()\nprint('ok')")
    for _ in range(6):
        r = run_python(script, env={"RGPU_SERVER": rgpu_server.address, "RGPU_TOKEN": rgpu_server.token})
        assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_a_cuda_style_engine_assert_in_backward_is_reraised_with_its_cause():
    # on a GPU host, CUDA autograd in a process with rgpu registered fails with this engine assert (#161129)
    import rgpu  # noqa: F401

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED at engine.cpp")

    x = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="process that never imports rgpu"):
        Fails.apply(x).sum().backward()

    class Other(Fails):
        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as info:  # any other error goes through untouched
        torch.autograd.grad(Other.apply(x).sum(), x)
    assert "rgpu" not in str(info.value)


def test_native_reference_process_never_imports_rgpu():
    # bench train's and the GPU check's native CUDA runs live there (CUDA autograd fails where rgpu is registered)
    from rgpu.bench.native_step import Native

    p = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, batch=2)
    with Native("cpu", p, 11, batches=2) as native:
        assert native.info["rgpu_imported"] is False
        losses = native.warm(2)
        assert len(losses) == 2 and all(v > 0 for v in losses)
        assert native.block(2) > 0
