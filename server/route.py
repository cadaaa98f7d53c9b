"""The contract every route's executor fills; one executor per session, in its worker process."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Session:
    """What an executor knows of its session."""
    id: str
    route: str
    settings: Any                          # rgpu.config.Settings of the server
    options: dict = field(default_factory=dict)        # the client's HELLO options
    peer_versions: dict = field(default_factory=dict)  # the client's software versions


class OpFailed(Exception):
    """An executor's failure naming the call that failed (sent to the client as RemoteError)."""

    def __init__(self, op: str, message: str):
        super().__init__(message)
        self.op = op


class Executor:
    """One session's executor. ``handle`` runs each POST and REQUEST in order."""

    def __init__(self, session: Session):
        """Made by the worker when the session starts; an exception here refuses the session (its message
        sent to the client as the REFUSED reason)."""
        self.session = session

    def welcome(self) -> dict:
        """Sent to the client at the end of the handshake (device names, counts)."""
        return {}

    def handle(self, meta: Any, buffers: list[memoryview], reply: bool):
        """Run one call: ``meta`` (any msgpack value), ``buffers`` (valid only during the call), ``reply``
        (a REQUEST: an answer is due). Returns ``(meta, buffers)`` for a request (``None`` answers
        ``(None, [])``), None for a post. An exception becomes an ERROR frame (``OpFailed``'s ``op`` names
        the call; for a post, raised at the client's next wait) and the session goes on."""
        raise NotImplementedError

    def close(self) -> None:
        """Release everything the session held; called once, whatever ended the session."""


# The routes, each a folder or module of its own; the acceptor names them without importing them (no torch).
ROUTES = {"ops": "rgpu.server.ops.executor", "cuda": "rgpu.server.cuda.executor", "echo": "rgpu.server.echo"}


def available() -> set[str]:
    """The route names a client may ask for."""
    return set(ROUTES)


def executor_class(route: str):
    """The route's Executor class (imports the route)."""
    import importlib

    if route not in ROUTES:
        raise KeyError(f"unknown route {route!r}")
    return importlib.import_module(ROUTES[route]).Executor
