"""A benchmark that runs for minutes shows its progress on stderr; its table or ``--json`` on stdout is unchanged."""
from __future__ import annotations

import json
import time

from rgpu import cli
from rgpu.bench import harness


def test_a_suite_counts_its_runs_on_stderr_and_leaves_stdout_to_the_json(monkeypatch, capsys):
    ticks = []

    def fake_suite(name, args):
        slow = lambda: time.sleep(0.3) or 1.0   # noqa: E731  (a second in all: the line is redrawn)
        result = harness.compare(slow, lambda: 2.0, repeats=4)
        ticks.append(harness._bar[-1].n)
        return [harness.row(name, "tcp", "rtt", 64, result, "baseline")]

    monkeypatch.setattr(harness, "run_suite", fake_suite)
    assert cli.main(["bench", "fake", "--json"]) == 0
    out = capsys.readouterr()
    rows = json.loads(out.out)                       # stdout: the JSON alone
    assert rows[0]["bench"] == "fake" and rows[0]["value"] == 1.0 and rows[0]["ratio"] == 0.5
    assert ticks == [4]                              # one tick per pair of runs
    assert "rgpu bench fake: " in out.err and "run" in out.err
    assert not harness._bar                          # the line is gone with the suite


def test_abba_runs_the_baseline_first_in_every_other_pair_and_pairs_them_as_before():
    order = []
    result = harness.compare(lambda: order.append("m") or 2.0, lambda: order.append("b") or 4.0, repeats=4, abba=True)
    assert order == ["m", "b", "b", "m", "m", "b", "b", "m"]
    assert result["ratio"] == 0.5 and result["runs"] == 4
