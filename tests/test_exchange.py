"""One owner for the state a connection's lone call touches (transport/exchange.py, shm_lone.c).

The exchange state and shm's ring ends have a Python class and, over shm's C path, a C type with the
same face; a connection's counters are a view of that state; and no C file of the transport reaches
into a Python object's private attributes or instance dict.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from rgpu import config
from rgpu.transport import shm, shm_fast
from rgpu.transport.connection import Connection
from rgpu.transport.exchange import STATS, Counts, Exchange
from rgpu.transport.shm_ring import Ends
from transport_pairs import shm_pair

TRANSPORT = Path(__file__).resolve().parent.parent / "transport"
FIELDS = ("reading", "waiters", "sending_seq", "dead", "async_error", *STATS)
native = pytest.mark.skipif(shm.available() is not None or shm_fast.load() is None,
                            reason=str(shm.available() or f"shm's C path: {shm_fast.why_not()}"))


def face(state) -> dict:
    return {name: getattr(state, name) for name in FIELDS}


def test_the_python_exchange_starts_empty_and_counts_from_one():
    x = Exchange()
    assert face(x) == {"reading": False, "waiters": 0, "sending_seq": 0, "dead": None, "async_error": None,
                       "messages": 0, "round_trips": 0, "bytes_out": 0, "bytes_in": 0}
    assert [x.next_seq() for _ in range(3)] == [1, 2, 3]


@native
def test_the_c_lone_call_has_the_python_exchanges_face_and_keeps_what_it_is_given():
    client, server = shm_pair()
    try:
        conn = Connection(client, config.settings(environ={}))
        x = conn._x
        assert type(x).__name__ == "LoneCall" and x is conn._lone
        assert face(x) == face(Exchange())
        err = ConnectionError("gone")
        x.dead, x.async_error, x.reading, x.waiters, x.bytes_in = err, (3, err), True, 2, 5
        assert (x.dead, x.async_error, x.reading, x.waiters, x.bytes_in) == (err, (3, err), True, 2, 5)
        x.dead = x.async_error = None
        x.reading, x.waiters = False, 0
        assert [x.next_seq() for _ in range(3)] == [1, 2, 3]
        with pytest.raises(TypeError):
            x.reading = 1                      # a bool, as the Python twin's users write it
    finally:
        client.close()
        server.close()


@native
def test_shm_keeps_its_ends_in_one_object_c_or_python_alike():
    for use_c in (True, False):
        client, server = shm_pair(use_c, use_c)
        try:
            ends = client._ends
            assert (type(ends) is Ends) is (not use_c)
            assert (ends.tail, ends.head, ends.closed, ends.shared_until) == (client._tail, client._head, False, 0.0)
            client.send(client.frame_parts(2, 1, 0, {"a": 1}, []))
            assert ends.tail == client._tail > 0
        finally:
            client.close()
            server.close()
        assert ends.closed


def test_stats_is_a_view_of_the_counters_that_can_be_adjusted_in_place():
    x = Exchange()
    stats = Counts(x)
    x.messages, x.bytes_out = 2, 100
    assert stats == {"messages": 2, "round_trips": 0, "bytes_out": 100, "bytes_in": 0} and len(stats) == 4
    stats["bytes_out"] -= 40                   # device_backend/transfers.py's correction of a download
    stats["bytes_in"] += 40
    assert (x.bytes_out, x.bytes_in) == (60, 40) and dict(stats)["bytes_in"] == 40
    with pytest.raises(KeyError, match="'posts'"):
        stats["posts"] = 1
    with pytest.raises(KeyError):
        stats["posts"]


def test_no_c_file_of_the_transport_reads_a_python_objects_private_names_or_instance_dict():
    for path in sorted(TRANSPORT.glob("*.c")):
        text = path.read_text()
        assert "GenericGetDict" not in text and "tp_dictoffset" not in text, path.name
        private = re.findall(r'"(_(?!rgpu_)[a-z]\w*)"', text)    # a private name looked up by its string (not a module)
        assert not private, f"{path.name} names {private}"
