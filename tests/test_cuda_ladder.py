"""The GPU host's ladder of stock PyTorch (bench/cuda_ladder.py) checked on the CPU: its rungs run and record, a
failing or hung rung costs only itself, and its comparison of a native and an rgpu run reads synthetic runs right."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from conftest import clean_env
from rgpu.bench import cuda_ladder
from rgpu.bench.cuda_ladder import compare_rung

ROOT = Path(__file__).resolve().parent.parent
LADDER = ROOT / "bench" / "cuda_ladder.py"


@pytest.fixture(autouse=True)
def torch_settings_restored(monkeypatch):
    """The ladder makes torch deterministic process-wide (its own process on the GPU host); the tests that run
    after these in this process must not inherit that (an empty tensor of a bits dtype cannot be filled)."""
    torch = pytest.importorskip("torch")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    b = torch.backends
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             b.cudnn.deterministic, b.cudnn.benchmark, b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32)
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    b.cudnn.deterministic, b.cudnn.benchmark, b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32 = saved[2:]


def ladder(tmp_path, *args, timeout=120):
    """The ladder as the GPU script runs it: a file, from another folder, on the CPU."""
    pytest.importorskip("torch", reason="the ladder's rungs are torch programs")
    done = subprocess.run([sys.executable, str(LADDER), "--device", "cpu", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout, env=clean_env())
    return done


def test_cheap_rungs_record_digests_and_summaries_and_a_failing_rung_does_not_stop_the_next(tmp_path):
    out = tmp_path / "ladder.json"
    done = ladder(tmp_path, "--rungs", "R5,R99,R4", "--out", str(out), "--quick-exit")
    assert done.returncode == 1, done.stderr              # one rung failed, the others ran
    doc = json.loads(out.read_text())
    assert list(doc["rungs"]) == ["R5", "R99", "R4"] and doc["running"] is None
    bad = doc["rungs"]["R99"]
    assert bad["ok"] is False and bad["error"]["type"] == "ValueError" and "R99" in bad["error"]["message"]
    r4 = doc["rungs"]["R4"]
    assert r4["ok"] is True and r4["error"] is None and r4["failed"] == [] and r4["wall_s"] > 0
    res = r4["results"]
    assert {"mm_fp32_127x65x33", "mm_bf16_transposed_views", "linear_fp32_8x40.db", "bmm_bf16", "mv_fp32"} <= set(res)
    for entry in res.values():
        assert set(entry) >= {"sha256", "dtype", "sum", "absmax", "first", "nonfinite"} and len(entry["sha256"]) == 64
    assert res["mm_bf16_256x512x256"]["dtype"] == "bfloat16"
    assert doc["rungs"]["R5"]["ok"] is True and "batchnorm2d_train_fp32.running_var" in doc["rungs"]["R5"]["results"]
    assert doc["meta"]["device"] == "cpu" and doc["meta"]["rgpu"] is False
    marks = [line for line in done.stderr.splitlines() if line.startswith(cuda_ladder.MARK)]
    assert marks == [f"{cuda_ladder.MARK}{r} ==" for r in ("R5", "R99", "R4")]

    # the inputs are the result name's seeded CPU draws: torch here gives the same values
    import torch
    gen = torch.Generator().manual_seed(zlib.crc32(b"mv_fp32"))
    want = torch.randn(200, 300, generator=gen).double() @ torch.randn(300, generator=gen).double()
    mv = res["mv_fp32"]
    assert mv["sum"] == pytest.approx(float(want.sum()), rel=1e-4, abs=1e-3)
    assert mv["first"] == pytest.approx(want[:4].tolist(), rel=1e-4, abs=1e-4)
    assert mv["absmax"] == pytest.approx(float(want.abs().max()), rel=1e-5)


def test_a_rung_past_its_timeout_is_recorded_and_resume_runs_the_rest(tmp_path):
    out = tmp_path / "ladder.json"
    first = ladder(tmp_path, "--rungs", "R7,R5", "--out", str(out), "--rung-timeout", "0.02")   # R7 trains for a second or more
    assert first.returncode == 3, first.stderr
    doc = json.loads(out.read_text())
    assert list(doc["rungs"]) == ["R7"] and doc["rungs"]["R7"]["error"]["type"] == "Timeout" and doc["running"] is None
    assert "R7 timed out" in first.stderr
    again = ladder(tmp_path, "--rungs", "R7,R5", "--out", str(out), "--resume")
    assert again.returncode == 1, again.stderr            # R7 stays failed
    doc = json.loads(out.read_text())
    assert doc["rungs"]["R7"]["error"]["type"] == "Timeout" and doc["rungs"]["R5"]["ok"] is True
    assert doc["attempts"] == 2


def test_resume_marks_the_rung_a_dead_process_left_running_and_gives_up_after_two_deaths_before_any(tmp_path):
    out = tmp_path / "ladder.json"
    out.write_text(json.dumps({"rungs": {}, "running": "R4", "attempts": 1, "recorded_at_start": 0}))
    done = ladder(tmp_path, "--rungs", "R4,R5", "--out", str(out), "--resume")
    doc = json.loads(out.read_text())
    assert done.returncode == 1 and doc["rungs"]["R4"]["error"]["type"] == "ProcessDied"
    assert doc["rungs"]["R5"]["ok"] is True
    # a process that died before its first rung, and nothing was running: the next would too
    out.write_text(json.dumps({"rungs": {"R4": doc["rungs"]["R4"]}, "running": None, "attempts": 1, "recorded_at_start": 1}))
    assert cuda_ladder.run_ladder(["R4", "R5"], "cpu", str(out), resume=True) == 1
    doc = json.loads(out.read_text())
    assert "before this rung" in doc["rungs"]["R5"]["error"]["message"]


def test_the_bench_mode_times_the_eager_step_after_its_warm_up(tmp_path, monkeypatch):
    pytest.importorskip("torch", reason="the bench loads torch")
    steps = []                                    # the harness's timing, not the GPT (R7 is the GPT)
    monkeypatch.setattr(cuda_ladder.rungs, "gpt_setup", lambda dev: ("model", "opt", [("x", "y")]))
    monkeypatch.setattr(cuda_ladder.rungs, "train_step", lambda *args: steps.append(args) or 1.0)
    monkeypatch.setattr(cuda_ladder, "_round_trips", lambda: None)   # other tests may load the interceptor here
    out = tmp_path / "bench.json"
    assert cuda_ladder.bench("cpu", 3, 2, str(out)) == 0
    b = json.loads(out.read_text())
    assert len(steps) == 5 and steps[0][:4] == ("model", "opt", "x", "y")
    assert len(b["times_ms"]) == 3 and b["spread_ms"][0] <= b["median_ms"] <= b["spread_ms"][1]
    assert b["round_trips_per_step"] is None and b["meta"]["device"] == "cpu"   # rgpu is not this process's CUDA
    monkeypatch.setattr(cuda_ladder.rungs, "train_step", lambda *args: 1 / 0)
    assert cuda_ladder.bench("cpu", 3, 2, str(out)) == 1
    assert json.loads(out.read_text())["error"]["type"] == "ZeroDivisionError"


# ---- the comparison, on synthetic runs --------------------------------------------------------------------

def entry(sha="a" * 64, s=1.0, first=(1.0, 2.0), **extra):
    return {"sha256": sha, "dtype": "float32", "n": 2, "sum": s, "absmax": 2.0, "first": list(first), "nonfinite": 0, **extra}


def run_of(rungs: dict, rgpu=False) -> dict:
    return {"rungs": rungs, "running": None, "meta": {"rgpu": rgpu, "device": "cuda"}}


def test_equal_runs_compare_bitwise_equal_and_a_difference_is_measured():
    same = compare_rung({"ok": True, "results": {"x": entry(), "t": {"info": 3.2}}},
                        {"ok": True, "results": {"x": entry(), "t": {"info": 9.9}}})
    assert same["bitwise_equal"] is True and same["max_abs_diff"] == 0.0 and same["compared"] == 1 and same["equal"] == 1
    differ = compare_rung({"ok": True, "results": {"x": entry(), "y": entry()}},
                          {"ok": True, "results": {"x": entry("b" * 64, s=1.25, first=(1.0, 2.5)), "y": entry()}})
    assert differ["bitwise_equal"] is False and differ["mismatched"] == ["x"] and differ["max_abs_diff"] == 0.5
    losses = compare_rung({"ok": True, "results": {"l": entry(values=[3.0, 2.0])}},
                          {"ok": True, "results": {"l": entry("c" * 64, values=[3.0, 2.001])}})
    assert losses["max_abs_diff"] == pytest.approx(0.001)
    nan = cuda_ladder._max_diff(entry(first=(float("nan"), 1.0)), entry(first=(float("nan"), 1.0)))
    assert nan == 0.0 and cuda_ladder._max_diff(entry(first=(float("nan"), 1.0)), entry()) == float("inf")


def test_failures_on_either_side_are_named_and_never_read_as_equal():
    err = {"error": {"type": "RuntimeError", "message": "CUBLAS_STATUS_NOT_SUPPORTED", "traceback": ""}}
    row = compare_rung({"ok": True, "results": {"x": entry(), "y": entry(), "z": err}},
                       {"ok": False, "results": {"x": entry(), "y": err, "z": err}})
    assert row["bitwise_equal"] is False and list(row["rgpu_failed"]) == ["y"] and list(row["both_failed"]) == ["z"]
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in row["rgpu_failed"]["y"]
    parts = compare_rung({"ok": True, "results": {"lin.y": entry(), "lin.dx": entry()}}, {"ok": False, "results": {"lin": err}})
    assert parts["rgpu_failed"] == {"lin": "RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED"} and parts["mismatched"] == []
    crashed = compare_rung({"ok": True, "results": {"x": entry()}},
                           {"ok": False, "results": {}, "error": {"type": "ProcessDied", "message": "ended", "traceback": ""}})
    assert crashed["bitwise_equal"] is False and crashed["rgpu_error"] == "ProcessDied: ended"
    assert "only native" in crashed["mismatched"][0]
    missing = compare_rung({"ok": True, "results": {"x": entry()}}, None)
    assert missing["rgpu_ok"] == "not run" and missing["bitwise_equal"] is False
    skipped = compare_rung({"ok": None, "skipped": "no torchvision", "results": {}}, {"ok": None, "results": {}})
    assert skipped["bitwise_equal"] is None and skipped["skipped"] == "no torchvision"


def test_the_command_compares_files_assigns_refused_calls_to_rungs_and_times_the_step(tmp_path, capsys):
    (tmp_path / "n.json").write_text(json.dumps(run_of({"R4": {"ok": True, "results": {"x": entry()}, "wall_s": 1},
                                                         "R5": {"ok": True, "results": {"c": entry()}, "wall_s": 1}})))
    (tmp_path / "r.json").write_text(json.dumps(run_of({"R4": {"ok": True, "results": {"x": entry()}, "wall_s": 2}}, rgpu=True)))
    (tmp_path / "killed.json").write_text(json.dumps({"rungs": {}, "running": "R4"}))
    (tmp_path / "r1.err").write_text(f"rgpu: started\n{cuda_ladder.MARK}R4 ==\n{cuda_ladder.MARK}R5 ==\n"
                                     "rgpu: cudnnBackendExecute (libcudnn) is not supported over rgpu yet\n"
                                     "rgpu: cudnnBackendExecute (libcudnn) is not supported over rgpu yet\n")
    for i, (n, r) in enumerate(((10.0, 20.0), (12.0, 30.0))):
        (tmp_path / f"bn{i}.json").write_text(json.dumps({"median_ms": n, "spread_ms": [n - 1, n + 1]}))
        (tmp_path / f"br{i}.json").write_text(json.dumps({"median_ms": r, "spread_ms": [r - 2, r + 2], "round_trips_per_step": 1}))
    (tmp_path / "r2.err").write_text("rgpu: cublasLtMatmul (libcublasLt) is not supported over rgpu yet\n")   # a fresh process
    (tmp_path / "n2.json").write_text(json.dumps(run_of({"R4": {"ok": True, "results": {"x": entry("d" * 64)}}})))
    t = str(tmp_path)
    assert cuda_ladder.main(["compare", f"{t}/n.json", f"{t}/r.json", "--stderr", f"{t}/r1.err", f"{t}/r2.err", f"{t}/gone.err",
                             "--native-again", f"{t}/n2.json",
                             "--bench-native", f"{t}/bn0.json", f"{t}/bn1.json",
                             "--bench-rgpu", f"{t}/br0.json", f"{t}/br1.json", "--out", f"{t}/s.json"]) == 0
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["rungs"]["R4"]["bitwise_equal"] is True and s["rungs"]["R5"]["rgpu_ok"] == "not run"
    assert s["rungs"]["R5"]["not_supported"] == ["rgpu: cudnnBackendExecute (libcudnn) is not supported over rgpu yet"]
    assert s["rungs"]["R4"]["not_supported"] == [] and s["all_equal"] is False
    assert s["not_supported_at_start"] == ["rgpu: cublasLtMatmul (libcublasLt) is not supported over rgpu yet"]
    assert s["rungs"]["R4"]["native_repeats"] is False and s["rungs"]["R4"]["native_unstable"] == ["x"]
    assert s["rungs"]["R5"]["native_repeats"] is None
    b = s["bench"]
    assert b["ratio"] == pytest.approx(2.25) and b["ratio_spread"] == [2.0, 2.5]
    assert b["native"]["median_ms"] == 11.0 and b["rgpu"]["spread_ms"] == [18.0, 32.0]
    table = capsys.readouterr().out
    assert "R4" in table and "equal" in table and "cudnnBackendExecute" in table and "rgpu/native 2.25" in table
    assert "native differs from itself on: x" in table
    assert cuda_ladder.compare(f"{t}/absent.json", f"{t}/r.json")["unreadable"]
    killed = cuda_ladder.compare(f"{t}/n.json", f"{t}/killed.json")["rungs"]["R4"]
    assert killed["rgpu_ok"] is False and "no time was left" in killed["rgpu_error"]


def test_the_gpu_script_parses():
    if not shutil.which("bash"):
        pytest.skip("bash is not installed")
    done = subprocess.run(["bash", "-n", str(ROOT / "gpu" / "check_cuda_libs.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
