"""gpu/steps.sh, which every GPU-host check sources: a check stopped from outside (run_all.sh's timeout) still
brings back what its steps wrote, and a caller's BUDGET trims the steps to fit."""
from __future__ import annotations

import re
import shutil
import subprocess
import tarfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")

CHECK = textwrap.dedent("""
    BUDGET=${BUDGET:-465}
    . gpu/steps.sh
    step first 5 echo '{"rows": 1}'
    step second 300 sleep 60
    pack never.tar.gz
""")


def test_a_check_stopped_from_outside_packs_what_its_steps_wrote(tmp_path):
    script = tmp_path / "check_fake.sh"
    script.write_text(CHECK)
    out = tmp_path / "out"
    done = subprocess.run(["timeout", "3", "bash", str(script)], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(out), "BUDGET": "30", "HOME": str(tmp_path)},
                          timeout=60)
    assert done.returncode == 124, done.stdout + done.stderr
    assert "stopped from outside" in done.stdout
    assert re.search(r"second \(limit (29|30) s\)", done.stdout)   # the caller's budget, not the script's 465
    with tarfile.open(out / "partial.tar.gz") as tar:
        names = {n.removeprefix("./") for n in tar.getnames()}
        assert {"first.json", "first.rc", "log.txt"} <= names
        assert tar.extractfile("./first.json").read() == b'{"rows": 1}\n'
    assert not (out / "never.tar.gz").exists()
