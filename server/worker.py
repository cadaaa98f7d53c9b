"""One session in its own process: receives the socket from the acceptor, runs the frame loop.

A worker is started ahead of need (``spare``), waits on its control socket for a
connection (passed with SCM_RIGHTS) and the session's details, then serves that
one session and exits: everything the session held goes with the process, and a
crash or a fatal device error ends this session and no other.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import socket
import sys
import threading
import traceback

import msgpack

from rgpu import config
from rgpu.errors import ConnectionLost, ProtocolError, RgpuError, VersionMismatch
from rgpu.transport import handshake, negotiate, tcp_streams_setup, tls
from rgpu.transport.resume_server import ResumableEnd, accept_tls_resume
from rgpu.transport.shm_native import SERVE_RAISED, SERVE_REPLY
from rgpu.transport.tcp import TcpTransport
from rgpu.transport.wire import BufferPool, Limits, MsgKind, as_bytes_view

from . import quotas, route, warmup
from .route import Session
from .stopping import REASON as STOPPING, Stopping, StopSignal

log = logging.getLogger("rgpu.server.worker")


# CUDA errors that leave the process's context unusable (sticky: every later call fails the same way): the
# session ends with a BYE naming it, once its client has the failed op's ERROR; other sessions' workers (their
# own processes and contexts) go on
FATAL_DEVICE = ("device-side assert triggered", "an illegal memory access was encountered", "unspecified launch failure",
                "misaligned address", "an illegal instruction was encountered")


class FatalDeviceError(Exception):
    """An op's CUDA error after which this session cannot go on (one of ``FATAL_DEVICE``)."""


def error_meta(exc: BaseException, seq: int) -> dict:
    op = getattr(exc, "op", None)
    return {"seq": seq, "op": op, "type": type(exc).__name__, "message": str(exc) or type(exc).__name__}


def serve_session(transport, session: Session, transports: list, resume: dict | None = None,
                  control: socket.socket | None = None, streams: tcp_streams_setup.ServerOffer | None = None) -> None:
    """Run one session to its end; never raises for what the client sent. ``resume`` (the acceptor's offer)
    and ``control`` (its socket, where resumed connections arrive): the session outlives a dropped tcp
    connection for the grace (``transport/resume_server.py``). ``streams``: extra tcp streams offered."""
    limits = Limits.from_settings(session.settings)
    pool = BufferPool()
    try:
        executor = route.executor_class(session.route)(session)
    except Exception as exc:
        handshake.refuse(transport, "route", f"cannot start the {session.route!r} route: {exc}")
        log.exception("route %s failed to start", session.route)
        if streams is not None:
            streams.cancel()
        return
    stop = StopSignal().install()   # SIGTERM (rgpu serve stops): the op running finishes, then a BYE says why
    try:
        extra = {"resume": {"id": resume["id"], "grace_s": resume["grace_s"]}} if resume and control else {}
        offered = {"streams": streams.details()} if streams is not None else {}
        handshake.welcome(transport, session.id, transports, executor.welcome(), **extra, **offered)
        if negotiate.expects_upgrade(transports):  # the client switches to shm / ucx or stays on tcp
            transport = negotiate.server_upgrade(transport, transports, session.settings)
        if streams is not None:   # still on tcp: the client's extra streams (transport/tcp_streams_setup.py)
            if transport.capabilities.resumable:
                transport = streams.attach(transport)
            else:
                streams.cancel()
        # waiting for the next op: tcp polls before it sleeps (RGPU_TCP_SPIN_US); shm and ucx wait their own way
        transport.tune_reads(session.settings.tcp_spin_us, session.settings.shm_c)
        if extra and transport.capabilities.resumable:
            transport = _resumable(transport, session, resume, control)
        if control is not None and not isinstance(transport, ResumableEnd):
            control.close()           # shm, ucx: a dropped peer ends the session, as it always has
        with _serving(executor):
            # an executor may own the receive buffers (the ops route on a GPU: pinned, DMA'd from where they land)
            _loop(transport, executor, session, limits, getattr(executor, "receive_pool", None) or pool, stop)
    except Stopping:
        _say_bye(transport, STOPPING, error="ServerStopping")
    except (ProtocolError, VersionMismatch) as exc:
        log.warning("session %s: %s; closing it", session.id, exc)
        _say_bye(transport, f"protocol error: {exc}", error=type(exc).__name__)
    except ConnectionLost:
        pass
    except FatalDeviceError as exc:
        log.warning("session %s: %s; ending it", session.id, exc)
        _say_bye(transport, f"a fatal CUDA error ended this session (the GPU's context of its worker is unusable; "
                 f"other sessions go on): {exc}", error="FatalDeviceError")
    except Exception as exc:  # a bug here ends this session with a reason, never silently
        log.exception("session %s failed", session.id)
        _say_bye(transport, f"internal error in the server: {type(exc).__name__}: {exc}")
    finally:
        try:
            executor.close()
        finally:
            transport.close()


