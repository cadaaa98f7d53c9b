"""Bytes between this machine and the server: uploads, downloads, and copies on the device.

``_copy_from`` is where every ``.to("rgpu")``, ``.cpu()`` and cross-device
``copy_`` arrives. An upload is sent before the call returns, or copied first
(the transport copies small buffers at ``post``; a non-contiguous or converted
source is a fresh tensor already), so later changes to the CPU source never
reach the server. A download is one round trip straight into the destination's memory. With
several servers, each goes to its device's server, and a copy between two
servers' devices goes from one server to the other (``peer_copy``).
"""
from __future__ import annotations

import torch

from rgpu.transport.wire import as_bytes_view

aten = torch.ops.aten


def _conform(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``src``'s values as ``dst``'s memory must hold them: its dtype, its math bits, its shape, contiguous."""
    data = src
    if data.dtype != dst.dtype:
        data = data.to(dst.dtype)
    # dst's memory holds what, read through dst's conjugate/negative bits, gives src's values
    if dst.is_conj():
        data = data.conj()
    if dst.is_neg():
        data = data.neg()
    data = data.resolve_conj().resolve_neg()
    if data.shape != dst.shape:
        data = data.expand(dst.shape)
    return data.contiguous()


def upload(s, src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> None:
    data = _conform(src, dst)
    if dst.numel():
        server = s.server(dst.device.index)
        s._on(server, lambda: server.transfers.upload(s.C.describe(dst), data, non_blocking))


def download(s, src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.numel() == 0:
        return
    # Why not one element directly: a one-element view keeps any stride, and is "contiguous" all the same
    direct = (dst.is_contiguous() and dst.numel() > 1 and dst.dtype == src.dtype and dst.shape == src.shape
              and not dst.is_conj() and not dst.is_neg() and not src.is_conj() and not src.is_neg())
    target = dst if direct else torch.empty(src.shape, dtype=src.dtype)
    server = s.server(src.device.index)
    # the bytes, without src's math bits
    s._on(server, lambda: server.transfers.download(s.C.describe(src), as_bytes_view(target)))
    if not direct:
        if src.is_conj():
            target = target.conj()
        if src.is_neg():
            target = target._neg_view()
        dst.copy_(target)


def copy_from(s, stream, src, dst, non_blocking=False):
    """aten::_copy_from(src, dst): src's values into dst, one side or both on the device."""
    on_src, on_dst = src.device.type == s.devtype, dst.device.type == s.devtype
    if on_src and on_dst:
        if s.several and s.server(src.device.index) is not s.server(dst.device.index):
            peer_copy(s, src, dst)
        else:  # one server: a copy there, between its devices or on one
            stream(aten.copy_.default, (dst, src), {}, mixed_ok=True)
    elif on_dst:
        upload(s, src, dst, non_blocking)
    else:
        download(s, src, dst)
    return dst


def peer_copy(s, src: torch.Tensor, dst: torch.Tensor) -> None:
    """A copy between two servers' devices: the bytes go server to server, never through this process
    (with ``RGPU_PEER_COPY=client``: down here, then up).

    Converted on the source's device first (dtype, math bits, broadcast), so that
    the bytes sent are the ones ``dst``'s memory takes.
    """
    if dst.numel() == 0:
        return
    if s.peer_through_client:   # RGPU_PEER_COPY=client: the servers cannot reach each other (SSH tunnels)
        dst.copy_(src.cpu())
        return
    data = _conform(src, dst)
    s.peer_copy(s.C.describe(data), s.C.describe(dst))


def copy_from_and_resize(s, stream, src, dst):
    if dst.shape != src.shape:
        dst.resize_(src.shape)
    return copy_from(s, stream, src, dst)


def compatible_for_set_data(s, stream, a, b) -> bool:
    """Dense tensors here and on the device may swap data (``param.data = p.to("rgpu")``), as CPU and CUDA do.

    Why it matters: ``Module.to`` keeps each Parameter object (and so weight tying)
    only when this answers True; otherwise it makes new, untied Parameters.
    """
    return a.layout == torch.strided and b.layout == torch.strided and not a.is_quantized and not b.is_quantized
