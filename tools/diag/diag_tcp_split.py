"""Where a 64 B round trip over tcp spends what it costs beyond a raw socket's: the client's side and the
server's apart. Three pings, interleaved, each the median of its runs:

- rgpu: ``conn.call`` of the echo route (``rgpu bench transport``'s rgpu tcp row);
- server only: the same frames written and read by hand on that connection's socket (no client Python
  beyond a ``sendmsg`` and a ``recv_into``), so what it adds to the raw figure is the server's;
- raw: ``rgpu bench transport``'s raw socket pair.

Client and servers pinned to different cores, as the bench does (``--no-pin`` leaves them).

    python tools/diag/diag_tcp_split.py [--repeats 7] [--no-pin]      (rgpu installed; on the GPU host or here)
"""
import argparse
import statistics
import struct
import sys
from pathlib import Path

import numpy as np

from rgpu.bench import harness
from rgpu.bench.transport import PING_BYTES, Context, RawSocket, RgpuEcho
from rgpu.transport.wire import HEADER, MsgKind, encode_prefix, pack_meta

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpu"))   # tools/diag/ -> the repository's gpu/
from item_probe import per_call_us  # noqa: E402

_META_LEN_NBUFS = struct.Struct("<II")   # the header's meta_len and nbufs (wire.py: offsets 28 and 32)


class ServerOnly:
    """The echo route's request and reply done by hand on ``echo``'s socket, after its own calls: the frames an
    rgpu client would write (increasing seqs, the last answer acknowledged), none of its Python."""

    def __init__(self, echo: RgpuEcho):
        echo.ping()                                  # one call, so the session's last answer is seq 1
        self.sock = echo.conn.transport.sock
        self.seq = echo.conn.stats["messages"]       # seqs drawn so far: the connection sent nothing else
        self.meta = pack_meta(RgpuEcho.ECHO)
        self.out = np.arange(PING_BYTES, dtype=np.uint8)
        self.buf = bytearray(4096)
        self.view = memoryview(self.buf)

    def ping(self) -> None:
        self.seq += 1
        self.sock.sendmsg([encode_prefix(MsgKind.REQUEST, self.seq, self.seq - 1, self.meta, [PING_BYTES]), self.out])
        got, need = 0, HEADER.size
        while got < need:
            k = self.sock.recv_into(self.view[got:])
            if not k:
                raise ConnectionError("the rgpu server closed")
            got += k
            if need == HEADER.size and got >= HEADER.size:
                meta_len, nbufs = _META_LEN_NBUFS.unpack_from(self.buf, 28)
                need = HEADER.size + 8 * nbufs + meta_len + PING_BYTES * nbufs
        if MsgKind(struct.unpack_from("<H", self.buf, 6)[0]) is not MsgKind.REPLY:
            raise RuntimeError("the echo route did not answer with a REPLY")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--pings", type=int, default=3000, help="round trips per run")
    p.add_argument("--no-pin", dest="pin", action="store_false")
    args = p.parse_args()
    with Context(args) as ctx, harness.pinned(ctx.client_cpus):
        address, token = ctx.rgpu_server()
        rgpu = ctx.own(RgpuEcho("tcp", address, token))
        by_hand = ServerOnly(ctx.own(RgpuEcho("tcp", address, token)))
        raw = ctx.own(RawSocket(*ctx.raw_server()))
        pings = {"rgpu": rgpu.ping, "server only": by_hand.ping, "raw": raw.ping}
        runs = {name: [] for name in pings}
        for ping in pings.values():
            per_call_us(ping, 300)                       # warm
        for _ in range(args.repeats):
            for name, ping in pings.items():
                runs[name].append(per_call_us(ping, args.pings))
    m = {name: statistics.median(v) for name, v in runs.items()}
    for name, v in runs.items():
        print(f"{name:12s} {m[name]:7.1f} us  [{min(v):.1f}-{max(v):.1f}]  {m[name] / m['raw']:.3f} of raw")
    print(f"beyond raw: {m['rgpu'] - m['raw']:.1f} us, the server's {m['server only'] - m['raw']:.1f}, "
          f"the client's {m['rgpu'] - m['server only']:.1f}")


if __name__ == "__main__":
    main()
