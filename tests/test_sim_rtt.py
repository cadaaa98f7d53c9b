"""RGPU_SIM_RTT_MS: a delay line that keeps order and makes a chain of posts plus one wait cost one round trip."""
from __future__ import annotations

import json

from device_helpers import run_python

from rgpu.transport.delay import DelayTransport, set_rtt


def test_the_delay_line_delivers_every_frame_in_order(rgpu_server):
    conn = rgpu_server.connect("echo", sim_rtt_ms=20)
    assert isinstance(conn.transport, DelayTransport) and conn.transport_name == conn.transport.inner.name
    for v in range(50):
        conn.post({"op": "note", "v": v})
    assert conn.call({"op": "notes"}).meta == {"notes": list(range(50))}


def test_a_chain_of_posts_and_one_wait_costs_one_round_trip(rgpu_server):
    conn = rgpu_server.connect("echo", sim_rtt_ms=30)
    before = dict(conn.stats)
    for v in range(20):
        conn.post({"op": "note", "v": v})
    conn.call({"op": "notes"})
    assert conn.stats["round_trips"] - before["round_trips"] == 1
    assert conn.stats["messages"] - before["messages"] == 21
    assert 1 <= conn.transport.delayed <= 21  # the posts went through the line, batched as the connection wrote them


def test_posted_buffers_may_change_once_post_returns_while_their_frames_wait(rgpu_server):
    conn = rgpu_server.connect("echo", sim_rtt_ms=30)
    data = bytearray(b"a" * 4096)
    fut = conn.request({"op": "echo"}, [data])
    data[:] = b"b" * 4096  # the frame is still in the line
    reply = fut.result()
    assert bytes(reply.buffers[0]) == b"a" * 4096
    reply.release()


def test_a_zero_delay_sends_directly_and_a_live_connection_can_switch(rgpu_server):
    conn = rgpu_server.connect("echo")
    assert not isinstance(conn.transport, DelayTransport)
    set_rtt(conn, 10)
    conn.call({"op": "notes"})
    line = conn.transport
    assert isinstance(line, DelayTransport) and line.delayed == 1
    set_rtt(conn, 0)
    conn.call({"op": "notes"})
    assert conn.transport is line and line.delayed == 1  # nothing queued: written on the caller's thread


def test_rgpu_sim_rtt_ms_puts_the_device_route_behind_the_line(rgpu_server):
    code = (
        "import json, torch, rgpu\n"
        "from rgpu.device_backend import session\n"
        "x = torch.ones(8).to('rgpu')\n"
        "rgpu.stats(reset=True)\n"
        "y = x\n"
        "for _ in range(30):\n"
        "    y = y * 1.5 + 1\n"
        "y.cpu()\n"
        "print(json.dumps({'line': type(session.current().conn.transport).__name__, **rgpu.stats()}))\n")
    r = run_python(code, env={"RGPU_SIM_RTT_MS": "20", "RGPU_SERVER": rgpu_server.address,
                              "RGPU_TOKEN": rgpu_server.token})
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["line"] == "DelayTransport" and got["round_trips"] == 1, got
