"""Which of rgpu's Python files one steady-state ``torch.add`` and its ``.cpu()`` run, client and server alike.

    python tests/walkthrough_trace.py            # prints one JSON object (RGPU_NATIVE=off: the Python paths)

A plain tcp session as ``rgpu serve`` gives one (the handshake, the resume offer, the ops route's
executor on the CPU) with the worker's ``serve_session`` on a thread of this process, so one profiler
(``sys.setprofile`` and ``threading.setprofile``) sees the client's threads and the server's. The add
and the download are recorded after three warm rounds: the signature's plan is learnt, the op defined.
``tests/test_walkthrough.py`` holds ``docs/walkthrough.md`` to what this prints.
"""
from __future__ import annotations

import json
import socket
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "walkthrough-token-0123456789abcdef"

seen: set[str] = set()
recording = False


def _profile(frame, event, arg) -> None:
    if recording:   # every event, not only calls: a frame already running (the worker's loop) counts too
        seen.add(frame.f_code.co_filename)


def _ours(filename: str) -> str | None:
    """``filename`` as a path in the tree when it is one of rgpu's Python files (not a test's), else None."""
    path = Path(filename).resolve()
    if path.suffix != ".py" or not path.is_file() or not path.is_relative_to(ROOT):
        return None
    rel = path.relative_to(ROOT)
    return None if rel.parts[0] == "tests" else rel.as_posix()


def _serve(listener: socket.socket, settings) -> None:
    """What the acceptor and a worker do for one plain tcp session, on this thread."""
    from rgpu.server import worker
    from rgpu.server.route import Session
    from rgpu.transport import handshake, negotiate
    from rgpu.transport.tcp import TcpTransport
    from rgpu.transport.wire import Limits

    sock, _ = listener.accept()
    listener.close()
    t = TcpTransport(sock)
    hello = handshake.server_handshake(t, TOKEN.encode(), Limits.from_settings(settings), {"ops"})
    control, _acceptor = socket.socketpair()   # where resumed connections would arrive (none does)
    resume = {"id": "walkthrough", "grace_s": settings.session_grace, "replay_bytes": settings.replay_bytes}
    session = Session(id=hello.session, route="ops", settings=settings, options=hello.options,
                      peer_versions=hello.versions)
    worker.serve_session(t, session, negotiate.server_offer(hello.transports, settings), resume, control)


def main() -> None:
    global recording
    threading.setprofile(_profile)   # before any thread of the session starts
    sys.setprofile(_profile)
    import torch

    import rgpu  # noqa: F401  (registers the device)
    from rgpu import config
    from rgpu.device_backend import session, startup
    from rgpu.transport import tcp
    from rgpu.transport.client import connect

    here = config.settings()   # RGPU_NATIVE as this process was given it, for both ends
    server_settings = config.settings(environ={}, device="cpu", server_c=here.server_c)
    listener = tcp.listen("127.0.0.1", 0)
    port = listener.getsockname()[1]
    threading.Thread(target=_serve, args=(listener, server_settings), daemon=True).start()
    conn = connect("ops", settings=here.with_(server=f"127.0.0.1:{port}", token=TOKEN, transport="tcp", tcp_streams=1))
    startup.use(conn)
    C = session.current().C
    a_cpu, b_cpu = torch.arange(6, dtype=torch.float32), torch.full((6,), 0.5)
    a, b = a_cpu.to("rgpu"), b_cpu.to("rgpu")
    for _ in range(3):   # the first add goes through Python and teaches C++ its plan
        torch.add(a, b).cpu()
    hits = C.fast_path_stats()["hits"]
    recording = True
    c = torch.add(a, b)
    out = c.cpu()
    recording = False
    sys.setprofile(None)
    threading.setprofile(None)
    files = sorted(filter(None, map(_ours, seen)))
    print(json.dumps({"files": files, "out": out.tolist(), "expected": torch.add(a_cpu, b_cpu).tolist(),
                      "fast_path_hits": C.fast_path_stats()["hits"] - hits, "op_path": conn.welcome["info"]["op_path"],
                      "transport": type(conn.transport).__name__}))
    conn.close()


if __name__ == "__main__":
    main()