def _resumable(transport, session: Session, resume: dict, control: socket.socket) -> ResumableEnd:
    """The session's tcp end, kept through a drop for the grace; a thread takes resumed connections."""
    theirs = session.options.get("replay_bytes")
    end = ResumableEnd(transport, session.id, resume["id"], float(resume["grace_s"]), int(resume["replay_bytes"]),
                       session.settings, theirs if isinstance(theirs, int) and theirs > 0 else None)

    def watch() -> None:
        while True:
            try:
                got = receive_session(control)
            except (OSError, ValueError):
                got = None
            if got is None:           # the acceptor closed it (it stops): no resume can come any more
                end.resumed.put((None, None))
                return
            if got[1].get("tls"):     # authenticated here, first (resume_server.py)
                got = accept_tls_resume(*got, resume, session.id, {session.route}, session.settings)
                if got is None:
                    continue
            end.interrupt()           # the client left the connection we hold: a read blocked on it wakes
            end.resumed.put(got)

    threading.Thread(target=watch, name="rgpu-resume", daemon=True).start()
    return end


def _serving(executor):
    """What an executor holds for its whole session loop (the ops route: torch's inference mode), if anything."""
    serving = getattr(executor, "serving", None)
    return serving() if serving is not None else contextlib.nullcontext()


_BYE, _POST, _REQUEST, _REPLY, _ERROR = MsgKind.BYE, MsgKind.POST, MsgKind.REQUEST, MsgKind.REPLY, MsgKind.ERROR


def _loop(transport, executor, session: Session, limits: Limits, pool: BufferPool, stop: StopSignal | None = None) -> None:
    """The frame loop: each POST and REQUEST through the executor in order, until BYE.

    Where the transport has a frame loop in C (``serve``: shm's), frames run there and come back here
    only when Python is needed: ``handle`` raised, an answer it cannot put, a frame it leaves to
    ``recv_frame`` (a BYE, heap buffers, anything malformed), or nothing to read (``recv_frame`` sleeps).
    ``stop``: SIGTERM ends the loop between frames, or at once while it waits for one (``Stopping``).
    """
    applied = 0
    handle, recv_frame, serve = executor.handle, transport.recv_frame, transport.serve
    stop = stop or StopSignal()
    in_flight = quotas.InFlight.of(session.settings)   # RGPU_MAX_FRAMES_IN_FLIGHT, counted here (not in C)
    if in_flight is not None:
        serve = None
    while True:
        if stop.requested:
            raise Stopping()
        if serve is not None:
            why, applied, detail = serve(handle, applied, limits)
            if why == SERVE_RAISED:
                _send_failure(transport, session, *detail, applied)
                continue
            if why == SERVE_REPLY:
                seq, result = detail
                _send_reply(transport, session, seq, result)
                continue
        stop.idle = True
        frame = recv_frame(limits, pool)
        stop.idle = False
        try:
            kind = frame.kind
            if kind == _BYE:
                break
            if kind != _POST and kind != _REQUEST:
                raise ProtocolError(f"kind: a client may not send {frame.kind.name} in a session")
            try:
                if in_flight is not None:
                    in_flight.note(kind == _REQUEST)
                result = handle(frame.meta, frame.buffers, kind == _REQUEST)
            except Exception as exc:
                _send_failure(transport, session, frame.seq, exc, applied)
                continue
            applied = frame.seq
            if kind == _REQUEST:
                _send_reply(transport, session, frame.seq, result)
        finally:
            frame.release()


def _send_reply(transport, session: Session, seq: int, result) -> None:
    """The answer to request ``seq`` (the last one applied), or its failure's when it cannot be sent."""
    try:
        meta, bufs = result if result is not None else (None, [])
        try:  # a reply that cannot be encoded is the executor's failure, not the client's
            parts = transport.frame_parts(_REPLY, seq, seq, meta, [as_bytes_view(b) for b in bufs])
        except (ProtocolError, TypeError) as exc:
            raise RuntimeError(f"the reply cannot be sent: {exc}") from None
        transport.send(parts)
    except Exception as exc:
        _send_failure(transport, session, seq, exc, seq)


def _send_failure(transport, session: Session, seq: int, exc: BaseException, applied: int) -> None:
    """An ERROR for frame ``seq``: the op failed, the session goes on (a lost connection or a protocol
    error ends it, as does anything that is not an Exception)."""
    if isinstance(exc, (ConnectionLost, ProtocolError, VersionMismatch)) or not isinstance(exc, Exception):
        raise exc
    if session.settings.debug and not isinstance(exc, RgpuError):
        log.debug("op failed:\n%s", "".join(traceback.format_exception(exc)))
    transport.send(transport.frame_parts(_ERROR, seq, applied, error_meta(exc, seq), []))
    text = str(exc)
    if any(m in text for m in FATAL_DEVICE):
        raise FatalDeviceError(f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}")


def _say_bye(transport, reason: str, error: str | None = None) -> None:
    try:
        transport.send(transport.frame_parts(MsgKind.BYE, 0, 0, {"reason": reason, "error": error}, []))
    except RgpuError:
        pass


