"""``dlad-cam`` and the camera rig end to end: a video made from prep's synthetic scenes (PyAV,
H.264) through the sources into a real daemon, each frame's detections equal to the SDK's for
the same decoded frame; frames dropped at the source and superseded, counted; a live source
that drops, reconnected; a full sink that costs no frame; errors in one line; Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import av
import numpy as np
import pytest
import zmq
from anyio.streams.memory import MemoryObjectReceiveStream
from PIL import Image

from dlad.imaging.pre import yuv_to_rgb
from dlad_client import AsyncClient, Client
from dlad_client.cam import main, pixels_for
from dlad_client.cameras import CameraRig, Sink
from dlad_client.sources import (
    CameraFrame,
    Pace,
    Source,
    SourceError,
    gstreamer,
    open_source,
)
from prep.data.synth import generate_image
from tests.clients.rtsp_server import Stream, encode, rtsp_server
from tests.clients.waiting import until
from tests.dlad.serving import NUMERIC_DEMO, serve_config

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
SLOW = """
[daemon]
default_deadline_ms = 60000.0
[frontend]
endpoints = ["tcp://127.0.0.1:5555"]
[devices.dla0]
kind = "dla"
core = 0
mode = "timing"
latency_us = 200000
queue_depth = 1
[models.demo]
devices = ["dla0"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
"""


def make_video(path: Path, frames: int, fps: int = 10, size: tuple[int, int] = (320, 256)) -> Path:
    """An H.264 clip of prep's synthetic scenes (each on a grey canvas of ``size``)."""
    w, h = size
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"preset": "ultrafast"}
        for i in range(frames):
            scene, _ = generate_image(7, i % 6)
            canvas = np.full((h, w, 3), 114, np.uint8)
            part = scene[:h, :w]
            canvas[: part.shape[0], : part.shape[1]] = part
            for packet in stream.encode(av.VideoFrame.from_ndarray(canvas, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A numeric-mode daemon (the real INT8 core) serving the bundled demo model; its default
    deadline is long, so that a loaded machine's slow core sheds nothing the tests count."""
    patient = "[daemon]\ndefault_deadline_ms = 60000.0\n" + NUMERIC_DEMO
    with serve_config(patient, tmp_path_factory.mktemp("cam")) as ep:
        yield ep


@pytest.fixture(scope="module")
def slow_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A core that takes 200 ms a frame: far slower than a 30 fps camera."""
    with serve_config(SLOW, tmp_path_factory.mktemp("cam")) as ep:
        yield ep


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_video(tmp_path_factory.mktemp("clip") / "clip.mp4", 12)


def _rows(detections: list[dict[str, Any]]) -> np.ndarray:
    rows = [[*d["box"], d["score"], d["class_id"]] for d in detections]
    return np.array(rows, np.float32).reshape(-1, 6)


def _events(text: str) -> list[dict[str, Any]]:
    """The JSON events among the lines (the in-process daemon logs to stdout too)."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_every_frame_of_a_video_is_the_sdks_detections(
    endpoint: str, clip: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--no-realtime`` sends every frame of a file: each event's detections (with class
    names) are the SDK's for the same decoded frame, sent as NV12 the same way."""
    args = [str(clip), "--endpoint", endpoint, "--json", "--no-realtime", "--quiet", "--nv12"]
    assert main(args) == 0
    events = sorted(_events(capsys.readouterr().out), key=lambda e: e["frame"])  # as answered
    assert [e["frame"] for e in events] == list(range(12))
    frames = list(open_source(str(clip), realtime=False).frames())
    assert all(getattr(f.pixel_format, "layout", None) == "NV12" for f in frames)
    with Client(endpoint, timeout_s=60) as client:
        names = client.class_names("demo")
        for event, frame in zip(events, frames, strict=True):
            want = client.detect(frame.array(), pixel_format=frame.pixel_format)
            np.testing.assert_array_equal(_rows(event["detections"]), want.detections)
            assert [d["class_name"] for d in event["detections"]] == want.labels
            assert event["camera"] == "clip"
            assert event["device"] == "dla0"
    assert sum(len(e["detections"]) for e in events) > 0
    assert {d["class_name"] for e in events for d in e["detections"]} <= set(names)


def test_video_goes_as_rgb_to_a_daemon_that_pre_processes_on_its_cpu(
    endpoint: str, clip: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --nv12 or --rgb, dlad-cam asks the daemon where it pre-processes: this one
    (no GPU) on its CPU, so video is converted to RGB here, which costs less than the daemon's
    numpy conversion of NV12."""
    assert main([str(clip), "--endpoint", endpoint, "--json", "--no-realtime", "--quiet"]) == 0
    events = sorted(_events(capsys.readouterr().out), key=lambda e: e["frame"])
    frames = list(open_source(str(clip), output="rgb", realtime=False).frames())
    with Client(endpoint, timeout_s=60) as client:
        assert client.status()["devices"][0].get("pre_post") == "cpu"
        for event, frame in zip(events, frames, strict=True):
            want = client.detect(frame.array(), pixel_format=frame.pixel_format)
            np.testing.assert_array_equal(_rows(event["detections"]), want.detections)


@pytest.mark.parametrize(
    ("where", "want"),
    [({"dla0": "gpu", "dla1": "gpu"}, "nv12"), ({"dla0": "gpu", "dla1": "cpu"}, "rgb"),
     ({"dla0": "gpu"}, "rgb"), ({"dla0": None, "dla1": None}, "rgb")],
)  # fmt: skip
def test_nv12_goes_only_where_every_engine_converts_it_on_its_gpu(
    where: dict[str, str | None], want: str
) -> None:
    devices = [{"name": n} | ({} if w is None else {"pre_post": w}) for n, w in where.items()]
    report: Any = {"devices": devices, "models": [{"name": "demo", "devices": ["dla0", "dla1"]}]}
    assert pixels_for(report, "demo") == want
    assert pixels_for(report, "other") == "rgb"


def test_images_in_a_directory_are_sent_as_rgb(
    endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    images = ROOT / "dlad/models/demo/images"
    assert main([str(images), "--endpoint", endpoint, "--json", "--quiet"]) == 0
    events = sorted(_events(capsys.readouterr().out), key=lambda e: e["frame"])
    paths = sorted(images.glob("*.jpg"))
    assert len(events) == len(paths)
    frames = list(open_source(str(images)).frames())
    with Client(endpoint, timeout_s=60) as client:
        for event, frame in zip(events, frames, strict=True):
            assert frame.pixel_format == "RGB"
            want = client.detect(frame.array())
            np.testing.assert_array_equal(_rows(event["detections"]), want.detections)


def _run_rig(endpoint: str, sources: list[Source], **kwargs: Any) -> CameraRig:
    async def go() -> CameraRig:
        async with AsyncClient(endpoint, timeout_s=60, max_in_flight=16) as client:
            rig = CameraRig(client, sources, **kwargs)
            await rig.run()
            return rig

    return anyio.run(go)


def _check_counts(rig: CameraRig) -> None:
    """Every decoded frame is accounted for: dropped at the source, or sent and answered."""
    for s in rig.stats.values():
        assert s.decoded == s.sent + s.dropped_at_source, s
        assert s.sent == s.ok + s.superseded + s.shed + s.failed, s


def test_a_camera_faster_than_the_daemon_drops_at_the_source(
    slow_endpoint: str, tmp_path: Path
) -> None:
    """30 fps played in real time against 200 ms a frame: frames are dropped here, none waits
    in a queue, and what is sent is answered."""
    video = make_video(tmp_path / "fast.mp4", 30, fps=30, size=(160, 128))
    rig = _run_rig(slow_endpoint, [open_source(str(video))], in_flight=1)
    (stats,) = rig.stats.values()
    _check_counts(rig)
    assert stats.decoded == 30
    assert stats.dropped_at_source >= 1
    assert stats.ok >= 1
    assert stats.failed == 0


def test_a_queued_frame_is_superseded_by_the_newer_one(slow_endpoint: str, tmp_path: Path) -> None:
    """A camera (30 fps) with four frames in flight against 200 ms a frame: two run (the
    core's two task slots) and a queued one is replaced by a newer one of its stream: the
    daemon answers it CANCELLED, counted as superseded."""
    video = make_video(tmp_path / "fast.mp4", 8, fps=30, size=(160, 128))
    rig = _run_rig(slow_endpoint, [open_source(str(video))], in_flight=4)
    (stats,) = rig.stats.values()
    _check_counts(rig)
    assert stats.superseded >= 1
    assert stats.failed == 0


def test_a_lossless_source_loses_no_frame_to_a_newer_one(
    slow_endpoint: str, tmp_path: Path
) -> None:
    """The same four in flight from a file sent as fast as the rig takes it (lossless): its
    frames go without a stream, so none supersedes another, and every frame is answered."""
    video = make_video(tmp_path / "fast.mp4", 8, fps=30, size=(160, 128))
    rig = _run_rig(slow_endpoint, [open_source(str(video), realtime=False)], in_flight=4)
    (stats,) = rig.stats.values()
    _check_counts(rig)
    assert (stats.decoded, stats.ok, stats.superseded, stats.dropped_at_source) == (8, 8, 0, 0)


class Flaky(Source):
    """A live source that drops twice after two frames, then gives three and ends its run;
    each frame waits for the one before to be taken (none dropped at the source)."""

    live = True
    lossless = True

    def __init__(self, frame: CameraFrame) -> None:
        self.name, self.frame, self.runs = "flaky", frame, 0

    def frames(self) -> Iterator[CameraFrame]:
        self.runs += 1
        f = self.frame
        for i in range(2 if self.runs <= 2 else 3):
            yield CameraFrame(self.name, i, time.monotonic_ns(), None, f.height, f.width,
                              f.pixel_format, f._write)  # fmt: skip
        if self.runs <= 2:
            raise SourceError("flaky: the stream ended")
        self.live = False  # the third run ends for good (a real camera would go on)


def test_a_live_source_that_drops_is_opened_again(endpoint: str, clip: Path) -> None:
    (frame, *_) = open_source(str(clip), realtime=False).frames()
    source = Flaky(frame)
    rig = _run_rig(endpoint, [source], in_flight=1, backoff_s=(0.01, 0.02))
    (stats,) = rig.stats.values()
    assert source.runs == 3
    assert stats.reconnects == 2
    assert stats.error == "flaky: the stream ended"
    _check_counts(rig)
    assert (stats.decoded, stats.ok) == (7, 7)


class Stuck(Sink):
    """A sink that never reads (a broker that is down)."""

    name = "stuck"

    async def run(self, events: MemoryObjectReceiveStream[dict[str, Any]]) -> None:
        await anyio.Event().wait()  # nothing sets it: the rig cancels the sink at its end


def test_a_sink_that_is_down_costs_no_frame(endpoint: str, tmp_path: Path) -> None:
    video = make_video(tmp_path / "long.mp4", 300, fps=30, size=(64, 64))
    source = open_source(str(video), realtime=False)
    rig = _run_rig(endpoint, [source], sinks=[Stuck()], sink_drain_s=0.05)
    (stats,) = rig.stats.values()
    assert stats.ok == 300  # every frame answered, lossless
    assert rig.sink_dropped["stuck"] == 300 - 256  # the sink's queue held 256


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "no source"),
        (["/no/such.mp4"], "/no/such.mp4: no such file"),
        (["--config", "/no/such.toml"], "/no/such.toml"),
        (["x.mp4", "--in-flight", "0"], "--in-flight must be >= 1"),
        (["x.mp4", "--fps", "-1"], "--fps must be > 0"),
    ],
)
def test_bad_arguments_are_one_line_and_status_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("dlad-cam: ")
    assert message in err
    assert "Traceback" not in err


def test_a_config_file_runs_its_cameras_into_its_sink(
    endpoint: str, clip: Path, tmp_path: Path
) -> None:
    events = tmp_path / "events.jsonl"
    cfg = tmp_path / "cams.toml"
    cfg.write_text(f"""
endpoint = "{endpoint}"
rig = true
[cameras.front]
source = "{clip}"
realtime = false
[cameras.back]
source = "{clip}"
realtime = false
[sinks.json]
path = "{events}"
""")
    assert main(["--config", str(cfg), "--quiet"]) == 0
    got = _events(events.read_text())
    # lossless files: every frame of each camera answered once (in the order answered, which
    # two frames on the core's two task slots at once may swap)
    by_camera = {c: sorted(e["frame"] for e in got if e["camera"] == c) for c in ("front", "back")}
    assert by_camera == {"front": list(range(12)), "back": list(range(12))}, got


def test_an_unknown_field_in_the_config_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "cams.toml"
    cfg.write_text('[cameras.a]\nsource = "x.mp4"\nfsp = 3\n')
    assert main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "fsp" in err
    assert "Traceback" not in err


def test_ctrl_c_stops_the_sources_and_prints_the_summary(endpoint: str, clip: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlad_client.cam", str(clip), "--loop", "--json",
         "--endpoint", endpoint],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert proc.stdout is not None
    first = proc.stdout.readline()  # a result: the rig is running
    assert json.loads(first)["camera"] == "clip"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "clip" in err  # the summary's row


def test_a_camera_device_that_is_not_there_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["/dev/video97"]) == 2
    assert "dlad-cam: /dev/video97: no such camera" in capsys.readouterr().err


def _has_gstreamer() -> bool:
    try:
        gstreamer()
    except SourceError:
        return False
    return True


@pytest.mark.skipif(_has_gstreamer(), reason="GStreamer's Python bindings are installed here")
def test_a_gstreamer_source_without_its_bindings_says_what_to_install(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["gst:videotestsrc ! appsink name=sink"]) == 2
    err = capsys.readouterr().err
    assert "python3-gi" in err
    assert "Traceback" not in err


@pytest.mark.skipif(
    not _has_gstreamer(),
    reason="GStreamer's Python bindings (python3-gi, gir1.2-gstreamer-1.0) are not installed",
)
def test_a_gstreamer_pipeline_gives_nv12_frames(endpoint: str) -> None:
    """videotestsrc (GStreamer's base plugins) through an NV12 appsink, as a Jetson's
    nvv4l2decoder pipeline would end, into the daemon."""
    source = open_source(
        "gst:videotestsrc num-buffers=5 ! video/x-raw,width=320,height=240 ! videoconvert ! "
        "video/x-raw,format=NV12 ! appsink name=sink"
    )
    frames = []
    for frame in source.frames():
        frames.append(frame.array())
        if len(frames) == 3:
            source.close()
    assert frames[0].shape == (360, 320)
    with Client(endpoint, timeout_s=60) as client:
        assert client.detect(frames[0], pixel_format="NV12").device == "dla0"


# ------------------------------------------------------------------------------ faults


def test_an_rtsp_camera_that_drops_mid_stream_is_reconnected(endpoint: str) -> None:
    """A local RTSP server (H.264 over RTP/TCP, as IP cameras serve it) that cuts each client
    after 15 frames: the source reports the drop, is opened again, and frames keep coming."""
    scenes = [np.ascontiguousarray(generate_image(7, i)[0][:128, :160]) for i in range(6)]
    frames = [np.pad(s, ((0, 128 - s.shape[0]), (0, 160 - s.shape[1]), (0, 0))) for s in scenes]
    stream = Stream(encode(frames * 5, 30), 30, drop_after=15)
    with rtsp_server(stream) as url:

        async def go() -> CameraRig:
            async with AsyncClient(endpoint, timeout_s=60) as client:
                rig = CameraRig(client, [open_source(url, name="door")], backoff_s=(0.05, 0.1))
                async with anyio.create_task_group() as tg:
                    tg.start_soon(rig.run)
                    await until(lambda: rig.stats["door"].reconnects >= 2, timeout_s=60)
                    await until(lambda: rig.stats["door"].ok >= 20, timeout_s=60)
                    rig.stop()
                return rig

        rig = anyio.run(go)
    stats = rig.stats["door"]
    assert stream.sessions >= 3
    assert stream.dropped >= 2
    assert stats.error.endswith("the stream ended")
    assert stats.failed == 0
    assert stats.ok >= 20


def test_a_daemon_that_stops_answering_costs_the_camera_nothing(clip: Path) -> None:
    """A daemon that takes frames and never answers: each request times out (counted), the
    camera keeps decoding and dropping at the source, and the rig stops when asked."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:

        async def go() -> CameraRig:
            async with AsyncClient(f"tcp://127.0.0.1:{port}", timeout_s=0.5) as client:
                source = open_source(str(clip), loop=True)
                rig = CameraRig(client, [source], in_flight=1)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(rig.run)
                    await until(lambda: rig.stats["clip"].failed >= 2, timeout_s=60)
                    rig.stop()
                return rig

        rig = anyio.run(go)
    finally:
        router.close(linger=0)
        context.term()
    stats = rig.stats["clip"]
    assert stats.ok == 0
    assert stats.failed >= 2
    assert "ClientTimeout" in stats.error
    assert stats.dropped_at_source >= 1  # 10 fps decoded, one frame a half second sent


def test_save_writes_each_answered_frame_with_its_boxes(
    endpoint: str, clip: Path, tmp_path: Path
) -> None:
    assert main([str(clip), "--endpoint", endpoint, "--no-realtime", "--quiet",
                 "--save", str(tmp_path)]) == 0  # fmt: skip
    written = sorted((tmp_path / "clip").glob("*.jpg"))
    assert [p.name for p in written] == [f"{i:06d}.jpg" for i in range(12)]
    frame = next(iter(open_source(str(clip), realtime=False).frames()))
    plain = yuv_to_rgb(frame.array(), "NV12", 0)
    drawn = np.asarray(Image.open(written[0]))
    assert drawn.shape == plain.shape
    assert np.abs(drawn.astype(int) - plain).max() > 100  # boxes and labels were drawn on it


def test_an_fps_cap_drops_frames_at_the_source() -> None:
    """A 10 fps camera capped at 4 fps (the clock stepped a frame at a time): frames 0, 3, 5,
    8 and 10 are yielded, the others dropped where they are decoded."""
    now = [0]
    pace = Pace(4.0, realtime=False, clock=lambda: now[0])
    taken = []
    for index in range(12):
        now[0] = 1_000_000_000 + index * 100_000_000
        if pace.take():
            taken.append(index)
    assert taken == [0, 3, 5, 8, 10]


def test_a_capped_source_yields_fewer_frames(clip: Path) -> None:
    frames = list(open_source(str(clip), fps=4.0).frames())
    indices = [f.index for f in frames]
    assert indices[0] == 0
    assert len(indices) < 12
    assert indices == sorted(set(indices))
