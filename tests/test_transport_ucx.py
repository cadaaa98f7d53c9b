"""The ucx transport through a real server: forced by name, chosen by auto only with RDMA, dead peers noticed."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from rgpu.errors import ConnectionLost
from rgpu.transport import ucx
from transport_pairs import skip_reason

MiB = 1 << 20

RESOURCES = """#
#      resource 0  :  md 0  dev 0  flags -- self/memory
#      resource 1  :  md 1  dev 1  flags -- tcp/eth0
#      resource 2  :  md 2  dev 2  flags -- rc_verbs/mlx5_0:1
#      resource 3  :  md 2  dev 2  flags -- rc_mlx5/mlx5_0:1
#      resource 4  :  md 2  dev 2  flags -- dc_mlx5/mlx5_0:1
#      resource 5  :  md 2  dev 2  flags -- ud_verbs/mlx5_0:1
#      resource 6  :  md 3  dev 0  flags -- posix/memory
#      resource 7  :  md 4  dev 0  flags -- cma/memory
"""


def test_transports_are_read_from_a_ucx_resource_list():
    names = ucx.transports_of(RESOURCES)
    assert names == ["self", "tcp", "rc_verbs", "rc_mlx5", "dc_mlx5", "ud_verbs", "posix", "cma"]
    assert [n for n in names if n.split("_")[0] in ucx.RDMA_KINDS] == ["rc_verbs", "rc_mlx5", "dc_mlx5", "ud_verbs"]


needs_ucxx = pytest.mark.skipif(skip_reason("ucx") is not None, reason=str(skip_reason("ucx")))


@needs_ucxx
def test_forced_ucx_carries_frames_both_ways_into_caller_memory(rgpu_server):
    conn = rgpu_server.connect("echo", transport="ucx")
    assert conn.transport_name == "ucx"
    for n in (0, 100, 1 * MiB, 64 * MiB):
        src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
        dest = np.empty_like(src)
        reply = conn.call({"op": "echo"}, [src], reply_into=[memoryview(dest)], timeout=120)
        assert np.array_equal(dest, src)
        reply.release()
    for i in range(100):
        conn.post({"op": "note", "v": i}, [b"p" * (i * 100)])
    assert conn.call({"op": "notes"}).meta["notes"] == list(range(100))


@needs_ucxx
def test_auto_takes_ucx_only_where_both_ends_have_rdma(start_server):
    server = start_server(env={"RGPU_TRANSPORT": "ucx"})         # it offers tcp and ucx, not shm
    conn = server.connect("echo", transport="auto")
    assert conn.transport_name == ("ucx" if ucx.rdma_transports() else "tcp")
    assert conn.call({"op": "sizes"}, [b"xy"]).meta["sizes"] == [2]


@needs_ucxx
def test_a_killed_server_is_connection_lost_not_a_hang(start_server):
    server = start_server()
    conn = server.connect("echo", transport="ucx")
    assert conn.call({"op": "sizes"}, [b"x" * (2 * MiB)]).meta["sizes"] == [2 * MiB]
    os.kill(conn.welcome["info"]["pid"], signal.SIGKILL)
    with pytest.raises(ConnectionLost):
        conn.call({"op": "sizes"}, [b"after"], timeout=60)
