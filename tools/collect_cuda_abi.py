"""Collects, on a GPU host, the CUDA libraries' export lists and what torch and CuPy import from them.

    OUT=/some/folder python3 tools/collect_cuda_abi.py      (through the device tool: JSON to $OUT)

Writes $OUT/cuda_abi.json: for each stock library rgpu replaces (libcudart.so.13, libcublas.so.13,
libcublasLt.so.13, libcudnn.so.9, libcuda.so.1) its defined functions with their version nodes, and
for each of torch's and CuPy's shared objects the symbols it imports from them (name, version node).
rgpu's ABI test (tests/test_cuda_abi.py) holds rgpu's exports against the committed result.
"""
import glob
import json
import os
import re
import subprocess
import sys

LIBS = ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcudnn.so.9", "libcuda.so.1")
LINE = re.compile(r"^\s*\d+:\s+[0-9a-f]+\s+\d+\s+(\w+)\s+(\w+)\s+\w+\s+(\w+)\s+(\S+)")


def dynsyms(path):
    out = subprocess.run(["readelf", "--dyn-syms", "-W", path], capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        typ, bind, ndx, name = m.groups()
        name = re.sub(r"\s*\(\d+\)$", "", name)
        sym, _, ver = name.partition("@")
        yield typ, ndx, sym, ver.lstrip("@")


def needed(path):
    out = subprocess.run(["readelf", "-d", "-W", path], capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def main():
    out = os.environ.get("OUT", "/tmp/cuda-abi")
    os.makedirs(out, exist_ok=True)
    import torch
    site = os.path.dirname(os.path.dirname(torch.__file__))
    found = {}
    for lib in LIBS:
        cands = glob.glob(f"{site}/nvidia/**/{lib}*", recursive=True) + glob.glob(f"{site}/torch/lib/{lib}*")
        if lib == "libcuda.so.1":
            ld = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True).stdout
            cands += re.findall(r"libcuda\.so\.1 .*=> (\S+)", ld)
        cands = [c for c in cands if os.path.isfile(c)]
        if cands:
            found[lib] = sorted(cands, key=len)[0]
    exports = {}
    for lib, path in found.items():
        exports[lib] = sorted({(s, v) for t, n, s, v in dynsyms(path) if n != "UND" and t in ("FUNC", "IFUNC")})
    importers = sorted(glob.glob(f"{site}/torch/lib/*.so*") + glob.glob(f"{site}/torch/_C*.so")
                       + glob.glob(f"{site}/cupy/**/*.so", recursive=True)
                       + glob.glob(f"{site}/cupy_backends/**/*.so", recursive=True))
    imports = {}
    for path in importers:
        rows = [(s, v) for t, n, s, v in dynsyms(path) if n == "UND"
                and (v.startswith(("libcudart", "libcublas", "libcudnn")) or s.startswith(("cu", "__cuda")))]
        if rows:
            imports[os.path.relpath(path, site)] = {"needed": needed(path), "symbols": sorted(set(rows))}
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "paths": found}
    try:
        import cupy
        info["cupy"] = cupy.__version__
    except Exception as exc:  # not installed, or no GPU
        info["cupy"] = f"{type(exc).__name__}: {exc}"
    json.dump({"info": info, "exports": exports, "imports": imports}, open(f"{out}/cuda_abi.json", "w"), indent=0)
    print(json.dumps(info, indent=1))
    for lib, rows in exports.items():
        print(lib, len(rows), "exports; nodes", sorted({v for _, v in rows}))
    for name, d in imports.items():
        print(name, len(d["symbols"]), "imports")


if __name__ == "__main__":
    main()
