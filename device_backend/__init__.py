"""``rgpu.device_backend``: the "rgpu" PrivateUse1 device; ``register()`` is cheap, the rest starts on first use.

Importing this package registers nothing and imports no torch; ``startup`` is its top.
"""
from __future__ import annotations

from .startup import register, register_with_torch


def stats(reset: bool = False) -> dict:
    """Counts since import: transport, messages, round_trips, bytes_out, bytes_in (``reset`` starts over)."""
    from .session import stats as _stats

    return _stats(reset)


__all__ = ["register", "register_with_torch", "stats"]
