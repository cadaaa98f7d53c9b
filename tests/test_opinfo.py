"""rgpu against the CPU on PyTorch's own OpInfo samples (``op_db``), with the tolerances of its test_compare_cpu.

A sample is made on the device (as PyTorch's CUDA tests make theirs), copied to
the CPU, and the op runs on both; results are compared as test_compare_cpu
compares CUDA's (``assertEqual``, atol = rtol = 1e-3). The denominator is every
sample of the dtype that runs on the CPU, except the ops in ``NONDETERMINISTIC``;
a sample that fails, raises, or cannot be made on the device counts as failed.

    pytest tests/test_opinfo.py             first sample of every op, float32 (CI)
    RGPU_OPINFO_FULL=1 pytest ...           every sample (about 5 minutes on 2 cores)
    RGPU_TEST_DEVICES=3 pytest ...          the multi-device test on a server with 3 devices (default 2)
    python tests/test_opinfo.py [--full] [dtype ...]   rates and failures, for docs/ops.md

The test fails when the rate falls below the one recorded in docs/ops.md.
"""
from __future__ import annotations

import json
import os
import re
import sys
import warnings
from pathlib import Path

import torch
from device_helpers import run_python

ROOT = Path(__file__).resolve().parents[1]
OPS_MD = ROOT / "docs" / "ops.md"
DTYPES = ("float32", "bfloat16", "int64", "bool", "complex64")
ATOL = RTOL = 1e-3  # test_compare_cpu's (no op_db entry overrides them for that test)

# Ops whose results are random or uninitialised memory: not in the denominator.
NONDETERMINISTIC = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "normal", "uniform", "multinomial",
    "rand_like", "randn", "randn_like", "randint", "randint_like", "svd_lowrank", "pca_lowrank",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d", "nn.functional.alpha_dropout",
    "nn.functional.feature_alpha_dropout", "nn.functional.rrelu", "nn.functional.fractional_max_pool2d",
    "nn.functional.fractional_max_pool3d",
    "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided",
}


def _op_db():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return [op for op in op_db if op.name not in NONDETERMINISTIC]


def _cpu(x):
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, x)


def _runs_on_cpu(op, sample) -> bool:
    try:
        op(sample.input, *sample.args, **sample.kwargs)
        return True
    except Exception:
        return False


def check(op, sample, compare) -> str | None:
    """None if ``sample`` (on the device) gives the CPU's result; else why not. Raises _NotInDenominator."""
    cpu = sample.transform(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t)
    try:
        expected = cpu.output_process_fn_grad(op(cpu.input, *cpu.args, **cpu.kwargs))
    except Exception:
        raise _NotInDenominator from None
    try:
        actual = _cpu(sample.output_process_fn_grad(op(sample.input, *sample.args, **sample.kwargs)))
        compare(actual, expected, atol=ATOL, rtol=RTOL, exact_device=False)
        return None
    except Exception as exc:
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[0] if text else ''}"[:240]


class _NotInDenominator(Exception):
    """The sample does not run on the CPU."""


def sweep(dtype: str, device: str = "rgpu", full: bool = False, ops=None):
    """(samples, passed, [(op name, sample index, why)]) for ``dtype`` over ``op_db`` (or ``ops``)."""
    from torch.testing._internal.common_utils import TestCase

    compare = TestCase().assertEqual
    dt = getattr(torch, dtype)
    total, failures = 0, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in ops if ops is not None else _op_db():
            if dt not in op.supported_dtypes("cpu"):
                continue
            name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
            torch.manual_seed(0)  # samples are random: the same ones every run
            index, samples = 0, iter(op.sample_inputs(device, dt))
            while full or index == 0:
                try:
                    sample = next(samples)
                except StopIteration:
                    break
                except Exception as exc:  # the device could not make the rest: each that runs on the CPU fails
                    why = f"sample not made on the device: {type(exc).__name__}: {str(exc)[:160]}"
                    rest = list(op.sample_inputs("cpu", dt))[index:] if full else list(op.sample_inputs("cpu", dt))[:1]
                    for k, s in enumerate(rest):
                        if _runs_on_cpu(op, s):
                            total += 1
                            failures.append((name, index + k, why))
                    break
                try:
                    why = check(op, sample, compare)
                    total += 1
                    if why is not None:
                        failures.append((name, index, why))
                except _NotInDenominator:
                    pass
                index += 1
    return total, total - len(failures), failures


