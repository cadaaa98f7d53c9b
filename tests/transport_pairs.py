"""Connected pairs of transports in one process, for the contract and per-transport tests.

    with pair("shm") as (client, server): ...     # each end a Transport; both closed after

tcp: a loopback TCP connection; tcp-streams: four of them as one (tcp_streams.py), frames of 64 KiB or more
striped. shm: the server's offer and the client's attach
(on a thread, as they would be two processes), with the C path (shm_fast.c) where it
builds; shm-py: both ends on the Python path; shm-mixed: the client in C, the server in
Python (the records are the same). ucx: two UCXX workers joined by
worker addresses, each with a tcp carrier as in a real session.
"""
from __future__ import annotations

import importlib.util
import socket
import threading
from contextlib import contextmanager

from rgpu.transport.tcp import TcpTransport, tune

NAMES = ("tcp", "tcp-streams", "shm", "shm-py", "shm-mixed", "ucx")


def skip_reason(name: str) -> str | None:
    if name == "ucx" and importlib.util.find_spec("ucxx") is None:
        return "UCXX is not installed (pip install 'rgpu[ucx]', i.e. ucxx-cu12==0.52.*)"
    if name.startswith("shm"):
        from rgpu.transport import shm, shm_fast
        return shm.available() or (None if name == "shm-py" or shm_fast.load() else
                                   f"shm's C path did not build: {shm_fast.why_not()}")
    return None


def tcp_pair() -> tuple[TcpTransport, TcpTransport]:
    listener = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    listener.close()
    for s in (a, b):
        tune(s)
    return TcpTransport(a), TcpTransport(b)


def tcp_streams_pair(streams: int = 4, stripe_bytes: int = 64 << 10):
    from rgpu.transport.tcp_streams import StripedTcp

    main, *extra = [tcp_pair() for _ in range(streams)]
    return tuple(StripedTcp(main[i], [e[i].sock for e in extra], stripe_bytes) for i in (0, 1))


def shm_pair(client_c: bool = True, server_c: bool = True):
    from rgpu.transport import shm_setup

    offer = shm_setup.ShmOffer()
    got = {}
    th = threading.Thread(target=lambda: got.update(pair=shm_setup.attach(offer.details(), 10, client_c)))
    th.start()
    offer.accept(10)
    th.join()
    client, nonce = got["pair"]
    assert offer.proven(nonce)
    return client, offer.transport(server_c)


def ucx_pair():
    from rgpu.transport import ucx

    carrier_c, carrier_s = tcp_pair()
    client, server = ucx.UcxTransport(carrier_c), ucx.UcxTransport(carrier_s)
    client.connect(server.address)
    server.connect(client.address)
    return client, server


@contextmanager
def pair(name: str):
    client, server = {"tcp": tcp_pair, "tcp-streams": tcp_streams_pair, "shm": shm_pair, "shm-py": lambda: shm_pair(False, False),
                      "shm-mixed": lambda: shm_pair(True, False), "ucx": ucx_pair}[name]()
    try:
        yield client, server
    finally:
        client.close()
        server.close()
