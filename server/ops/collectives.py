"""Collectives on the servers: this session's part in a process group formed by the sessions of several servers.

The client's torch.distributed backend (``rgpu/distributed.py``) posts each collective in
stream order; here it runs on this session's tensors through torch's own engine, gloo on
the CPU executor and NCCL on GPUs, so gradients never cross a client. The group forms
through a rendezvous store that rank 0's server opens (``GROUP_STORE``); the clients pass
its address to the other ranks through their own store, and each rank's session joins
(``GROUP_JOIN``). A collective that fails (a peer server gone, a timeout) poisons what it
would write, says which rank's server does not answer, and breaks its group: later
collectives on it fail at once, naming the first failure, instead of waiting again.
"""
from __future__ import annotations

import datetime
import os
import socket
import time

import torch
import torch.distributed as dist

from rgpu.protocol.ops import Msg
from rgpu.server.ops.handles import Poisoned
from rgpu.server.route import OpFailed

# wire name -> torch's reduce op; AVG is summed and divided here (gloo has no AVG of its own)
REDUCE = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
          "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}
MAX_STORES = 16  # rendezvous stores one session may open (each a listening port and a thread)
MAX_WAIT_S = 24 * 3600  # the longest timeout a join may ask for
PROBE_SECONDS = 1.5  # how long a failed collective looks for a peer server that no longer takes connections


class Group:
    """One joined group: the torch backend object, this session's rank in it, every rank's server (for errors)."""

    def __init__(self, pg, rank: int, size: int, backend: str, servers: list[str], device: torch.device,
                 store: tuple[str, int]):
        self.pg, self.rank, self.size, self.backend = pg, rank, size, backend
        self.servers, self.device, self.store = servers, device, store
        self.broken: str | None = None  # the first failure: every later collective on the group fails with it


