"""``torch.distributed`` backend "rgpu": collectives on rgpu tensors run on the servers, never on this machine.

    import rgpu.distributed                  # registers the backend (and the device, as import rgpu does)
    torch.distributed.init_process_group("rgpu")          # or "cpu:gloo,rgpu:rgpu"
    model = DistributedDataParallel(model.to("rgpu"))     # device_ids=None

One process per rank (``torchrun``), each with one rgpu device (``torch.rgpu.set_device``
before init picks it) on its own server or a shared one. At init every rank's session
joins a process group among the servers' sessions: rank 0's server opens a rendezvous
store, its address goes to the other ranks through the store init_process_group gives
this backend, and each server joins (gloo on CPU servers, NCCL on GPU servers). Each
collective is then one message posted in stream order: nothing waits, and ``Work.wait()``
and ``get_future()`` behave as NCCL's do on CUDA (the stream orders what follows; the
future holds the tensors). A failure on the servers (a peer server gone, a timeout) comes
back at the next wait as ``rgpu.RemoteError`` naming the collective and the rank's server.
CPU tensors go through a gloo group among the clients, made on first use.
"""
from __future__ import annotations

import itertools
from datetime import timedelta

import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceCoalescedOptions, AllreduceOptions, BarrierOptions,
                                        BroadcastOptions, ReduceScatterOptions, _create_work_from_future)
from torch.futures import Future

from rgpu import config, register
from rgpu.device_backend import session as _session
from rgpu.protocol.ops import Msg

_RENDEZVOUS = "rgpu/servers/rendezvous"
_SUPPORTED = "all_reduce, broadcast, all_gather, all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor, barrier"
_REDUCE = ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "avg"), (dist.ReduceOp.MAX, "max"),
           (dist.ReduceOp.MIN, "min"), (dist.ReduceOp.PRODUCT, "product"))
_ids = itertools.count(1)  # a group's number within this process's session


def _reduce_name(op) -> str:
    for red, name in _REDUCE:
        if op == red:
            return name
    said = op.op.name if isinstance(op, dist.ReduceOp) else op
    raise NotImplementedError(f"rgpu process group: reduce op {said} is not supported (SUM, AVG, MAX, MIN, PRODUCT)")


def _address(server) -> str:
    """``host:port`` of a rank's server, as its client reached it (a local server: its loopback address)."""
    if ":" in server.where:  # one of several servers: the address RGPU_SERVER gave
        return server.where
    addr = server.conn.settings.server_address()
    return f"{addr[0]}:{addr[1]}" if addr else "the local server"


def _done(value) -> dist.Work:
    """A Work already complete: the server's stream orders the collective before anything posted later."""
    fut = Future()
    fut.set_result(value)
    return _create_work_from_future(fut)


