"""``torch.rgpu``: the device module, mirroring ``torch.cuda`` where it makes sense.

Nothing here starts the session at import; the functions that need the
server (device count, names, memory, synchronize) start it on first call.
``torch.manual_seed`` reaches ``manual_seed_all`` here: before the session
starts the seed is kept and sent when it does, so seeding alone never
starts a server.
"""
from __future__ import annotations

import random as _random

import torch

from rgpu.errors import RgpuError
from rgpu.protocol.ops import Msg

from . import session as _session

_pending_seed: dict[int, int] = {}  # device (-1: every one) -> seed, set before the session started
_initial_seed = 67280421310721


def _s():
    return _session.get()


def send_pending_seeds(s) -> None:
    """Called when the session starts: seeds set before it go to the server first."""
    for dev, seed in list(_pending_seed.items()):  # in the order they were set; -1: every device
        for d in range(s.count) if dev == -1 else [dev] if dev < s.count else []:
            s.post([Msg.SEED, d, seed], d)
    _pending_seed.clear()


def _index(device=None) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return current_device() if device.index is None else device.index


def is_available() -> bool:
    """True when the server answers (starting the local one if none is named)."""
    try:
        return _s().count > 0
    except RgpuError:
        return False


def is_initialized() -> bool:
    return _session.current() is not None


def __getattr__(name: str):
    # ``torch.cuda._initialized``'s twin: torch.utils.checkpoint saves a device's random
    # state only where this is true (read as an attribute, so answered per access)
    if name == "_initialized":
        return is_initialized()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def init() -> None:
    _s()


def _is_in_bad_fork() -> bool:
    return False


def get_amp_supported_dtype() -> list:
    """The dtypes ``torch.autocast("rgpu", dtype=...)`` takes, as on CUDA (the policy is CUDA's lists).

    Loads the C++ part, which registers that policy, when autocast is first entered.
    """
    from . import build

    build.load()
    return [torch.float16, torch.bfloat16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def device_count() -> int:
    return _s().count


def current_device() -> int:
    s = _session.current()
    return s.C.current_device() if s is not None else 0


def set_device(device) -> None:
    _s().C.set_device(_index(device))


class device:
    """Context manager that makes ``device`` the current rgpu device (like ``torch.cuda.device``)."""

    def __init__(self, device):
        self.idx = _index(device) if device is not None else -1
        self.prev = -1

    def __enter__(self):
        if self.idx >= 0:
            self.prev = current_device()
            set_device(self.idx)
        return self

    def __exit__(self, *exc):
        if self.prev >= 0:
            set_device(self.prev)
        return False


def get_device_name(device=None) -> str:
    return _s().names[_index(device)]


def synchronize(device=None) -> None:
    """Wait until the server has run every op sent so far (raises the first failure, if any).

    With several servers: ``device``'s server, or every server when None.
    """
    s = _s()
    s.sync(None if device is None else _index(device))  # frees too, so memory_allocated() after this is exact


def manual_seed(seed: int) -> None:
    _seed(current_device(), int(seed))


def manual_seed_all(seed: int) -> None:
    s = _session.current()
    if s is None:  # kept for every device the session will have
        global _initial_seed
        _initial_seed = int(seed)
        _pending_seed.clear()
        _pending_seed[-1] = int(seed)
        return
    for dev in range(s.count):
        _seed(dev, int(seed))


def _seed(dev: int, seed: int) -> None:
    global _initial_seed
    _initial_seed = seed
    s = _session.current()
    if s is None:
        _pending_seed[dev] = seed
    else:
        s.post([Msg.SEED, dev, seed], dev)


def seed() -> None:
    manual_seed(_random.getrandbits(63))


def seed_all() -> None:
    manual_seed_all(_random.getrandbits(63))


def initial_seed() -> int:
    return _initial_seed


def get_rng_state(device="rgpu") -> torch.Tensor:
    """The server's generator state for ``device``, a CPU ByteTensor (``torch.utils.checkpoint`` saves it)."""
    index = _index(device)
    state = _s().request([Msg.GET_RNG_STATE, index], index)[0]
    return torch.frombuffer(bytearray(state), dtype=torch.uint8)


def set_rng_state(new_state: torch.Tensor, device="rgpu") -> None:
    index = _index(device)
    _s().post([Msg.SET_RNG_STATE, index, new_state.detach().cpu().contiguous().numpy().tobytes()], index)


def get_rng_state_all() -> list:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


def memory_allocated(device=None) -> int:
    index = _index(device)
    return _s().request([Msg.MEMORY, index], index)[0]


def max_memory_allocated(device=None) -> int:
    index = _index(device)
    return _s().request([Msg.MEMORY, index], index)[1]
