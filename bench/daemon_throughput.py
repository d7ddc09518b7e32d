"""The daemon at saturation vs the transport ceiling and the ideal device capacity, in one run.

    python bench/daemon_throughput.py [--seconds 8] [--in-flight 16] [--latency-us 3820]
        [--pre-post-backends cpu[,cuda]|none] [--profile DIR] [--trials N] [--shm] [--before DIR]
        [--variant 'NAME:SECTION.KEY=VALUE' ...] [--batch N] [--held] [--perf DIR] [--floor]
        [--floor-gpu] [--native-floor] [--native] [--native-plane]

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
p50/p99 latency, and the server process's CPU seconds per request (from /proc): in all, and
the daemon's own, without its emulated cores' threads (work a DLA does in silicon), as a ratio
to the bare server's. For dlad and the bare server alike, each thread's CPU per request with
its kernel share, its context switches per request (``/proc/PID/task/*/status``): a
switch is a sleep and a wake-up, for work, a lock or the GIL (BENCHMARKS §9.10), and its minor
page faults per request (a frame's buffer freshly mapped would cost one a page: §9.14).

``--profile DIR`` runs each dlad server under py-spy (``pip install py-spy``; it samples the
process from outside, on-CPU samples only, every thread) and prints, per run, the functions
holding the most samples: by self time, and inclusive of what they call. The raw stacks are
kept in DIR (``flamegraph.pl`` or speedscope read them). ``--perf DIR`` records the event
loop's thread with ``perf`` (native code: the interpreter, libzmq, the kernel) and prints where
its samples fell. ``--held`` adds a third baseline: the bare server paced to dlad's load and
acking each frame ``--latency-us`` after it came, from a wake-up of its own, as any server of
an engine must. ``--floor`` adds a fourth: the least a Python daemon of dlad's shape can
cost, a uvloop ROUTER that hands each frame to one of two engine threads (timing mode, tasks
back to back at ``--latency-us``, two in flight per engine, the rest queued), takes the
completions back through ``call_soon_threadsafe`` and answers with a valid INFER_REPLY; its own
CPU per request is the floor dlad's own is compared with (BENCHMARKS §9.13); ``--floor-gpu``
the same server copying each frame to the GPU on receipt, as dlad's GPU path must. With
``--shm`` each floor server also runs with shared-memory frames (its segment mapped once; with
the GPU, registered, so the copy is DMA), the floor of dlad's own shared-memory runs.
``--native-floor`` adds each floor server written again in C (``bench/native_floor.c``, built
with ``cc`` against pyzmq's libzmq on first use): the same shape with no Python between the
socket and the engines, the floor of a daemon whose data plane is native (BENCHMARKS §9.16).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from dlad.errors import DladError
from dlad.protocol import PROTOCOL_VERSION, Kind, Status
from dlad_client import Client

FRAME = (672, 672, 3)
CONFIG = """
[daemon]
default_deadline_ms = 60000.0
[soc]
[scheduler]
[shm]
[frontend]
endpoints = ["{endpoint}"]
sndhwm = 1000
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

HELD_SERVER = """
import math, sys, time, zmq
from collections import deque
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.setsockopt(zmq.SNDHWM, 1000)
s.setsockopt(zmq.RCVHWM, 1000); s.bind(sys.argv[1]); hold = float(sys.argv[2]) / 1e6
held = deque()  # (when its ack is due, the message: its frame stays alive until then)
print("ready", flush=True)
while True:
    timeout = None if not held else math.ceil(max(held[0][0] - time.perf_counter(), 0) * 1e3)
    if s.poll(timeout):
        while True:
            try:
                f = s.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(f) == 2 and f[1].bytes == b"stop":
                sys.exit(0)
            held.append((time.perf_counter() + hold, f))
    now = time.perf_counter()
    while held and held[0][0] <= now:
        s.send_multipart([held.popleft()[1][0], b"k"])
"""


