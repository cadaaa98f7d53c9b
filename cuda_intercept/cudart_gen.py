"""The generated half of rgpu's libcudart.so.13: a loud stub for every export not written in cudart*.c, and the error table.

The export list is the stock library's (``abi/stock_cuda_13_torch_2_11.json``,
taken from the real ``libcudart.so.13`` on the GPU host) together with every
function of the toolkit's ``cuda_runtime_api.h``.  A stub logs
``rgpu: cudaXxx is not supported over rgpu (yet)`` once, sets the thread's
last error and returns ``cudaErrorNotSupported``.  Stubs sit in a unit of their
own that does not include the runtime header, so they are declared
``int name(void)`` without clashing with the real prototypes.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

from . import header

HERE = Path(__file__).resolve().parent
STOCK = HERE / "abi" / "stock_cuda_13_torch_2_11.json"
SOURCES = ("cudart.c", "cudart_launch.c", "cudart_code.c", "cudart_memory.c", "cudart_order.c")
NOT_SUPPORTED = 801

# cudaGetErrorString's words for the errors programs meet most (the stock runtime's); the rest read their doc's
# first sentence from driver_types.h.
SHORT_TEXT = {
    "cudaSuccess": "no error", "cudaErrorInvalidValue": "invalid argument", "cudaErrorMemoryAllocation": "out of memory",
    "cudaErrorInitializationError": "initialization error", "cudaErrorCudartUnloading": "driver shutting down",
    "cudaErrorNoDevice": "no CUDA-capable device is detected", "cudaErrorInvalidDevice": "invalid device ordinal",
    "cudaErrorNotSupported": "operation not supported", "cudaErrorNotReady": "device not ready",
    "cudaErrorIllegalAddress": "an illegal memory access was encountered",
    "cudaErrorLaunchFailure": "unspecified launch failure", "cudaErrorInvalidDeviceFunction": "invalid device function",
    "cudaErrorInvalidSymbol": "invalid device symbol", "cudaErrorInvalidResourceHandle": "invalid resource handle",
    "cudaErrorNoKernelImageForDevice": "no kernel image is available for execution on the device",
    "cudaErrorMissingConfiguration": "__global__ function call is not configured",
    "cudaErrorInvalidMemcpyDirection": "invalid copy direction for memcpy",
    "cudaErrorInvalidPitchValue": "invalid pitch argument", "cudaErrorUnknown": "unknown error",
    "cudaErrorStreamCaptureUnsupported": "operation not permitted when stream is capturing",
}


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


@lru_cache(maxsize=4)
def header_functions(include_dir: Path) -> dict[str, str]:
    """name -> return type of every function ``cuda_runtime_api.h`` declares."""
    text = _strip_comments((include_dir / "cuda_runtime_api.h").read_text())
    found = {}
    for m in re.finditer(r"extern\s+([^;{}()]*?)\bCUDARTAPI\s+(\w+)\s*\(", text):
        found[m.group(2)] = re.sub(r"__\w+__|__CUDA_DEPRECATED", "", m.group(1)).strip()
    return found


def stock_exports() -> list[str]:
    return json.loads(STOCK.read_text())["exports"]["libcudart.so.13"]


def implemented() -> set[str]:
    """Exports written in cudart*.c: ``RT_API ... name(``, and the twins the TWIN/GETTER macros make."""
    names = set()
    for f in SOURCES:
        text = _strip_comments((HERE / f).read_text())
        names.update(re.findall(r"^RT_API\s+[^;{(]*?\b(\w+)\s*\(", text, flags=re.M))
        for m in re.finditer(r"^(?:TWIN|GETTER)\((\w+)", text, flags=re.M):
            names.update((m.group(1), m.group(1) + "_ptsz"))
    return names


def exports(include_dir: Path) -> list[str]:
    return sorted(set(stock_exports()) | set(header_functions(include_dir)))


def stubs(include_dir: Path) -> list[str]:
    """Exports that get a loud stub; refuses to stub a function that does not return cudaError_t."""
    done, declared = implemented(), header_functions(include_dir)
    out = [n for n in exports(include_dir) if n not in done]
    odd = [n for n in out if n.startswith("__cuda") or declared.get(n, "cudaError_t") != "cudaError_t"]
    if odd:
        raise RuntimeError(f"these do not return cudaError_t and must be written in cudart*.c, not stubbed: {odd}")
    return out


def error_codes(include_dir: Path) -> list[tuple[str, int, str]]:
    """(name, code, text) of every ``cudaError`` value in driver_types.h."""
    raw = (include_dir / "driver_types.h").read_text()
    body = raw[raw.index("enum __device_builtin__ cudaError"):]
    body = body[:body.index("};")]
    out = []
    for m in re.finditer(r"(?:/\*\*(.*?)\*/\s*)?(cudaError\w*|cudaSuccess)\s*=\s*(\d+)", body, flags=re.S):
        doc = " ".join(line.strip(" *") for line in (m.group(1) or "").splitlines()).strip()
        doc = re.sub(r"\\p |::|\\ref ", "", doc)
        first = re.split(r"(?<=\.)\s", doc, maxsplit=1)[0].rstrip(".") if doc else m.group(2)
        out.append((m.group(2), int(m.group(3)), SHORT_TEXT.get(m.group(2), first)))
    return out


def _c(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def source(include_dir: Path) -> str:
    """The stubs' translation unit (it includes no CUDA header)."""
    errors = error_codes(include_dir)
    lines = [
        "/* Generated by cuda_intercept/cudart_gen.py: do not edit. */",
        "#include <stdio.h>",
        "#define RT_API __attribute__((visibility(\"default\")))",
        "int rt_ret(int e);",
        "",
        "/* Said once per function, then only the error. */",
        "static int rt_stub(const char *name, int *said) {",
        "    if (!__atomic_exchange_n(said, 1, __ATOMIC_RELAXED))",
        "        fprintf(stderr, \"rgpu: %s is not supported over rgpu (yet)\\n\", name);",
        f"    return rt_ret({NOT_SUPPORTED});",
        "}",
        "",
        "struct rt_error { int code; const char *name, *text; };",
        "static const struct rt_error rt_errors[] = {",
        *(f"    {{{code}, {_c(name)}, {_c(text)}}}," for name, code, text in errors),
        "};",
        "static const struct rt_error *rt_error_of(int code) {",
        "    for (unsigned i = 0; i < sizeof rt_errors / sizeof *rt_errors; i++)",
        "        if (rt_errors[i].code == code) return &rt_errors[i];",
        "    return 0;",
        "}",
        "int rt_error_known(int code) { return rt_error_of(code) != 0; }",
        "const char *rt_error_name(int code) { const struct rt_error *e = rt_error_of(code); return e ? e->name : 0; }",
        "const char *rt_error_text(int code) { const struct rt_error *e = rt_error_of(code); return e ? e->text : 0; }",
        "",
    ]
    for name in stubs(include_dir):
        lines.append(f"RT_API int {name}(void) {{ static int said; return rt_stub({_c(name)}, &said); }}")
    return "\n".join(lines) + "\n"


def write(folder: Path, include_dir: Path | None = None) -> Path:
    """Write the stubs' C into ``folder`` and return its path."""
    include_dir = include_dir or header.find_include_dir()
    path = Path(folder) / "cudart_stubs.c"
    path.write_text(source(include_dir))
    return path