def recorded_rate(dtype: str, full: bool) -> float:
    """The pass rate docs/ops.md records for ``dtype`` (its table: first samples, then all samples)."""
    row = re.search(rf"^\| {dtype} \|([^\n]*)$", OPS_MD.read_text(), re.M)
    assert row, f"docs/ops.md records no row for {dtype}"
    rates = re.findall(r"([\d.]+)%", row.group(1))
    return float(rates[1 if full else 0])


def _full() -> bool:
    return os.environ.get("RGPU_OPINFO_FULL") == "1"


# The sweep runs in a process of its own: importing PyTorch's test harness changes
# process-wide state (it disables cudnn's global flags), and the device session is
# process-wide too, so a second server (several devices) needs a second process.
_SWEEP = """
import json, sys, torch, rgpu
sys.path.insert(0, {tests!r})
import test_opinfo as t
{checks}
print("RESULT " + json.dumps(t.sweep("float32", device={device!r}, full={full})))
"""

# Inputs on two devices raise as on CUDA, and .to() moves the bytes between them.
_TWO_DEVICES = """
last = torch.rgpu.device_count() - 1
assert last >= 1, torch.rgpu.device_count()
x = torch.arange(6.0).reshape(2, 3)
b = x.to("rgpu:0").to(f"rgpu:{last}")
assert b.device.index == last and torch.equal(b.cpu(), x)
c = torch.zeros(2, 3, device="rgpu:0").copy_(b * 2)
assert c.device.index == 0 and torch.equal(c.cpu(), x * 2)
mixed = 0
for op in t._op_db():
    if type(op).__name__ != "BinaryUfuncInfo" or torch.float32 not in op.supported_dtypes("cpu"):
        continue
    s = next(iter(op.sample_inputs("rgpu:0", torch.float32)))
    other = s.args[0] if s.args else None
    cpu = s.transform(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v)
    if not isinstance(other, torch.Tensor) or not t._runs_on_cpu(op, cpu):  # 0-dim: raises on CUDA too
        continue
    try:
        op(s.input, other.to(f"rgpu:{last}"), *s.args[1:], **s.kwargs)
    except RuntimeError as e:
        assert "same device" in str(e), (op.name, str(e)[:200])
        mixed += 1
    else:
        raise AssertionError(f"{op.name}: inputs on rgpu:0 and rgpu:{last} did not raise")
assert mixed >= 20, mixed  # binary ufuncs whose second input is a tensor
"""


def _sweep_in_a_process(server, device: str, checks: str = ""):
    code = _SWEEP.format(tests=str(ROOT / "tests"), checks=checks, device=device, full=_full())
    r = run_python(code, env={"RGPU_SERVER": server.address, "RGPU_TOKEN": server.token}, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads([line for line in r.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])


def _assert_at_the_recorded_rate(total: int, passed: int, failures: list) -> None:
    rate = round(100.0 * passed / total, 2)  # as docs/ops.md records it
    listing = "\n".join(f"  {n}[{i}]: {why}" for n, i, why in failures)
    assert rate >= recorded_rate("float32", _full()), f"{passed}/{total} = {rate:.2f}%; failures:\n{listing}"


def test_float32_samples_match_the_cpu_at_the_recorded_rate(rgpu_server):
    _assert_at_the_recorded_rate(*_sweep_in_a_process(rgpu_server, "rgpu"))


def test_the_op_reference_names_every_op_the_server_refuses():
    from rgpu.server.ops.resolve import BLOCKED

    text = OPS_MD.read_text()
    assert [name for name in BLOCKED if f"| `{name}` |" not in text] == []


def test_samples_on_another_device_stay_there_and_mixing_devices_raises_as_on_cuda(start_server):
    devices = max(2, int(os.environ.get("RGPU_TEST_DEVICES", "2")))
    server = start_server("--device", "cpu", "--devices", str(devices))
    _assert_at_the_recorded_rate(*_sweep_in_a_process(server, f"rgpu:{devices - 1}", _TWO_DEVICES))


def main(argv: list[str]) -> None:
    """Print each dtype's samples, passes and rate, then the failures (for docs/ops.md)."""
    full = "--full" in argv
    dtypes = [a for a in argv if not a.startswith("--")] or list(DTYPES)
    import rgpu  # noqa: F401  (the device; RGPU_SERVER or a local server)

    for dtype in dtypes:
        total, passed, failures = sweep(dtype, full=full)
        print(f"| {dtype} | {total} | {passed} | {100.0 * passed / total:.2f}% |", flush=True)
        for name, index, why in failures:
            print(f"    {name}[{index}]: {why}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
