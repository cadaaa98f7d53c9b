"""docs/cuda_coverage.md, generated: every export of rgpu's libcuda.so.1, libcudart.so.13 and math libraries and what each does.

    rgpu intercept coverage --out docs/cuda_coverage.md
"""
from __future__ import annotations

from collections import Counter

from . import calls_code, calls_device, calls_launch, calls_link, calls_memory, calls_order, calls_pointer  # noqa: F401 (register)
from . import cudart_gen, header, model
from .annotations import (C_ANSWERED, C_ONLY, QUEUED, REFUSED, RT_IN_C, RT_NOTES, RT_QUEUED, RT_REFUSED,
                          RT_SYNCHRONISING, SYNCHRONISING, base_of, runtime_base)
from .registry import IMPLS

KINDS = {
    "in C": "answered in C, never entering Python",
    "in C, else forwarded": "answered in C when it can (after cuInit, a known launch), else by Python",
    "queued": "posted in a batch; its failure is reported at the next synchronisation",
    "synchronising": "waits for the server; reports an earlier queued failure",
    "implemented": "answered by the client, or forwarded and waited for",
    "refused": "CUDA_ERROR_NOT_SUPPORTED with the reason logged: cannot cross a network",
    "not supported": "CUDA_ERROR_NOT_SUPPORTED, its name logged once",
}


def status(name: str) -> tuple[str, str]:
    base = base_of(name)
    if name in C_ONLY:
        return "in C", REFUSED.get(base, "")
    if name in C_ANSWERED:
        return "in C, else forwarded", "queued" if base in QUEUED else ""
    if name in IMPLS:
        if base in QUEUED:
            return "queued", ""
        return ("synchronising" if base in SYNCHRONISING else "implemented"), ""
    if base in REFUSED:
        return "refused", REFUSED[base]
    return "not supported", ""


RUNTIME_KINDS = {
    "in C": "answered in C from the runtime's state or libcuda.so.1's C tables: no Python, no round trip",
    "queued": "translated into driver calls that libcuda.so.1 queues; a failure comes at the next synchronisation",
    "synchronising": "waits for the server; reports an earlier queued failure (kernel faults stay sticky)",
    "translated": "translated into driver calls, answered or waited for",
    "refused": "cudaErrorNotSupported with the reason logged: cannot cross a network",
    "not supported": "a generated stub: cudaErrorNotSupported, its name logged once",
}


def runtime_status(name: str, written: set[str]) -> tuple[str, str]:
    base = runtime_base(name)
    if base in RT_REFUSED:
        return "refused", RT_REFUSED[base]
    if name not in written:
        return "not supported", ""
    for kind, names in (("in C", RT_IN_C), ("queued", RT_QUEUED), ("synchronising", RT_SYNCHRONISING)):
        if base in names:
            return kind, RT_NOTES.get(base, "")
    return "translated", RT_NOTES.get(base, "")


def runtime_markdown() -> list[str]:
    include_dir = header.find_include_dir()
    written = cudart_gen.implemented()
    rows = [(name, *runtime_status(name, written)) for name in sorted(cudart_gen.exports(include_dir), key=str.lower)]
    counts = Counter(kind for _, kind, _ in rows)
    out = ["", "# CUDA runtime API coverage of rgpu's libcudart.so.13", "",
           f"Generated from the stock `libcudart.so.13`'s export list (`cuda_intercept/abi/`) and the toolkit's "
           f"`cuda_runtime_api.h`: {len(rows)} exports (per-thread `_ptsz`/`_ptds` and the `__cuda*` registration "
           "entry points included), every one exported under the version node `libcudart.so.13`. The runtime is "
           "translated on the client into driver calls on rgpu's `libcuda.so.1` (`cuda_intercept/cudart*.c`).", "",
           "| status | meaning | exports |", "|---|---|---|"]
    out += [f"| {kind} | {RUNTIME_KINDS[kind]} | {counts.get(kind, 0)} |" for kind in RUNTIME_KINDS]
    out += ["", "| function | status | note |", "|---|---|---|"]
    out += [f"| `{name}` | {kind} | {note} |" for name, kind, note in rows]
    return out


