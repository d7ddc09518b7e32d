"""``dlad``: run the daemon, or ask a running one for its status.

    dlad [--config FILE]                 serve in the foreground (SIGTERM/SIGINT: drain; a
                                         second one: force); without --config, the default
                                         config the package carries (an emulated Orin
                                         serving the bundled model)
    dlad config --print-default          write that default config to stdout, to edit
    dlad status [--endpoint tcp://...]   print a running daemon's STATUS report
    dlad status --watch [SECONDS]        a live per-device table (busy %, queue, rate, p99)
    dlad status --platform               this host's cuDLA probe (version, DLA cores, or why not)
                                         and the emulated core's INT8 kernel path
    dlad selftest [--loadable 0=PATH]    exercise every cuDLA call once on a Jetson (docs/jetson.md)
    dlad --version

``--help`` and ``--version`` import nothing heavy. ``--config`` may come before or after the
subcommand. Exit status: 0 success; 1 a runtime failure (no daemon answered, the daemon answered
an error, a port to bind is taken: the message names the config key); 2 bad arguments or
configuration (the message names the key and the file). No traceback for any of these, and a
closed pipe (``dlad status | head``) ends quietly.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import dlad

if TYPE_CHECKING:
    from dlad.config import Plan


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dlad",
        description="Serve YOLO detection (YOLOv5, YOLOv8, YOLO11, YOLO26) on a Jetson Orin's "
        "DLA cores and GPU (or an emulated Orin) over ZeroMQ.",
    )
    p.add_argument("--version", action="version", version=f"dlad {dlad.__version__}")
    p.add_argument("--config", default=None,
                   help="configuration file (TOML); default: the package's own "
                        "(`dlad config --print-default` shows it)")  # fmt: skip
    sub = p.add_subparsers(dest="command")
    st = sub.add_parser(
        "status",
        help="print a running daemon's STATUS: a summary on a "
        "terminal, the whole report as JSON elsewhere or with --json",
    )
    # Also after the subcommand (what people type); SUPPRESS keeps the top-level value otherwise.
    st.add_argument("--config", default=argparse.SUPPRESS, help="configuration file (TOML)")
    st.add_argument("--endpoint", default=None, help="daemon endpoint (default: from --config)")
    st.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the reply")
    st.add_argument(
        "--watch", type=float, nargs="?", const=1.0, default=None, metavar="SECONDS",
        help="a live table (per device busy %%, queue, rate, p99) redrawn every SECONDS (1)",
    )  # fmt: skip
    st.add_argument("--count", type=int, default=None, help="with --watch: stop after N draws")
    st.add_argument("--json", action="store_true",
                    help="the whole STATUS report as JSON (the default where stdout is no "
                         "terminal)")  # fmt: skip
    st.add_argument("--curve-key", default=None, metavar="FILE",
                    help="this client's secret key file, for a daemon with [auth] mode = "
                         "curve (its public key comes from its server_secret_key)")  # fmt: skip
    kg = sub.add_parser("keygen", help="write a CURVE key pair (NAME.key, NAME.key_secret)")
    kg.add_argument("name", help="whose keys: 'server' for the daemon, a client's name")
    kg.add_argument("--dir", default=".", help="where to write them (created, mode 0700)")
    st.add_argument("--platform", action="store_true",
                    help="print this host's cuDLA probe (version, DLA cores), the emulated "
                         "DLA core's INT8 kernel path, the native core and the engine each "
                         "device of --config would get, as JSON")  # fmt: skip
    cf = sub.add_parser("config", help="the default config (--print-default)")
    cf.add_argument(
        "--print-default",
        action="store_true",
        required=True,
        help="write the default config (every setting, explained) to stdout",
    )
    sub.add_parser("selftest", add_help=False,
                   help="exercise every cuDLA call once on a Jetson (--help: options)")  # fmt: skip
    return p


def _int8_kernel_path() -> dict[str, object]:
    """The emulated core's INT8 kernel path on this host, or why there is none."""
    try:
        from dlad.devices.int8_layout import NoExactKernelError, select_kernel_path

        return select_kernel_path("auto").to_dict()
    except ImportError as exc:
        return {"available": False, "reason": f"onnxruntime or onnx is not installed: {exc}"}
    except NoExactKernelError as exc:
        return {"available": False, "reason": str(exc)}


