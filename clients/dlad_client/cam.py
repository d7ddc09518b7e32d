"""``dlad-cam``: cameras, streams, videos and images into a dlad daemon, results out.

One camera on one line, many from a TOML file::

    dlad-cam rtsp://10.0.0.5/stream1 --json              # a JSON object a frame on stdout
    dlad-cam clip.mp4 /dev/video0 photos/ --endpoint tcp://orin:5555
    dlad-cam --config cameras.toml

A camera's frames go to the daemon as its ``stream`` (named after the source, or the
config's table): video as NV12 where the daemon pre-processes on its GPU (its STATUS says so),
else as RGB converted here (``--nv12``, ``--rgb``: either one); frames the daemon cannot keep
up with are dropped here, never queued (see
:mod:`dlad_client.cameras`). Progress (fps in and out, drops, p99) goes to stderr; ``--save
DIR`` writes each answered frame with its boxes drawn. Ctrl-C (SIGINT) or SIGTERM stops the
sources, lets the frames in flight be answered and prints the summary.

The config file::

    endpoint = "tcp://127.0.0.1:5555"   # or endpoints = [...]
    model = "demo"
    in_flight = 2                       # per camera
    rig = false                         # true: the cameras' frames of one instant in one batch
    output = "auto"                     # "nv12", "rgb"; auto: NV12 where the daemon's GPU
                                        # converts it, else RGB (converted here)
    [cameras.front]
    source = "rtsp://10.0.0.5/stream1"
    fps = 15                            # at most; the rest are dropped at the source
    [cameras.dock]
    source = "/dev/video0"
    options = { video_size = "1280x720", input_format = "mjpeg" }
    [sinks.json]
    path = "events.jsonl"               # "-": stdout
    [sinks.mqtt]
    url = "mqtt://broker.local:1883"    # mqtts:// over TLS; user:password@ in it
    topic = "dlad/{camera}"
    max_per_s = 5                       # per camera; every sink takes it, and:
    only_detections = true              # frames with a detection only
    classes = ["person", "car"]         # only these (others are taken out of the event)
    [sinks.webhook]
    url = "http://hooks.local/dlad/{camera}"
    timeout_s = 2.0

Each sink has a bounded queue: one that is slow or down drops events (counted in the summary),
never frames.

Exit status: 0 done; 1 no frame was answered; 2 bad arguments, config or source.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final, Literal, cast

import anyio
import msgspec
from rich.console import Console
from rich.live import Live
from rich.table import Table

from dlad_client._async import AsyncClient
from dlad_client._core import ClientTimeout, Result, _local
from dlad_client.cameras import CameraRig, fmt_ms
from dlad_client.sinks import JsonLinesSink, MqttSink, Sink, WebhookSink
from dlad_client.sources import CameraFrame, Output, Source, SourceError, open_source
from dlad_wire.errors import InternalError, NotFound
from dlad_wire.protocol import DaemonStatus, YuvFormat

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["CameraConfig", "RigConfig", "main"]


class CameraConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One ``[cameras.NAME]`` table."""

    source: str
    fps: float | None = None
    loop: bool = False
    realtime: bool = True
    options: dict[str, str] = msgspec.field(default_factory=dict)


