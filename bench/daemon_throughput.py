"""The daemon at saturation vs the transport ceiling and the ideal device capacity, in one run.

    python bench/daemon_throughput.py [--seconds 8] [--in-flight 16] [--latency-us 3820]
        [--pre-post-backends cpu[,cuda]]

Three measurements, one after another, each in its own server process, with 672x672x3 uint8
frames (1,354,752 B, the published YOLOv5s input) sent zero-copy from one DEALER:

1. bare pyzmq: a ROUTER that answers each frame with a 1-byte ack (the transport ceiling);
2. dlad with two emulated DLA cores in timing mode at the published Orin service time
   (YOLOv5s 672, FP16 heads: 3.82 ms per frame per core), pre/post-processing OFF (the daemon's
   own path: frontend, scheduler, workers, fences, replies);
3. the same with pre/post-processing ON (letterbox 672->256 + int8 quantise, decode + NMS), on
   the CPU reference path and, with ``--pre-post-backends cpu,cuda`` on a GPU machine, as CUDA
   kernels fenced to the DLA tasks (docs/gpu.md).

Reported: achieved requests/s, the ratio to min(ideal device capacity, transport ceiling),
p50/p99 latency, and the server process's CPU seconds per request (from /proc).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np
import zmq

from dlad.errors import DladError
from dlad_client import Client

FRAME = (672, 672, 3)
CONFIG = """
[daemon]
default_deadline_ms = 60000.0
[frontend]
endpoints = ["{endpoint}"]
sndhwm = 1000
rcvhwm = 1000
[pre_post]
enabled = {pre_post}
backend = "{backend}"
threads = 2
[devices.dla0]
kind = "dla"
core = 0
queue_depth = 16
mode = "timing"
latency_us = {latency}
[devices.dla1]
kind = "dla"
core = 1
queue_depth = 16
mode = "timing"
latency_us = {latency}
[models.demo]
devices = ["dla0", "dla1"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
core1 = "bundled:demo/fp16_heads.dla1.emu"
{gpu}"""

ECHO_SERVER = """
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.setsockopt(zmq.SNDHWM, 1000)
s.setsockopt(zmq.RCVHWM, 1000); s.bind(sys.argv[1]); print("ready", flush=True)
while True:
    f = s.recv_multipart(copy=False)
    if len(f) == 2 and f[1].bytes == b"stop":
        break
    s.send_multipart([f[0], b"k"])
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def _stats(lat: list[float], ok: int, bad: int, elapsed: float) -> dict[str, float]:
    arr = np.asarray(lat)
    return {
        "rate": ok / elapsed,
        "p50_ms": float(np.percentile(arr, 50)),
        "p99_ms": float(np.percentile(arr, 99)),
        "ok": ok,
        "errors": bad,
        "seconds": elapsed,
    }


def drive_bare(endpoint: str, seconds: float, in_flight: int) -> dict[str, float]:
    """Bare pyzmq: keep ``in_flight`` frames outstanding for ``seconds`` (acks come in order)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.setsockopt(zmq.RCVHWM, 1000)
    sock.connect(endpoint)
    image = np.random.default_rng(0).integers(0, 255, FRAME, dtype=np.uint8)
    sent: deque[int] = deque()
    lat: list[float] = []
    ok = 0

    def send() -> None:
        sent.append(time.perf_counter_ns())
        sock.send_multipart([b"x", image], copy=False)

    for _ in range(in_flight):
        send()
    warm_until = time.perf_counter() + 1.0
    end = warm_until + seconds
    t_start = None
    while (now := time.perf_counter()) < end:
        if not sock.poll(5000):
            raise RuntimeError("no reply for 5 s")
        sock.recv_multipart(copy=False)
        t0 = sent.popleft()
        if now >= warm_until:
            t_start = t_start or now
            lat.append((time.perf_counter_ns() - t0) / 1e6)
            ok += 1
        send()
    elapsed = time.perf_counter() - (t_start or warm_until)
    sock.close(0)
    ctx.term()
    return _stats(lat, ok, 0, elapsed)


def drive_sdk(endpoint: str, seconds: float, in_flight: int) -> dict[str, float]:
    """The SDK: ``Client.submit`` keeps ``in_flight`` INFERs outstanding for ``seconds``."""
    image = np.random.default_rng(0).integers(0, 255, FRAME, dtype=np.uint8)
    lat: list[float] = []
    ok = bad = 0
    with Client(endpoint, timeout_s=30.0, max_in_flight=in_flight, sndhwm=1000, rcvhwm=1000) as c:
        handles = deque((time.perf_counter_ns(), c.submit(image)) for _ in range(in_flight))
        warm_until = time.perf_counter() + 1.0
        end = warm_until + seconds
        t_start = None
        while (now := time.perf_counter()) < end:
            t0, handle = handles.popleft()
            try:
                handle.result()
                good = True
            except DladError:
                good = False
            if now >= warm_until:
                t_start = t_start or now
                lat.append((time.perf_counter_ns() - t0) / 1e6)
                ok += good
                bad += not good
            handles.append((time.perf_counter_ns(), c.submit(image)))
        elapsed = time.perf_counter() - (t_start or warm_until)
        for _, handle in handles:
            with contextlib.suppress(DladError):
                handle.result()
    return _stats(lat, ok, bad, elapsed)


def bare_ceiling(endpoint: str, seconds: float, in_flight: int) -> tuple[dict[str, float], float]:
    """The transport ceiling: a bare ROUTER answering 1-byte acks; (stats, CPU s per frame)."""
    echo = subprocess.Popen(
        [sys.executable, "-c", ECHO_SERVER, endpoint], stdout=subprocess.PIPE, text=True
    )
    wait_ready(echo, "ready")
    cpu0 = cpu_seconds(echo.pid)
    stats = drive_bare(endpoint, seconds, in_flight)
    cpu = (cpu_seconds(echo.pid) - cpu0) / max(stats["ok"], 1)
    ctx = zmq.Context()
    stop = ctx.socket(zmq.DEALER)
    stop.linger = 0
    stop.connect(endpoint)
    stop.send(b"stop")
    echo.wait(10)
    stop.close(0)
    ctx.term()
    return stats, cpu


def wait_ready(proc: subprocess.Popen[str], marker: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if marker in line:
            return
    raise RuntimeError(f"server exited before {marker!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--latency-us", type=float, default=3820.0)
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:5599")
    ap.add_argument(
        "--transports", default="tcp,ipc", help="bare-pyzmq ceilings to measure (tcp and/or ipc)"
    )
    ap.add_argument("--pre-post-backends", default="cpu", help="cpu and/or cuda, comma-separated")
    args = ap.parse_args()
    ideal = 2 * 1e6 / args.latency_us
    print(f"load average before: {os.getloadavg()[0]:.2f} (cpus: {os.cpu_count()})")

    ceilings: dict[str, tuple[dict[str, float], float]] = {}
    for transport in args.transports.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            ep = args.endpoint if transport == "tcp" else f"ipc://{tmp}/echo.sock"
            ceilings[transport] = bare_ceiling(ep, args.seconds, args.in_flight)
        stats, cpu = ceilings[transport]
        print(
            f"bare pyzmq ROUTER/DEALER over {transport}, 1.35 MB frames, {args.in_flight} in "
            f"flight: {stats['rate']:.0f} frames/s, p50 {stats['p50_ms']:.2f} ms, "
            f"p99 {stats['p99_ms']:.2f} ms, server CPU {cpu * 1e3:.3f} ms/frame"
        )
    # dlad serves on tcp loopback (its default: faster and steadier than ipc on these machines).
    bare, bare_cpu = ceilings.get("tcp", next(iter(ceilings.values())))
    ceiling = bare["rate"]
    print(f"ideal device capacity: 2 cores x 1/{args.latency_us:.0f} us = {ideal:.0f} req/s")
    bound = min(ideal, ceiling)

    runs = [("false", "cpu")] + [("true", b) for b in args.pre_post_backends.split(",")]
    for pre_post, backend in runs:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = Path(tmp) / "dlad.toml"
            gpu = '[devices.gpu]\nkind = "gpu"\n' if backend == "cuda" else ""
            cfg.write_text(
                CONFIG.format(
                    endpoint=args.endpoint,
                    pre_post=pre_post,
                    latency=args.latency_us,
                    backend=backend,
                    gpu=gpu,
                )
            )
            proc = subprocess.Popen(
                [sys.executable, "-m", "dlad.cli", "--config", str(cfg)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            wait_ready(proc, "listening")
            cpu0 = cpu_seconds(proc.pid)
            r = drive_sdk(args.endpoint, args.seconds, args.in_flight)
            cpu = (cpu_seconds(proc.pid) - cpu0) / max(r["ok"], 1)
            proc.terminate()
            proc.wait(30)
        print(
            f"dlad, pre/post {'on (' + backend + ')' if pre_post == 'true' else 'off'}: "
            f"{r['rate']:.0f} req/s "
            f"= {r['rate'] / bound:.3f} x min(ideal, ceiling); p50 {r['p50_ms']:.2f} ms, "
            f"p99 {r['p99_ms']:.2f} ms; daemon CPU {cpu * 1e3:.3f} ms/request "
            f"(bare pyzmq server: {bare_cpu * 1e3:.3f}); errors {r['errors']}"
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
