"""The installed package holds every subpackage of the source tree."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_source_package_is_listed_in_pyproject():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    dirs = {v: k for k, v in conf["package-dir"].items()}
    found = set()
    for top in ("rgpu", "transport", "device_backend", "cuda_intercept", "server", "bench"):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).as_posix()
            parts = rel.split("/")
            name = dirs.get(parts[0], parts[0])
            found.add(".".join([name, *parts[1:]]))
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"



def test_every_native_source_and_data_file_beside_the_code_travels_as_package_data():
    import fnmatch

    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    data, dirs = conf["package-data"], {ROOT / d: p for p, d in conf["package-dir"].items()}
    missing = set()
    for top in dirs:
        for path in top.rglob("*"):
            if not path.is_file() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
                continue
            home = next(d for d in path.parents if (d / "__init__.py").exists())   # the package it lands in
            base = next(d for d in [home, *home.parents] if d in dirs)
            package = ".".join([dirs[base], *home.relative_to(base).parts])
            rel = path.relative_to(home).as_posix()
            patterns = data.get("*", []) + data.get(package, [])
            if not any(fnmatch.fnmatch(rel, pat) and pat.count("/") == rel.count("/") for pat in patterns):
                missing.add(f"{path.relative_to(ROOT)} (package {package})")
    assert not missing, f"add to [tool.setuptools.package-data]: {sorted(missing)}"
