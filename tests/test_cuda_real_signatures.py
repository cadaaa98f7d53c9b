"""The real driver's ctypes signatures agree with cuda.h, parameter by parameter."""
from __future__ import annotations

import pytest

from rgpu.server.cuda.real_api import SIGNATURES

@pytest.fixture(scope="module")
def api():
    from rgpu.cuda_intercept import header, model
    try:
        return model.parse(header.load())
    except Exception as exc:  # no CUDA headers on this machine
        pytest.skip(f"CUDA headers not found: {exc}")


def test_every_real_driver_signature_has_the_headers_number_of_parameters(api):
    wrong = {name: (sig, [p.ctype for p in api.functions[name].params])
             for name, sig in SIGNATURES.items()
             if name in api.functions and len(sig) != len(api.functions[name].params)}
    assert not wrong, f"signatures whose arity differs from cuda.h: {wrong}"


def test_every_real_driver_signature_names_a_function_cuda_h_declares(api):
    assert not [name for name in SIGNATURES if name not in api.functions]


def test_pointer_parameters_are_typed_as_pointers(api):
    wrong = [(name, i, p.ctype) for name, sig in SIGNATURES.items() if name in api.functions
             for i, (letter, p) in enumerate(zip(sig, api.functions[name].params))
             if "*" in p.ctype and letter != "p"]
    assert not wrong, f"a pointer parameter given a non-pointer letter: {wrong}"
