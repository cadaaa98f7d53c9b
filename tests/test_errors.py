"""One error family: its tree, the OSError translation, and every failure path mapped into it."""
from __future__ import annotations

import errno
import socket

import pytest

import rgpu
from rgpu import config, errors
from rgpu.errors import (
    AuthenticationError, ConfigError, ConnectError, ConnectionLost, ProtocolError, RemoteError, RgpuError, SessionLost,
    Timeout, VersionMismatch, translate_os_error,
)
from rgpu.transport import tcp, wire
from rgpu.transport.client import connect
from rgpu.transport.wire import HEADER, MAGIC, PROTOCOL_VERSION


FAMILY = [ConnectError, AuthenticationError, VersionMismatch, ProtocolError, ConnectionLost, SessionLost, Timeout,
          RemoteError, ConfigError]


@pytest.mark.parametrize("cls", FAMILY, ids=lambda c: c.__name__)
def test_every_error_is_an_rgpu_error_drawn_in_the_tree_and_exported(cls):
    assert issubclass(cls, RgpuError)
    assert f"── {cls.__name__}" in errors.__doc__
    assert getattr(rgpu, cls.__name__) is cls


def test_a_session_lost_is_a_connection_lost():
    assert issubclass(SessionLost, ConnectionLost)


def test_a_remote_error_names_the_op_and_the_remote_type():
    exc = RemoteError("boom", op="aten::add", remote_type="RuntimeError")
    assert str(exc) == "aten::add: boom" and exc.op == "aten::add" and exc.remote_type == "RuntimeError"


OS_ERRORS = [
    (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), {}, ConnectError),
    (socket.gaierror(-2, "Name or service not known"), {}, ConnectError),
    (socket.timeout("timed out"), {"connecting": True}, ConnectError),
    (OSError(errno.EHOSTUNREACH, "no route"), {"connecting": True}, ConnectError),
    (socket.timeout("timed out"), {}, Timeout),
    (TimeoutError(), {}, Timeout),
    # the kernel gave the peer up (keepalive, TCP_USER_TIMEOUT): a lost connection, which a session resumes
    (OSError(errno.ETIMEDOUT, "Connection timed out"), {}, ConnectionLost),
    (ConnectionResetError(errno.ECONNRESET, "reset"), {}, ConnectionLost),
    (BrokenPipeError(errno.EPIPE, "pipe"), {}, ConnectionLost),
    (OSError(errno.EBADF, "bad fd"), {}, ConnectionLost),
    (OSError(errno.ENOTCONN, "not connected"), {}, ConnectionLost),
    (OSError(errno.EIO, "i/o"), {}, ConnectionLost),
    (ValueError("x"), {}, RgpuError),
]


@pytest.mark.parametrize("exc, kw, expected", OS_ERRORS, ids=lambda v: type(v).__name__ if isinstance(v, BaseException)
                         else None)
def test_each_os_error_translates_to_the_error_a_caller_can_act_on(exc, kw, expected):
    out = translate_os_error(exc, where="here", **kw)
    assert type(out) is expected and "here" in str(out)


def test_an_rgpu_error_passes_translation_unchanged():
    exc = Timeout("t")
    assert translate_os_error(exc) is exc


# ---- every path, end to end -------------------------------------------------------------------------

def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _nothing_listens(server, _):
    connect("echo", settings=server.settings(), server=f"127.0.0.1:{_free_port()}")


def _dns_fails(server, _):
    connect("echo", settings=server.settings(), server="no-such-host.invalid:9713")


def _server_busy(_, start_server):
    busy = start_server("--max-sessions", "1")
    busy.connect("echo")
    busy.connect("echo")


def _wrong_token(server, _):
    connect("echo", settings=server.settings(), token="wrong")


def _no_token_anywhere(server, _):
    s = config.settings(environ={"RGPU_TOKEN_FILE": "/nonexistent/rgpu/token"}, server=server.address)
    connect("echo", settings=s)


def _empty_token_file(server, start_server):
    path = start_server().workdir / "empty-token"
    path.write_text("")
    connect("echo", settings=config.settings(environ={"RGPU_TOKEN_FILE": str(path)}, server=server.address))


def _other_protocol(server, _):
    real = wire.PROTOCOL_VERSION
    wire.PROTOCOL_VERSION = real + 1
    try:
        connect("echo", settings=server.settings())
    finally:
        wire.PROTOCOL_VERSION = real


def _malformed_frame(server, _):
    conn = server.connect("echo")
    conn.transport.send([HEADER.pack(MAGIC, PROTOCOL_VERSION, 200, 0, 1, 0, 0, 0)])
    conn.call({"op": "sizes"}, timeout=10)


def _unencodable_metadata(server, _):
    server.connect("echo").post({"op": object()})


def _worker_crashes(server, _):
    server.connect("echo").call({"op": "crash"}, timeout=30)


def _call_after_close(server, _):
    conn = server.connect("echo")
    conn.close()
    conn.post({"op": "sizes"})


def _no_answer_in_time(server, _):
    server.connect("echo", request_timeout=0.2).call({"op": "sleep", "s": 1})


def _op_fails(server, _):
    server.connect("echo").call({"op": "fail"})


def _unknown_route(server, _):
    connect("no-such-route", settings=server.settings())


def _bad_setting(server, _):
    config.settings(environ={"RGPU_PORT": "ninety"})


def _port_in_use(server, _):
    tcp.listen("127.0.0.1", server.port)


PATHS = {
    "nothing listens": (_nothing_listens, ConnectError),
    "the host name does not resolve": (_dns_fails, ConnectError),
    "the server runs its limit of sessions": (_server_busy, ConnectError),
    "a wrong token": (_wrong_token, AuthenticationError),
    "no token anywhere": (_no_token_anywhere, AuthenticationError),
    "an empty token file": (_empty_token_file, ConfigError),
    "another protocol version": (_other_protocol, VersionMismatch),
    "a malformed frame": (_malformed_frame, ProtocolError),
    "metadata msgpack cannot encode": (_unencodable_metadata, ProtocolError),
    "the worker crashes": (_worker_crashes, ConnectionLost),
    "a call after close": (_call_after_close, ConnectionLost),
    "no answer in time": (_no_answer_in_time, Timeout),
    "the op fails on the server": (_op_fails, RemoteError),
    "an unknown route": (_unknown_route, RemoteError),
    "a setting rgpu cannot use": (_bad_setting, ConfigError),
    "the port is taken": (_port_in_use, ConfigError),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_every_failure_path_raises_its_rgpu_error_and_never_a_bare_os_error(rgpu_server, start_server, path):
    fn, expected = PATHS[path]
    with pytest.raises(RgpuError) as info:
        fn(rgpu_server, start_server)
    assert isinstance(info.value, expected), f"{path}: got {type(info.value).__name__}: {info.value}"
    assert str(info.value)
