"""Camera, video and image sources for dlad: each yields decoded frames, ready to send.

A source is opened from one string, as the camera tools of the field take it::

    photos/                  every image of a directory (sorted), or a glob: "shots/*.jpg"
    shot.png                 one image file (Pillow)
    clip.mp4                 a video file (PyAV: FFmpeg's demuxers and decoders)
    rtsp://cam/stream        an RTSP stream (over TCP), or http(s):// an HTTP stream
    /dev/video0              a USB camera (V4L2), also v4l2:///dev/video0
    gst:<pipeline>           a GStreamer pipeline ending in an appsink (Jetson's nvv4l2decoder,
                             nvarguscamerasrc), through GStreamer's Python bindings

and :meth:`Source.frames` yields :class:`CameraFrame` objects as they are decoded. A video
source decodes to NV12 (``output="nv12"``, the default: FFmpeg's H.264/H.265 decoders give
4:2:0, which becomes NV12 by interleaving its chroma, with no colour arithmetic) so the daemon
converts it on the GPU with the letterbox; ``output="rgb"`` converts on the CPU instead (the
baseline). A frame's colour (BT.601 or BT.709, limited or full range) is the stream's. A frame
is handed over as the decoder's own frame and written out once, by :meth:`CameraFrame.write`,
into the buffer it is sent from (a shared-memory slot): a frame dropped before it is sent is
never converted.

Files play at their own rate (``realtime=True``, as a camera would, dropping what the daemon
cannot take; ``False``: every frame, each as soon as the daemon takes it), image files one
after another; a ``fps`` cap drops frames at the source, and ``loop`` restarts a file at its
end.
Errors are :class:`SourceError`, one line naming the source.
"""

from __future__ import annotations

import glob
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

from dlad_wire.protocol import PixelFormat, YuvFormat, frame_shape

__all__ = [
    "IMAGE_SUFFIXES",
    "CameraFrame",
    "Source",
    "SourceError",
    "open_source",
]

IMAGE_SUFFIXES: Final = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
Output = Literal["nv12", "rgb"]
_LIVE_SCHEMES: Final = ("rtsp://", "rtsps://", "rtmp://", "http://", "https://", "udp://",
                        "tcp://", "srt://")  # fmt: skip


class SourceError(Exception):
    """A source that cannot be opened or read, in one line naming it."""