class _Filter(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What every sink table may also say (dlad_client.sinks.Sink)."""

    max_per_s: float | None = None
    only_detections: bool = False
    classes: list[str] | None = None

    def filters(self) -> dict[str, Any]:
        return {"max_per_s": self.max_per_s, "only_detections": self.only_detections,
                "classes": self.classes}  # fmt: skip


class JsonSinkConfig(_Filter, frozen=True):
    path: str = "-"


class MqttSinkConfig(_Filter, frozen=True):
    url: str = "mqtt://127.0.0.1:1883"
    topic: str = "dlad/{camera}"
    qos: int = 0
    retain: bool = False


class WebhookSinkConfig(_Filter, frozen=True):
    url: str = ""
    timeout_s: float = 2.0
    headers: dict[str, str] = msgspec.field(default_factory=dict)


class SinksConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    json: JsonSinkConfig | None = None
    mqtt: MqttSinkConfig | None = None
    webhook: WebhookSinkConfig | None = None

    def build(self, out: IO[str] | None) -> list[Sink]:
        """The sinks; raises UsageError for a bad URL or setting."""
        sinks: list[Sink] = []
        try:
            if self.json is not None:
                sinks.append(JsonLinesSink(out, **self.json.filters()))
            if self.mqtt is not None:
                m = self.mqtt
                sinks.append(MqttSink(m.url, topic=m.topic, qos=m.qos, retain=m.retain,
                                      **m.filters()))  # fmt: skip
            if self.webhook is not None:
                h = self.webhook
                sinks.append(WebhookSink(h.url, timeout_s=h.timeout_s, headers=h.headers,
                                         **h.filters()))  # fmt: skip
        except ValueError as exc:
            raise UsageError(f"sinks: {exc}") from None
        return sinks


class RigConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A ``dlad-cam --config`` file."""

    cameras: dict[str, CameraConfig]
    endpoint: str | None = None
    endpoints: list[str] | None = None
    model: str = "demo"
    in_flight: int = 2
    rig: bool = False
    output: Output | Literal["auto"] = "auto"
    conf: float | None = None
    deadline_ms: int | None = None
    sinks: SinksConfig = msgspec.field(default_factory=SinksConfig)


class UsageError(Exception):
    """Bad arguments, config or source: one line, exit status 2."""


def load_config(path: str) -> RigConfig:
    """The rig in the TOML file at ``path``; raises UsageError naming what is wrong."""
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror or exc}") from None
    try:
        config = msgspec.toml.decode(text, type=RigConfig)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise UsageError(f"{path}: {exc}") from None
    if not config.cameras:
        raise UsageError(f"{path}: no [cameras.NAME] table")
    return config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dlad-cam", description=__doc__.splitlines()[0] if __doc__ else None,
        epilog="Sources: image files, directories and globs, video files, rtsp:// and http(s):// "
               "streams, /dev/videoN (V4L2), gst:PIPELINE (GStreamer, ending in an appsink).",
    )  # fmt: skip
    p.add_argument("sources", nargs="*", metavar="SOURCE", help="what to read (see below)")
    p.add_argument("--config", help="a TOML file of cameras and sinks (see the docs)")
    p.add_argument("--endpoint", action="append", help="the daemon (default tcp://127.0.0.1:5555)")
    p.add_argument("--model", default=None, help="the model to run (default: demo)")
    p.add_argument("--json", action="store_true", help="a JSON object a result on stdout")
    p.add_argument("--jsonl", metavar="FILE", help="the JSON objects to FILE instead")
    p.add_argument("--mqtt", metavar="URL", help="each result to this MQTT broker (mqtt://host)")
    p.add_argument("--mqtt-topic", metavar="T", help="its topic (default dlad/{camera})")
    p.add_argument("--webhook", metavar="URL", help="each result POSTed as JSON to this URL")
    p.add_argument("--fps", type=float, help="each source's most frames a second")
    p.add_argument("--in-flight", type=int, default=None, help="requests in flight a camera (2)")
    p.add_argument("--rig", action="store_true", help="one instant of every camera in one batch")
    p.add_argument("--rgb", action="store_true", help="convert video to RGB on this CPU")
    p.add_argument(
        "--nv12",
        action="store_true",
        help="send video as NV12 (default: where the daemon converts it on its GPU)",
    )
    p.add_argument("--loop", action="store_true", help="play files again at their end")
    p.add_argument("--no-realtime", action="store_true", help="decode files as fast as they go")
    p.add_argument("--seconds", type=float, help="stop after this long")
    p.add_argument("--conf", type=float, help="the confidence threshold (the model's default)")
    p.add_argument("--save", metavar="DIR", help="write each answered frame with its boxes")
    p.add_argument("--no-shm", action="store_true", help="frames in the message, not shm")
    p.add_argument("--quiet", action="store_true", help="no progress and no summary")
    return p