def receive_session(control: socket.socket):
    """Wait for the acceptor: (connected socket, session details) or None when it closes."""
    msg, fds, _, _ = socket.recv_fds(control, 1 << 20, 1)
    if not fds:
        return None
    details = msgpack.unpackb(msg, raw=False)
    sock = socket.socket(fileno=fds[0])
    return sock, details


def run_session(sock: socket.socket, d: dict, control: socket.socket | None = None) -> None:
    """Authenticate the connection handed over by the acceptor, then serve it (``control``: where resumed
    connections arrive, when the acceptor offered a resume)."""
    s = config.settings(**d.get("overrides", {}))
    logging.basicConfig(level=logging.DEBUG if s.debug else logging.WARNING, format="rgpu worker: %(message)s")
    if d.get("hello") is not None:  # the acceptor authenticated it (server/gate.py); WELCOME is ours to send
        h = d["hello"]
        hello = handshake.Hello(route=h["route"], session=h["session"], versions=h["versions"],
                                transports=h["transports"], options=h["options"])
        serve_session(TcpTransport(sock), Session(id=hello.session, route=hello.route, settings=s,
                                                  options=hello.options, peer_versions=hello.versions),
                      negotiate.server_offer(hello.transports, s), d.get("resume"), control,
                      tcp_streams_setup.ServerOffer.make(sock, hello, s, d["token"].encode(), None))
        return
    sock.settimeout(d.get("deadline_s", s.connect_timeout))  # a client that stalls in the handshake is dropped
    try:
        sock = tls.accept(sock, d.get("tls"))  # TLS state cannot cross processes: the worker does the TLS handshake
    except RgpuError as exc:  # a bare connect-and-close (a port check) is not worth a warning
        say = log.debug if isinstance(exc, ConnectionLost) else log.warning
        say("connection from %s refused: %s", d.get("peer"), exc)
        sock.close()
        return
    transport = TcpTransport(sock)
    try:
        hello = handshake.server_handshake(transport, d["token"].encode(), Limits.from_settings(s), route.available())
    except RgpuError as exc:
        if isinstance(exc, ProtocolError):
            handshake.refuse(transport, "protocol", str(exc))
        log.warning("handshake from %s refused: %s", d.get("peer"), exc)
        transport.close()
        return
    sock.settimeout(None)
    session = Session(id=hello.session, route=hello.route, settings=s, options=hello.options,
                      peer_versions=hello.versions)
    # a resumable TLS session: its resumed connections come raw, and their TLS handshake and proof happen here
    resume = ({**d["resume"], "tls": d.get("tls"), "token": d["token"]}
              if d.get("resume") and hello.options.get("resumable") is True else None)
    serve_session(transport, session, negotiate.server_offer(hello.transports, s), resume, control,
                  tcp_streams_setup.ServerOffer.make(sock, hello, s, d["token"].encode(), d.get("tls")))


def describe_device(s) -> str:
    """What this server's ops run on, in words (``rgpu serve`` prints it once)."""
    from rgpu.server.ops.executor import pick_devices

    try:
        kind, devices, names = pick_devices(s)
    except Exception as exc:
        return f"no device: {exc}"
    if kind == "cuda":
        return f"cuda: {len(names)} GPU{'s' if len(names) > 1 else ''} ({', '.join(sorted(set(names)))})"
    if s.device == "auto":
        return ("the CPU: --device auto found no usable CUDA device here (torch.cuda.is_available() is False); "
                "--device cuda insists on a GPU")
    return f"the CPU (--device cpu, {len(devices)} device{'s' if len(devices) > 1 else ''})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="rgpu-worker")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--preload", default="")
    parser.add_argument("--overrides", default="{}", help="the server's settings overrides, as JSON")
    args = parser.parse_args(argv)
    control = socket.socket(fileno=args.control_fd)
    for name in filter(None, args.preload.split(",")):
        try:
            __import__(name)  # warm the spare before a session needs it (torch takes seconds)
        except ImportError:
            pass
    s = config.settings(**json.loads(args.overrides))
    # the shm copy's compile (numba, a second or more) happens here, while no session waits: in a
    # background thread during a session it would hold the GIL against every call (5 ms a switch)
    from rgpu.transport import fastcopy, shm_fast
    fastcopy.warm_up()
    shm_fast.load(s.shm_c)   # shm's C path: built once per machine, loaded here, not mid-handshake
    device = None
    if "torch" in sys.modules:   # preloaded: the ops route's C++ op path built now, before a session waits on it
        from rgpu.server.ops import fast_op

        fast_op.load(s.server_c)
        device = describe_device(s)
    try:
        control.send(warmup.ready_message(device))   # warm: the acceptor hands this worker the next connection
    except OSError:
        return 0
    got = receive_session(control)
    if got is not None and got[1].get("resume"):
        run_session(*got, control)    # the control socket stays: resumed connections come through it
        return 0
    control.close()
    if got is not None:
        run_session(*got)
    return 0


if __name__ == "__main__":
    sys.exit(main())
