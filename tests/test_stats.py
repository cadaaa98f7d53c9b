"""``rgpu.stats()`` counts the bytes a tensor's upload and download move, both ways, on every transport."""
from __future__ import annotations

import json

import pytest

from device_helpers import run_python

# in its own interpreter: the device session (and its transport) is process-wide
SCRIPT = r"""
import json, torch, rgpu
n = 16 << 20                                              # bytes: big enough for shm's staged download
x = torch.ones(n // 4)
torch.ones(1, device="rgpu").cpu()
counts = {}
rgpu.stats(reset=True)
y = x.to("rgpu"); torch.rgpu.synchronize()
counts["upload"] = rgpu.stats(reset=True)
z = y.cpu()
counts["download"] = rgpu.stats(reset=True)
pinned = torch.empty(n // 4).pin_memory()
pinned.copy_(y)                                           # into pinned memory: over shm written in place
counts["download_pinned"] = rgpu.stats(reset=True)
counts["transport"] = counts["upload"]["transport"]
counts["right"] = bool((z == 1).all()) and bool((pinned == 1).all())
print(json.dumps(counts))
"""
MiB = 1 << 20


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_stats_count_an_upload_as_bytes_out_and_a_download_as_bytes_in(rgpu_server, transport):
    r = run_python(SCRIPT, env={"RGPU_SERVER": rgpu_server.address, "RGPU_TOKEN": rgpu_server.token,
                                "RGPU_TRANSPORT": transport})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["transport"] == transport and out["right"]
    assert 16 * MiB <= out["upload"]["bytes_out"] < 17 * MiB and out["upload"]["bytes_in"] < MiB
    for case in ("download", "download_pinned"):
        assert 16 * MiB <= out[case]["bytes_in"] < 17 * MiB, (case, out[case])
        assert out[case]["bytes_out"] < MiB, (case, out[case])
