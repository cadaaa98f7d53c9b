"""The fake driver's code objects: PTX modules parsed for entries, parameter layouts and globals; links; launches.

Only PTX loads (cubins are machine code for a GPU the fake does not have): a
PTX image as is, or the newest uncompressed PTX entry of a fatbin container;
each entry's parameter layout comes from its ``.param`` declarations, laid
out as the CUDA ABI does (each at its alignment, in order), so launches are
checked against it exactly as ``cuFuncGetParamInfo`` would.  ``.global`` and
``.const`` variables (``__device__``, ``__constant__``) get fake device memory.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field

from rgpu import fatbin

from .base import (CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_IMAGE, CUDA_ERROR_INVALID_PTX, CUDA_ERROR_INVALID_VALUE,
                   CUDA_ERROR_LAUNCH_FAILED, CUDA_ERROR_NO_BINARY_FOR_GPU, CUDA_ERROR_NOT_FOUND,
                   CUDA_ERROR_NOT_SUPPORTED, Code, CudaDriverError, check)
from . import fake_kernels

_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(([^)]*)\)", re.S)
# .param [.align A] .<type><bits> [.ptr [.space] [.align P]] name[[count]]: P is the pointee's alignment
_PARAM = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.([busf])(\d+)\s+(?:\.ptr\s+(?:\.\w+\s+)*?(?:\.align\s+\d+\s+)?)?(\w+)(?:\s*\[(\d+)\])?")
_GLOBAL = re.compile(r"\.(?:global|const)\s+(?:\.align\s+(\d+)\s+)?\.([busf])(\d+)\s+(\w+)(?:\s*\[(\d+)\])?")
_FMT = {("u", 8): "B", ("u", 16): "H", ("u", 32): "I", ("u", 64): "Q", ("s", 8): "b", ("s", 16): "h",
        ("s", 32): "i", ("s", 64): "q", ("b", 8): "B", ("b", 16): "H", ("b", 32): "I", ("b", 64): "Q",
        ("f", 32): "f", ("f", 64): "d", ("f", 16): "e"}

CU_JIT_INPUT_PTX = 1


@dataclass
class Param:
    offset: int
    size: int
    fmt: str | None       # struct format of a scalar; None for byte arrays (passed as bytes)


@dataclass
class Entry:
    name: str
    params: list[Param]
    attrs: dict = field(default_factory=dict)

    @property
    def arg_bytes(self) -> int:
        return max((p.offset + p.size for p in self.params), default=0)

    def decode(self, blob: bytes) -> list:
        check(len(blob) == self.arg_bytes, CUDA_ERROR_INVALID_VALUE,
              f"kernel {self.name!r} takes {self.arg_bytes} bytes of arguments "
              f"({len(self.params)} parameters), the launch passed {len(blob)}")
        return [struct.unpack_from("<" + p.fmt, blob, p.offset)[0] if p.fmt else bytes(blob[p.offset:p.offset + p.size])
                for p in self.params]


def parse_entries(ptx: str) -> dict[str, Entry]:
    entries = {}
    for m in _ENTRY.finditer(ptx):
        params, offset = [], 0
        for p in _PARAM.finditer(m.group(2)):
            kind, bits = p.group(2), int(p.group(3))
            elem, count = bits // 8, int(p.group(5) or 1)
            align = int(p.group(1) or elem)
            offset = (offset + align - 1) // align * align
            fmt = _FMT.get((kind, bits)) if count == 1 else None
            params.append(Param(offset, elem * count, fmt))
            offset += elem * count
        entries[m.group(1)] = Entry(m.group(1), params)
    return entries


def parse_globals(ptx: str) -> dict[str, int]:
    """name -> size in bytes of each ``.global`` or ``.const`` variable."""
    return {m.group(4): int(m.group(3)) // 8 * int(m.group(5) or 1) for m in _GLOBAL.finditer(ptx)}


def ptx_text(image: bytes) -> str:
    """The PTX in a module image, or the driver's error for images the fake cannot run."""
    head = bytes(image[:4])
    if head == b"\x7fELF":
        raise CudaDriverError(CUDA_ERROR_NO_BINARY_FOR_GPU, "the fake driver runs PTX only, not cubins")
    if fatbin.is_container(image):
        return fatbin_ptx(image)
    if len(head) == 4 and struct.unpack("<I", head)[0] == fatbin.WRAPPER_MAGIC:
        raise CudaDriverError(CUDA_ERROR_INVALID_IMAGE, "a fatbin wrapper points into the client's memory: "
                                                        "the client sends the container it points at")
    try:
        text = bytes(image).split(b"\0", 1)[0].decode()
    except UnicodeDecodeError:
        raise CudaDriverError(CUDA_ERROR_INVALID_IMAGE, "module image is neither PTX, cubin nor fatbin") from None
    check(".entry" in text or ".version" in text, CUDA_ERROR_INVALID_PTX, "no PTX in the module image")
    return text


