"""``dlad status --watch``: a terminal table of a running daemon's load, refreshed from STATUS.

Each refresh sends one STATUS request with ``load`` set (``docs/protocol.md`` §6) and draws,
per device: health, busy % over the daemon's load window, tasks in flight, queue depth, OK
replies per second and their p99 latency; and for the daemon: state, readiness, the admission
queue, the reply rate and p50/p99. Nothing here reads the daemon's internals: it is a client of
the wire protocol like any other.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from typing import Any

import zmq
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dlad import protocol
from dlad.errors import DladError, Status, error_for

__all__ = ["fetch_status", "render", "watch"]


class _NoReply(TimeoutError):
    pass


def fetch_status(sock: zmq.Socket[Any], request_id: int, timeout: float) -> protocol.DaemonStatus:
    """One STATUS round trip with ``load`` on ``sock`` (a connected DEALER).

    Raises TimeoutError when no reply comes within ``timeout`` seconds, and the
    :mod:`dlad.errors` class of a non-OK reply (BadRequest from a daemon older than ``load``).
    """
    sock.send_multipart(protocol.encode(protocol.StatusRequest(request_id, load=True)))
    deadline_ms = int(timeout * 1000)
    while True:
        if not sock.poll(deadline_ms):
            raise _NoReply(f"no reply within {timeout:g} s")
        reply = protocol.decode_reply(sock.recv_multipart())
        if reply.id != request_id:  # a late reply to an earlier, timed-out request
            continue
        if reply.status != Status.OK or not isinstance(reply, protocol.StatusReply):
            raise error_for(reply.status, reply.message)
        assert reply.report is not None  # a decoded OK StatusReply always has one
        return reply.report


def _ms(us: float) -> str:
    return f"{us / 1000:.1f}" if us > 0 else "-"


def render(report: protocol.DaemonStatus, endpoint: str = "") -> Group:
    """The view of one report: a summary line and the per-device table."""
    load = report.get("load")
    q = report["queues"]
    summary = Text.assemble(
        (f"{report['name']} ", "bold"),
        f"{endpoint}  " if endpoint else "",
        (report["state"], "green" if report["state"] == "RUNNING" else "yellow"),
        "  ready " if report["ready"] else "  NOT READY ",
        f" queue {q['depth']}/{q['capacity']}",
    )
    if load is not None:
        summary.append(
            f"  {load['rate_hz']:.1f} replies/s ({load['ok_rate_hz']:.1f} OK)"
            f"  p50 {_ms(load['p50_us'])} ms  p99 {_ms(load['p99_us'])} ms"
            f"  over {load['window_s']:.1f} s"
        )
    by_name = {d["name"]: d for d in load["devices"]} if load is not None else {}
    table = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("device", "kind", "health", "busy %", "in flight", "queue", "OK/s", "p99 ms",
                "completed", "failed", "batch"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("device", "kind", "health") else "right")
    for d in report["devices"]:
        dl = by_name.get(d["name"])
        busy = dl["busy_ratio"] * 100 if dl is not None else None
        table.add_row(
            d["name"],
            d["kind"] if d["core"] is None else f"{d['kind']}{d['core']}",
            _health(d),
            "-" if busy is None else f"{busy:.0f}",
            str(d["in_flight"]),
            str(d["queue_depth"]),
            "-" if dl is None else f"{dl['rate_hz']:.1f}",
            "-" if dl is None else _ms(dl["p99_us"]),
            str(d["completed"]),
            str(d["failed"]),
            _batch(d),
        )
    return Group(summary, table)


def _health(d: protocol.DeviceStatus) -> Text:
    state = d.get("state")  # absent from older daemons' reports
    if state == "quarantined":
        return Text("QUARANTINED", "yellow")
    if state == "warming":
        return Text("warming", "cyan")
    return Text("ok", "green") if d["healthy"] else Text("FAULT", "red")


def _batch(d: protocol.DeviceStatus) -> str:
    """``mean/max`` batch size of what the device ran (``-/max`` before its first batch)."""
    runs = sum(d["batches"])
    jobs = sum((i + 1) * n for i, n in enumerate(d["batches"]))
    return f"{jobs / runs:.1f}/{d['max_batch']}" if runs else f"-/{d['max_batch']}"


def watch(
    endpoint: str,
    interval: float,
    timeout: float,
    count: int | None = None,
    console: Console | None = None,
    *,
    prepare: Callable[[zmq.Socket[Any]], None] | None = None,
) -> int:
    """Redraw the view every ``interval`` seconds until Ctrl-C (or ``count`` refreshes);
    ``prepare`` sets up the socket before it connects (CURVE keys).

    Returns the exit status: 0, or 1 when the daemon does not answer or refuses (the reason is
    printed on stderr).
    """
    if not interval > 0:
        print("dlad: --watch needs an interval > 0", file=sys.stderr)
        return 2
    console = console or Console()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        if prepare is not None:
            prepare(sock)
        sock.connect(endpoint)
        ids = itertools.count(1)
        report = fetch_status(sock, next(ids), timeout)
        with Live(render(report, endpoint), console=console, auto_refresh=False) as live:
            for _ in itertools.count(1) if count is None else range(count - 1):
                # the poll doubles as the refresh timer: nothing arrives unasked on this socket
                sock.poll(int(interval * 1000))
                report = fetch_status(sock, next(ids), timeout)
                live.update(render(report, endpoint), refresh=True)
    except _NoReply as exc:
        print(f"dlad: {endpoint}: {exc}", file=sys.stderr)
        return 1
    except DladError as exc:
        hint = (
            " (a daemon older than `status --watch`?)" if exc.status == Status.BAD_REQUEST else ""
        )
        print(f"dlad: {endpoint}: {exc.status.name}: {exc.message}{hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        sock.close(0)
        ctx.term()
    return 0
