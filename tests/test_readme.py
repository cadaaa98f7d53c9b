"""The README stays true: its configuration table is the one config.py generates."""
from pathlib import Path

from rgpu import config

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_lists_every_setting_exactly_as_config_defines_it():
    assert config.markdown_table() in README.read_text()


def test_the_readme_test_command_is_the_one_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    line = next(l for l in README.read_text().splitlines() if "pytest" in l and l.startswith("pip install"))
    assert line.replace("pip install", "python -m pip install -q") in ci