FLOOR_SERVER = """
import asyncio, collections, mmap, os, sys, threading, time
import msgpack, numpy as np, uvloop, zmq
from dlad.devices.emulated import name_os_thread
from dlad.protocol import PROTOCOL_VERSION, Kind, Status
endpoint, latency_ns = sys.argv[1], int(float(sys.argv[2]) * 1e3)
GPU = sys.argv[3:] == ["gpu"]
if GPU:  # each frame copied to the GPU on receipt, as dlad's upload does it (pageable memory)
    from cuda.bindings import driver as drv
    def ok(result):
        if int(result[0]) != 0:
            raise SystemExit(f"CUDA: {result[0]}")
        return result[1] if len(result) == 2 else None
    ok(drv.cuInit(0))
    context = ok(drv.cuDevicePrimaryCtxRetain(ok(drv.cuDeviceGet(0))))
    ok(drv.cuCtxSetCurrent(context))
    stream = ok(drv.cuStreamCreate(int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)))
    device_image = ok(drv.cuMemAlloc(672 * 672 * 3))
SEGMENTS = {}  # (client, name) -> the segment mapped read-only (and registered with the GPU)

def segment(client, name):
    # A shared-memory frame's segment, mapped on first use, as dlad's SharedFrames maps it; with
    # the GPU, registered too, so a frame's copy is DMA, as dlad's register_host makes it.
    key = (client, name)
    if key not in SEGMENTS:
        fd = os.open(f"/dev/shm/{name}", os.O_RDONLY | os.O_NOFOLLOW)
        try:
            m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        view = np.frombuffer(m, np.uint8)
        if GPU:
            flags = (drv.CU_MEMHOSTREGISTER_DEVICEMAP | drv.CU_MEMHOSTREGISTER_READ_ONLY
                     | drv.CU_MEMHOSTREGISTER_PORTABLE)
            ok(drv.cuMemHostRegister(view.ctypes.data, view.nbytes, flags))
        SEGMENTS[key] = view
    return SEGMENTS[key]
SLOTS, NOBLOCK, MORE = 2, int(zmq.NOBLOCK), int(zmq.SNDMORE) | int(zmq.NOBLOCK)
TIMING = ("queue_us", "pre_us", "device_us", "post_us", "total_us")
VERSION, REPLY, OK = PROTOCOL_VERSION, int(Kind.INFER_REPLY), int(Status.OK)

class Core(threading.Thread):
    # An engine in timing mode: its tasks back to back, each latency_ns; the end of each
    # handed to the loop by call_soon_threadsafe, as an emulated core's fence callback is.
    def __init__(self, name, loop, done):
        super().__init__(name=name, daemon=True)
        self.cv, self.tasks = threading.Condition(), collections.deque()
        self.loop, self.done = loop, done
        self.busy, self.free_at = 0, 0
    def submit(self, task):
        self.busy += 1
        with self.cv:
            self.tasks.append(task)
            self.cv.notify()
    def run(self):
        name_os_thread(self.name)
        while True:
            with self.cv:
                while not self.tasks:
                    self.cv.wait()
                task = self.tasks.popleft()
            start = max(time.monotonic_ns(), self.free_at)
            end = self.free_at = start + latency_ns
            with self.cv:
                while (left := end - time.monotonic_ns()) > 0:
                    self.cv.wait(left / 1e9)
            self.loop.call_soon_threadsafe(self.done, self, task, start, end)

async def main():
    loop = asyncio.get_running_loop()
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.SNDHWM, 1000)
    s.setsockopt(zmq.RCVHWM, 1000)
    s.bind(endpoint)
    queued, stop = collections.deque(), loop.create_future()

    def done(core, task, start, end):
        ident, rid, frames, came = task
        now = time.monotonic_ns()
        timing = dict.fromkeys(TIMING, 0)
        timing.update(device_us=(end - start) // 1000, total_us=(now - came) // 1000,
                      start_ns=start, end_ns=end)
        header = msgpack.packb({"v": VERSION, "kind": REPLY, "id": rid, "status": OK, "message": "",
                                "device": core.name[:4], "timing": timing, "count": 0})
        s.send(ident, MORE)
        s.send(header, MORE)
        s.send(b"", NOBLOCK)
        core.busy -= 1
        if queued:
            core.submit(queued.popleft())
        readable()  # a send can take the fd's edge for a message that came meanwhile

    def readable():
        while s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = s.recv_multipart(NOBLOCK, copy=False)
            if len(frames) == 2 and len(frames[1]) == 4 and frames[1].bytes == b"stop":
                stop.set_result(None)
                return
            h = msgpack.unpackb(frames[1].buffer)
            if (ref := h.get("shm")) is not None:  # the frame in the client's slot (len 2)
                geometry = h["image"]
                nbytes = geometry["height"] * geometry["width"] * 3
                image = segment(frames[0].bytes, ref["name"])[ref["offset"]:][:nbytes]
            else:
                image = np.frombuffer(frames[-1].buffer, np.uint8)
            if GPU:
                ok(drv.cuMemcpyHtoDAsync(device_image, image.ctypes.data, image.nbytes, stream))
            task = (frames[0].bytes, h["id"], frames, time.monotonic_ns())
            core = min(cores, key=lambda c: c.busy)
            if core.busy < SLOTS:
                core.submit(task)
            else:
                queued.append(task)

    cores = [Core(f"flr{i}-emulated", loop, done) for i in range(2)]
    for core in cores:
        core.start()
    loop.add_reader(s.FD, readable)
    print("ready", flush=True)
    readable()
    await stop

uvloop.run(main())
"""
"""The floor of any Python daemon built as dlad is: a uvloop event loop reading a ROUTER
(edge-triggered fd), two engine threads in timing mode whose task ends come back by
``call_soon_threadsafe``, two tasks in each engine and the rest queued, and a valid
INFER_REPLY (msgpack header, empty detections) sent from the loop. No checks, no scheduler,
no metrics, no limits: what is left of dlad's cost once every feature is gone (``--floor``).
A shared-memory frame's segment is mapped on its first frame and kept (with ``--shm``)."""


PLANE_SERVER = """
import sys, zmq
from dlad import protocol
from dlad.errors import BadRequest, InternalError
from dlad.native_plane import NativePlane, PlaneDevice
endpoint, latency_us = sys.argv[1], float(sys.argv[2])
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
for option, value in ((zmq.SNDHWM, 1000), (zmq.RCVHWM, 1000), (zmq.ROUTER_MANDATORY, 1),
                      (zmq.LINGER, 0)):
    s.setsockopt(option, value)
s.bind(endpoint)
devices = [PlaneDevice(f"dla{i}", latency_us, slots=2, capacity=16) for i in range(2)]
plane = NativePlane(s, devices=devices, models={"demo": ["dla0", "dla1"]},
                    default_deadline_ms=60000.0)
plane.start()
print("ready", flush=True)
while True:  # the control plane: the messages the plane leaves (the benchmark sends none)
    client, *frames = plane.forwarded.recv_multipart()
    if frames == [b"stop"]:
        break
    try:
        protocol.decode_request(frames)
        err = InternalError("this benchmark's server takes INFERs alone")
    except BadRequest as exc:
        err = exc
    plane.send(client, protocol.encode_error_reply(err))
plane.drain(5.0)
print(plane.counters(), flush=True)
"""
"""The native data plane (``dlad/native/plane.hpp``, ``--native-plane``): dlad's INFER path in C++
(the reader of protocol.py's fast path, the frontend's bounds, the scheduler's C++ core, replies
with its statuses and words) on two emulated cores in timing mode, as dlad with pre/post off has.
Its Python thread only answers what the plane forwards (here, nothing but the stop message)."""


def cpu_seconds(pid: int) -> float:
    return _stat_cpu(Path(f"/proc/{pid}/stat"))


