"""C text generated from the API model: tables, the exported wrappers, and cffi's extern "Python" declarations.

Every export becomes one C function: it returns at once after Python has
finalised (destructors at exit), answers in C when shim.c has an
``rgpu_fast_<name>``, and otherwise makes sure the embedded interpreter is up
before handing the call to Python's ``_py_<name>``.
"""
from __future__ import annotations

import re

from .annotations import C_ANSWERED, C_ONLY
from .model import Api, Function

CUDA_SUCCESS = 0
CUDA_ERROR_DEINITIALIZED = 4
CUDA_ERROR_NOT_INITIALIZED = 3
# After finalisation, releasing something is a success (the session ends and the
# server frees it all anyway), and so is the bookkeeping a library's destructors do
# while the process exits (torch's pinned-memory cache records an event as a tensor
# dies, and aborts on an error there; the stock driver is still up at that point);
# anything else is the driver shutting down.
_RELEASE = re.compile(r"(Destroy|Free|Unload|Release|Unregister|Reset|EventRecord|EventQuery|EventSynchronize"
                      r"|StreamWaitEvent|StreamQuery|StreamSynchronize|CtxSynchronize)")
# ... and a new event is a handle nobody will use (its value never names a server's event).
_AFTER_EXIT = {"cuEventCreate": "if (phEvent) *phEvent = (CUevent)(uintptr_t)(0xEE00000000000000ull + "
                                "__atomic_add_fetch(&rgpu_exit_events, 1, __ATOMIC_RELAXED));"}


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def tables(api: Api) -> str:
    """rgpu_errors[] for cuGetErrorName/String and rgpu_procs[] for cuGetProcAddress."""
    lines = ["struct rgpu_error { int code; const char *name; const char *text; };",
             "static const struct rgpu_error rgpu_errors[] = {"]
    lines += [f"    {{{code}, {_c_string(name)}, {_c_string(text)}}}," for name, code, text in api.header.errors]
    lines += ["};", f"static const int rgpu_nerrors = {len(api.header.errors)};", "",
              "struct rgpu_proc { const char *base; int version; int per_thread; void *fn; };",
              "static const struct rgpu_proc rgpu_procs[] = {"]
    lines += [f'    {{"{e.base}", {e.version}, {int(e.per_thread)}, (void *)&{e.export}}},' for e in api.proc_table]
    lines += ["};", f"static const int rgpu_nprocs = {len(api.proc_table)};", ""]
    return "\n".join(lines)


def python_name(name: str) -> str:
    return f"_py_{name}"


def extern_python(api: Api) -> str:
    """The cdef lines declaring one Python implementation per export (cffi's extern "Python")."""
    return "\n".join(f'extern "Python" {fn.prototype(python_name(fn.name))};'
                     for fn in api.functions.values() if fn.name not in C_ONLY)


def _wrapper(fn: Function) -> str:
    after_exit = CUDA_SUCCESS if _RELEASE.search(fn.base) else CUDA_ERROR_DEINITIALIZED
    body = []
    if fn.name in C_ONLY:
        body.append(f"return rgpu_fast_{fn.name}({fn.arg_names});")
    else:
        if fn.name in C_ANSWERED:
            body += [f"CUresult r = rgpu_fast_{fn.name}({fn.arg_names});", "if (r != RGPU_PY) return r;"]
        if fn.base in _AFTER_EXIT:
            body.append(f"if (rgpu_finalized) {{ {_AFTER_EXIT[fn.base]} return CUDA_SUCCESS; }}")
        body += [f"if (rgpu_finalized) return (CUresult){after_exit};",
                 f"if (rgpu_start() != 0) return (CUresult){CUDA_ERROR_NOT_INITIALIZED};",
                 f"return {python_name(fn.name)}({fn.arg_names});"]
    inner = "\n    ".join(body)
    return f"RGPU_EXPORT {fn.prototype()} {{\n    {inner}\n}}\n"


def wrappers(api: Api) -> str:
    """Forward declarations of the extern "Python" functions, then every exported wrapper."""
    decls = [f"static {fn.prototype(python_name(fn.name))};"
             for fn in api.functions.values() if fn.name not in C_ONLY]
    return ("\n".join(decls) + "\n\nstatic uint64_t rgpu_exit_events;   /* events made after exit */\n\n"
            + "\n".join(_wrapper(fn) for fn in api.functions.values()))
