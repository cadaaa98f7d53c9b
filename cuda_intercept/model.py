"""The driver API as data: every exported function, its parameters and versions, parsed from the header.

``Api.functions`` holds each entry point the real ``libcuda.so.1`` exports
(``cuMemAlloc``, ``cuMemAlloc_v2``, ``cuMemcpy_ptds``, ...); ``Api.proc_table``
says which export ``cuGetProcAddress(name, version, flags)`` returns, matched
from the ``PFN_<name>_v<version>`` typedefs of cudaTypedefs.h: within one base
name and one stream flavour, typedefs and exports with the same signature pair
up in version order.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import cffi
from pycparser import c_ast, c_generator, c_parser

from rgpu.errors import ConfigError

from .header import Header

_PRELUDE = "typedef unsigned int uint32_t; typedef unsigned long long uint64_t; typedef unsigned long size_t;\n"
_EXPORT = re.compile(r"^(\w+?)(?:_v(\d+))?(_ptds|_ptsz)?$")
_PFN = re.compile(r"^PFN_(\w+?)_v(\d+)(_ptds|_ptsz)?$")
# A prototype in the preprocessed text (for stripping them out of the cdef).
_PROTOTYPE = re.compile(r"^\s*CUresult\s+(cu\w+)\s*\([^;]*\)\s*;", re.M)


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str          # C type text, e.g. "const void *"

    @property
    def decl(self) -> str:
        return _declare(self.ctype, self.name)


@dataclass(frozen=True)
class Function:
    name: str           # exported symbol, e.g. cuMemcpyHtoD_v2_ptds
    result: str
    params: tuple[Param, ...]
    base: str           # cuMemcpyHtoD
    revision: int       # 2 for _v2, 1 when unsuffixed
    stream: str         # "", "_ptds" or "_ptsz"

    def prototype(self, name: str | None = None) -> str:
        args = ", ".join(p.decl for p in self.params) or "void"
        return f"{self.result} {name or self.name}({args})"

    @property
    def arg_names(self) -> str:
        return ", ".join(p.name for p in self.params)


@dataclass(frozen=True)
class ProcEntry:
    base: str           # what callers ask cuGetProcAddress for
    version: int        # the CUDA version that introduced this signature (PFN_..._v<version>)
    per_thread: bool    # the _ptds / _ptsz flavour
    export: str         # the symbol to hand back


@dataclass(frozen=True)
class Api:
    functions: dict[str, Function]
    proc_table: tuple[ProcEntry, ...]
    types_text: str     # the header without prototypes: what cffi's cdef gets
    header: Header


def _declare(ctype: str, name: str) -> str:
    # function-pointer parameters never appear in cuda.h prototypes (callbacks are typedefs)
    return f"{ctype}{name}" if ctype.endswith("*") else f"{ctype} {name}"


def _split_export(name: str) -> tuple[str, int, str]:
    m = _EXPORT.match(name)
    return m.group(1), int(m.group(2) or 1), m.group(3) or ""


def parse(header: Header) -> Api:
    """Build the model of every function and the cuGetProcAddress table."""
    ast = c_parser.CParser().parse(_PRELUDE + header.text)
    gen = c_generator.CGenerator()
    functions: dict[str, Function] = {}
    pfns: dict[str, str] = {}
    signature: dict[str, str] = {}
    for ext in ast.ext:
        if isinstance(ext, c_ast.Decl) and isinstance(ext.type, c_ast.FuncDecl):
            params = []
            for i, p in enumerate(ext.type.args.params if ext.type.args else ()):
                ctype = gen.visit(p.type)
                if ctype == "void":
                    continue
                params.append(Param(p.name or f"arg{i}", ctype))
            base, rev, stream = _split_export(ext.name)
            fn = Function(ext.name, gen.visit(ext.type.type), tuple(params), base, rev, stream)
            functions[ext.name] = fn
            signature[ext.name] = f"typedef CUresult (*SIG_{ext.name})({', '.join(p.ctype for p in params) or 'void'});"
        elif isinstance(ext, c_ast.Typedef) and ext.name.startswith("PFN_cu"):
            pfns[ext.name] = ext.name
    proc = _match_proc_table(functions, pfns, signature, header.text)
    types_text = _PROTOTYPE.sub("", header.text)
    if len(_PROTOTYPE.findall(header.text)) != len(functions):
        raise ConfigError("cuda.h: a prototype does not fit the pattern that strips them from the cdef")
    return Api(functions, proc, types_text, header)


def _match_proc_table(functions, pfns, signature, header_text) -> tuple[ProcEntry, ...]:
    # cffi resolves typedefs, so CUdeviceptr_v2 and CUdeviceptr compare equal;
    # each export's signature becomes a SIG_<name> typedef so one cdef parses them all.
    ffi = cffi.FFI()
    ffi.cdef(_PROTOTYPE.sub("", header_text) + "\n".join(signature.values()))
    for name in signature:
        signature[name] = f"SIG_{name}"
    # ffi.typeof(str) re-runs the C parser per call (seconds for 1268 names);
    # the parsed declarations are already in the parser's table.
    declared = ffi._parser._declarations  # noqa: SLF001

    def canonical(typedef: str):
        return declared[f"typedef {typedef}"][0].as_raw_function()
    groups: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
    for name, fn in functions.items():
        groups[(fn.base, fn.stream, canonical(signature[name]))][0].append((fn.revision, name))
    for name, sig in pfns.items():
        m = _PFN.match(name)
        groups[(m.group(1), m.group(3) or "", canonical(sig))][1].append((int(m.group(2)), name))
    table = []
    for (base, stream, _), (exports, typedefs) in groups.items():
        exports.sort()
        typedefs.sort()
        for i, (version, _pfn) in enumerate(typedefs):
            if not exports:
                break
            export = exports[min(i, len(exports) - 1)][1]
            table.append(ProcEntry(base, version, bool(stream), export))
    return tuple(sorted(table, key=lambda e: (e.base, e.per_thread, e.version)))