def _engines(config_path: str) -> dict[str, object]:
    """The engine each device of the config would get on this host (``engines``), or why that
    cannot be said (``engines_error``)."""
    from dlad.config import ConfigError, load_config
    from dlad.daemon import plane_engine
    from dlad.gpu.service import select_backend

    try:
        plan = load_config(config_path).plan()
    except ConfigError as exc:
        return {"engines_error": str(exc)}
    c = plan.config
    pre_post = c.pre_post.enabled
    configured = any(d.kind == "gpu" and d.backend != "cpu" for d in c.devices)
    try:
        gpu = pre_post and select_backend(c.pre_post.backend, configured)[0] == "cuda"
    except RuntimeError as exc:  # cuda required, none usable: the daemon would not start
        return {"engines_error": str(exc)}
    return {"engines": {p.device: plane_engine(plan, p, pre_post=pre_post, gpu=gpu)[1]
                        for p in plan.placements}}  # fmt: skip


def _platform(config_path: str) -> int:
    """``dlad status --platform``: the cuDLA platform probe of this host, the emulated core's
    INT8 kernel path (``emulated_int8``), whether the C++ core is here (``native_core``) and the
    engine each device of ``config_path`` would get (``engines``); needs no daemon."""
    from dlad.devices.cudla.probe import probe
    from dlad.native_plane import missing_core

    found = probe()
    report = {"summary": found.summary(), **found.to_dict(), "emulated_int8": _int8_kernel_path(),
              "native_core": missing_core() or "present", **_engines(config_path)}  # fmt: skip
    print(json.dumps(report, indent=2))
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


def _curve_client(
    plan: Plan, key_file: str | None
) -> Callable[[Any], None] | Literal[False] | None:
    """How ``dlad status`` sets up its socket for a CURVE daemon (None: plain; False: it
    cannot, having said why)."""
    from pathlib import Path

    from dlad.auth import configure_client, read_server_keys
    from dlad.errors import StartupError

    if plan.server_secret_key is None:
        return None
    if key_file is None:
        print("dlad: the daemon authenticates clients ([auth] mode = curve): pass --curve-key "
              "with a secret key file whose public key it allows", file=sys.stderr)  # fmt: skip
        return False
    try:
        server_public, _ = read_server_keys(plan.server_secret_key)
        read_server_keys(Path(key_file), key="--curve-key")
    except StartupError as exc:
        print(f"dlad: {exc}", file=sys.stderr)
        return False
    return lambda sock: configure_client(sock, server_public, Path(key_file))


def _status(
    endpoint: str, timeout: float, prepare: Callable[[Any], None] | None = None,
    as_json: bool | None = None,
) -> int:  # fmt: skip
    """One STATUS: the report as JSON (``as_json``; None: where stdout is no terminal), else
    the summary ``dlad status --watch`` draws, and the models served."""
    import zmq

    from dlad import protocol
    from dlad.errors import ProtocolError, Status

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        if prepare is not None:
            prepare(sock)
        sock.connect(endpoint)
        sock.send_multipart(protocol.encode(protocol.StatusRequest(1)))
        if not sock.poll(int(timeout * 1000)):
            print(f"dlad: no reply from {endpoint} within {timeout} s", file=sys.stderr)
            return 1
        try:
            reply = protocol.decode_reply(sock.recv_multipart())
        except ProtocolError as exc:
            print(f"dlad: {endpoint} sent a reply that is not dlad's: {exc}", file=sys.stderr)
            return 1
    finally:
        sock.close(0)
        ctx.term()
    if reply.status != Status.OK or not isinstance(reply, protocol.StatusReply):
        print(f"dlad: {endpoint}: {reply.status.name}: {reply.message}", file=sys.stderr)
        return 1
    report = reply.report
    assert report is not None  # a StatusReply has its report
    if as_json if as_json is not None else not sys.stdout.isatty():
        print(json.dumps(report, indent=2))
        return 0
    from rich.console import Console

    from dlad.status_view import render

    console = Console()
    console.print(render(report, endpoint))
    for m in report["models"]:
        family = m.get("family", "")
        console.print(f"model {m['name']} ({family + ', ' if family else ''}{m['classes']} "
                      f"classes, {m['input_width']}x{m['input_height']}) on "
                      f"{', '.join(m['devices'])}")  # fmt: skip
    console.print("[dim]dlad status --json: the whole report[/]")
    return 0