@dataclass(slots=True)
class CameraFrame:
    """One decoded frame of a source.

    ``index`` counts the source's frames from 0 (frames the ``fps`` cap skipped included);
    ``captured_ns`` is when it was decoded (``time.monotonic_ns``); ``pts_s`` its presentation
    time in the stream (None where it has none). :attr:`shape` and :attr:`pixel_format` are
    what it is sent as; :meth:`write` puts its pixels there, :meth:`array` into a new array.
    """

    source: str
    index: int
    captured_ns: int
    pts_s: float | None
    height: int
    width: int
    pixel_format: PixelFormat | YuvFormat
    _write: Any = field(repr=False)

    @property
    def shape(self) -> tuple[int, ...]:
        fmt = self.pixel_format
        return frame_shape(fmt.layout if isinstance(fmt, YuvFormat) else fmt, self.height,
                           self.width)  # fmt: skip

    def write(self, out: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
        """Write the frame's pixels into ``out`` (of :attr:`shape`, uint8); returns it."""
        if out.shape != self.shape or out.dtype != np.uint8:
            raise ValueError(f"a frame of shape {self.shape} does not fit {out.shape} {out.dtype}")
        self._write(out)
        return out

    def array(self) -> npt.NDArray[np.uint8]:
        """The frame's pixels in a new array."""
        return self.write(np.empty(self.shape, np.uint8))


class Source:
    """A source of frames (see the module's docstring); open one with :func:`open_source`."""

    name: str
    live: bool = False  # a stream that has no end of its own (reconnected when it drops)
    lossless: bool = False  # frames wait for the consumer (files not played in real time)
    output: Output = "rgb"  # what video is decoded to (settable until frames() starts)

    def frames(self) -> Iterator[CameraFrame]:
        """The frames, as they are decoded (blocking); raises SourceError."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop reading (a ``frames`` iterator in another thread ends at its next frame)."""


def open_source(
    uri: str,
    *,
    name: str | None = None,
    output: Output = "nv12",
    fps: float | None = None,
    realtime: bool = True,
    loop: bool = False,
    options: dict[str, str] | None = None,
) -> Source:
    """The source ``uri`` names (see the module's docstring), called ``name`` (its stream on
    the daemon; default: the file's stem or the URI). ``fps``: the most frames a second it
    yields (the rest are dropped here); ``options``: FFmpeg's (for example ``{"video_size":
    "1280x720", "input_format": "mjpeg"}`` for a V4L2 camera). Raises SourceError for a URI
    that names nothing."""
    if output not in ("nv12", "rgb"):
        raise SourceError(f"{uri}: output must be 'nv12' or 'rgb', got {output!r}")
    if fps is not None and not fps > 0:
        raise SourceError(f"{uri}: fps must be positive, got {fps!r}")
    if uri.startswith("gst:"):
        return GstSource(uri.removeprefix("gst:").strip(), name=name or "gst", output=output,
                         fps=fps)  # fmt: skip
    device = uri.removeprefix("v4l2://")
    if device.startswith("/dev/video"):
        if not os.path.exists(device):
            raise SourceError(f"{uri}: no such camera")
        return AvSource(device, name=name or Path(device).name, output=output, fps=fps,
                        realtime=False, loop=False, live=True, av_format="v4l2",
                        options=options)  # fmt: skip
    if uri.startswith(_LIVE_SCHEMES):
        opts = {"rtsp_transport": "tcp"} if uri.startswith("rtsp") else {}
        return AvSource(uri, name=name or _uri_name(uri), output=output, fps=fps, realtime=False,
                        loop=False, live=True, options=opts | (options or {}))  # fmt: skip
    images = _image_files(uri)
    if images is not None:
        return ImageFiles(images, name=name or _uri_name(uri), fps=fps, loop=loop)
    if not os.path.exists(uri):
        raise SourceError(f"{uri}: no such file, directory, camera or stream")
    return AvSource(uri, name=name or Path(uri).stem, output=output, fps=fps, realtime=realtime,
                    loop=loop, live=False, options=options)  # fmt: skip


def _uri_name(uri: str) -> str:
    stem = uri.split("://", 1)[-1].rstrip("/")
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in stem)[-64:] or "source"


