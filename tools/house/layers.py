"""The layer contract over the package: which part of rgpu may import which, checked from the source's ASTs.

Layers, bottom first; a module may import its own layer and those below, never one above.
The routes share a layer and never import each other. A module of rgpu that no layer
names is the face (the top). `python tools/check_house.py layers` runs this alone.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

# bottom first; a tuple of tuples is a layer of independent parts (none imports another)
LAYERS: tuple = (
    ("rgpu.errors", "rgpu.config", "rgpu.protocol", "rgpu.ops_substitutes", "rgpu.fatbin", "rgpu.excepthook"),
    ("rgpu.native", "rgpu.toolchain", "rgpu.torch_ext", "rgpu.local_server"),
    ("rgpu.transport",),
    (("rgpu.device_backend",), ("rgpu.cuda_intercept",), ("rgpu.server",)),
    ("rgpu.bench", "rgpu"),  # the face: the package top, cli, doctor, remote, ssh, and any module unnamed above
)

# (importer, imported, why it is allowed for now): each is a debt, to be removed when its cause goes
EXCEPTIONS: tuple[tuple[str, str, str], ...] = (
    ("rgpu.transport.handshake", "rgpu",
     "reads rgpu.__version__ from the package top; the version belongs with the wire constants (rgpu.protocol)"),
)

# Every `import rgpu.x` runs rgpu/__init__.py first, so what the top imports at module level
# is imported by every module of every layer: it may import the bottom layer only.
TOP = "rgpu"


def _parts() -> list[tuple[int, int, str]]:
    """(layer, part within the layer, module prefix) for every named prefix."""
    out = []
    for i, layer in enumerate(LAYERS):
        for j, part in enumerate(layer):
            for prefix in (part if isinstance(part, tuple) else (part,)):
                out.append((i, j if isinstance(part, tuple) else -1, prefix))
    return out


def place(module: str) -> tuple[int, int, str]:
    """Where a module sits: the longest named prefix it falls under."""
    best = max((p for p in _parts() if module == p[2] or module.startswith(p[2] + ".")), key=lambda p: len(p[2]))
    return best


def package_dirs(root: Path) -> dict[str, Path]:
    """Import name -> folder, from pyproject.toml's package-dir table."""
    text = (root / "pyproject.toml").read_text()  # read by hand: tomllib is Python 3.11's, rgpu runs on 3.10
    block = re.search(r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    pairs = re.findall(r'^"([\w.]+)"\s*=\s*"([^"]+)"', block.group(1) if block else "", re.M)
    return {name: root / folder for name, folder in pairs}


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package, named as it is imported."""
    dirs = package_dirs(root)
    out: dict[str, Path] = {}
    for name, folder in sorted(dirs.items(), key=lambda kv: len(kv[0])):
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("").parts
            if any(p.startswith((".", "_build")) or p == "__pycache__" for p in rel):
                continue
            dotted = ".".join((name, *rel)).removesuffix(".__init__")
            out.setdefault(dotted, path)  # a nested package-dir entry maps the same files: the first wins
    return out


def imports(module: str, path: Path, known: set[str], top_level: bool = False) -> list[tuple[int, str]]:
    """(line, imported module of rgpu) for every import in a file, function-level ones too unless top_level."""
    is_pkg = path.name == "__init__.py"
    out = []
    tree = ast.parse(path.read_text(), str(path))
    for node in (tree.body if top_level else ast.walk(tree)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = module.split(".")[: len(module.split(".")) - node.level + is_pkg]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub if sub in known else base))
    return [(line, m) for line, m in out if m == "rgpu" or m.startswith("rgpu.")]


def check(root: Path) -> list[str]:
    """One line per forbidden import: file:line: importer -> imported (why it is forbidden)."""
    mods = modules(root)
    known = set(mods)
    allowed = {(a, b) for a, b, _ in EXCEPTIONS}
    seen: set[tuple[str, str]] = set()
    problems = []
    for module, path in mods.items():
        here = place(module)
        for line, target in imports(module, path, known):
            if target not in known and target != TOP:
                problems.append(f"{path.relative_to(root)}:{line}: {module} -> {target} (no such module in the package)")
                continue
            there = place(target)
            if module != TOP:
                seen.add((module, target))
            if there[2] == here[2] or (module, target) in allowed:
                continue
            if there[0] > here[0]:
                why = f"{here[2]} sits below {there[2]}"
            elif there[0] == here[0] and here[1] >= 0 and there[1] != here[1]:
                why = f"{here[2]} and {there[2]} are independent routes"
            else:
                continue
            problems.append(f"{path.relative_to(root)}:{line}: {module} -> {target} ({why})")
    problems = list(dict.fromkeys(problems))  # one line per import, not per name it imports
    if TOP in mods:
        for line, target in imports(TOP, mods[TOP], known, top_level=True):
            seen.add((TOP, target))
            if place(target)[0] > 0 and (TOP, target) not in allowed and not target.startswith(TOP + ".__"):
                problems.append(f"{mods[TOP].relative_to(root)}:{line}: {TOP} -> {target} "
                                f"(the package top runs on every import of rgpu: at module level it imports the bottom layer only)")
    problems += [f"layers.py: exception {a} -> {b} no longer matches an import: remove it"
                 for a, b, _ in EXCEPTIONS if (a, b) not in seen and a in mods]
    return problems