class ProcessGroupRgpu(dist.ProcessGroup):
    """A rank's process group: rgpu tensors' collectives posted to its server, CPU tensors' through gloo here."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self._rank, self._size, self._store = rank, size, store
        seconds = min(timeout.total_seconds(), config.settings().collective_timeout)
        self._timeout = timedelta(seconds=seconds)
        self._cpu = None
        s = self._s = _session.get()
        self._device = s.C.current_device()
        self._server = s.server(self._device)  # with several servers (RGPU_SERVER=a,b), the device's own
        self._gid = next(_ids)
        self._join(seconds)

    def _join(self, seconds: float) -> None:
        server = self._server
        mine = _address(server)
        self._store.set(f"rgpu/servers/{self._rank}", mine)
        if self._rank == 0:
            host, port = self._s.request([Msg.GROUP_STORE], self._device)
            if host in ("", "0.0.0.0", "::"):  # a server bound to every address: reach it as this client does
                host = mine.rpartition(":")[0].strip("[]") or "127.0.0.1"
            self._store.set(_RENDEZVOUS, f"{host}:{port}")
        keys = [_RENDEZVOUS, *(f"rgpu/servers/{r}" for r in range(self._size))]
        try:
            self._store.wait(keys, self._timeout)
        except dist.DistError as exc:  # a rank that failed before it said where its server is
            raise RuntimeError(f"rgpu process group: rank {self._rank} of {self._size} waited {seconds:g} s for the "
                               f"other ranks' servers (rank 0's rendezvous, every rank's address): {exc}") from None
        host, _, port = self._store.get(_RENDEZVOUS).decode().rpartition(":")
        self.servers = [self._store.get(key).decode() for key in keys[1:]]
        self._s.request([Msg.GROUP_JOIN, self._gid, host, int(port), self._rank, self._size, None, self._device,
                         seconds, self.servers], self._device)

    def _post(self, name: str, ins: list, outs: list = (), op=None, root: int = 0) -> None:
        s, server = self._s, self._server
        for t in (*ins, *outs):
            if t.device.type != s.devtype or t.device.index != self._device:
                raise ValueError(f"rgpu process group: {name} of a tensor on {t.device}; this rank's group "
                                 f"runs on {s.devtype}:{self._device}")
        with s.lock:  # the allocator's events due at this server first, in the same message, as an op's
            s.post([Msg.COLLECTIVE, server.events(), self._gid, name, op, root,
                    [s.C.describe(t) for t in ins], [s.C.describe(t) for t in outs]], self._device)

    def _on_cpu(self, tensors) -> bool:
        return all(t.device.type == "cpu" for t in tensors)

    def _gloo(self):
        """The clients' own gloo group for CPU tensors (``cpu:gloo,rgpu:rgpu``), made by the first CPU collective."""
        if self._cpu is None:
            self._cpu = dist.ProcessGroupGloo(dist.PrefixStore("rgpu/cpu", self._store), self._rank, self._size,
                                              self._timeout)
        return self._cpu

    # ---- the collectives -----------------------------------------------------------------

    def allreduce(self, tensors, opts=AllreduceOptions()):
        if self._on_cpu(tensors):
            return self._gloo().allreduce(tensors, opts)
        op = _reduce_name(opts.reduceOp)
        for t in tensors:
            self._post("all_reduce", [t], op=op)
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=AllreduceCoalescedOptions()):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=BroadcastOptions()):
        if self._on_cpu(tensors):
            return self._gloo().broadcast(tensors, opts)
        for t in tensors:
            self._post("broadcast", [t], root=opts.rootRank)
        return _done(tensors)

    def allgather(self, output_lists, inputs, opts=AllgatherOptions()):
        if self._on_cpu(inputs):
            return self._gloo().allgather(output_lists, inputs, opts)
        for outs, t in zip(output_lists, inputs):
            self._post("all_gather", [t], list(outs))
        return _done(output_lists)

    def all_gather_single(self, output, input, opts=AllgatherOptions()):
        if self._on_cpu([input]):
            return self._gloo()._allgather_base(output, input, opts)
        self._post("all_gather_into_tensor", [input], [output])
        return _done([output])

    def all_gather_single_coalesced(self, outputs, inputs, opts=AllgatherOptions()):
        for out, t in zip(outputs, inputs):
            self.all_gather_single(out, t, opts)
        return _done(outputs)

    def reduce_scatter(self, outputs, input_lists, opts=ReduceScatterOptions()):
        if self._on_cpu(outputs):
            return self._gloo().reduce_scatter(outputs, input_lists, opts)
        op = _reduce_name(opts.reduceOp)
        for out, ins in zip(outputs, input_lists):
            self._post("reduce_scatter", list(ins), [out], op=op)
        return _done(outputs)

    def reduce_scatter_single(self, output, input, opts=ReduceScatterOptions()):
        if self._on_cpu([input]):
            return self._gloo()._reduce_scatter_base(output, input, opts)
        self._post("reduce_scatter_tensor", [input], [output], op=_reduce_name(opts.reduceOp))
        return _done([output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=ReduceScatterOptions()):
        for out, t in zip(outputs, inputs):
            self.reduce_scatter_single(out, t, opts)
        return _done(outputs)

    def barrier(self, opts=BarrierOptions()):
        """Every rank's server has reached it before this returns (one round trip, as NCCL's barrier blocks)."""
        self._post("barrier", [])
        self._s.request([Msg.SYNC], self._device)
        return _done([])

    def _refuse(name: str):
        def refused(self, *args, **kwargs):
            raise NotImplementedError(f"rgpu process group: {name} is not supported (supported: {_SUPPORTED})")
        refused.__name__ = name
        return refused

    reduce, gather, scatter, alltoall = _refuse("reduce"), _refuse("gather"), _refuse("scatter"), _refuse("alltoall")
    all_to_all_single, send, recv = _refuse("all_to_all_single"), _refuse("send"), _refuse("recv")
    recv_anysource, allgather_coalesced = _refuse("recv_anysource"), _refuse("allgather_coalesced")
    monitored_barrier = _refuse("monitored_barrier")
    del _refuse

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return "rgpu"

    def shutdown(self) -> None:
        if _session.current() is self._s:
            self._s.post([Msg.GROUP_LEAVE, self._gid], self._device)

    def __repr__(self) -> str:
        return f"ProcessGroupRgpu(rank={self._rank}, size={self._size}, device=rgpu:{self._device})"


def _create(store, rank: int, size: int, timeout: timedelta) -> ProcessGroupRgpu:
    return ProcessGroupRgpu(store, rank, size, timeout)


register()  # asking for the backend is asking for the device: `import rgpu.distributed` alone names it too
if "rgpu" not in dist.Backend.backend_list:
    dist.Backend.register_backend("rgpu", _create, devices=["rgpu"])
