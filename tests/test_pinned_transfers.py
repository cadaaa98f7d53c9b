"""Pinned host memory is shared memory: over shm it uploads by name with no copy, and downloads land in place.

Big downloads into ordinary memory go through two pinned stages the server fills while we copy out.
"""
from __future__ import annotations

import json

import pytest

from device_helpers import run_python

# Each case runs in its own interpreter: the device session (and its transport) is process-wide.
SCRIPT = r"""
import json, torch, rgpu
from rgpu.device_backend import session, transfers
torch.ones(1, device="rgpu")
s = session.current()
t = s.conn.transport
heap = getattr(getattr(t, "writer", None), "heap", None)   # shm's sender heap (tcp has none)
out = {"transport": s.conn.transport_name}

x = torch.arange(1 << 20, dtype=torch.float32).pin_memory()          # 4 MiB: a shared block
region = s.C.pinned_region(x.data_ptr())
out["region"] = [region[2], region[1] <= x[7:].data_ptr() < region[1] + region[2]] if region else None
out["small_region"] = s.C.pinned_region(torch.arange(8.0).pin_memory().data_ptr())
out["pinned"] = [x.is_pinned(), x[7:].is_pinned(), torch.arange(8.0).pin_memory().is_pinned()]
heap_before = heap.total if heap else None

y = x.to("rgpu")                      # blocking: returns once the device has the bytes
x.add_(1)                             # so this change never reaches y
out["blocking_kept"] = torch.equal(y.cpu(), torch.arange(1 << 20, dtype=torch.float32))
z = torch.empty(1 << 20, device="rgpu")
z.copy_(x, non_blocking=True)
torch.rgpu.synchronize()
out["non_blocking"] = torch.equal(z.cpu(), x)
part = torch.empty(100_000, device="rgpu")
part.copy_(x[1000:101_000])           # a slice inside the block
out["slice"] = torch.equal(part.cpu(), x[1000:101_000])

base = x.data_ptr()
del x
again = torch.empty(1 << 20, pin_memory=True)       # the freed block comes back from the cache
again.fill_(3.0)
w = again.to("rgpu")
out["reused"] = again.data_ptr() == base
out["after_reuse"] = bool((w.cpu() == 3.0).all())
loader = torch.utils.data.DataLoader(torch.arange(4 * 131072.0).view(4, 131072), batch_size=2, pin_memory=True)
out["loader"] = all(torch.equal(b.to("rgpu").cpu(), b) and b.is_pinned() for b in loader)
out["heap_grew"] = (heap.total - heap_before) if heap else None          # (what follows uploads ordinary memory)
src = torch.arange(3 << 20, dtype=torch.float32).to("rgpu")            # 12 MiB
named = getattr(t, "shared_bytes", 0)
into = torch.empty(3 << 20, pin_memory=True)
into.copy_(src)                                                        # into pinned memory: written in place
out["download_pinned"] = [torch.equal(into, torch.arange(3 << 20, dtype=torch.float32)),
                          getattr(t, "shared_bytes", 0) - named]
transfers.SHARED_PIECE_BYTES, transfers.STAGED_DOWNLOAD_BYTES = 2 << 20, 1 << 20   # small pieces: several stages
got = []
for n in ((15 << 20) // 8, (13 << 20) // 8, 1 << 17, 1000):          # 7.5 MiB: 4 pieces; 6.5: tail joins; small
    want = torch.arange(n, dtype=torch.float64)
    got.append(torch.equal(want.to("rgpu").cpu(), want))
out["download_staged"] = got
out["stages"] = [st.nbytes for st in (s.transfers._stages or [])]
out["shared_bytes"] = getattr(t, "shared_bytes", 0)
out["shared_regions"] = getattr(t, "shared_regions", 0)
print(json.dumps(out))
"""


def _run(server, transport: str) -> dict:
    r = run_python(SCRIPT, env={"RGPU_SERVER": server.address, "RGPU_TOKEN": server.token,
                                "RGPU_TRANSPORT": transport})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_over_shm_pinned_memory_moves_by_name_and_big_downloads_pass_through_pinned_stages(rgpu_server):
    out = _run(rgpu_server, "shm")
    assert out["transport"] == "shm"
    assert out["region"] == [4 << 20, True]          # rounded to a power of two; any address inside it counts
    assert out["small_region"] == [] and out["pinned"] == [True, True, True]
    assert out["blocking_kept"] and out["non_blocking"] and out["slice"]
    assert out["reused"] and out["after_reuse"] and out["loader"]
    assert out["download_pinned"] == [True, 12 << 20]
    assert out["download_staged"] == [True] * 4 and out["stages"] == [3 << 20] * 2
    assert out["shared_regions"] >= 3                 # the 4 MiB block (reused: mapped once), the loader's, ...
    assert out["heap_grew"] == 0                       # nothing went through the copy heap


@pytest.mark.parametrize("transport", ["tcp"])
def test_pinned_memory_moves_as_plain_memory_where_the_server_cannot_map_it(rgpu_server, transport):
    out = _run(rgpu_server, transport)
    assert out["transport"] == transport and out["shared_bytes"] == 0 and out["stages"] == []
    assert out["blocking_kept"] and out["non_blocking"] and out["slice"] and out["reused"] and out["loader"]
    assert out["download_pinned"][0] and out["download_staged"] == [True] * 4


REUSE = r"""
import json, torch, rgpu
a = torch.randn(1500, 1500).to("rgpu")
for _ in range(6):
    a = a @ a / 1500                                  # the server is busy for a while: the upload waits
x = torch.ones(1 << 20).pin_memory()
base = x.data_ptr()
d = x.to("rgpu", non_blocking=True)                   # named, not copied; not yet read by the server
del x                                                 # its block may not come back to the allocator yet
y = torch.empty(1 << 20).pin_memory()
y.fill_(7.0)                                          # were it the same block, this would reach d
torch.rgpu.synchronize()
print(json.dumps({"same_block": y.data_ptr() == base, "kept": bool((d.cpu() == 1.0).all())}))
"""


def test_a_pinned_block_is_not_reused_while_a_non_blocking_upload_still_names_it(rgpu_server):
    r = run_python(REUSE, env={"RGPU_SERVER": rgpu_server.address, "RGPU_TOKEN": rgpu_server.token,
                               "RGPU_TRANSPORT": "shm"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"same_block": False, "kept": True}
