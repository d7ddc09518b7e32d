"""``dlad``: run the daemon, or ask a running one for its status.

    dlad --config etc/dlad.toml          serve in the foreground
                                         (SIGTERM/SIGINT: drain; a second one: force)
    dlad status [--endpoint tcp://...]   print a running daemon's STATUS report
    dlad status --watch [SECONDS]        a live per-device table (busy %, queue, rate, p99)
    dlad status --platform               this host's cuDLA probe (version, DLA cores, or why not)
    dlad selftest [--loadable 0=PATH]    exercise every cuDLA call once on a Jetson (docs/jetson.md)
    dlad --version

``--help`` and ``--version`` import nothing heavy. Exit status: 0 success, 1 a runtime failure,
2 bad arguments or configuration (the message names the key and the file; no traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

import dlad


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dlad",
        description="Serve YOLOv5 detection on a Jetson Orin's DLA cores and GPU "
        "(or an emulated Orin) over ZeroMQ.",
    )
    p.add_argument("--version", action="version", version=f"dlad {dlad.__version__}")
    p.add_argument("--config", default="etc/dlad.toml", help="configuration file (TOML)")
    sub = p.add_subparsers(dest="command")
    st = sub.add_parser("status", help="print a running daemon's STATUS report as JSON")
    st.add_argument("--endpoint", default=None, help="daemon endpoint (default: from --config)")
    st.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the reply")
    st.add_argument(
        "--watch", type=float, nargs="?", const=1.0, default=None, metavar="SECONDS",
        help="a live table (per device busy %%, queue, rate, p99) redrawn every SECONDS (1)",
    )  # fmt: skip
    st.add_argument("--count", type=int, default=None, help="with --watch: stop after N draws")
    st.add_argument("--platform", action="store_true",
                    help="print this host's cuDLA probe (version, DLA cores) as JSON")  # fmt: skip
    sub.add_parser("selftest", add_help=False,
                   help="exercise every cuDLA call once on a Jetson (--help: options)")  # fmt: skip
    return p


def _platform() -> int:
    """``dlad status --platform``: the cuDLA platform probe of this host (needs no daemon)."""
    from dlad.devices.cudla.probe import probe

    found = probe()
    print(json.dumps({"summary": found.summary(), **found.to_dict()}, indent=2))
    return 0


def _configure_logging(fmt: str, level: str) -> None:
    import structlog

    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format="%(message)s")
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
    )


def _status(endpoint: str, timeout: float) -> int:
    import zmq

    from dlad import protocol

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(endpoint)
        sock.send_multipart(protocol.encode(protocol.StatusRequest(1)))
        if not sock.poll(int(timeout * 1000)):
            print(f"dlad: no reply from {endpoint} within {timeout} s", file=sys.stderr)
            return 1
        reply = protocol.decode_reply(sock.recv_multipart())
    finally:
        sock.close(0)
        ctx.term()
    print(json.dumps(getattr(reply, "report", None), indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(argv)
    if args.command == "selftest":  # its own options; needs no config
        from dlad.devices.cudla.selftest import main as selftest

        return selftest(rest)
    if rest:
        _parser().error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "status" and args.platform:
        return _platform()
    from dlad.config import ConfigError, load_config

    try:
        config = load_config(args.config)
        plan = config.plan()
    except ConfigError as exc:
        print(f"dlad: {exc}", file=sys.stderr)
        return 2
    if args.command == "status" and args.watch is not None:
        from dlad.status_view import watch

        return watch(args.endpoint or plan.endpoints[0], args.watch, args.timeout, args.count)
    if args.command == "status":
        return _status(args.endpoint or plan.endpoints[0], args.timeout)
    _configure_logging(config.logging.format, config.logging.level)
    import anyio

    from dlad.daemon import run

    try:
        anyio.run(run, plan)
    except KeyboardInterrupt:  # a forced exit
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
