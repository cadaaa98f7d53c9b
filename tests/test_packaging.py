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
