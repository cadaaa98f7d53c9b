"""``rgpu doctor`` for several servers (``RGPU_SERVER=a,b``): every check on each server in turn, each line naming it.

A server that fails does not hide the others' results: each one runs every
check. Its devices are named as the session will number them (``rgpu:0..``
across the servers, in the order they are listed). A summary line gives the
servers and devices, or the servers that failed and why; the exit status is 0
only when no check failed on any server.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass

from . import doctor


@dataclass
class ServerReport:
    """One server's checks, and where its devices fall in the session."""
    where: str
    checks: list
    first: int | None    # its first device's rgpu index (None: an earlier server did not say how many it has)
    count: int | None    # its devices (None: the devices check did not list them)

    @property
    def failure(self) -> doctor.Check | None:
        return next((c for c in self.checks if c.status == "fail"), None)

    def devices(self) -> str:
        if self.first is None or not self.count:
            return f"{self.count or '?'} devices"
        last = self.first + self.count - 1
        return f"rgpu:{self.first}" if last == self.first else f"rgpu:{self.first}..{last}"


def where_of(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_servers(settings, on_result=None) -> list[ServerReport]:
    """Every check on each server of ``settings.server``, in order; ``on_result(where, check)`` as each ends."""
    reports: list[ServerReport] = []
    first: int | None = 0
    for host, port in settings.server_addresses():
        where = where_of(host, port)
        seen = None if on_result is None else (lambda c, where=where: on_result(where, c))
        checks = doctor.run_checks(settings.with_(server=where), seen, first)
        devices = next((c for c in checks if c.name == "devices"), None)
        listed = devices.data.get("devices") if devices is not None and devices.status != "fail" else None
        count = len(listed) if listed else None
        reports.append(ServerReport(where, checks, first, count))
        first = first + count if first is not None and count is not None else None
    return reports


def summary(reports: list[ServerReport]) -> str:
    """One line: N servers, M devices and where each range is; or which servers failed and why."""
    failed = [r for r in reports if r.failure is not None]
    if failed:
        why = "; ".join(f"{r.where} ({r.failure.name}: {r.failure.detail})" for r in failed)
        return (f"{len(failed)} of {len(reports)} servers failed: {why}; a session of all of them would not start "
                "(fix it, or leave it out of RGPU_SERVER)")
    total = sum(r.count or 0 for r in reports)
    where = ", ".join(f"{r.devices()} on {r.where}" for r in reports)
    span = f"rgpu:0..{total - 1}" if total > 1 else "rgpu:0"
    return f"{len(reports)} servers, {total} devices {span}: {where}"


def main(args, settings) -> int:
    reports = check_servers(settings, None if args.json else _printer(settings))
    ok = not any(r.failure is not None for r in reports)
    line = summary(reports)
    from rgpu.cuda_intercept import libraries   # the CUDA route: what `rgpu intercept run` would load, from where
    cuda = libraries.report()
    if args.json:
        servers = [{"server": r.where, "ok": r.failure is None, "first": r.first, "count": r.count,
                    "checks": [asdict(c) for c in r.checks]} for r in reports]
        total = sum(r.count or 0 for r in reports) if ok else None
        print(json.dumps({"ok": ok, "servers": servers, "devices": total, "summary": line, "cuda_libraries": cuda},
                         indent=1, default=str))
    else:
        print(f"\n  summary: {line}")
        print("\n".join(f"  {text}" for text in ["", "CUDA route:", *libraries.describe(cuda)]))
        print(f"rgpu doctor: all checks pass on {len(reports)} servers" if ok else
              f"rgpu doctor: some checks failed: {line}", file=sys.stderr)
    return 0 if ok else 1


def _printer(settings):
    """Prints each check as it ends, the server's address in every line (a header before each server's first)."""
    wheres = [where_of(h, p) for h, p in settings.server_addresses()]
    width = max(map(len, wheres))
    started: set = set()

    def show(where: str, c: doctor.Check) -> None:
        if where not in started:
            started.add(where)
            print(f"{'' if len(started) == 1 else chr(10)}server {len(started)} of {len(wheres)}: {where}", flush=True)
        status = c.status.upper() if c.status in ("fail", "warn") else c.status
        print(f"  {status:5} {where:{width}} {c.name:10} {c.detail}", flush=True)
        if c.fix:
            print(f"  {'':5} {where:{width}} {'':10} fix: {c.fix}", flush=True)
    return show
