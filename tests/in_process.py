"""One server session on a thread of the test's process: ``worker.serve_session`` with a test executor.

    with session_on_a_thread(monkeypatch, Recording) as (client, thread):
        client.send([encode_frame(MsgKind.REQUEST, 1, "ok")])     # the WELCOME is already read

The client end is a plain ``TcpTransport``; on leaving, it is closed and the worker must have ended.
"""
from __future__ import annotations

import contextlib
import threading

from rgpu import config
from rgpu.server import worker
from rgpu.server.route import Session
from rgpu.transport import tcp
from rgpu.transport.tcp import TcpTransport
from rgpu.transport.wire import BufferPool, Limits, MsgKind


@contextlib.contextmanager
def session_on_a_thread(monkeypatch, executor_class):
    monkeypatch.setattr(worker.route, "executor_class", lambda route: executor_class)
    listener = tcp.listen("127.0.0.1", 0)
    client = TcpTransport(tcp.connect("127.0.0.1", listener.getsockname()[1], 10))
    server_sock, _ = listener.accept()
    listener.close()
    session = Session(id="s", route="test", settings=config.settings(environ={}))
    t = threading.Thread(target=worker.serve_session, args=(TcpTransport(server_sock), session, ["tcp"]), daemon=True)
    t.start()
    try:
        assert client.recv_frame(Limits(), BufferPool()).kind == MsgKind.WELCOME
        yield client, t
    finally:
        client.close()
        t.join(10)
    assert not t.is_alive()
