"""Fatbins trimmed to the server's GPU before upload: only the entries its device can load travel.

torch's fatbins carry a cubin for every architecture it supports and PTX
besides (24 MB for one small GPT); the server's device loads one of them. For a
device of compute capability X.Y we keep

- the cubins for sm_XY itself (all variants: sm_90 and sm_90a); else, for the
  newest sm_XZ with Z <= Y that the device may load (portable and family
  targets; an arch-specific 'a' cubin only on its exact device);
- only when no cubin fits, the newest PTX at or below X.Y (an 'a' PTX only on
  its exact device), which the server's driver compiles.

Entries are copied whole (a compressed one stays compressed: the client never
decompresses). An image that is not a readable container, or in which nothing
fits, travels unchanged, so the server's driver gives its own answer.
"""
from __future__ import annotations

from rgpu.fatbin import KIND_ELF, KIND_PTX, Entry, FatbinError, entries, is_container, rebuild


def loadable(e: Entry, major: int, minor: int) -> bool:
    """Whether a device of compute capability major.minor can run entry ``e`` (cubin as is, PTX by JIT)."""
    emaj, emin = divmod(e.arch, 10)
    if e.variant == "a":
        return (emaj, emin) == (major, minor)
    if e.kind == KIND_ELF or e.variant == "f":
        return emaj == major and emin <= minor           # cubins run within their major, on its newer minors
    return e.kind == KIND_PTX and (emaj, emin) <= (major, minor)


def choose(found: list[Entry], major: int, minor: int) -> list[Entry]:
    """The entries worth sending to a device of compute capability major.minor (empty: none fits)."""
    for kind in (KIND_ELF, KIND_PTX):
        fit = [e for e in found if e.kind == kind and e.arch and loadable(e, major, minor)]
        if fit:
            best = max(e.arch for e in fit)
            return [e for e in fit if e.arch == best]
    return []


def trim(image: bytes, capability) -> bytes:
    """``image`` keeping only what devices of ``capability`` (one (major, minor) or a list of them) can use.

    A library loads into every device, so each capability named keeps its own entries; the image
    travels unchanged when that cannot be told (no capability, unreadable, or some device fits nothing).
    """
    caps = [capability] if isinstance(capability, tuple) else list(capability or ())
    if not caps or not is_container(image):
        return image
    try:
        found = entries(image)
    except FatbinError:
        return image                     # unreadable here: the server's driver judges it
    keep: set[int] = set()
    for major, minor in set(caps):
        chosen = choose(found, major, minor)
        if not chosen:
            return image
        keep.update(e.offset for e in chosen)
    if len(keep) == len(found):
        return image
    return rebuild(image, [e for e in found if e.offset in keep])
