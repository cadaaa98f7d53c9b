"""TLS's big reads in C (transport/tls_fast.py): the bytes a Python SSLSocket would read, in one call,
and Python's behaviour wherever the C read stops (a socket with a timeout, the peer gone mid-buffer)."""
from __future__ import annotations

import os
import socket
import ssl
import threading

import pytest

from test_tls import write_pair
from rgpu.transport import shm_fast, tls_fast

pytestmark = pytest.mark.skipif(shm_fast.load() is None, reason=f"no C path here: {shm_fast.why_not()}")


@pytest.fixture(scope="module")
def contexts(tmp_path_factory):
    _, _, cert, key = write_pair(tmp_path_factory.mktemp("tls"), "server")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    return server, client


@pytest.fixture
def pair(contexts):
    listener = socket.create_server(("127.0.0.1", 0))
    plain = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    listener.close()
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("s", contexts[0].wrap_socket(accepted, server_side=True)))
    t.start()
    client = contexts[1].wrap_socket(plain)
    t.join()
    yield client, done["s"]
    client.close()
    done["s"].close()


def _send_in_background(sock, data: bytes, close_after: bool = False) -> threading.Thread:
    def send():
        sock.sendall(data)
        if close_after:               # a FIN (a close with the session ticket unread would be a reset)
            sock.shutdown(socket.SHUT_WR)
    t = threading.Thread(target=send)
    t.start()
    return t


def test_a_whole_buffer_of_many_records_arrives_byte_exact_in_one_call(pair):
    client, server = pair
    data = os.urandom((3 << 20) + 12345)        # ~200 records, the last one short
    read = tls_fast.exact_reader(server)
    assert read is not None
    sender = _send_in_background(client, data)
    dest = memoryview(bytearray(len(data)))
    assert read(dest) == len(data)
    sender.join()
    assert dest.tobytes() == data


def test_a_socket_with_a_timeout_still_gets_every_byte(pair):
    client, server = pair
    server.settimeout(5.0)                       # non-blocking underneath: SSL_read_ex would block, Python waits
    read = tls_fast.exact_reader(server)
    data = os.urandom(1 << 20)
    dest = memoryview(bytearray(len(data)))

    def slow_sender():
        for i in range(0, len(data), 100_000):
            client.sendall(data[i:i + 100_000])
            threading.Event().wait(0.01)
    t = threading.Thread(target=slow_sender)
    t.start()
    assert read(dest) == len(data)
    t.join()
    assert dest.tobytes() == data


def test_a_peer_gone_mid_buffer_reads_as_the_end_with_what_came(pair):
    client, server = pair
    read = tls_fast.exact_reader(server)
    sender = _send_in_background(client, b"x" * 50_000, close_after=True)
    dest = memoryview(bytearray(100_000))
    got = read(dest)
    sender.join()
    assert got == 50_000 and dest[:got].tobytes() == b"x" * 50_000


def test_what_is_not_a_tls_socket_of_this_python_gets_no_c_read(pair):
    plain = socket.socket()
    try:
        assert tls_fast.exact_reader(plain) is None
    finally:
        plain.close()
    assert tls_fast.exact_reader(pair[1], use_c=False) is None
