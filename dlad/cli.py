"""``dlad``: run the daemon, or ask a running one for its status.

    dlad --config etc/dlad.toml          serve in the foreground
                                         (SIGTERM/SIGINT: drain; a second one: force)
    dlad status [--endpoint tcp://...]   print a running daemon's STATUS report
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
    return p


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
    args = _parser().parse_args(argv)
    from dlad.config import ConfigError, load_config

    try:
        config = load_config(args.config)
        plan = config.plan()
    except ConfigError as exc:
        print(f"dlad: {exc}", file=sys.stderr)
        return 2
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