def engine_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid``'s emulated-engine threads (named ``*-emulated`` for the OS: each
    core's ``dla<N>-emulated``, and with GPU pre/post the ``fence-emulated`` poller and
    ``fwait-emulated`` waiters through which the emulated core sees the GPU's fences): the
    "hardware" an Orin has in silicon, where a DLA waits on an NvSciSync fence itself, not the
    daemon's own cost. They live as long as the daemon, so a difference of two readings is
    their whole share of a run."""
    return _engines(read_threads(pid))


@dataclass(frozen=True, slots=True)
class ThreadReading:
    """One thread's counters so far (``/proc/PID/task/TID``): CPU seconds, those spent in the
    kernel (system calls and what the hypervisor charges to them), and context switches,
    voluntary and not (each a sleep and a wake-up: a wait for work, a lock, or the GIL)."""

    cpu: float
    kernel: float
    switches: int
    involuntary: int = 0  # of ``switches``: preempted while runnable (the CPU was wanted)
    faults: int = 0  # minor page faults: a page first touched, each a trap into the kernel


Threads = dict[tuple[int, str], ThreadReading]
"""Readings keyed by (tid, name); the main thread (the event loop) is named ``loop``."""


def read_threads(pid: int) -> Threads:
    """Each of ``pid``'s threads' :class:`ThreadReading`, read once."""
    out: Threads = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):  # a thread that ended meanwhile
            tid = int(task.name)
            name = "loop" if tid == pid else (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            user, system = int(fields[11]), int(fields[12])
            status = (task / "status").read_text().splitlines()
            counts = {k: int(v) for k, _, v in (line.partition(":") for line in status)
                      if k.endswith("ctxt_switches")}  # fmt: skip
            forced = counts.get("nonvoluntary_ctxt_switches", 0)
            out[tid, name] = ThreadReading(
                (user + system) / tick, system / tick, sum(counts.values()), forced,
                int(fields[7]),
            )  # fmt: skip
    return out


def _engines(threads: Threads) -> float:
    return sum(r.cpu for (_, name), r in threads.items() if name.endswith("-emulated"))


def thread_report(before: Threads, after: Threads, requests: int, unit: str = "request") -> str:
    """Per ``unit``, each thread name's CPU (threads of one name summed: a pool's workers, the
    driver's helpers) with its kernel share, highest first, and its context switches, most
    first: where a run's CPU went, native code included."""
    cpu: Counter[str] = Counter()
    kernel: Counter[str] = Counter()
    switches: Counter[str] = Counter()
    forced: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    zero = ThreadReading(0.0, 0.0, 0)
    for key, r in after.items():
        was = before.get(key, zero)
        cpu[key[1]] += r.cpu - was.cpu
        kernel[key[1]] += r.kernel - was.kernel
        switches[key[1]] += r.switches - was.switches
        forced[key[1]] += r.involuntary - was.involuntary
        faults[key[1]] += r.faults - was.faults
    n = max(requests, 1)
    by_cpu = ", ".join(f"{name} {c / n * 1e3:.3f} ({kernel[name] / c:.0%} kernel)"
                       for name, c in cpu.most_common() if c > 0)  # fmt: skip
    by_switches = ", ".join(f"{name} {k / n:.2f} ({forced[name] / n:.2f} preempted)"
                            for name, k in switches.most_common() if k > 0)  # fmt: skip
    by_faults = ", ".join(f"{name} {f / n:.1f}" for name, f in faults.most_common() if f > 0)
    return (f"CPU ms/{unit} by thread: {by_cpu}\n"
            f"  context switches a {unit} by thread: {by_switches}\n"
            f"  minor page faults a {unit} by thread: {by_faults or 'none'}")  # fmt: skip