def _rig_config(args: argparse.Namespace) -> RigConfig:
    """The command line as a config (a ``--config`` file with the command line's overrides)."""
    if args.config:
        if args.sources:
            raise UsageError("give sources on the command line or in --config, not both")
        config = load_config(args.config)
    else:
        if not args.sources:
            raise UsageError("no source: give one or more, or --config FILE")
        cams: dict[str, CameraConfig] = {}
        for uri in args.sources:
            cams[f"{len(cams)}:{uri}"] = CameraConfig(uri)
        config = RigConfig(cameras=cams)
    changes: dict[str, Any] = {}
    if args.endpoint:
        changes["endpoints"], changes["endpoint"] = args.endpoint, None
    for name in ("model", "in_flight", "conf"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.rig:
        changes["rig"] = True
    if args.rgb and args.nv12:
        raise UsageError("--rgb and --nv12 contradict each other")
    if args.rgb or args.nv12:
        changes["output"] = "rgb" if args.rgb else "nv12"
    if args.json or args.jsonl:
        changes["sinks"] = msgspec.structs.replace(
            changes.get("sinks", config.sinks), json=JsonSinkConfig(path=args.jsonl or "-")
        )
    if args.mqtt:
        mqtt = MqttSinkConfig(url=args.mqtt, topic=args.mqtt_topic or "dlad/{camera}")
        changes["sinks"] = msgspec.structs.replace(changes.get("sinks", config.sinks), mqtt=mqtt)
    if args.webhook:
        hook = WebhookSinkConfig(url=args.webhook)
        changes["sinks"] = msgspec.structs.replace(changes.get("sinks", config.sinks), webhook=hook)
    return msgspec.structs.replace(config, **changes)


def _sources(config: RigConfig, args: argparse.Namespace, from_file: bool) -> list[Source]:
    sources = []
    for key, cam in config.cameras.items():
        name = key if from_file else None
        try:
            output: Output = "rgb" if config.output == "rgb" else "nv12"  # auto: set later
            sources.append(open_source(
                cam.source, name=name, output=output, fps=args.fps or cam.fps,
                realtime=cam.realtime and not args.no_realtime, loop=cam.loop or args.loop,
                options=cam.options,
            ))  # fmt: skip
        except SourceError as exc:
            raise UsageError(str(exc)) from None
    names = [s.name for s in sources]
    for i, source in enumerate(sources):  # two sources of one name: numbered
        if names.count(source.name) > 1:
            source.name = f"{source.name}-{i}"
    return sources


def pixels_for(report: DaemonStatus, model: str) -> Output:
    """NV12 where every device serving ``model`` pre-processes on its GPU (a YUV frame is
    converted there, in the pre kernel), else RGB: a CPU-only daemon converts NV12 in numpy,
    which costs more than converting here (docs/cameras.md). A daemon that does not say
    (older than the field) cannot take NV12 either."""
    where = {d["name"]: d.get("pre_post") for d in report["devices"]}
    serving = next((m["devices"] for m in report["models"] if m["name"] == model), [])
    return "nv12" if serving and all(where.get(d) == "gpu" for d in serving) else "rgb"


def _endpoints(config: RigConfig) -> list[str]:
    if config.endpoints:
        return list(config.endpoints)
    return [config.endpoint or "tcp://127.0.0.1:5555"]


def _table(rig: CameraRig) -> Table:
    table = Table(title="dlad-cam", title_justify="left")
    for col in ("camera", "fps in", "fps out", "dropped", "superseded", "shed", "failed",
                "p50 ms", "p99 ms", "reconnects"):  # fmt: skip
        table.add_column(col, justify="left" if col == "camera" else "right")
    for r in rig.rows():
        table.add_row(
            r["camera"], f"{r['fps_in']:.1f}", f"{r['fps_out']:.1f}", str(r["dropped_at_source"]),
            str(r["superseded"]), str(r["shed"]), str(r["failed"]), fmt_ms(r["p50_ms"]),
            fmt_ms(r["p99_ms"]), str(r["reconnects"]),
        )  # fmt: skip
    return table


_AV_FORMATS: Final = {"RGB": "rgb24", "BGR": "bgr24", "GRAY": "gray", "NV12": "nv12",
                      "YUYV": "yuyv422"}  # fmt: skip
"""The wire's pixel formats as FFmpeg names them."""


class _Saver:
    """Each answered frame with its boxes drawn, as ``DIR/CAMERA/FRAME.jpg``."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def __call__(self, event: dict[str, Any], result: Result, frame: CameraFrame) -> None:
        import av  # noqa: PLC0415  # the cameras extra: FFmpeg converts the frame to draw on
        from PIL import Image  # noqa: PLC0415

        fmt = frame.pixel_format
        layout = fmt.layout if isinstance(fmt, YuvFormat) else fmt
        picture = av.VideoFrame.from_ndarray(frame.array(), format=_AV_FORMATS[layout])
        if isinstance(fmt, YuvFormat):  # the frame's own colour, as the daemon reads it
            space = "ITU709" if fmt.colorspace == "bt709" else "ITU601"
            full = "JPEG" if fmt.color_range == "full" else "MPEG"
            picture = picture.reformat(format="rgb24", src_colorspace=space, src_color_range=full)
        rgb = cast("npt.NDArray[np.uint8]", picture.to_ndarray(format="rgb24"))
        out = self.root / frame.source.replace("/", "_")
        out.mkdir(parents=True, exist_ok=True)
        Image.fromarray(result.draw(rgb)).save(out / f"{frame.index:06d}.jpg", quality=90)


async def _run(
    config: RigConfig, sources: list[Source], args: argparse.Namespace, out: IO[str] | None
) -> int:
    sinks = config.sinks.build(out)
    endpoints = _endpoints(config)
    in_flight = config.in_flight * (1 if config.rig else len(sources))
    shm: dict[str, int] = {}
    if not args.no_shm and all(_local(e) for e in endpoints):
        frame = 1920 * 1080 * 3 // (1 if config.output == "rgb" else 2)  # a 1080p frame
        shm = {"shm_slot_bytes": frame, "shm_slots": in_flight + len(sources)}
    console = Console(stderr=True)
    live = console.is_terminal and not args.quiet
    client = AsyncClient(endpoints, max_in_flight=max(in_flight, 1), **shm)  # type: ignore[arg-type]
    try:
        async with client:
            try:  # a model the daemon does not serve stops here, in one line
                await client.class_names(config.model, timeout_s=5.0)
                output = config.output
                if output == "auto":
                    output = pixels_for(await client.status(timeout_s=5.0), config.model)
            except NotFound as exc:
                raise UsageError(str(exc)) from None
            except (InternalError, ClientTimeout):
                output = "rgb" if config.output == "auto" else config.output  # the frames will say
            for source in sources:
                source.output = output
            rig = CameraRig(
                client, sources, model=config.model, in_flight=config.in_flight, rig=config.rig,
                sinks=sinks, conf=config.conf, deadline_ms=config.deadline_ms,
                on_result=_Saver(args.save) if args.save else None,
            )  # fmt: skip
            display = Live(_table(rig), console=console, refresh_per_second=2, transient=True)
            with display if live else contextlib.nullcontext():
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_stop_on_signal, rig)
                    if args.seconds is not None:
                        tg.start_soon(_stop_after, rig, args.seconds)
                    if live:
                        tg.start_soon(_refresh, display, rig)
                    await rig.run()
                    tg.cancel_scope.cancel()
    except OSError as exc:  # the shared-memory segment (a small /dev/shm): say so
        raise UsageError(f"shared memory: {exc} (try --no-shm)") from None
    if not args.quiet:
        console.print(_table(rig))
        for sink in sinks:
            console.print(_sink_line(sink, rig))
        for r in rig.rows():
            if r["error"]:
                console.print(f"{r['camera']}: {r['error']}")
    return 0 if any(s.ok for s in rig.stats.values()) else 1


def _sink_line(sink: Sink, rig: CameraRig) -> str:
    """A sink's summary: sent, and each way an event did not get there."""
    words = [f"sink {sink.name}: {sink.sent} sent"]
    for count, why in ((rig.sink_dropped[sink.name], "dropped (its queue was full)"),
                       (sink.limited, "over max_per_s"), (sink.filtered, "filtered out"),
                       (sink.failed, "failed")):  # fmt: skip
        if count:
            words.append(f"{count} {why}")
    error = rig.sink_errors.get(sink.name) or getattr(sink, "error", "")
    return ", ".join(words) + (f" (last error: {error})" if error else "")


async def _stop_on_signal(rig: CameraRig) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            rig.stop()
            return


async def _stop_after(rig: CameraRig, seconds: float) -> None:
    await anyio.sleep(seconds)
    rig.stop()


async def _refresh(display: Live, rig: CameraRig) -> None:
    while True:
        display.update(_table(rig))
        await anyio.sleep(0.5)


@contextlib.contextmanager
def _events_out(config: RigConfig) -> Iterator[IO[str] | None]:
    """Where the JSON events go: stdout, a file (appended to), or nowhere."""
    if config.sinks.json is None:
        yield None
    elif config.sinks.json.path == "-":
        yield sys.stdout
    else:
        try:
            f = open(config.sinks.json.path, "a", encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            raise UsageError(f"{config.sinks.json.path}: {exc.strerror or exc}") from None
        with f:
            yield f


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dlad-cam`` with ``argv`` (default: the command line); returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.in_flight is not None and args.in_flight < 1:
            raise UsageError("--in-flight must be >= 1")
        if args.fps is not None and not (math.isfinite(args.fps) and args.fps > 0):
            raise UsageError("--fps must be > 0")
        config = _rig_config(args)
        sources = _sources(config, args, from_file=bool(args.config))
        with _events_out(config) as out:
            return anyio.run(_run, config, sources, args, out)
    except UsageError as exc:
        print(f"dlad-cam: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
