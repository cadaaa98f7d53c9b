"""The ``rgpu`` command: serve, bench, config, build (and the subcommands later layers add)."""
from __future__ import annotations

import argparse
import importlib
import json
import sys

from . import config
from .errors import RgpuError

# subcommands contributed by other layers: module with add_parser(subparsers)
EXTENSIONS = ("rgpu.cuda_intercept.cli", "rgpu.remote", "rgpu.parts")


def _serve(args) -> int:
    from rgpu.server import serve

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port), ("device", args.device),
                                   ("devices", args.devices), ("cuda_driver", args.cuda_driver),
                                   ("max_sessions", args.max_sessions), ("max_frame_bytes", args.max_frame),
                                   ("token_file", args.token_file), ("spare_workers", args.spare_workers),
                                   ("tls", True if args.tls else None), ("tls_cert", args.tls_cert),
                                   ("tls_key", args.tls_key), ("session_grace", args.session_grace)) if v is not None}
    s = config.settings(**overrides)
    return serve.run(s, overrides, preload=args.preload, parent_pid=args.exit_with_parent)


def _bench(args) -> int:
    from rgpu.bench import harness

    if args.suite == "transport" and args.tls:
        from rgpu.bench import tls  # registers the "tcp+tls" transport: rgpu over TLS beside plain rgpu tcp

        if args.transport:
            args.transport += f",{tls.NAME}"
    with harness.progress(f"rgpu bench {args.suite}"):   # on stderr: stdout stays the table or the JSON
        if args.suite == "transport" and args.netns:  # two network namespaces: tcp (and ucx) beside a raw socket there
            from rgpu.bench import transport_lan

            rows = transport_lan.rows(args)
        else:
            rows = harness.run_suite(args.suite, args)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(harness.format_table(rows))
    return 0


def _config(args) -> int:
    if args.markdown:
        print(config.markdown_table())
        return 0
    s = config.settings()
    for item in config.TABLE:
        value = _secret(s, item) if item.field in SECRETS else repr(getattr(s, item.field))
        print(f"{item.env:24} {value}")
    return 0


# settings whose value is a secret: `rgpu config` says whether it is set and where it comes from, never what it is
SECRETS = {"token"}


def _secret(s, item) -> str:
    if getattr(s, item.field) is not None:
        return f"set (from {item.env}; not shown)"
    path = s.token_path
    return f"unset (the token comes from the token file {path}, {'present' if path.exists() else 'absent'})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rgpu", description="Run PyTorch and CUDA work on a remote GPU.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve both routes on one port (default 127.0.0.1:9713)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1; others need --tls or a tunnel)")
    p.add_argument("--port", type=int, help="port (default 9713; 0 picks a free one)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], help="where ops run (default: cuda if present)")
    p.add_argument("--devices", type=int, help="CPU devices to expose with --device cpu")
    p.add_argument("--cuda-driver", choices=["auto", "real", "fake"], help="driver behind the cuda route")
    p.add_argument("--max-sessions", type=int)
    p.add_argument("--max-frame", type=config._size, help="largest frame accepted, e.g. 2G")
    p.add_argument("--token-file", help="where the token lives")
    p.add_argument("--spare-workers", type=int, help="workers kept started ahead of sessions")
    p.add_argument("--tls", action="store_true", help="require TLS")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--session-grace", type=float,
                   help="seconds a dropped client's session waits for it to resume (default 120; 0: ends at once)")
    p.add_argument("--preload", default="torch", help="modules a spare worker imports ahead (comma list)")
    p.add_argument("--exit-with-parent", type=int, help=argparse.SUPPRESS)
    p.set_defaults(func=_serve)

    p = sub.add_parser("bench", help="measure rgpu beside its baseline; prints a table or JSON rows")
    p.add_argument("suite", help="transport, ops, train, generate, cuda, upload, resilience")
    p.add_argument("--json", action="store_true", help="print one JSON array of rows")
    p.add_argument("--transport", default=None, help="tcp, shm, ucx (default: every one available)")
    p.add_argument("--sizes", default=None, help="comma list of sizes for bandwidth, e.g. 64,1M,64M")
    p.add_argument("--repeats", type=int, default=5, help="interleaved runs per figure (median reported)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    p.add_argument("--plot", default=None, help="write a bandwidth-against-size PNG here")
    p.add_argument("--server", default=None, help="host:port of a running server (default: start a local one)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin client and server to different cores (a busy shared machine)")
    p.add_argument("--compile", nargs="?", const="default", default=None,
                   help="train: also the step under torch.compile(backend='rgpu') [mode, e.g. reduce-overhead]")
    p.add_argument("--sim-rtt", default=None, help="train: comma list of simulated round trips in ms, e.g. 1,10,30")
    p.add_argument("--torch", action="store_true", help="cuda: stock CUDA PyTorch's training steps beside native")
    p.add_argument("--queue-bytes", default=None,
                   help="cuda --torch: the eager steps at each RGPU_CUDA_QUEUE_BYTES of this comma list, e.g. 256K,16K "
                        "(FIRST:LIMIT sets RGPU_CUDA_QUEUE_FIRST_BYTES too, e.g. 64K:64K,8K:64K)")
    p.add_argument("--tls", action="store_true",
                   help="transport: add TLS rows beside plain tcp (what TLS costs); resilience: a TLS server's row too")
    p.add_argument("--tokens", type=int, default=None, help="generate: new tokens per sequence (128; --quick: 16)")
    p.add_argument("--flood", type=int, default=None, help="resilience: connections in the strangers' flood (256)")
    p.add_argument("--step", choices=["small", "bench"], default=None,
                   help="resilience: also the acknowledgements' cost on the eager training step of this preset")
    p.add_argument("--netns", action="store_true",
                   help="transport: across two network namespaces joined by a veth pair (root), beside a raw socket")
    p.add_argument("--rate", default=None, help="with --netns: tbf rate limit on the veth pair, e.g. 10gbit")
    p.set_defaults(func=_bench)

    p = sub.add_parser("config", help="show every setting and its current value")
    p.add_argument("--markdown", action="store_true", help="print the README's table")
    p.set_defaults(func=_config)

    for name in EXTENSIONS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        module.add_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RgpuError as exc:
        print(f"rgpu: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
