"""The drivers behind the cuda route are an explicit interface (server/cuda/base.py): every call the executor
makes is a method of both drivers, their code parts implement every call a driver hands them, and nothing
reaches one object through another's attribute forwarding."""
from __future__ import annotations

from pathlib import Path

from rgpu.server.cuda import base, fake, fake_code, real, real_code
from rgpu.server.cuda.executor import OPS


def test_no_attribute_forwarding_and_no_import_circle():
    for cls in (real.RealDriver, fake.FakeDriver, real_code.RealCode, fake_code.FakeCode):
        assert not any("__getattr__" in vars(k) for k in cls.__mro__), cls
    assert "from .real import" not in Path(real_code.__file__).read_text()


def test_every_executor_op_is_a_method_of_both_drivers_and_every_code_call_is_implemented():
    for op in sorted(OPS - {"lib_call", "lib_record"}):
        for cls in (real.RealDriver, fake.FakeDriver):
            assert callable(getattr(cls, op, None)), f"{cls.__name__} has no {op}"
            assert getattr(cls, op) is not getattr(base.Code, op, None)
    for code in (real_code.RealCode, fake_code.FakeCode):
        missing = [n for n in base.CODE_CALLS if getattr(code, n) is getattr(base.Code, n)]
        assert not missing, f"{code.__name__} lacks {missing}"
    assert base.Code.module_load.__doc__ and base.Driver.launch_records.__doc__


def test_a_fake_drivers_code_calls_are_its_codes():
    drv = fake.FakeDriver()
    drv.set_current(drv.primary_ctx_retain(0))
    assert drv.launch_at is None and drv.launch_records(0, 0, 0, None) is None
    ptx = b".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry noop()\n{\n ret;\n}\n"
    mod = drv.module_load(None, ptx)[0]
    assert drv.module_get_function(mod, "noop") == drv.code.module_get_function(mod, "noop")