def fatbin_ptx(image) -> str:
    """The newest PTX of a fatbin container, or an error saying why the fake cannot run it."""
    try:
        found = fatbin.entries(image)
    except fatbin.FatbinError as exc:
        raise CudaDriverError(CUDA_ERROR_INVALID_IMAGE, f"unreadable fatbin: {exc}") from None
    ptx = [e for e in found if e.kind == fatbin.KIND_PTX]
    plain = [e for e in ptx if not e.compressed]
    if not plain:
        has = ", ".join(e.name() for e in found) or "no entries"
        why = ("its PTX is compressed (build with nvcc -no-compress)" if ptx else
               "it has no PTX (build with -gencode arch=compute_90,code=compute_90)")
        raise CudaDriverError(CUDA_ERROR_NO_BINARY_FOR_GPU, f"the fake driver runs a fatbin's PTX, and {why}: {has}")
    best = max(plain, key=lambda e: e.arch)
    try:
        text = fatbin.ptx_text(image, best)
    except UnicodeDecodeError:
        raise CudaDriverError(CUDA_ERROR_INVALID_PTX, f"the fatbin's {best.name()} entry is not PTX text") from None
    check(".entry" in text or ".version" in text, CUDA_ERROR_INVALID_PTX, f"no PTX in the fatbin's {best.name()}")
    return text


@dataclass
class Module:
    handle: int
    ptx: str
    entries: dict[str, Entry]
    globals: dict[str, tuple[int, int]]     # name -> (device pointer, size)


@dataclass
class Link:
    options: dict
    ptx: list[str] = field(default_factory=list)


def add_to_link(link: Link, kind: int, data: bytes, name: str) -> None:
    if kind != CU_JIT_INPUT_PTX:
        raise CudaDriverError(CUDA_ERROR_NOT_SUPPORTED, f"the fake linker takes PTX only (input {name!r} is type {kind})")
    link.ptx.append(ptx_text(data))


def run_kernel(mem, entry: Entry, grid, block, blob: bytes, shared: int = 0, globals_=None) -> None:
    args = entry.decode(blob)
    impl = fake_kernels.lookup(entry.name)
    if impl is None:
        raise CudaDriverError(CUDA_ERROR_LAUNCH_FAILED, f"the fake driver has no CPU implementation of kernel "
                                                        f"{entry.name!r} (see fake_kernels.py)")
    if getattr(impl, "wants_launch", False):
        impl(mem, fake_kernels.Launch(tuple(grid), tuple(block), shared, globals_ or {}), *args)
        return
    threads = grid[0] * grid[1] * grid[2] * block[0] * block[1] * block[2]
    impl(mem, threads, *args)


def find_entry(modules: dict[int, Module], name: str) -> Entry:
    for mod in modules.values():
        if name in mod.entries:
            return mod.entries[name]
    raise CudaDriverError(CUDA_ERROR_NOT_FOUND, f"no kernel named {name!r}")


