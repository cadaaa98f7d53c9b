"""``rgpu bench generate --quick`` against a CPU server: rgpu's greedy tokens equal native's, rows in the bench schema."""
from __future__ import annotations

import importlib.util
import json

import pytest

from device_helpers import run_python

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="Hugging Face transformers is not installed (pip install transformers)")

SCHEMA = {"bench", "transport", "metric", "unit", "size", "value", "baseline_name", "baseline", "ratio", "spread"}
FACTS = {"batch", "new_tokens", "preset", "params", "server", "transformers", "tokens_equal"}

# in its own interpreter: the device session is process-wide
BENCH = "import sys; from rgpu.bench import generate; sys.exit(generate.main(['--quick', '--json']))"


@needs_transformers
def test_the_quick_generation_bench_makes_native_tokens_and_reports_its_round_trips(rgpu_server):
    r = run_python(BENCH, env={"RGPU_SERVER": rgpu_server.address, "RGPU_TOKEN": rgpu_server.token}, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "DIFFER" not in r.stderr
    rows = json.loads(r.stdout)
    assert all(SCHEMA | FACTS <= set(row) for row in rows), rows
    assert all(row["bench"] == "generate" and row["tokens_equal"] is True for row in rows)
    assert all(row["server"] == "cpu" and row["preset"] == "tiny" for row in rows)
    speed = [row for row in rows if row["unit"] == "tokens/s"]
    assert [row["batch"] for row in speed] == [1, 8]
    assert all(row["value"] > 0 and row["baseline"] > 0 and row["runs"] == 3 for row in speed)
    loop = [row for row in rows if row["metric"].startswith("round trips per new token in the decode loop")]
    assert [row["value"] for row in loop] == [1.0, 1.0]      # one stopping check per token, nothing else waits
    messages = [row for row in rows if row["metric"].startswith("messages per new token")]
    assert len(messages) == 2 and all(row["value"] > 1 for row in messages)


def test_without_transformers_the_bench_names_the_install_and_exits_2():
    code = ("import sys; sys.modules['transformers'] = None\n"      # an import of it now raises ImportError
            "from rgpu import cli; sys.exit(cli.main(['bench', 'generate', '--quick']))")
    r = run_python(code, timeout=60)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "pip install transformers" in r.stderr and r.stdout == ""
