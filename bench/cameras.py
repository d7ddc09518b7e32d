"""Many cameras into one daemon: dlad's camera rig (NV12, and RGB converted on the CPU) against
OpenCV's ``VideoCapture`` + RGB conversion + ``Client.detect``, the same cameras, one run.

    python bench/cameras.py [--cameras 8 16] [--seconds 10] [--size 1280x720] [--fps 30]
        [--latency-us 3820] [--pre-post cpu|cuda] [--json FILE]

Each camera is an H.264 file of prep's synthetic scenes (made once, looped), played at its
frame rate as a live camera would be, each under its own stream name. The daemon runs in a
process of its own: two emulated DLA cores in timing mode at ``--latency-us`` a frame (3.82 ms:
YOLOv5s-672 on Orin, published), with pre/post-processing on the CPU or as CUDA kernels.

Three ways to feed it, each for ``--seconds``:

* ``dlad nv12``: :class:`dlad_client.cameras.CameraRig` (what ``dlad-cam`` runs): frames
  decoded to NV12 (4:2:0 interleaved, no colour arithmetic) into shared-memory slots, two in
  flight a camera, dropped at the source when the daemon is behind;
* ``dlad rgb``: the same rig, frames converted to RGB on this CPU (FFmpeg's swscale);
* ``opencv``: a thread a camera, ``cv2.VideoCapture.read()`` (BGR), ``cvtColor`` to RGB,
  ``Client.detect`` (one in flight), the loop most camera scripts are: it never drops, so when
  it is behind, frames wait in the decoder and the lag grows.

Reported per way: frames in (decoded), answered, dropped at the source, superseded, failed;
camera-to-result latency p50/p99, from the moment the camera would have shown the frame (its
index / fps after the camera's first frame) to its result; and CPU per frame: the feeding
process's (decode, conversion, sending) per frame in, and the daemon's per frame answered.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "clients")]

from dlad_client import (  # noqa: E402
    AsyncClient,
    Client,
    ClientTimeout,
    DeadlineExceeded,
    DladError,
    Overloaded,
)
from dlad_client.cameras import CameraRig  # noqa: E402
from dlad_client.sources import CameraFrame, Output, Source, open_source  # noqa: E402

CONFIG = """
[daemon]
default_deadline_ms = 1000.0
[frontend]
endpoints = ["tcp://127.0.0.1:{port}"]
max_message_bytes = 67108864
[metrics]
enabled = false
[logging]
level = "warning"
[pre_post]
backend = "{pre_post}"
[devices.dla0]
kind = "dla"
core = 0
mode = "timing"
latency_us = {latency}
queue_depth = 32
[devices.dla1]
kind = "dla"
core = 1
mode = "timing"
latency_us = {latency}
queue_depth = 32
{gpu}
[models.demo]
devices = ["dla0", "dla1"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
core1 = "bundled:demo/fp16_heads.dla1.emu"
"""


def make_clip(path: Path, size: tuple[int, int], fps: int, seconds: float) -> Path:
    """An H.264 file of prep's synthetic scenes, each held for a quarter of a second."""
    import av
    from PIL import Image

    from prep.data.synth import generate_image

    w, h = size
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"preset": "veryfast", "g": str(fps)}
        for i in range(round(seconds * fps)):
            scene = generate_image(11, i // max(1, fps // 4))[0]
            frame = np.asarray(Image.fromarray(scene).resize((w, h)))
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    """dlad in a process of its own; its CPU time is read from outside."""

    def __init__(self, workdir: Path, latency_us: float, pre_post: str) -> None:
        self.port = free_port()
        cfg = workdir / "dlad.toml"
        gpu = '[devices.gpu]\nkind = "gpu"\nbackend = "cuda"' if pre_post == "cuda" else ""
        cfg.write_text(
            CONFIG.format(port=self.port, latency=latency_us, pre_post=pre_post, gpu=gpu)
        )
        self.log = workdir / "dlad.log"
        path = os.pathsep.join([str(ROOT), str(ROOT / "clients"), os.environ.get("PYTHONPATH", "")])
        env = os.environ | {"PYTHONPATH": path}
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dlad.cli", "--config", str(cfg)], env=env, stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        with Client(self.endpoint, timeout_s=2) as client:
            for _ in range(60):
                if self.proc.poll() is not None:
                    break
                with contextlib.suppress(ClientTimeout):
                    client.status()  # up
                    return
        sys.exit(f"the daemon did not come up:\n{self.log.read_text()[-3000:]}")

    def cpu_s(self) -> float:
        t = psutil.Process(self.proc.pid).cpu_times()
        return float(t.user + t.system)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class Scheduled(Source):
    """A source that notes when each of its frames was due: its first frame's time plus
    index / fps (a camera shows frame i then, whether or not anyone reads it)."""

    def __init__(self, inner: Source, fps: float) -> None:
        self.inner, self.name, self.live, self.period_ns = inner, inner.name, inner.live, 1e9 / fps
        self.first_ns: int | None = None

    def frames(self) -> Iterator[CameraFrame]:
        for frame in self.inner.frames():
            if self.first_ns is None:
                self.first_ns = frame.captured_ns - round(frame.index * self.period_ns)
            yield frame

    def due_ns(self, index: int) -> int:
        assert self.first_ns is not None
        return self.first_ns + round(index * self.period_ns)

    def close(self) -> None:
        self.inner.close()


def _summary(  # noqa: PLR0917
    name: str, seconds: float, counts: dict[str, int], latencies: list[float], source_cpu: float,
    daemon_cpu: float,
) -> dict[str, Any]:  # fmt: skip
    lat = np.array(latencies) if latencies else np.array([np.nan])
    frames_in, ok = counts["frames_in"], counts["ok"]
    return {
        "way": name, "seconds": round(seconds, 2), **counts,
        "fps_in": round(frames_in / seconds, 1), "fps_ok": round(ok / seconds, 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 1),
        "p99_ms": round(float(np.percentile(lat, 99)), 1),
        "source_cpu_ms_per_frame_in": round(1e3 * source_cpu / max(frames_in, 1), 3),
        "daemon_cpu_ms_per_frame_ok": round(1e3 * daemon_cpu / max(ok, 1), 3),
        "source_cpu_cores": round(source_cpu / seconds, 2),
        "daemon_cpu_cores": round(daemon_cpu / seconds, 2),
    }  # fmt: skip


def run_rig(  # noqa: PLR0917
    daemon: Daemon, clip: Path, cameras: int, fps: int, seconds: float, output: Output
) -> dict[str, Any]:
    sources = [Scheduled(open_source(str(clip), name=f"cam{i}", output=output, loop=True), fps)
               for i in range(cameras)]  # fmt: skip
    latencies: list[float] = []

    def on_result(event: dict[str, Any], result: Any, frame: CameraFrame) -> None:
        source = next(s for s in sources if s.name == frame.source)
        latencies.append((time.monotonic_ns() - source.due_ns(frame.index)) / 1e6)

    async def go() -> CameraRig:
        slot = 1920 * 1080 * 3
        async with AsyncClient(daemon.endpoint, timeout_s=30, max_in_flight=2 * cameras,
                               shm_slot_bytes=slot, shm_slots=3 * cameras) as client:  # fmt: skip
            rig = CameraRig(client, sources, in_flight=2, on_result=on_result)
            async with anyio.create_task_group() as tg:
                tg.start_soon(rig.run)
                await anyio.sleep(seconds)
                rig.stop()
            return rig

    me, d0 = psutil.Process(), daemon.cpu_s()
    c0, t0 = me.cpu_times(), time.monotonic()
    rig = anyio.run(go)
    c1, elapsed, d1 = me.cpu_times(), time.monotonic() - t0, daemon.cpu_s()
    keys = ("decoded", "ok", "dropped_at_source", "superseded", "shed", "failed")
    total = {k: sum(getattr(s, k) for s in rig.stats.values()) for k in keys}
    counts = {"frames_in": total["decoded"], "ok": total["ok"],
              "dropped_at_source": total["dropped_at_source"],
              "superseded": total["superseded"], "shed": total["shed"],
              "failed": total["failed"]}  # fmt: skip
    cpu = (c1.user + c1.system) - (c0.user + c0.system)
    return _summary(f"dlad {output}", elapsed, counts, latencies, cpu, d1 - d0)


def run_opencv(
    daemon: Daemon, clip: Path, cameras: int, fps: int, seconds: float
) -> dict[str, Any]:
    import cv2

    stop = threading.Event()
    latencies: list[float] = []
    counts = {"frames_in": 0, "ok": 0, "dropped_at_source": 0, "superseded": 0, "shed": 0,
              "failed": 0}  # fmt: skip
    lock = threading.Lock()

    def camera(i: int) -> None:
        cap = cv2.VideoCapture(str(clip))
        first = time.monotonic_ns()
        index = 0
        with Client(daemon.endpoint, timeout_s=30) as client:
            while not stop.is_set():
                due = first + round(index * 1e9 / fps)
                delay = due - time.monotonic_ns()
                if delay > 0:
                    time.sleep(delay / 1e9)
                ok, bgr = cap.read()
                if not ok:  # the end of the file: the camera goes on from its start
                    cap.release()
                    cap = cv2.VideoCapture(str(clip))
                    continue
                rgb = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
                with lock:
                    counts["frames_in"] += 1
                try:
                    client.detect(rgb, stream=f"cam{i}")
                except (Overloaded, DeadlineExceeded):
                    with lock:
                        counts["shed"] += 1
                except DladError:
                    with lock:
                        counts["failed"] += 1
                else:
                    with lock:
                        counts["ok"] += 1
                        latencies.append((time.monotonic_ns() - due) / 1e6)
                index += 1
        cap.release()

    me, d0 = psutil.Process(), daemon.cpu_s()
    c0, t0 = me.cpu_times(), time.monotonic()
    threads = [threading.Thread(target=camera, args=(i,)) for i in range(cameras)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(60)
    c1, elapsed, d1 = me.cpu_times(), time.monotonic() - t0, daemon.cpu_s()
    cpu = (c1.user + c1.system) - (c0.user + c0.system)
    return _summary("opencv", elapsed, counts, latencies, cpu, d1 - d0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cameras", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--size", default="1280x720")
    parser.add_argument("--fps", type=int, default=30)
    parser.add_argument("--latency-us", type=float, default=3820.0)
    parser.add_argument("--pre-post", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--ways", nargs="+", default=["dlad nv12", "dlad rgb", "opencv"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    w, h = (int(v) for v in args.size.split("x"))
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
        "cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
        "size": args.size, "fps": args.fps, "latency_us": args.latency_us,
        "pre_post": args.pre_post, "runs": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        clip = make_clip(Path(tmp) / "camera.mp4", (w, h), args.fps, 4.0)
        daemon = Daemon(Path(tmp), args.latency_us, args.pre_post)
        try:
            for n in args.cameras:
                for way in args.ways:
                    if way == "opencv":
                        row = run_opencv(daemon, clip, n, args.fps, args.seconds)
                    else:
                        output = "rgb" if way == "dlad rgb" else "nv12"
                        row = run_rig(daemon, clip, n, args.fps, args.seconds, output)
                    row["cameras"] = n
                    results["runs"].append(row)
                    print(json.dumps(row), flush=True)
                    time.sleep(1.0)  # the daemon's queues empty between ways
        finally:
            daemon.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
