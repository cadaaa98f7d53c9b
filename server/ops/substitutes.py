"""Ops a backend reaches with no kernel anywhere, and the op each end runs instead (torch-free).

PyTorch sends some work on a third-party device to "overrideable" ops whose
only kernels raise; the client claims them, sizes their outputs with the meta
kernel of the substitute, and the server runs the substitute: both ends read
this one table, so the sizes the client mints always match what the server makes.
"""
from __future__ import annotations


def _conv_backward(args: list) -> list:
    """convolution_backward_overrideable's arguments -> convolution_backward's (which also wants bias_sizes)."""
    a = list(args)
    weight, transposed, groups = a[2], a[6], a[8]
    a.insert(3, [weight.shape[1] * groups] if transposed else [weight.shape[0]])
    return a


# "name.overload" -> ("substitute name.overload", argument adapter or None)
SUBSTITUTES = {
    "convolution_overrideable.default": ("convolution.default", None),
    "convolution_backward_overrideable.default": ("convolution_backward.default", _conv_backward),
}
