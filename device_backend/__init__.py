"""``rgpu.device_backend``: the "rgpu" PrivateUse1 device; ``register()`` is cheap, the rest starts on first use."""
from __future__ import annotations

from .registration import register, register_with_torch


def stats(reset: bool = False) -> dict:
    """Counts since import: transport, messages, round_trips, bytes_out, bytes_in (``reset`` starts over)."""
    from .session import stats as _stats

    return _stats(reset)


__all__ = ["register", "register_with_torch", "stats"]