def _stat_cpu(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


def drive_bare(
    endpoint: str,
    seconds: float,
    in_flight: int,
    rate: float | None = None,
    frame: tuple[int, ...] = FRAME,
) -> dict[str, float]:
    """Bare pyzmq: keep ``in_flight`` frames outstanding for ``seconds`` (acks come in order);
    with ``rate``, send at most that many frames a second (the ceiling's CPU cost at the load
    dlad carried)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.setsockopt(zmq.RCVHWM, 1000)
    sock.connect(endpoint)
    image = np.random.default_rng(0).integers(0, 255, frame, dtype=np.uint8)
    sent: deque[int] = deque()
    lat: list[float] = []
    ok = 0

    gap = 0.0 if rate is None else 1.0 / rate
    due = time.perf_counter()

    def send() -> None:
        nonlocal due
        if gap:
            due += gap
            time.sleep(max(due - time.perf_counter(), 0.0))
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


def drive_sdk(
    endpoint: str,
    seconds: float,
    in_flight: int,
    shm: bool = False,
    *,
    shape: tuple[int, ...] = FRAME,
    in_place: bool = False,
    batch: int = 1,
) -> dict[str, float]:
    """The SDK: ``Client.submit`` keeps ``in_flight`` INFERs outstanding for ``seconds`` after
    1 s of warm-up. With ``shm``, each frame is copied into a shared-memory slot and only its
    header sent; with ``in_place`` too, frames are rendered into ``Client.frame`` slots (each
    slot written once: what a camera writes is the camera's cost, not the transport's). With
    ``batch`` > 1, ``Client.submit_batch`` sends that many frames a message (INFER_BATCH),
    ``in_flight // batch`` messages outstanding; the counts and the rate are of frames, the
    latencies of messages."""
    image = np.random.default_rng(0).integers(0, 255, shape, dtype=np.uint8)
    lat: list[float] = []
    ok = bad = 0
    # (shm_slot_bytes only when asked: a --before tree's SDK predates it)
    extra = {"shm_slot_bytes": image.nbytes} if shm else {}
    with Client(endpoint, timeout_s=30.0, max_in_flight=in_flight, sndhwm=1000, rcvhwm=1000,
                **extra) as c:  # fmt: skip
        written: set[int] = set()

        def frame() -> np.ndarray:
            if not in_place:
                return image
            slot = c.frame(shape)
            if slot is None:
                raise RuntimeError("no free slot, with fewer in flight than slots")
            if slot.ctypes.data not in written:
                slot[...] = image
                written.add(slot.ctypes.data)
            return slot

        def send() -> Any:
            if batch == 1:
                return c.submit(frame())
            return c.submit_batch([frame() for _ in range(batch)])

        def outcome(handle: Any) -> int:  # frames answered OK
            if batch == 1:
                handle.result()
                return 1
            return sum(not isinstance(r, DladError) for r in handle.result())

        messages = max(in_flight // batch, 1)
        handles = deque((time.perf_counter_ns(), send()) for _ in range(messages))
        warm_until = time.perf_counter() + 1.0
        end = warm_until + seconds
        t_start = None
        while (now := time.perf_counter()) < end:
            t0, handle = handles.popleft()
            try:
                good = outcome(handle)
            except DladError:
                good = 0
            if now >= warm_until:
                t_start = t_start or now
                lat.append((time.perf_counter_ns() - t0) / 1e6)
                ok += good
                bad += batch - good
            handles.append((time.perf_counter_ns(), send()))
        elapsed = time.perf_counter() - (t_start or warm_until)
        for _, handle in handles:
            with contextlib.suppress(DladError):
                handle.result()
        if shm and c.shm is not None and c.shm.inline:
            raise RuntimeError(f"{c.shm.inline} frames went inline: the slots ran out")
    return _stats(lat, ok, bad, elapsed)


def bare_ceiling(
    endpoint: str,
    seconds: float,
    in_flight: int,
    rate: float | None = None,
    frame: tuple[int, ...] = FRAME,
    *,
    hold_us: float = 0.0,
) -> tuple[dict[str, float], float, str]:
    """The transport ceiling: a bare ROUTER answering 1-byte acks; (stats, CPU s per frame, its
    :func:`thread_report`). With ``rate``, the same server paced to that load (a server's CPU
    per frame grows as its load falls: fewer messages share each wake-up). With ``hold_us``,
    each ack leaves that long after its frame came, from a wake-up of its own, as a server's
    whose work takes an engine's time (whole ms: ``zmq_poll``'s resolution)."""
    code, extra = (HELD_SERVER, [str(hold_us)]) if hold_us else (ECHO_SERVER, [])
    echo = subprocess.Popen(
        [sys.executable, "-c", code, endpoint, *extra], stdout=subprocess.PIPE, text=True
    )
    wait_ready(echo, "ready")
    cpu0, threads0 = cpu_seconds(echo.pid), read_threads(echo.pid)
    stats = drive_bare(endpoint, seconds, in_flight, rate, frame)
    cpu1, threads1 = cpu_seconds(echo.pid), read_threads(echo.pid)
    n = int(stats["ok"])
    cpu = (cpu1 - cpu0) / max(n, 1)
    threads = thread_report(threads0, threads1, n, unit="frame")
    stop_server(endpoint, echo)
    return stats, cpu, threads


def stop_server(endpoint: str, proc: subprocess.Popen[str]) -> None:
    """Stop a bare or floor server: a message of one frame, ``stop``; wait for it to exit."""
    ctx = zmq.Context()
    stop = ctx.socket(zmq.DEALER)
    stop.linger = 0
    stop.connect(endpoint)
    stop.send(b"stop")
    proc.wait(10)
    stop.close(0)
    ctx.term()


def run_floor(
    args: argparse.Namespace,
    *,
    gpu: bool = False,
    shm: bool = False,
    native: bool = False,
    plane: bool = False,
) -> tuple[dict[str, float], float, str]:
    """:data:`FLOOR_SERVER` driven as dlad is (the SDK, frames in the message, or with ``shm``
    in shared-memory slots): (stats, its own CPU s per request without the engine threads, its
    :func:`thread_report`). ``gpu``: each frame is also copied to the GPU on receipt
    (``cuMemcpyHtoDAsync`` from the message's pageable memory, as dlad's upload is, or DMA from
    the registered segment), the least a GPU pre-processing path adds. ``native``: the same
    server in C (:func:`native_floor`); ``plane``: :data:`PLANE_SERVER`."""
    with floor_server(args.endpoint, args.latency_us, gpu=gpu, native=native,
                      plane=plane) as proc:  # fmt: skip
        cpu0, threads0 = cpu_seconds(proc.pid), read_threads(proc.pid)
        stats = drive_sdk(args.endpoint, args.seconds, args.in_flight, shm)
        cpu1, threads1 = cpu_seconds(proc.pid), read_threads(proc.pid)
    n = max(int(stats["ok"]), 1)
    own = (cpu1 - cpu0 - (_engines(threads1) - _engines(threads0))) / n
    return stats, own, thread_report(threads0, threads1, n)


@contextlib.contextmanager
def floor_server(
    endpoint: str,
    latency_us: float,
    *,
    gpu: bool = False,
    native: bool = False,
    plane: bool = False,
) -> Iterator[subprocess.Popen[str]]:
    """:data:`FLOOR_SERVER` on ``endpoint``, its engines at ``latency_us`` a task, ready to
    serve; stopped on leaving (killed if it will not stop). ``native``: the same server in C
    (:func:`native_floor`); ``plane``: :data:`PLANE_SERVER` instead."""
    if native:
        wire = (PROTOCOL_VERSION, int(Kind.INFER_REPLY), int(Status.OK))
        command = [str(native_floor()), endpoint, str(latency_us), *map(str, wire)]
    elif plane:
        command = [sys.executable, "-c", PLANE_SERVER, endpoint, str(latency_us)]
    else:
        command = [sys.executable, "-c", FLOOR_SERVER, endpoint, str(latency_us)]
    proc = subprocess.Popen(command + (["gpu"] if gpu else []), stdout=subprocess.PIPE, text=True)
    try:
        wait_ready(proc, "ready")
        yield proc
        stop_server(endpoint, proc)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


NATIVE_FLOOR = Path(__file__).with_name("native_floor.c")


class NativeFloorError(Exception):
    """The native floor server could not be built here (no C compiler, no libzmq to link)."""


def native_floor() -> Path:
    """The executable of :data:`NATIVE_FLOOR`, built once per source with ``cc`` into the
    temporary directory, linked against the libzmq this pyzmq loads (its wheel's
    ``pyzmq.libs``, else the system's), so both floors have the same I/O thread. Raises
    :class:`NativeFloorError` with the reason if it cannot be built."""
    bundled = sorted(
        (Path(zmq.__file__).resolve().parent.parent / "pyzmq.libs").glob("libzmq*.so*")
    )
    if bundled:
        lib = bundled[0]
        link = [f"-L{lib.parent}", f"-l:{lib.name}", f"-Wl,-rpath,{lib.parent}"]
    else:
        link = ["-lzmq"]
    key = hashlib.sha256(NATIVE_FLOOR.read_bytes() + " ".join(link).encode()).hexdigest()[:12]
    exe = Path(tempfile.gettempdir()) / f"dlad-native-floor-{key}"
    if exe.exists():
        return exe
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise NativeFloorError("no C compiler (cc or gcc) on PATH")
    tmp = exe.with_suffix(".part")
    flags = ["-O2", "-Wall", "-Wextra", "-pthread"]
    built = subprocess.run(
        [cc, *flags, "-o", str(tmp), str(NATIVE_FLOOR), *link, "-ldl"],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    if built.returncode != 0:
        raise NativeFloorError(f"{cc} failed on {NATIVE_FLOOR.name}:\n{built.stderr.strip()}")
    tmp.replace(exe)
    return exe


def require_native_floor(ap: argparse.ArgumentParser) -> None:
    """Build :func:`native_floor` now, or exit with ``--native-floor``'s usage error (status 2)
    saying why it cannot be built here."""
    try:
        native_floor()
    except NativeFloorError as e:
        ap.error(f"--native-floor: {e}")


def start_profile(
    pid: int, raw: Path, seconds: float, *, gil: bool = False, native: bool = False
) -> subprocess.Popen[bytes]:
    """py-spy sampling ``pid`` for ``seconds`` (the measured window, not the start-up) into
    ``raw`` as collapsed stacks, every thread, 200 samples a second, without pausing it (a
    paused daemon serves less and its profile is of another load). ``gil``: only samples of a
    thread holding the GIL (a thread waiting for it is left out: py-spy counts that wait as
    running). ``native``: C frames too (the driver's, libzmq's, the interpreter's); py-spy
    then pauses the process for each sample (it cannot unwind native stacks otherwise), so
    the rates of such a run are not the daemon's."""
    raw.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        ["py-spy", "record", "--pid", str(pid), "--duration", str(math.ceil(seconds)),
         "--rate", "200", "--threads", "--format", "raw", "--output", str(raw),
         *(["--gil"] if gil else []), *(["--native"] if native else ["--nonblocking"])],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def start_perf(pid: int, data: Path) -> subprocess.Popen[bytes]:
    """``perf record`` of ``pid``'s main thread (the event loop) into ``data``: the kernel's
    clock every 0.2 ms, on-CPU only, native stacks (no hardware counters: these VMs have none).
    Stop it with SIGINT."""
    data.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        ["perf", "record", "-e", "cpu-clock", "-F", "4999", "-g", "-t", str(pid), "-o",
         str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def perf_report(data: Path, n: int = 12) -> str:
    """Where the loop thread's samples fell: by shared object (libpython: the interpreter;
    ``[kernel.kallsyms]``: system calls and switches), then the top symbols."""
    rows = []
    for sort, top in (("dso", n), ("dso,sym", n)):
        out = subprocess.run(
            ["perf", "report", "-i", str(data), "--no-children", "--sort", sort, "--stdio",
             "-g", "none"], capture_output=True, text=True, check=False,
        ).stdout  # fmt: skip
        lines = [x.strip() for x in out.splitlines() if x.strip() and not x.startswith("#")]
        rows.append(f"  by {sort}:")
        rows += [f"    {x}" for x in lines[:top]]
    return "\n".join(rows)


SWITCH_SECONDS = 2
"""How long ``--switches`` records (dwarf stacks are large: about 8 KB a switch)."""


def start_switches(pid: int, data: Path) -> subprocess.Popen[bytes]:
    """``perf record`` of every context switch of ``pid``'s main thread (the event loop) for
    :data:`SWITCH_SECONDS`, from a second into the load, with dwarf call stacks: frame pointers
    do not reach past libc's futex wait into the interpreter (``take_gil``)."""
    data.parent.mkdir(parents=True, exist_ok=True)
    record = (f"sleep 1; exec perf record -e context-switches -c 1 --call-graph dwarf,8192 "
              f"-t {pid} -o {shlex.quote(str(data))} -- sleep {SWITCH_SECONDS}")  # fmt: skip
    return subprocess.Popen(
        ["sh", "-c", record], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


SWITCH_KINDS = (
    ("take_gil", "__uvasync_callback",
     "waits for the GIL, woken by another thread's call_soon_threadsafe"),
    ("take_gil", "", "waits for the GIL, elsewhere"),
    ("epoll_pwait", "", "sleeps in epoll (nothing to do)"),
    ("futex", "", "waits on another lock or condition"),
    ("", "", "preempted, or another wait"),
)  # fmt: skip
"""A switch's kind by the symbols on its stack (both, when two are given; first match)."""


def switch_report(data: Path, requests_per_s: float) -> str:
    """The loop thread's context switches by why it stopped running (:data:`SWITCH_KINDS`),
    a request each; the recording is removed afterwards (it is large)."""
    out = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "ip,sym"], capture_output=True, text=True,
        check=False,
    ).stdout  # fmt: skip
    data.unlink(missing_ok=True)
    counts = dict.fromkeys((k[2] for k in SWITCH_KINDS), 0)
    for stack in out.split("\n\n"):
        if not stack.strip():
            continue
        for first, second, kind in SWITCH_KINDS:
            if first in stack and second in stack:
                counts[kind] += 1
                break
    requests = max(requests_per_s * SWITCH_SECONDS, 1.0)
    total = sum(counts.values())
    head = f"over {SWITCH_SECONDS} s: {total / requests:.2f} a request, by why it stopped"
    rows = [f"  the loop's context switches {head}"]
    rows += [f"    {n / requests:.2f}  {kind}" for kind, n in counts.items()]
    return "\n".join(rows)


WAITS = frozenset({"Condition.wait", "EpollSelector.select", "Event.wait", "sleep"})
"""Innermost frames that block (py-spy can count a timed wait as running: dropped)."""


LOOP = "_main (cli.py)"
"""A frame only the event loop's thread has (the daemon's entry point)."""


def top_functions(raw: Path, n: int = 15, only: str | None = None) -> str:
    """The ``n`` functions with the most samples in py-spy's raw (collapsed) stacks: by self
    time (the innermost frame) and inclusive (anywhere on the stack, once per sample); samples
    blocked in a wait (:data:`WAITS`) are left out. ``only``: the samples of stacks holding
    that frame (:data:`LOOP`: the event loop's thread)."""
    selfs: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = waits = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [_short(f) for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if only is not None and only not in frames:
            continue
        k = int(count)
        if not frames or frames[-1].partition(" (")[0] in WAITS:
            waits += k
            continue
        total += k
        selfs[frames[-1]] += k
        for f in set(frames):
            incl[f] += k
    total = max(total, 1)
    rows = [f"  {total} samples running ({waits} waiting, left out); self:"]
    rows += [f"    {100 * c / total:5.1f}%  {f}" for f, c in selfs.most_common(n)]
    rows.append("  inclusive:")
    rows += [f"    {100 * c / total:5.1f}%  {f}" for f, c in incl.most_common(n)]
    return "\n".join(rows)


def _short(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``: one row per function."""
    name, _, where = frame.partition(" (")
    return f"{name} ({Path(where.rsplit(':', 1)[0]).name})"


def wait_ready(proc: subprocess.Popen[str], marker: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if marker in line:
            return
    raise RuntimeError(f"server exited before {marker!r}")


def run_dlad(
    args: argparse.Namespace, pre_post: str, backend: str, trial: int, *, shm: bool = False,
    tree: Path | None = None, variant: str | None = None,
) -> tuple[dict[str, float], float, float, Path | None, str]:  # fmt: skip
    """One dlad server measured (``tree``: from that checkout's code; ``variant``: a
    ``--variant``, None for the config as it is): (stats, process CPU s/request, engine
    threads' CPU s/request, the profile's raw stacks or None, the CPU per request of each
    thread name)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "dlad.toml"
        gpu = '[devices.gpu]\nkind = "gpu"\n' if backend == "cuda" else ""
        cfg.write_text(
            _with_variant(variant, CONFIG).format(
                endpoint=args.endpoint,
                pre_post=pre_post,
                latency=args.latency_us,
                backend=backend,
                gpu=gpu,
            )
        )
        env = tree_env(tree)
        proc = subprocess.Popen(
            [sys.executable, "-m", "dlad.cli", "--config", str(cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tree,
            env=env,
        )
        try:  # the daemon goes, whatever fails (a later run needs its port)
            wait_ready(proc, "listening")
            name = _run_name(pre_post, backend, shm, tree, variant)
            raw = args.profile / f"dlad-pre-post-{name}-{trial}.txt" if args.profile else None
            spy = (
                None
                if raw is None
                else start_profile(
                    proc.pid, raw, args.seconds + 1, gil=args.profile_gil, native=args.native
                )
            )
            data = args.perf / f"dlad-pre-post-{name}-{trial}.perf" if args.perf else None
            perf = None if data is None else start_perf(proc.pid, data)
            sw_data = (
                args.switches / f"dlad-pre-post-{name}-{trial}.switches" if args.switches
                else None
            )  # fmt: skip
            switches = None if sw_data is None else start_switches(proc.pid, sw_data)
            cpu0, threads0 = cpu_seconds(proc.pid), read_threads(proc.pid)
            r = drive_sdk(args.endpoint, args.seconds, args.in_flight, shm, batch=args.batch)
            cpu1, threads1 = cpu_seconds(proc.pid), read_threads(proc.pid)
            native = ""
            if perf is not None and data is not None:
                perf.send_signal(signal.SIGINT)
                perf.wait(60)
                native = f"\n  perf, the event loop's thread ({data}):\n{perf_report(data)}"
            if switches is not None and sw_data is not None:
                switches.wait(60)
                native += "\n" + switch_report(sw_data, r["rate"])
            cpu = (cpu1 - cpu0) / max(r["ok"], 1)
            engines = (_engines(threads1) - _engines(threads0)) / max(r["ok"], 1)
            threads = thread_report(threads0, threads1, int(r["ok"])) + native
            if spy is not None:
                spy.wait(60)
        finally:
            proc.terminate()
            proc.wait(30)
    return r, cpu, engines, raw, threads


def tree_env(tree: Path | None) -> dict[str, str]:
    """The environment a daemon runs in: this one, and for ``tree`` (a ``--before``
    checkout) its own dlad and clients first on PYTHONPATH, the other entries (a machine's
    wheels) kept. With ``cwd=tree``, ``-m`` puts the tree first on sys.path too."""
    env = dict(os.environ)
    if tree is not None:
        kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([str(tree), str(tree / "clients"), *kept])
    return env


def _run_name(
    pre_post: str, backend: str, shm: bool = False, tree: Path | None = None,
    variant: str | None = None,
) -> str:  # fmt: skip
    name = (f"on-{backend}" if pre_post == "true" else "off") + ("-shm" if shm else "")
    name += "" if variant is None else f"-{variant.partition(':')[0]}"
    return name if tree is None else f"before-{name}"


def _with_variant(variant: str | None, config: str) -> str:
    """``config`` with a ``--variant``'s keys set (``NAME:SECTION.KEY=VALUE``, VALUE in TOML,
    several joined by ``;``: ``'asyncio:daemon.event_loop="asyncio"'``), replacing the value
    where the section sets the key already; each section must be one the config has."""
    if variant is None:
        return config
    _, _, settings = variant.partition(":")
    for setting in settings.split(";"):
        where, _, value = setting.strip().partition("=")
        section, _, key = where.rpartition(".")
        header = f"[{section}]\n"
        if not key or not value or header not in config:
            raise SystemExit(f"--variant {variant!r}: want NAME:SECTION.KEY=VALUE[;...], "
                             "sections of ours")  # fmt: skip
        value = value.replace("{", "{{").replace("}", "}}")  # the config is a format string
        start = config.index(header) + len(header)
        end = config.find("\n[", start)
        end = len(config) if end < 0 else end + 1
        body, count = re.subn(rf"(?m)^{re.escape(key)} = .*$", f"{key} = {value}",
                              config[start:end])  # fmt: skip
        if not count:  # a key the section does not set yet
            body = f"{key} = {value}\n{body}"
        config = config[:start] + body + config[end:]
    return config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--latency-us", type=float, default=3820.0)
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:5599")
    ap.add_argument(
        "--transports", default="tcp,ipc", help="bare-pyzmq ceilings to measure (tcp and/or ipc)"
    )
    ap.add_argument(
        "--pre-post-backends", default="cpu",
        help="cpu and/or cuda, comma-separated; none: pre/post off only",
    )  # fmt: skip
    ap.add_argument("--profile", type=Path, help="profile each dlad run with py-spy into DIR")
    ap.add_argument(
        "--perf", type=Path, metavar="DIR",
        help="record each dlad run's event-loop thread with perf (native stacks) into DIR",
    )  # fmt: skip
    ap.add_argument(
        "--switches", type=Path, metavar="DIR",
        help=f"record the event loop's context switches ({SWITCH_SECONDS} s of each dlad run, "
             "perf with dwarf stacks, in DIR) and report why the loop stopped running "
             "(BENCHMARKS 9.12)",
    )  # fmt: skip
    ap.add_argument(
        "--profile-gil", action="store_true",
        help="with --profile: only samples holding the GIL (BENCHMARKS 9.10)",
    )  # fmt: skip
    ap.add_argument(
        "--native", action="store_true",
        help="with --profile: native frames too (py-spy --native: CUDA's driver, libzmq; it "
             "pauses the daemon for each sample: read the shares, not the rates)",
    )  # fmt: skip
    ap.add_argument(
        "--before", type=Path, metavar="DIR",
        help="also run each server (frames in the message) from this checkout's code, "
             "alternating with this code's in every trial (git worktree add DIR <commit>)",
    )  # fmt: skip
    ap.add_argument(
        "--shm", action="store_true",
        help="also run each dlad server with shared-memory frames (docs/protocol.md)",
    )  # fmt: skip
    ap.add_argument(
        "--batch", type=int, default=1,
        help="frames per message from dlad's client (INFER_BATCH when > 1; the bare server "
             "always gets one frame a message)",
    )  # fmt: skip
    ap.add_argument(
        "--variant", action="append", default=[], metavar="NAME:SECTION.KEY=VALUE",
        help="also run each dlad server with this config key set (VALUE in TOML; several "
             "joined by ';'), alternating with the config as it is in every trial; repeatable. "
             "E.g. 'asyncio:daemon.event_loop=\"asyncio\"'",
    )  # fmt: skip
    ap.add_argument(
        "--only", default="",
        help="run only the dlad servers of these names, comma-separated (as the summary names "
             "them: off, off-shm, on-cuda-shm-asyncio, ...); empty: all",
    )  # fmt: skip
    ap.add_argument(
        "--held", action="store_true",
        help="also a bare server paced to dlad's load that acks each frame --latency-us after "
             "it came (the cost of a reply sent from a wake-up of its own, which any server of "
             "an engine pays and an echo does not)",
    )  # fmt: skip
    ap.add_argument(
        "--floor", action="store_true",
        help="also the floor server (a uvloop ROUTER, two engine threads, a valid reply: dlad "
             "with every feature gone), run as dlad is; every dlad figure is also given as a "
             "ratio to its CPU",
    )  # fmt: skip
    ap.add_argument(
        "--floor-gpu", action="store_true",
        help="also the floor server copying each frame to the GPU on receipt (needs a GPU and "
             "cuda-python): the least GPU pre-processing of frames in the message costs",
    )  # fmt: skip
    ap.add_argument(
        "--native-floor", action="store_true",
        help="also each floor server (--floor, --floor-gpu) written in C, built with cc on first "
             "use: the floor of a daemon of the same shape whose data plane has no Python",
    )  # fmt: skip
    ap.add_argument(
        "--native-plane", action="store_true",
        help="also the native data plane (dlad/native/plane.hpp: dlad's INFER path in C++) on "
             "two emulated cores in timing mode, measured as the floor servers are",
    )  # fmt: skip
    ap.add_argument(
        "--trials", type=int, default=1,
        help="repeat the whole sequence N times; the summary gives each ratio's median and range",
    )  # fmt: skip
    args = ap.parse_args()
    needed = [(flag, tool) for flag, tool in (("--profile", "py-spy"), ("--perf", "perf"),
                                              ("--switches", "perf"))
              if getattr(args, flag[2:]) is not None and shutil.which(tool) is None]  # fmt: skip
    if needed:
        flag, tool = needed[0]
        ap.error(f"{flag} needs {tool}, which is not on PATH")
    if args.native_floor and not (args.floor or args.floor_gpu):
        ap.error("--native-floor needs --floor or --floor-gpu: it adds their servers in C")
    if args.native_floor:
        require_native_floor(ap)
    ideal = 2 * 1e6 / args.latency_us
    print(f"load average before: {os.getloadavg()[0]:.2f} (cpus: {os.cpu_count()})")
    print(f"ideal device capacity: 2 cores x 1/{args.latency_us:.0f} us = {ideal:.0f} req/s")
    backends = [b for b in args.pre_post_backends.split(",") if b != "none"]
    base = [("false", "cpu")] + [("true", b) for b in backends]
    variants: list[str | None] = [None, *args.variant]
    runs: list[tuple[str, str, bool, Path | None, str | None]] = []
    for pre_post, backend in base:
        if args.before is not None:
            runs.append((pre_post, backend, False, args.before.resolve(), None))
        runs += [
            (pre_post, backend, shm, None, variant)
            for shm in ((False, True) if args.shm else (False,))
            for variant in variants
        ]
    if args.only:
        keep = set(args.only.split(","))
        runs = [r for r in runs if _run_name(*r) in keep]
    ratios: dict[str, list[tuple[float, float, float, float, float, float]]] = {
        _run_name(*r): [] for r in runs
    }
    floor_kinds = [
        (("the native " if native else "the ") + label + (", shared-memory frames" if shm else ""),
         gpu, shm, native)
        for native in ((False, True) if args.native_floor else (False,))
        for label, gpu, wanted in (
            ("floor server", False, args.floor),
            ("floor server + each frame's copy to the GPU", True, args.floor_gpu),
        )
        if wanted
        for shm in ((False, True) if args.shm else (False,))
    ]  # fmt: skip
    floor_kinds = [(label, gpu, shm, native, False) for label, gpu, shm, native in floor_kinds]
    if args.native_plane:
        floor_kinds.append(("the native data plane (dlad's INFER path in C++)", False, False,
                            False, True))  # fmt: skip
    # each floor server's own CPU / the bare server's: at its ceiling, paced to its load
    floors: dict[str, list[tuple[float, float]]] = {label: [] for label, *_ in floor_kinds}
    for trial in range(args.trials):
        if args.trials > 1:
            print(f"--- trial {trial + 1} of {args.trials}")
        ceilings: dict[str, tuple[dict[str, float], float]] = {}
        for transport in args.transports.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                ep = args.endpoint if transport == "tcp" else f"ipc://{tmp}/echo.sock"
                stats, cpu, bare_threads = bare_ceiling(ep, args.seconds, args.in_flight)
            ceilings[transport] = stats, cpu
            print(
                f"bare pyzmq ROUTER/DEALER over {transport}, 1.35 MB frames, {args.in_flight} "
                f"in flight: {stats['rate']:.0f} frames/s, p50 {stats['p50_ms']:.2f} ms, "
                f"p99 {stats['p99_ms']:.2f} ms, server CPU {cpu * 1e3:.3f} ms/frame\n"
                f"  {bare_threads}"
            )
        # dlad serves on tcp loopback (its default), so the tcp server is the baseline.
        bare, bare_cpu = ceilings.get("tcp", next(iter(ceilings.values())))
        bound = min(ideal, bare["rate"])
        floor_cpus: dict[bool, float] = {}  # by shm: what each dlad figure is also given against
        for label, gpu, shm, native, plane in floor_kinds:
            fl, f_cpu, f_threads = run_floor(args, gpu=gpu, shm=shm, native=native, plane=plane)
            _, f_paced, _ = bare_ceiling(args.endpoint, args.seconds, args.in_flight, fl["rate"])
            floors[label].append((f_cpu / bare_cpu, f_cpu / f_paced))
            if not gpu and not native and not plane:
                floor_cpus[shm] = f_cpu
            print(
                f"{label}{'' if shm else ' (frames in the message)'}: {fl['rate']:.0f} req/s = "
                f"{fl['rate'] / bound:.3f} x min(ideal, ceiling); p50 {fl['p50_ms']:.2f} ms; "
                f"its own CPU {f_cpu * 1e3:.3f} ms/request = {f_cpu / bare_cpu:.2f} x "
                f"the bare server's at its ceiling, {f_cpu / f_paced:.2f} x paced to "
                f"its load ({f_paced * 1e3:.3f}); errors {fl['errors']}\n  {f_threads}"
            )
        for pre_post, backend, shm, tree, variant in runs:
            r, cpu, engines, raw, threads = run_dlad(
                args, pre_post, backend, trial, shm=shm, tree=tree, variant=variant
            )
            name = _run_name(pre_post, backend, shm, tree, variant)
            own = cpu - engines
            floor_cpu = floor_cpus.get(shm, floor_cpus.get(False, math.nan))
            paced, paced_cpu, paced_threads = bare_ceiling(
                args.endpoint, args.seconds, args.in_flight, r["rate"]
            )
            paced_threads = paced_threads.replace("\n  ", "\n    its ")
            held_line, held_cpu = "", math.nan
            if args.held:
                held, held_cpu, held_threads = bare_ceiling(
                    args.endpoint, args.seconds, args.in_flight, r["rate"],
                    hold_us=args.latency_us,
                )  # fmt: skip
                held_threads = held_threads.replace("\n  ", "\n    its ")
                held_line = (
                    f"  the bare server paced so, each ack {args.latency_us:.0f} us after its "
                    f"frame: {held['rate']:.0f} frames/s, CPU {held_cpu * 1e3:.3f} ms/frame: "
                    f"dlad's own = {own / held_cpu:.2f} x that\n    its {held_threads}\n"
                )
            floor_line = (
                f"  dlad's own = {own / floor_cpu:.2f} x the floor server's"
                f"{' with shared-memory frames' if shm and shm in floor_cpus else ''}\n"
                if args.floor
                else ""
            )
            ratios[name].append(
                (own / bare_cpu, own / paced_cpu, r["rate"] / bound, cpu, own / held_cpu,
                 own / floor_cpu)
            )  # fmt: skip
            print(
                f"{'the --before code' if tree else 'dlad'}, pre/post "
                f"{'on (' + backend + ')' if pre_post == 'true' else 'off'}"
                f"{', shared-memory frames' if shm else ''}"
                f"{'' if variant is None else ', variant ' + variant}: "
                f"{r['rate']:.0f} req/s "
                f"= {r['rate'] / bound:.3f} x min(ideal, ceiling); p50 {r['p50_ms']:.2f} ms, "
                f"p99 {r['p99_ms']:.2f} ms; process CPU {cpu * 1e3:.3f} ms/request, of which "
                f"the emulated cores' threads {engines * 1e3:.3f}: the daemon's own "
                f"{own * 1e3:.3f} = {own / bare_cpu:.2f} x the bare pyzmq server's "
                f"{bare_cpu * 1e3:.3f}; errors {r['errors']}\n"
                f"  the bare server paced to the same load: {paced['rate']:.0f} frames/s, CPU "
                f"{paced_cpu * 1e3:.3f} ms/frame: dlad's own = {own / paced_cpu:.2f} x that\n"
                f"    its {paced_threads}\n"
                f"{held_line}"
                f"{floor_line}"
                f"  {threads}"
            )
            if raw is not None and not raw.exists():
                print(f"profile of dlad, pre/post {name}: py-spy wrote nothing ({raw})")
            elif raw is not None:
                print(f"profile of dlad, pre/post {name} ({raw}):\n{top_functions(raw)}")
                print(f"  the event loop's thread alone:\n{top_functions(raw, 30, LOOP)}")
    if args.trials > 1:
        print(f"summary over {args.trials} trials (median [min, max]):")
        for name, rows in ratios.items():
            cpu_r, paced_r, rate_r, proc_r, held_r, floor_r = (
                sorted(x) for x in zip(*rows, strict=True)
            )
            held_text = "" if not args.held else (
                f", / paced and acking {args.latency_us:.0f} us late "
                f"{statistics.median(held_r):.2f} [{held_r[0]:.2f}, {held_r[-1]:.2f}]"
            )  # fmt: skip
            if args.floor:
                held_text += (f", / the floor server {statistics.median(floor_r):.2f} "
                              f"[{floor_r[0]:.2f}, {floor_r[-1]:.2f}]")  # fmt: skip
            print(
                f"  dlad pre/post {name}: process CPU {statistics.median(proc_r) * 1e3:.3f} "
                f"ms/request; daemon's own CPU / bare server's at its ceiling "
                f"{statistics.median(cpu_r):.2f} [{cpu_r[0]:.2f}, {cpu_r[-1]:.2f}], / paced "
                f"to the same load {statistics.median(paced_r):.2f} [{paced_r[0]:.2f}, "
                f"{paced_r[-1]:.2f}]{held_text}; rate / min(ideal, ceiling) "
                f"{statistics.median(rate_r):.3f} [{rate_r[0]:.3f}, {rate_r[-1]:.3f}]"
            )
        for label, got in floors.items():
            fc, fp = (sorted(x) for x in zip(*got, strict=True))
            print(
                f"  {label}: own CPU / bare server's at its ceiling "
                f"{statistics.median(fc):.2f} [{fc[0]:.2f}, {fc[-1]:.2f}], / paced to its load "
                f"{statistics.median(fp):.2f} [{fp[0]:.2f}, {fp[-1]:.2f}]"
            )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