def _endpoint_or_exit(endpoint: str) -> str | None:
    """``endpoint`` if it can name a daemon, else None after saying why (exit status 2)."""
    from dlad.protocol import endpoint_error

    problem = endpoint_error(endpoint)
    if problem is not None:
        print(f"dlad: --endpoint: {problem}", file=sys.stderr)
        return None
    return endpoint


def _startup_error(exc: BaseException) -> BaseException | None:
    """The daemon's StartupError inside ``exc`` (the task groups wrap it), if that is what
    stopped it."""
    from dlad.errors import StartupError

    if isinstance(exc, StartupError):
        return exc
    for inner in getattr(exc, "exceptions", ()):  # an ExceptionGroup
        found = _startup_error(inner)
        if found is not None:
            return found
    return None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (``dlad status | head``): nothing more to say, and nowhere to
        # say it; point stdout at /dev/null so the interpreter's final flush is quiet too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _main(argv: Sequence[str] | None) -> int:
    args, rest = _parser().parse_known_args(argv)
    if args.command == "selftest":  # its own options; needs no config
        from dlad.devices.cudla.selftest import main as selftest

        return selftest(rest)
    if rest:
        _parser().error(f"unrecognized arguments: {' '.join(rest)}")
    from dlad.config import DEFAULT_CONFIG

    if args.command == "config":
        sys.stdout.write(DEFAULT_CONFIG.read_text())
        return 0
    if args.config is None:
        args.config = str(DEFAULT_CONFIG)
    if args.command == "status" and args.platform:
        return _platform(args.config)
    if args.command == "keygen":
        from pathlib import Path

        from dlad.auth import write_keypair

        public, secret = write_keypair(Path(args.dir), args.name)
        print(f"public key (give it to the other side): {public}\nsecret key (keep it): {secret}")
        return 0
    from dlad.config import ConfigError, load_config

    try:
        config = load_config(args.config)
        plan = config.plan()
    except ConfigError as exc:
        print(f"dlad: {exc}", file=sys.stderr)
        return 2
    if args.command == "status":
        endpoint = _endpoint_or_exit(args.endpoint or plan.endpoints[0])
        if endpoint is None:
            return 2
        prepare = _curve_client(plan, args.curve_key)
        if prepare is False:
            return 2
        if args.watch is not None:
            from dlad.status_view import watch

            return watch(endpoint, args.watch, args.timeout, args.count, prepare=prepare or None)
        return _status(endpoint, args.timeout, prepare or None, True if args.json else None)
    from dlad.native_plane import missing_core

    if missing_core():  # the C++ core serves every request: no daemon without it
        print(f"dlad: {missing_core()}", file=sys.stderr)
        return 2
    _configure_logging(config.logging.format, config.logging.level)
    import anyio

    from dlad.daemon import run

    options: dict[str, Any] = {}
    if config.daemon.event_loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            print(
                f"dlad: {args.config}: [daemon] event_loop is 'uvloop', which is not installed "
                "(pip install uvloop), or set event_loop = 'asyncio'",
                file=sys.stderr,
            )
            return 2
        options["loop_factory"] = uvloop.new_event_loop
    try:
        anyio.run(run, plan, backend_options=options)
    except KeyboardInterrupt:  # a forced exit
        return 1
    except Exception as exc:  # a StartupError is told plainly; anything else is re-raised
        found = _startup_error(exc)
        if found is None:
            raise
        print(f"dlad: {args.config}: {found}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