class FakeCode(Code):
    """The fake driver's ``Code``: modules, libraries, links and launches of one FakeDriver (its memory,
    contexts and streams are the driver's)."""

    def __init__(self, driver):
        self.driver = driver
        self.modules: dict[int, Module] = {}
        self.functions: dict[int, tuple[int, Entry]] = {}    # handle -> (module, entry)
        self.links: dict[int, Link] = {}
        self.libraries: dict[int, int] = {}                  # library -> its module

    def module_load(self, options: dict | None, image: bytes) -> list:
        self.driver._need_ctx()
        return self._load(image)

    def _load(self, image: bytes) -> list:
        ptx = ptx_text(image)
        entries = parse_entries(ptx)
        globals_ = {name: (self.driver.mem.alloc(size), size) for name, size in parse_globals(ptx).items()}
        h = self.driver._new()
        self.modules[h] = Module(h, ptx, entries, globals_)
        return [h, f"rgpu fake driver: loaded {len(entries)} entries", ""]

    def module_unload(self, mod: int) -> None:
        m = self.modules.pop(mod, None)
        check(m is not None, CUDA_ERROR_INVALID_VALUE, f"module {mod:#x} does not exist")
        for ptr, _ in m.globals.values():
            self.driver.mem.free(ptr)
        for f in [f for f, (owner, _) in self.functions.items() if owner == mod]:
            del self.functions[f]

    def module_get_function(self, mod: int, name: str) -> int:
        m = self.modules.get(mod)
        check(m is not None, CUDA_ERROR_INVALID_VALUE, f"module {mod:#x} does not exist")
        check(name in m.entries, CUDA_ERROR_NOT_FOUND, f"no kernel named {name!r} in the module")
        for f, (owner, entry) in self.functions.items():
            if owner == mod and entry.name == name:
                return f
        h = self.driver._new()
        self.functions[h] = (mod, m.entries[name])
        return h

    def _entry(self, func: int) -> Entry:
        found = self.functions.get(func)
        check(found is not None, CUDA_ERROR_INVALID_VALUE, f"function {func:#x} does not exist")
        return found[1]

    def param_layout(self, func: int) -> list:
        entry = self._entry(func)
        if self.functions[func][0] in self.libraries.values():
            self._need_kernel_ctx(entry.name)
        return [[p.offset, p.size] for p in entry.params]

    def _need_kernel_ctx(self, name: str) -> None:
        # A library's kernel has no image until a context says which device: its layout is read in one
        # (rgpu's client reads it so; a static CUDA runtime loads its fatbins before it has a context)
        check(self.driver.current in self.driver.contexts, CUDA_ERROR_INVALID_CONTEXT,
              f"kernel {name!r}: a library kernel's parameter layout is read in a context, and none is current")

    def func_name(self, func: int) -> str:
        return self._entry(func).name

    def module_get_global(self, mod: int, name: str) -> list:
        m = self.modules.get(mod)
        check(m is not None, CUDA_ERROR_INVALID_VALUE, f"module {mod:#x} does not exist")
        check(name in m.globals, CUDA_ERROR_NOT_FOUND, f"no global named {name!r} in the module")
        return list(m.globals[name])

    def func_get_attribute(self, attr: int, func: int) -> int:
        entry = self._entry(func)
        defaults = {0: 1024, 4: 32, 5: 90, 6: 90, 8: 49152}
        return entry.attrs.get(attr, defaults.get(attr, 0))

    def func_set_attribute(self, func: int, attr: int, value: int) -> None:
        self._entry(func).attrs[attr] = value

    def kernel_get_attribute(self, attr: int, kernel: int, dev: int) -> int:
        return self.func_get_attribute(attr, kernel)

    def kernel_set_attribute(self, attr: int, value: int, kernel: int, dev: int) -> None:
        self.func_set_attribute(kernel, attr, value)

    def func_set_cache_config(self, func: int, config: int) -> None:
        self._entry(func)

    def library_load(self, options: dict | None, image: bytes) -> int:
        # no current context needed, as the driver's: a static CUDA runtime loads its fatbins before it has one
        mod = self._load(image)[0]
        h = self.driver._new()
        self.libraries[h] = mod
        return h

    def library_kernels(self, lib: int) -> dict:
        mod = self.library_get_module(lib)
        for name in self.modules[mod].entries:
            self._need_kernel_ctx(name)
        return {name: [self.module_get_function(mod, name), [[p.offset, p.size] for p in entry.params]]
                for name, entry in self.modules[mod].entries.items()}

    def library_unload(self, lib: int) -> None:
        check(lib in self.libraries, CUDA_ERROR_INVALID_VALUE, f"library {lib:#x} does not exist")
        self.module_unload(self.libraries.pop(lib))

    def library_get_module(self, lib: int) -> int:
        check(lib in self.libraries, CUDA_ERROR_INVALID_VALUE, f"library {lib:#x} does not exist")
        return self.libraries[lib]

    def library_get_kernel(self, lib: int, name: str) -> int:
        return self.module_get_function(self.library_get_module(lib), name)   # the fake's kernels are functions

    def kernel_get_function(self, kernel: int) -> int:
        self._entry(kernel)
        return kernel

    def library_get_global(self, lib: int, name: str) -> list:
        return self.module_get_global(self.library_get_module(lib), name)

    def link_create(self, options: dict | None = None) -> int:
        h = self.driver._new()
        self.links[h] = Link(options or {})
        return h

    def link_add_data(self, link: int, kind: int, name: str, options: dict | None, data: bytes) -> None:
        check(link in self.links, CUDA_ERROR_INVALID_VALUE, f"link {link:#x} does not exist")
        add_to_link(self.links[link], kind, data, name)

    def link_complete(self, link: int) -> list:
        check(link in self.links, CUDA_ERROR_INVALID_VALUE, f"link {link:#x} does not exist")
        # the fake's "cubin" is the linked PTX itself, which module_load accepts
        return [("\n".join(self.links[link].ptx) + "\0").encode(), "rgpu fake linker", ""]

    def link_destroy(self, link: int) -> None:
        check(self.links.pop(link, None) is not None, CUDA_ERROR_INVALID_VALUE, f"link {link:#x} does not exist")

    def launch(self, func: int, grid, block, shared: int, stream: int, attrs, args: bytes) -> None:
        self.driver._need_ctx()
        entry = self._entry(func)
        check(all(g > 0 for g in grid) and all(b > 0 for b in block), CUDA_ERROR_INVALID_VALUE,
              "grid and block dimensions must be positive")
        check(block[0] * block[1] * block[2] <= 1024, CUDA_ERROR_INVALID_VALUE, "more than 1024 threads in a block")
        entry.decode(args)   # arguments are checked at launch, as the driver does, even when captured
        check(shared <= 232448, CUDA_ERROR_INVALID_VALUE, f"{shared} bytes of shared memory: more than a block has")
        blob = bytes(args)
        mod = self.modules.get(self.functions[func][0])
        globals_ = {name: ptr for name, (ptr, _) in mod.globals.items()} if mod else {}
        self.driver._run(stream, lambda: run_kernel(self.driver.mem, entry, grid, block, blob, shared, globals_))

    def occupancy_max_active_blocks(self, func: int, block: int, shared: int, flags: int = 0) -> int:
        self._entry(func)
        return max(1, min(32, 2048 // max(1, block)))

    def occupancy_max_potential_block_size(self, func: int, shared: int, limit: int, flags: int = 0) -> list:
        self._entry(func)
        block = min(1024, limit) if limit else 1024
        return [132 * (2048 // block), block]
