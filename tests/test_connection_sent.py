"""``Connection.call(sent=)``: the caller told once its request is written, before the answer is awaited, on every
path a call takes (the lone call's, request()'s), over tcp and shm; never for a call refused before sending."""
from __future__ import annotations

import time

import pytest

from test_connection import echo_conn  # noqa: F401 (the fixture: tcp, then shm)

from rgpu.errors import ProtocolError


def test_a_calls_sent_runs_once_its_request_is_out_before_the_answer_on_every_path(echo_conn):
    """The lone call's path, and request()'s when another request is pending (the CUDA route's client releases
    its order lock in sent())."""
    marks = []

    def sent():
        marks.append(time.monotonic())
    t0 = time.monotonic()
    echo_conn.call({"op": "sleep", "s": 0.2}, sent=sent).release()
    assert len(marks) == 1 and marks.pop() - t0 < 0.1
    pending = echo_conn.request({"op": "sleep", "s": 0.2})     # the lone call declines: request()'s path
    t0 = time.monotonic()
    echo_conn.call({"op": "sizes"}, sent=sent).release()
    assert len(marks) == 1 and marks.pop() - t0 < 0.1
    pending.result().release()
    with pytest.raises(ProtocolError, match="metadata"):
        echo_conn.call({"op": object()}, sent=sent)
    assert marks == []