class Collectives:
    """This session's groups and the rendezvous stores it opened; ``handlers`` go into the executor's table."""

    def __init__(self, table, kind: str, host: str):
        self.table, self.kind, self.host = table, kind, host
        self.groups: dict[int, Group] = {}
        self.stores: list = []  # master stores opened here: they live as long as the session
        self.handlers = {Msg.GROUP_STORE: self.store, Msg.GROUP_JOIN: self.join,
                         Msg.COLLECTIVE: self.collective, Msg.GROUP_LEAVE: self.leave}

    def store(self, meta, buffers):
        """A TCPStore on this server's bind host for a new group's rendezvous: [host, port]."""
        if meta != [Msg.GROUP_STORE]:
            raise ValueError("GROUP_STORE takes no arguments")
        if len(self.stores) >= MAX_STORES:
            raise OpFailed("init_process_group", f"a session opens at most {MAX_STORES} process groups")
        store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False)
        self.stores.append(store)
        return [self.host, store.port], []

    def join(self, meta, buffers):
        """``Msg.GROUP_JOIN`` ``[id, store host, port, rank, size, backend, device, timeout s, servers]``: this
        rank joins the servers' group (gloo, or NCCL on a GPU server) and waits until every rank is there.
        Returns ``(None, [])``; ``OpFailed("init_process_group", why)`` when it cannot, or when a second rank
        of one group would be in this session; ``ValueError`` for a malformed message."""
        _, gid, host, port, rank, size, backend, dev, timeout, servers = _checked_join(meta)
        backend = backend or ("nccl" if self.kind == "cuda" else "gloo")
        device = self.table.device(dev)
        wait = datetime.timedelta(seconds=timeout)
        if any(g.store == (host, port) for g in self.groups.values()):
            # this worker runs one message at a time: a second rank here would wait behind the first forever
            raise OpFailed("init_process_group", f"two ranks of one group in one session (rgpu:{dev} and another "
                                                 f"device of this server): give each rank its own process")
        try:
            store = dist.PrefixStore("rgpu", dist.TCPStore(host, port, is_master=False, timeout=wait))
            pg = self._backend(backend, store, rank, size, wait, device)
            probe = torch.zeros(1, device=device)
            pg.allreduce([probe]).wait()  # every rank's server is there (and NCCL's communicator is made)
        except Exception as exc:
            raise OpFailed("init_process_group", f"rank {rank} of {size} could not join the servers' {backend} "
                                                 f"group through {host}:{port}: {_reason(exc)}") from None
        self.groups[gid] = Group(pg, rank, size, backend, list(servers), device, (host, port))
        return None, []

    def _backend(self, backend: str, store, rank: int, size: int, wait, device: torch.device):
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = wait
            # gloo listens where this server does, so the other servers reach it as they reach the store
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
            return dist.ProcessGroupGloo(store, rank, size, opts)
        if backend == "nccl":
            if self.kind != "cuda":
                raise OpFailed("init_process_group", "backend nccl needs a GPU server (this one runs on the CPU)")
            for var in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS"):  # NVLink multicast off, as the hosts require
                os.environ.setdefault(var, "0" if var == "NCCL_NVLS_ENABLE" else "1")
            os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
            torch.cuda.set_device(device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = wait
            return dist.ProcessGroupNCCL(store, rank, size, opts)
        raise NotImplementedError(f"servers' group backend {backend!r}: gloo or nccl")

    def leave(self, meta, buffers):
        """``Msg.GROUP_LEAVE`` ``[id]``: the group shut down here (an unknown id: nothing)."""
        group = self.groups.pop(meta[1], None)
        if group is not None:
            _shut(group)

    def close(self) -> None:
        """The session ends: every group shut down, the stores opened here let go."""
        for group in self.groups.values():
            _shut(group)
        self.groups.clear()
        self.stores.clear()

    # ---- a collective, in stream order -----------------------------------------------------

    def collective(self, meta, buffers):
        """``Msg.COLLECTIVE`` ``[events, id, name, op, root, inputs, outputs]``, run in stream order. An input
        a failed op made poisons what it would write, quietly; an unknown group, a broken one, a collective
        it does not run or a failure of the group's engine (a peer gone, a timeout, named) raise ``OpFailed``
        (what it would write poisoned, the group broken for later ones). Returns None (a post)."""
        _, events, gid, name, op, root, ins, outs = meta
        self.table.apply_events(events)
        group = self.groups.get(gid)
        written = outs if name in ("all_gather", "all_gather_into_tensor", "reduce_scatter",
                                   "reduce_scatter_tensor") else ins
        if group is None:
            raise OpFailed(name, f"process group #{gid} is not joined in this session")
        if group.broken is not None:
            self._poison(written, Poisoned(name, group.broken))
            raise OpFailed(name, group.broken)
        try:
            src = [self.table.tensor(d) for d in ins]
            dst = [self.table.tensor(d) for d in outs]
        except Poisoned as cause:  # an input from a failed op: this rank sits this one out, its client told once
            self._poison(written, cause)
            return None
        try:
            self._run(group, name, op, root, src, dst)
        except NotImplementedError as exc:
            raise OpFailed(name, str(exc)) from None
        except Exception as exc:  # the group's engine failed: a peer gone, a timeout
            group.broken = self._why(group, name, exc)
            self._poison(written, Poisoned(name, group.broken))
            raise OpFailed(name, group.broken) from None
        return None

    def _run(self, group: Group, name: str, op, root, src: list, dst: list) -> None:
        pg = group.pg
        if name == "barrier":
            pg.allreduce([torch.zeros(1, device=group.device)]).wait()
            return
        if name == "broadcast":
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = root, 0
            _in_place(src, lambda ts: pg.broadcast(ts, opts).wait())
            return
        if name == "all_gather":
            flat = [_dense(t) for t in dst]
            pg.allgather([flat], [_dense(src[0])]).wait()
            _back(dst, flat)
            return
        if name == "all_gather_into_tensor":
            flat = [_dense(dst[0])]
            pg._allgather_base(flat[0], _dense(src[0])).wait()
            _back(dst, flat)
            return
        if op not in REDUCE:
            raise NotImplementedError(f"reduce op {op!r} on the servers: {', '.join(REDUCE)}")
        if name == "all_reduce":
            opts = dist.AllreduceOptions()
            opts.reduceOp = REDUCE[op]
            _in_place(src, lambda ts: pg.allreduce(ts, opts).wait())
        elif name in ("reduce_scatter", "reduce_scatter_tensor"):
            opts = dist.ReduceScatterOptions()
            opts.reduceOp = REDUCE[op]
            flat = [_dense(dst[0])]
            if name == "reduce_scatter":
                pg.reduce_scatter(flat, [[_dense(t) for t in src]], opts).wait()
            else:
                pg._reduce_scatter_base(flat[0], _dense(src[0]), opts).wait()
            _back(dst, flat)
        else:
            raise NotImplementedError(f"collective {name!r} on the servers: all_reduce, broadcast, all_gather, "
                                      f"all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor, barrier")
        if op == "avg":
            for t in (dst if dst else src):
                if t.is_floating_point() or t.is_complex():
                    t.div_(group.size)
                else:  # integers divide as NCCL's average does
                    t.div_(group.size, rounding_mode="trunc")

    def _poison(self, descs: list, cause: Poisoned) -> None:
        for d in descs:
            self.table.poison(d[0], d[6], cause)

    def _why(self, group: Group, name: str, exc: Exception) -> str:
        """The failure in words, naming each peer rank whose server no longer takes a connection."""
        peers = {r: addr for r, addr in enumerate(group.servers) if r != group.rank}
        gone: list[str] = []
        deadline = time.monotonic() + PROBE_SECONDS
        while not gone and time.monotonic() < deadline:  # a killed host's listener may outlive its worker a moment
            gone = [f"rank {r}'s server {addr}" for r, addr in peers.items() if not _answers(addr)]
            if not gone:
                time.sleep(0.1)
        who = (f"{', '.join(gone)} {'does' if len(gone) == 1 else 'do'} not answer" if gone
               else "every peer server still answers")
        return (f"{name} on the servers' {group.backend} group (rank {group.rank} of {group.size}) failed: "
                f"{who} ({_reason(exc)})")


def _checked_join(meta) -> list:
    """GROUP_JOIN's fields, each of its type and within bounds (a malformed one is refused, never waited on)."""
    ok = (type(meta) is list and len(meta) == 10 and type(meta[1]) is int and type(meta[2]) is str
          and type(meta[3]) is int and 0 < meta[3] < 65536 and type(meta[4]) is int and type(meta[5]) is int
          and 0 <= meta[4] < meta[5] <= 65536 and meta[6] in (None, "gloo", "nccl") and type(meta[7]) is int
          and type(meta[8]) in (int, float) and 0 < meta[8] <= MAX_WAIT_S and type(meta[9]) is list
          and len(meta[9]) == meta[5] and all(type(a) is str for a in meta[9]))
    if not ok:
        raise ValueError(f"GROUP_JOIN: malformed {str(meta)[:120]}")
    return meta


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _back(dst: list, flat: list) -> None:
    """Results written into contiguous copies go back into the tensors the client named."""
    for t, f in zip(dst, flat):
        if f is not t:
            t.copy_(f)


def _in_place(ts: list, run) -> None:
    flat = [_dense(t) for t in ts]
    run(flat)
    _back(ts, flat)


def _answers(addr: str) -> bool:
    """Whether a server takes a tcp connection at ``host:port`` (a local server's name, unknown, counts as yes)."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        return True
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
        return True
    except OSError:
        return False


def _reason(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _shut(group: Group) -> None:
    if group.backend == "nccl":
        group.pg.shutdown()