def _image_files(uri: str) -> list[str] | None:
    """The image files ``uri`` names (a directory, a glob or one image), or None where it is
    not images. Raises SourceError for a directory or glob without any."""
    if os.path.isdir(uri):
        found = sorted(str(p) for p in Path(uri).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    elif glob.has_magic(uri):
        found = sorted(p for p in glob.glob(uri) if Path(p).suffix.lower() in IMAGE_SUFFIXES)
    elif Path(uri).suffix.lower() in IMAGE_SUFFIXES:
        if not os.path.isfile(uri):
            raise SourceError(f"{uri}: no such image")
        return [uri]
    else:
        return None
    if not found:
        raise SourceError(f"{uri}: no images ({', '.join(IMAGE_SUFFIXES)}) there")
    return found


class Pace:
    """The ``fps`` cap (a frame due before its turn is dropped) and, for a file played in
    real time, the wait until a frame's presentation time; ``clock``: monotonic ns."""

    def __init__(
        self, fps: float | None, realtime: bool, clock: Callable[[], int] = time.monotonic_ns
    ) -> None:
        self.period_ns = None if fps is None else round(1e9 / fps)
        self.realtime, self.clock = realtime, clock
        self.next_ns = 0
        self.origin: tuple[int, float] | None = None  # (monotonic ns, pts s) of the first frame

    def wait(self, pts_s: float | None) -> None:
        if not self.realtime or pts_s is None:
            return
        if self.origin is None:
            self.origin = (time.monotonic_ns(), pts_s)
        due = self.origin[0] + round((pts_s - self.origin[1]) * 1e9)
        delay = due - time.monotonic_ns()
        if delay > 0:
            time.sleep(delay / 1e9)

    def take(self) -> bool:
        """Whether a frame ready now is yielded (else the cap drops it)."""
        if self.period_ns is None:
            return True
        now = self.clock()
        if self.next_ns == 0:
            self.next_ns = now
        if now < self.next_ns - self.period_ns // 10:  # a tenth of a period early still counts
            return False
        self.next_ns = max(self.next_ns + self.period_ns, now - self.period_ns // 2)
        return True


class ImageFiles(Source):
    """Image files (Pillow), as RGB frames, one after another (``fps``: at most that many)."""

    def __init__(self, paths: Sequence[str], *, name: str, fps: float | None, loop: bool) -> None:
        self.name, self.paths, self.loop = name, list(paths), loop
        self.lossless = fps is None  # each image is sent, one after another
        self._pace = Pace(fps, realtime=False)
        self._stop = threading.Event()

    def frames(self) -> Iterator[CameraFrame]:
        from PIL import Image, UnidentifiedImageError  # noqa: PLC0415

        index = 0
        while not self._stop.is_set():
            for path in self.paths:
                if self._stop.is_set():
                    return
                if self.period_wait():
                    index += 1
                    continue
                try:
                    with Image.open(path) as img:
                        rgb = np.asarray(img.convert("RGB"))
                except (OSError, UnidentifiedImageError) as exc:
                    raise SourceError(f"{path}: not an image Pillow reads ({exc})") from None
                h, w = rgb.shape[:2]
                yield CameraFrame(self.name, index, time.monotonic_ns(), None, h, w, "RGB",
                                  lambda out, rgb=rgb: np.copyto(out, rgb))  # fmt: skip
                index += 1
            if not self.loop:
                return

    def period_wait(self) -> bool:
        """Whether the ``fps`` cap drops the next image (an image is ready at once: it waits
        for its turn instead)."""
        if self._pace.period_ns is not None:
            delay = self._pace.next_ns - time.monotonic_ns()
            if delay > 0:
                time.sleep(delay / 1e9)
        return not self._pace.take()

    def close(self) -> None:
        self._stop.set()


def colour_of(frame: Any) -> YuvFormat:
    """A decoded frame's colour, as its stream names it: BT.709 where it says so (or, unnamed,
    for HD and larger, FFmpeg's guess too), else BT.601; full range where it says so (or the
    format is a JPEG one), else limited."""
    import av  # noqa: PLC0415

    spaces = av.video.reformatter.Colorspace
    space = int(frame.colorspace)
    bt709 = space == int(spaces.ITU709) or (
        space not in (int(spaces.ITU601), int(spaces.SMPTE170M), int(spaces.FCC))
        and frame.height >= 720
    )
    full = int(frame.color_range) == int(av.video.reformatter.ColorRange.JPEG) or (
        frame.format.name.startswith("yuvj")
    )
    return YuvFormat("NV12", "bt709" if bt709 else "bt601", "full" if full else "limited")


def _plane(frame: Any, i: int, rows: int, cols: int) -> npt.NDArray[np.uint8]:
    """Plane ``i`` of a decoded frame as a ``rows x cols`` view (its line padding skipped)."""
    plane = frame.planes[i]
    buf = np.frombuffer(plane, np.uint8)
    return buf.reshape(-1, plane.line_size)[:rows, :cols]


def nv12_writer(frame: Any) -> Any:
    """A function writing a decoded frame into a ``3H/2 x W`` NV12 array: a copy of an NV12
    frame's planes, an interleave of a 4:2:0 planar frame's chroma (no colour arithmetic),
    else FFmpeg's conversion."""
    h, w = frame.height, frame.width
    name = frame.format.name

    def write(out: npt.NDArray[np.uint8]) -> None:
        if name == "nv12":
            out[:h] = _plane(frame, 0, h, w)
            out[h:] = _plane(frame, 1, h // 2, w)
        elif name in ("yuv420p", "yuvj420p"):
            out[:h] = _plane(frame, 0, h, w)
            uv = out[h:].reshape(h // 2, w // 2, 2)
            uv[:, :, 0] = _plane(frame, 1, h // 2, w // 2)
            uv[:, :, 1] = _plane(frame, 2, h // 2, w // 2)
        else:
            np.copyto(out, frame.reformat(format="nv12").to_ndarray())

    return write


class AvSource(Source):
    """A video file, stream or V4L2 camera, decoded by FFmpeg through PyAV (frame threads)."""

    def __init__(
        self,
        uri: str,
        *,
        name: str,
        output: Output,
        fps: float | None,
        realtime: bool,
        loop: bool,
        live: bool,
        av_format: str | None = None,
        options: dict[str, str] | None = None,
    ) -> None:
        self.uri, self.name, self.output, self.loop, self.live = uri, name, output, loop, live
        self.fps, self.realtime = fps, realtime
        self.lossless = not live and not realtime and fps is None
        self.av_format, self.options = av_format, dict(options or {})
        self._container: Any = None
        self._stop = threading.Event()

    def _open(self) -> Any:
        try:
            import av  # noqa: PLC0415
        except ImportError:
            raise SourceError(
                f"{self.uri}: video sources need PyAV (pip install 'dlad[cameras]')"
            ) from None
        try:
            container = av.open(self.uri, format=self.av_format, options=self.options,
                                timeout=(10.0, 5.0))  # fmt: skip
        except (av.FFmpegError, OSError) as exc:
            raise SourceError(f"{self.uri}: cannot open it ({exc})") from None
        if not container.streams.video:
            container.close()
            raise SourceError(f"{self.uri}: has no video stream")
        container.streams.video[0].thread_type = "AUTO"
        return container

    def frames(self) -> Iterator[CameraFrame]:
        import av  # noqa: PLC0415

        index = 0
        while not self._stop.is_set():
            container = self._container = self._open()
            pace = Pace(self.fps, self.realtime)
            try:
                stream = container.streams.video[0]
                for frame in container.decode(stream):
                    if self._stop.is_set():
                        return
                    pts = None if frame.pts is None else float(frame.pts * stream.time_base)
                    pace.wait(pts)
                    if pace.take():
                        yield self._frame(frame, index, pts)
                    index += 1
            except av.FFmpegError as exc:
                if self._stop.is_set():
                    return
                raise SourceError(f"{self.uri}: decoding failed ({exc})") from None
            finally:
                container.close()
                self._container = None
            if self.live and not self._stop.is_set():
                raise SourceError(f"{self.uri}: the stream ended")
            if not self.loop:
                return

    def _frame(self, frame: Any, index: int, pts: float | None) -> CameraFrame:
        now = time.monotonic_ns()
        h, w = frame.height, frame.width
        if self.output == "rgb" or h % 2 or w % 2:  # NV12 has even sides
            rgb = frame.to_ndarray(format="rgb24")
            return CameraFrame(self.name, index, now, pts, h, w, "RGB",
                               lambda out: np.copyto(out, rgb))  # fmt: skip
        return CameraFrame(self.name, index, now, pts, h, w, colour_of(frame), nv12_writer(frame))

    def close(self) -> None:
        self._stop.set()


def gstreamer() -> Any:
    """GStreamer's Python module (``gi.repository.Gst``); raises SourceError naming the
    packages where its bindings are not installed."""
    try:
        import gi  # noqa: PLC0415

        gi.require_version("Gst", "1.0")
        from gi.repository import Gst  # noqa: PLC0415
    except (ImportError, ValueError):
        raise SourceError(
            "gst: GStreamer sources need GStreamer's Python bindings (python3-gi and "
            "gir1.2-gstreamer-1.0 on Debian, Ubuntu and JetPack)"
        ) from None
    return Gst


class GstSource(Source):
    """A GStreamer pipeline ending in an ``appsink`` (``appsink name=sink`` or the last
    element), its caps set to ``video/x-raw,format=NV12`` (``output="nv12"``) or ``RGB``, through
    GStreamer's Python bindings (Debian and JetPack: ``python3-gi``, ``gir1.2-gstreamer-1.0``).
    On a Jetson: ``nvv4l2decoder ! nvvidconv ! video/x-raw,format=NV12 ! appsink``."""

    live = True

    def __init__(self, pipeline: str, *, name: str, output: Output, fps: float | None) -> None:
        self.pipeline, self.name, self.output = pipeline, name, output
        self._pace = Pace(fps, realtime=False)
        self._stop = threading.Event()
        self._gst: Any = gstreamer()

    def _start(self) -> tuple[Any, Any, Any]:
        Gst = self._gst
        Gst.init(None)
        caps = "NV12" if self.output == "nv12" else "RGB"
        text = self.pipeline if "appsink" in self.pipeline else (
            f"{self.pipeline} ! videoconvert ! video/x-raw,format={caps} ! appsink name=sink"
        )  # fmt: skip
        try:
            pipe = Gst.parse_launch(text)
        except Exception as exc:  # noqa: BLE001 (GLib.Error, named in the message)
            raise SourceError(f"gst: {text}: {exc}") from None
        sink = pipe.get_by_name("sink") or pipe.get_by_interface(Gst.ChildProxy)
        sink.set_property("max-buffers", 1)
        sink.set_property("drop", True)  # the newest buffer wins: no queue behind a slow daemon
        pipe.set_state(Gst.State.PLAYING)
        return Gst, pipe, sink

    def frames(self) -> Iterator[CameraFrame]:
        gst, pipe, sink = self._start()
        index = 0
        try:
            while not self._stop.is_set():
                sample = sink.emit("try-pull-sample", 500 * gst.MSECOND)
                if sample is None:
                    if sink.get_property("eos"):
                        raise SourceError(f"gst: {self.pipeline}: the stream ended")
                    continue
                if self._pace.take():
                    yield self._frame(sample, index)
                index += 1
        finally:
            pipe.set_state(gst.State.NULL)

    def _frame(self, sample: Any, index: int) -> CameraFrame:
        from gi.repository import GstVideo  # noqa: PLC0415

        info = GstVideo.VideoInfo.new_from_caps(sample.get_caps())
        w, h, fmt = info.width, info.height, info.finfo.name
        buffer = sample.get_buffer()
        pixels = np.frombuffer(buffer.extract_dup(0, buffer.get_size()), np.uint8)
        now = time.monotonic_ns()

        def plane(i: int, rows: int, cols: int) -> npt.NDArray[np.uint8]:
            """Plane ``i`` without its row padding (GStreamer aligns strides)."""
            at, stride = info.offset[i], info.stride[i]
            return pixels[at : at + rows * stride].reshape(rows, stride)[:, :cols]

        if fmt == "NV12":
            colour = YuvFormat("NV12", "bt709" if h >= 720 else "bt601")
            luma, uv = plane(0, h, w), plane(1, h // 2, w)

            def write(out: npt.NDArray[np.uint8]) -> None:
                out[:h], out[h:] = luma, uv

            return CameraFrame(self.name, index, now, None, h, w, colour, write)
        rgb = plane(0, h, w * 3).reshape(h, w, 3)
        return CameraFrame(self.name, index, now, None, h, w, "RGB",
                           lambda out: np.copyto(out, rgb))  # fmt: skip

    def close(self) -> None:
        self._stop.set()