def libraries_markdown() -> list[str]:
    """The math libraries: which exports rgpu writes (forwarded to the server's library or answered on the
    client) and which are refusing stubs; the forwarded calls, queued or answered."""
    from rgpu.protocol.cuda_libs import CALLS

    import re

    from . import stubs

    def written_of(soname: str) -> set[str]:      # by hand, less the hand-written refusals (RGPU_STUB_AS)
        refusing = {m for src in stubs.LIBRARIES[soname].sources
                    for m in re.findall(r"^RGPU_STUB_AS\(\s*[^,]+,\s*(\w+)", (stubs.HERE / src).read_text(), re.M)}
        return (stubs.implemented(soname) - refusing) & set(stubs.exports(soname))

    out = ["", "# cuBLAS, cuBLASLt and cuDNN coverage of rgpu's libcublas.so.13, libcublasLt.so.13, libcudnn.so.9", "",
           "Every export of the stock library is there under its version node (`cuda_intercept/abi/`). The ones "
           "written by hand (`cuda_intercept/lib_*.c`, `stub_*.c`) forward whole calls to the real library in the "
           "server's session worker (`server/cuda/libs/`: queued in order with the launches, or answered) or answer "
           "on the client (setters, descriptors' attributes, versions, error strings); every other export is a "
           "generated stub that returns the library's \"not supported\" status with its name logged once.", "",
           "| library | exports | written (forwarded or answered on the client) | refusing stubs |", "|---|---|---|---|"]
    for soname in stubs.LIBRARIES:
        exports, written = stubs.exports(soname), written_of(soname)
        out.append(f"| `{soname}` | {len(exports)} | {len(written)} | {len(exports) - len(written)} |")
    out += ["", "The calls that cross to the server (`rgpu.protocol.cuda_libs`):", "",
            "| id | call | crosses as |", "|---|---|---|"]
    out += [f"| `{c.id:#x}` | `{c.name}` | {'answered (a round trip)' if c.sync else 'queued (no round trip)'} |"
            for c in sorted(CALLS.values(), key=lambda c: c.id)]
    for soname in stubs.LIBRARIES:
        written = sorted(written_of(soname), key=str.lower)
        out += ["", f"Written in `{soname}`: " + ", ".join(f"`{n}`" for n in written) + "."]
    return out


def export_tables_markdown() -> list[str]:
    """The driver's private tables libcuda.so.1 serves (cuda_intercept/export_tables.c), for static runtimes."""
    return ["", "# The driver's private export tables (`cuGetExportTable`)", "",
            "A program carrying the CUDA runtime linked statically (nvcc's default `-cudart static`; CuPy's wheels) "
            "asks the driver for private tables of functions by UUID. rgpu's `libcuda.so.1` serves them in C "
            "(`cuda_intercept/export_tables.c`; the layout is what the ZLUDA project reverse-engineered), each slot "
            "mapped onto rgpu's own driver calls. A slot not written below fails with `CUDA_ERROR_NOT_SUPPORTED` and "
            "a line naming its table and slot; a table not listed is refused with a line naming the library that "
            "asked and the UUID. The libraries rgpu leaves stock (cuFFT, cuSPARSE, cuRAND, cuSOLVER, NCCL, CUPTI) "
            "and stock copies of the five it replaces are refused every table, naming themselves. CUDA 13's static "
            "runtime loads its fatbins with the public `cuLibraryLoadData` when it starts (content-addressed: the "
            "server keeps each image once), not through these tables.", "",
            "| table | UUID | slots served |", "|---|---|---|",
            "| CUDART_INTERFACE | `6bd5fb6c-5bf4-e74a-8987-d93912fd9df9` | 1, 6, 8: a module from a fatbin "
            "(`cuModuleLoadData`); 2: the device's primary context (retained once); 7: a notification, ignored; "
            "12: load the JIT compilers (the server's driver has them) |",
            "| TOOLS_RUNTIME_CALLBACK_HOOKS | `a094798c-2e74-2e74-93f2-0800200c0a66` | 2, 6: buffers the runtime "
            "writes tool hooks into (no tool reads them) |",
            "| CONTEXT_LOCAL_STORAGE | `c693336e-1121-df11-a8c3-68f355d89593` | 0 put, 1 delete, 2 get: per "
            "(context, key), in C (the destructors are never run: rgpu's contexts end with the session) |",
            "| INTEGRITY_CHECK | `d4082055-bde6-704b-8d34-ba123c66e1f2` | 1: the hash of the runtime's version, a "
            "time, process, thread, the tables' addresses, `cuDriverGetVersion` and each device's UUID and PCI "
            "location (held to ZLUDA's test vectors) |",
            "| CONTEXT_CHECKS | `263e8860-7cd2-6143-92f6-bbd5006dfa7e` | 2, 3: no flags set |",
            "| TOOLS_TLS, CTX_CREATE_BYPASS, HEAP_ACCESS, DEVICE_EXTENDED_RT | (in export_tables.c) | none: every "
            "slot fails by name |"]


def markdown() -> str:
    api = model.parse(header.load())
    rows = [(name, *status(name)) for name in sorted(api.functions, key=str.lower)]
    counts = Counter(kind for _, kind, _ in rows)
    out = ["# CUDA driver API coverage of rgpu's libcuda.so.1", "",
           f"Generated by `rgpu intercept coverage` from the CUDA {api.header.cuda_version // 1000}."
           f"{api.header.cuda_version % 1000 // 10} `cuda.h`: {len(rows)} exported entry points "
           f"(versioned `_v2`/`_v3`, per-thread `_ptds`/`_ptsz` and legacy names included), every one exported.", "",
           "| status | meaning | entry points |", "|---|---|---|"]
    out += [f"| {kind} | {KINDS[kind]} | {counts.get(kind, 0)} |" for kind in KINDS]
    out += ["", "| function | status | note |", "|---|---|---|"]
    out += [f"| `{name}` | {kind} | {note} |" for name, kind, note in rows]
    out += runtime_markdown()
    out += libraries_markdown()
    out += export_tables_markdown()
    return "\n".join(out) + "\n"
