"""The native plane's GPU chain (dlad/native/gpu_chain.cpp) on a fake CUDA driver (fake_cuda.c).

Each frame's chain is the one dlad/executors/dla.py queues: the frame staged, uploaded or read
in place, the pre kernel with the letterbox of dlad.imaging.pre, the ready word, the emulated
core's task, the wait for its word, the post graph (the settings copied only when they change)
and the host function that ends it; the reply carries the graph's detections. The fake runs each
stream's operations in order on a thread and logs what ran and when: the tests read its logs
(the pixels' checksum when the kernel ran, the words written, the graphs run) and the replies.
What a real GPU computes is held to the numpy reference by tests/dlad/gpu (GPU machines).
"""

from __future__ import annotations

import ctypes
import math
import shutil
import struct
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from dlad import _native, protocol
from dlad.config import load_config
from dlad.daemon import Daemon
from dlad.errors import Status
from dlad.gpu.driver import GpuProbe
from dlad.gpu.prepost import SORT_CAPACITY, FrameParams, Geometry
from dlad.imaging.post import logit_cut
from dlad.imaging.pre import hwc4_layout, letterbox_geometry
from dlad.native_plane import (
    CudaFunctions,
    Frame,
    Health,
    Item,
    ModelSettings,
    NativePlane,
    PlaneDevice,
    PlaneGpu,
    PlaneGpuSlot,
)
from dlad.protocol import InferReply, InferRequest, ShmRef
from tests.dlad.serving import serve_in_thread
from tests.dlad.test_daemon import dealer, recv
from tests.dlad.test_metrics import wait_for

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc builds the fake CUDA driver"),
]

SOURCE = Path(__file__).with_name("fake_cuda.c")
WAIT_MS = 20_000  # a hang guard: the replies come in milliseconds
CANVAS = (64, 96)  # height, width
MAX_DET = 1000
DEFAULTS = (0.25, 0.45, 300)  # the model's conf, iou, max_det
SETTINGS = {"demo": ModelSettings(*DEFAULTS)}
PRE = struct.Struct("<QQ12iffi5f")  # kernels.cu's PreParams
IMAGE_BYTES = 1 << 16
c_u64p = ctypes.POINTER(ctypes.c_uint64)
c_i64p = ctypes.POINTER(ctypes.c_int64)


class Fake:
    """The built fake and its controls."""

    def __init__(self, path: Path) -> None:
        lib = self.lib = ctypes.CDLL(str(path))
        lib.fake_stream_create.restype = ctypes.c_void_p
        for name in ("fake_stream_destroy", "fake_stream_sync", "fake_graph_destroy"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
        lib.fake_stream_hold.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.fake_graph_create.restype = ctypes.c_void_p
        lib.fake_graph_create.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 3
        lib.fake_graph_launches.argtypes = [ctypes.c_void_p]
        lib.fake_fail_next.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.fake_launches.argtypes = [ctypes.c_char_p, c_u64p, c_i64p, ctypes.c_int]
        lib.fake_writes.argtypes = [ctypes.POINTER(ctypes.c_uint32), c_i64p, ctypes.c_int]
        lib.fake_posts.argtypes = [c_i64p, ctypes.c_int]
        lib.fake_signals.argtypes = [c_i64p, ctypes.c_int]
        lib.fake_context.restype = ctypes.c_void_p
        lib.fake_reset()

    def function(self, name: str) -> int:
        address = ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value
        assert address is not None
        return address

    def functions(self) -> CudaFunctions:
        names = ("ctx_set_current", "memcpy_htod_async", "launch_kernel", "write_value32",
                 "wait_value32", "graph_launch", "launch_host_func")  # fmt: skip
        f = [self.function(f"fake_{n}") for n in names]
        return CudaFunctions(f[0], f[1], f[2], f[3], f[4], f[5], f[6], wait_geq=0)

    def launches(self) -> list[tuple[tuple[Any, ...], int, int]]:
        """(PreParams fields, the source's checksum, when it ran) of each pre kernel run."""
        most = 256
        params = ctypes.create_string_buffer(PRE.size * most)
        sums, at = (ctypes.c_uint64 * most)(), (ctypes.c_int64 * most)()
        n = self.lib.fake_launches(params, sums, at, most)
        return [(PRE.unpack_from(params.raw, PRE.size * i), sums[i], at[i]) for i in range(n)]

    def writes(self) -> list[tuple[int, int]]:
        """(value, when) of each ready word the streams wrote."""
        most = 256
        values, at = (ctypes.c_uint32 * most)(), (ctypes.c_int64 * most)()
        n = self.lib.fake_writes(values, at, most)
        return [(values[i], at[i]) for i in range(n)]

    def posts(self) -> list[int]:
        """When each post graph ran."""
        at = (ctypes.c_int64 * 256)()
        return list(at[: self.lib.fake_posts(at, 256)])

    def signals(self) -> list[int]:
        """When each external semaphore signal ran (a cuDLA core's ready fence)."""
        at = (ctypes.c_int64 * 256)()
        return list(at[: self.lib.fake_signals(at, 256)])


def build_fake(out_dir: Path) -> Fake:
    """Compile fake_cuda.c into ``out_dir`` with gcc and load it."""
    out = out_dir / "libfakecuda.so"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden",
         "-pthread", "-o", str(out), str(SOURCE)],
        check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return Fake(out)


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Fake:
    return build_fake(tmp_path_factory.mktemp("fake_cuda"))


def _address(a: npt.NDArray[Any]) -> int:
    return int(a.ctypes.data)


@dataclass
class GpuSlotBuffers:
    """One slot's memory on the fake "GPU" (host memory: the fake's device addresses are host
    addresses), its stream and its two graphs."""

    fake: Fake
    staging: bool
    image_bytes: int = IMAGE_BYTES
    output_bytes: tuple[int, ...] = ()  # the DLA outputs an emulated core writes its pattern to
    outputs: list[npt.NDArray[np.uint8]] = field(init=False)
    image: npt.NDArray[np.uint8] = field(init=False)
    input: npt.NDArray[np.uint8] = field(init=False)
    words: npt.NDArray[np.uint32] = field(init=False)
    frame_host: npt.NDArray[np.uint8] = field(init=False)
    frame_device: npt.NDArray[np.uint8] = field(init=False)
    out: npt.NDArray[np.float32] = field(init=False)
    stream: int = field(init=False)
    graphs: tuple[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.image = np.zeros(self.image_bytes, np.uint8)
        self.input = np.zeros(1024, np.uint8)
        self.words = np.zeros(32, np.uint32)  # ready at [0], done at [16]
        self.frame_host = np.zeros(64, np.uint8)
        self.frame_device = np.zeros(64, np.uint8)
        self.out = np.zeros(4 + 6 * MAX_DET, np.float32)
        self.outputs = [np.zeros(n, np.uint8) for n in self.output_bytes]
        lib = self.fake.lib
        self.stream = lib.fake_stream_create()
        frames = (_address(self.frame_host), _address(self.frame_device), _address(self.out))
        self.graphs = (lib.fake_graph_create(1, *frames), lib.fake_graph_create(0, *frames))

    def spec(self) -> PlaneGpuSlot:
        image = _address(self.image)
        words = _address(self.words)
        return PlaneGpuSlot(
            stream=self.stream,
            image=0 if self.staging else image,
            staging=image if self.staging else 0,
            staging_device=image if self.staging else 0,
            image_bytes=self.image_bytes,
            input=_address(self.input),
            ready=words, ready_device=words, done=words + 64, done_device=words + 64,
            post_copy=self.graphs[0], post_reuse=self.graphs[1],
            frame=_address(self.frame_host), out=_address(self.out),
            outputs=tuple(_address(o) for o in self.outputs),
        )  # fmt: skip

    def graph_launches(self) -> tuple[int, int]:
        """(with the settings' copy, without)."""
        copy, reuse = (int(self.fake.lib.fake_graph_launches(g)) for g in self.graphs)
        return copy, reuse

    def close(self) -> None:
        self.fake.lib.fake_stream_destroy(self.stream)
        for g in self.graphs:
            self.fake.lib.fake_graph_destroy(g)


class Rig:
    """A plane with one emulated core whose frames run on the fake GPU, and a DEALER."""

    CONTEXT = 0xC0FFEE

    def __init__(
        self, fake: Fake, *, slots: int = 1, staging: bool = False, latency_us: float = 200.0,
        int8: bool = True, image_bytes: int = IMAGE_BYTES, patterns: tuple[bytes, ...] = (),
        **settings: Any,
    ) -> None:  # fmt: skip
        fake.lib.fake_reset()
        self.fake = fake
        sizes = tuple(len(p) for p in patterns)
        self.slots = [GpuSlotBuffers(fake, staging, image_bytes, sizes) for _ in range(slots)]
        self.int8 = int8
        gpu = PlaneGpu(
            context=self.CONTEXT, pre_kernel=0x5EED, int8=int8, input_scale=0.5, canvas=CANVAS,
            max_det=MAX_DET, slots=tuple(s.spec() for s in self.slots), patterns=patterns,
        )  # fmt: skip
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        device = PlaneDevice("dla0", latency_us, slots=slots, capacity=64, gpu=gpu)
        settings.setdefault("health", Health(quarantine_after=0))  # the chain's failures alone
        self.plane = NativePlane(
            self.router, devices=[device], models={"demo": ["dla0"]}, settings=SETTINGS,
            cuda=fake.functions(),
            **settings,
        )  # fmt: skip
        self.plane.start()
        self.client = self.ctx.socket(zmq.DEALER)
        self.client.setsockopt(zmq.LINGER, 0)
        self.client.setsockopt(zmq.ROUTING_ID, b"cam")
        self.client.connect(f"tcp://127.0.0.1:{port}")
        self.closed = False

    def infer(self, rid: int, image: npt.NDArray[np.uint8], **fields: Any) -> None:
        request = InferRequest(id=rid, model="demo", image=image, **fields)
        self.client.send_multipart(protocol.encode(request), copy=False)

    def reply(self) -> InferReply:
        assert self.client.poll(WAIT_MS), "no reply"
        reply = protocol.decode_reply(self.client.recv_multipart())
        assert isinstance(reply, InferReply)
        return reply

    def close(self) -> None:
        if not self.closed:
            self.plane.close()
            self.closed = True
        self.client.close(0)
        self.router.close(0)
        self.ctx.term()
        for s in self.slots:
            s.close()


@pytest.fixture
def rigs(fake: Fake) -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for r in made:
        r.close()


def _rig(rigs: list[Rig], fake: Fake, **kwargs: Any) -> Rig:
    rigs.append(Rig(fake, **kwargs))
    return rigs[-1]


def _expected_pre(
    shape: tuple[int, ...], fmt: str, colour: int, src: int, dst: int, int8: bool
) -> tuple[Any, ...]:
    """The PreParams GpuPipeline.pre fills for this frame (dlad/gpu/prepost.py)."""
    h, w = protocol.frame_size(fmt, shape)
    pitch_bytes = {"RGB": 3 * w, "BGR": 3 * w, "YUYV": 2 * w}.get(fmt, w)
    ky, rv, gu, gv, bu, y_offset = _native.yuv_coefficients(colour)
    g = letterbox_geometry(w, h, CANVAS)
    pitch = hwc4_layout(3, g.dst_h, g.dst_w, 1)[0] if int8 else g.dst_w
    scale = float(np.float32(0.5)) if int8 else 1.0
    return (src, dst, w, h, pitch_bytes, protocol.PIXEL_FORMATS.index(fmt), y_offset, g.dst_w,
            g.dst_h, pitch, g.new_w, g.new_h, g.pad_x, g.pad_y, float(np.float32(g.scale)), scale,
            114, ky, rv, gu, gv, bu)  # fmt: skip


def _expected_rows(
    shape: tuple[int, ...], conf: float, iou: float, n: int, canvas: tuple[int, int] = CANVAS
) -> npt.NDArray[Any]:
    """What the fake's post graph writes from the settings it was given (fake_cuda.c)."""
    h, w = shape[0], shape[1]
    g = letterbox_geometry(w, h, canvas)
    rows = [[g.pad_x, g.pad_y, w, h, np.float32(conf), np.float32(iou) + i] for i in range(n)]
    return np.array(rows, np.float32).reshape(n, 6)


CASES = [  # shape, format, conf, iou, max_det (None: the model's default), a YUV frame's colour
    ((4, 4, 3), "RGB", None, None, None, {}),
    ((17, 33, 3), "BGR", 0.5, 0.3, 1, {}),
    ((9, 5, 1), "GRAY", 0.1, None, None, {}),
    ((120, 40, 3), "RGB", 0.0, 1.0, 7, {}),
    ((18, 20), "NV12", None, None, None, {}),
    ((18, 20), "NV12", None, None, None, {"colorspace": "bt709"}),
    ((7, 22, 2), "YUYV", 0.2, None, None, {"colorspace": "bt709", "color_range": "full"}),
]


@pytest.mark.parametrize("staging", [False, True], ids=["upload", "staging"])
@pytest.mark.parametrize("int8", [True, False], ids=["hwc4-int8", "chw16-fp16"])
def test_frames_run_the_chain_and_the_reply_carries_the_detections(
    fake: Fake, rigs: list[Rig], staging: bool, int8: bool
) -> None:
    rig = _rig(rigs, fake, staging=staging, int8=int8)
    rng = np.random.default_rng(5)
    images = [rng.integers(0, 256, size=shape, dtype=np.uint8) for shape, *_ in CASES]
    for rid, ((_, fmt, conf, iou, max_det, yuv), image) in enumerate(
        zip(CASES, images, strict=True)
    ):
        rig.infer(rid, image, format=fmt, conf=conf, iou=iou, max_det=max_det, **yuv)
        r = rig.reply()  # one at a time: the log's i-th launch is frame i's
        assert (r.id, r.status, r.device) == (rid, Status.OK, "dla0")
        n = min(max_det or DEFAULTS[2], 2)
        expected = _expected_rows(protocol.frame_size(fmt, image.shape),
                                  DEFAULTS[0] if conf is None else conf,
                                  DEFAULTS[1] if iou is None else iou, n)  # fmt: skip
        np.testing.assert_array_equal(r.detections, expected)
        t = r.timing
        assert t.start_ns is not None
        assert t.end_ns is not None
        assert t.device_us >= 200
        assert t.total_us >= t.pre_us + t.device_us + t.post_us - 3  # each rounded down
    slot = rig.slots[0]
    launches = fake.launches()
    assert len(launches) == len(CASES)
    for (params, checksum, _), image, (_, fmt, _c, _i, _m, yuv) in zip(
        launches, images, CASES, strict=True
    ):
        # the pixels were where the kernel read them when it ran (staged or uploaded)
        colour = protocol.colour_code(yuv.get("colorspace"), yuv.get("color_range"))
        assert params == _expected_pre(image.shape, fmt, colour, _address(slot.image),
                                       _address(slot.input), int8)  # fmt: skip
        assert checksum == int(image.astype(np.uint64).sum())
    assert fake.lib.fake_context() == Rig.CONTEXT
    assert rig.plane.counters()["by_status"] == {"OK": len(CASES)}


def _expected_settings(shape: tuple[int, ...], conf: float, iou: float, max_det: int) -> bytes:
    """The FrameParams and Geometry GpuPipeline.post writes for this frame (prepost.py)."""
    h, w = shape[0], shape[1]
    g = letterbox_geometry(w, h, CANVAS)
    f = FrameParams(
        conf=float(np.float32(conf)), obj_cut=float(np.float32(logit_cut(conf))), iou=float(iou),
        max_det=max_det, multi_label=0, max_candidates=SORT_CAPACITY, nms_rounds=24,
    )  # fmt: skip
    geo = Geometry(scale=g.scale, pad_x=g.pad_x, pad_y=g.pad_y, src_w=g.src_w, src_h=g.src_h)
    return bytes(f) + bytes(geo)


def test_the_planes_letterbox_and_settings_are_the_pipelines(fake: Fake, rigs: list[Rig]) -> None:
    """The plane's C++ port of the letterbox and of the frame's settings gives the bytes
    GpuPipeline.pre and .post give, on generated sizes and thresholds: the GPU then computes
    what the Python path makes it compute."""
    rig = _rig(rigs, fake, image_bytes=1200 * 1200 * 3)
    pixels = np.zeros(1200 * 1200 * 3, np.uint8)
    rid = iter(range(1 << 30))

    @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        h=st.integers(1, 600), w=st.integers(1, 600), fmt=st.sampled_from(protocol.PIXEL_FORMATS),
        colour=st.integers(0, 3), conf=st.floats(0, 1, exclude_max=True),
        iou=st.floats(0, 1, exclude_min=True), max_det=st.integers(1, MAX_DET),
    )  # fmt: skip
    def check(h: int, w: int, fmt: str, colour: int, conf: float, iou: float, max_det: int) -> None:
        yuv = fmt in ("NV12", "YUYV")
        h, w = (2 * h, 2 * w) if yuv else (h, w)
        shape = protocol.frame_shape(fmt, h, w)
        image = pixels[: math.prod(shape)].reshape(shape)
        fields = ({"colorspace": protocol.COLORSPACES[colour & 1],
                   "color_range": protocol.COLOR_RANGES[colour >> 1]} if yuv else {})  # fmt: skip
        rig.infer(next(rid), image, format=fmt, conf=conf, iou=iou, max_det=max_det, **fields)
        assert rig.reply().status is Status.OK
        params, _, _ = fake.launches()[-1]
        slot = rig.slots[0]
        expected = _expected_pre(image.shape, fmt, colour if yuv else 0, _address(slot.image),
                                 _address(slot.input), True)  # fmt: skip
        assert params == expected
        settings_bytes = _expected_settings((h, w), conf, iou, max_det)
        assert bytes(slot.frame_host[: len(settings_bytes)]) == settings_bytes

    check()


def test_the_settings_are_copied_to_the_gpu_only_when_they_change(
    fake: Fake, rigs: list[Rig]
) -> None:
    rig = _rig(rigs, fake)
    image = np.full((10, 20, 3), 7, np.uint8)
    runs = [(0.25, 10), (0.25, 10), (0.25, 10), (0.6, 10), (0.6, 10), (0.6, 3)]
    for rid, (conf, max_det) in enumerate(runs):
        rig.infer(rid, image, conf=conf, max_det=max_det)
        r = rig.reply()
        # a frame run on the graph without the copy after its settings changed would show the
        # last frame's conf here
        np.testing.assert_array_equal(r.detections, _expected_rows(image.shape, conf, 0.45, 2))
    assert rig.slots[0].graph_launches() == (3, 3)  # copies at frames 0, 3 and 5
    other = np.full((11, 20, 3), 7, np.uint8)  # another size: another geometry to copy
    rig.infer(99, other, conf=0.6, max_det=3)
    np.testing.assert_array_equal(rig.reply().detections, _expected_rows(other.shape, 0.6, 0.45, 2))
    assert rig.slots[0].graph_launches() == (4, 3)


def test_the_core_waits_for_the_pre_kernel_and_post_waits_for_the_core(
    fake: Fake, rigs: list[Rig]
) -> None:
    rig = _rig(rigs, fake, latency_us=2000.0)
    image = np.zeros((8, 8, 3), np.uint8)
    fake.lib.fake_stream_hold(rig.slots[0].stream, 1)  # the GPU has not run the pre kernel yet
    rig.infer(1, image)
    wait_for(lambda: rig.plane.state()[0][0].in_flight == 1)
    assert fake.writes() == []  # the ready word is unwritten: the core must not have started
    assert rig.plane.counters()["replied"] == 0
    fake.lib.fake_stream_hold(rig.slots[0].stream, 0)
    first = rig.reply()
    for rid in range(2, 6):
        rig.infer(rid, image)
    replies = [first] + [rig.reply() for _ in range(4)]
    writes, posts = fake.writes(), fake.posts()
    assert [v for v, _ in writes] == [1, 2, 3, 4, 5]  # one ready value per frame, in order
    for r, (_, written), posted in zip(replies, writes, posts, strict=True):
        assert r.status is Status.OK
        assert r.timing.start_ns is not None
        assert r.timing.end_ns is not None
        assert r.timing.start_ns >= written  # the task started after the pre kernel's signal
        assert posted >= r.timing.end_ns  # post ran after the task ended
    assert rig.slots[0].words[16] == 5  # the core signalled each frame's done value


@pytest.mark.parametrize(
    ("call", "staging"),
    [("cuMemcpyHtoDAsync", False), ("cuLaunchKernel", True), ("cuStreamWriteValue32", False),
     ("cuStreamWaitValue32", False), ("cuGraphLaunch", False), ("cuLaunchHostFunc", True),
     ("cuCtxSetCurrent", False)],
)  # fmt: skip
def test_a_failed_cuda_call_answers_device_failed_and_frees_the_slot(
    fake: Fake, rigs: list[Rig], call: str, staging: bool
) -> None:
    rig = _rig(rigs, fake, staging=staging)
    image = np.ones((6, 6, 3), np.uint8)
    fake.lib.fake_fail_next(call.encode(), 700)
    rig.infer(1, image)
    r = rig.reply()
    assert (r.id, r.status) == (1, Status.DEVICE_FAILED)
    assert r.message.startswith("dla0: the GPU chain could not be queued: ")
    assert f"{call}" in r.message
    assert "(700)" in r.message
    assert rig.plane.counters()["gpu_errors"] == 1
    # the slot is free and its stream runs on: a stream left waiting for the core's word was
    # released
    for rid in (2, 3):
        rig.infer(rid, image)
        ok = rig.reply()
        assert (ok.id, ok.status) == (rid, Status.OK)
        np.testing.assert_array_equal(ok.detections, _expected_rows(image.shape, 0.25, 0.45, 2))
    assert rig.plane.pending == 0


def test_submitted_images_answer_with_their_detections(fake: Fake, rigs: list[Rig]) -> None:
    rig = _rig(rigs, fake, slots=2)
    images = [np.full((5, 9, 3), i, np.uint8) for i in range(3)]
    items = [
        Item("demo", None, 0, None, img.nbytes, frame=Frame(5, 9, conf=0.3 + i / 10),
             pixels=img.tobytes())
        for i, img in enumerate(images)
    ]  # fmt: skip
    assert rig.plane.submit(b"cam", "cam-owner", 42, items, tag=7) is None
    outcomes = []
    for _ in images:
        assert rig.plane.forwarded.poll(WAIT_MS)
        parts = rig.plane.forwarded.recv_multipart()
        assert parts[0] == b""
        outcomes.append(NativePlane.outcome(parts[1:]))
    for o in sorted(outcomes, key=lambda o: o.index):
        assert o.tag == 7
        rows = np.frombuffer(o.detections, "<f4").reshape(-1, 6)
        np.testing.assert_array_equal(rows, _expected_rows((5, 9), 0.3 + o.index / 10, 0.45, 2))
        header = protocol.decode_reply([o.header, o.detections])
        assert isinstance(header, InferReply)
        assert (header.id, header.status, header.count) == (42, Status.OK, 2)
    assert sorted(checksum for _, checksum, _ in fake.launches()) == [0, 135, 270]


@pytest.mark.parametrize("registered", [True, False], ids=["in-place", "copied"])
def test_shared_memory_frames_are_read_in_place_where_the_gpu_has_the_segment(
    fake: Fake, rigs: list[Rig], registered: bool
) -> None:
    rig = _rig(rigs, fake, shm=True)
    segment = np.zeros(4096, np.uint8)
    image = np.arange(7 * 11 * 3, dtype=np.uint8).reshape(7, 11, 3)
    offset = 1000
    segment[offset : offset + image.nbytes] = image.reshape(-1)
    base = _address(segment)
    assert rig.plane.add_segment("63616d", "seg", segment.nbytes, bytes(16), host=base,
                                 device=base if registered else 0)  # fmt: skip
    ref = ShmRef("seg", offset, segment.nbytes, bytes(16))
    rig.infer(1, image, shm=ref)
    r = rig.reply()
    assert r.status is Status.OK, r.message
    ((params, checksum, _),) = fake.launches()
    assert params[0] == (base + offset if registered else _address(rig.slots[0].image))
    assert checksum == int(image.astype(np.uint64).sum())
    assert rig.plane.counters()["shm_frames"] == 1


def test_close_releases_a_chain_whose_core_stopped_and_waits_for_its_end(
    fake: Fake, rigs: list[Rig]
) -> None:
    rig = _rig(rigs, fake)
    stream = rig.slots[0].stream
    fake.lib.fake_stream_hold(stream, 1)  # the core waits for a ready word that has not come
    rig.infer(1, np.zeros((4, 4, 3), np.uint8))
    wait_for(lambda: rig.plane.state()[0][0].in_flight == 1)
    closing = threading.Thread(target=rig.plane.close)
    closing.start()
    r = rig.reply()  # the drain answers the frame whose chain still runs
    assert (r.id, r.status) == (1, Status.SHUTTING_DOWN)
    fake.lib.fake_stream_hold(stream, 0)  # the GPU goes on: the core is gone by now, or going
    closing.join(WAIT_MS / 1e3)
    assert not closing.is_alive()
    rig.closed = True
    # the stream reached its host function: the plane wrote the stopped core's done word (had
    # it not, the stream would wait for it still, and close would have given up on it)
    assert fake.lib.fake_host_calls() == 1
    assert rig.slots[0].words[16] == 1


# ----------------------------------------------------------------------------- the daemon


class FakeService:
    """GpuService's part in a daemon on the native plane, on the fake driver: each core's
    slots from :class:`GpuSlotBuffers`, segments "registered" at their host address."""

    fake: Fake
    made: ClassVar[list[FakeService]] = []
    daemon: Daemon | None = None  # the daemon it serves (set before it starts)
    read_frames_in_place = True  # [pre_post] gpu_frames = "auto"

    def __init__(self, *, max_image_bytes: int, frames: str) -> None:
        self.slots: list[GpuSlotBuffers] = []
        self.registered: dict[int, int] = {}
        self.plane_closed_first: bool | None = None
        FakeService.made.append(self)

    def plane_gpu(self, loadable: Any, slots: int) -> PlaneGpu:
        made = [GpuSlotBuffers(self.fake, staging=False) for _ in range(slots)]
        self.slots += made
        h, w = loadable.image_size
        return PlaneGpu(
            context=Rig.CONTEXT, pre_kernel=0x5EED, int8=True, input_scale=0.5, canvas=(h, w),
            max_det=MAX_DET, slots=tuple(s.spec() for s in made),
        )  # fmt: skip

    def register_frames(self, address: int, nbytes: int) -> None:
        self.registered[address] = nbytes

    def unregister_frames(self, address: int) -> None:
        self.registered.pop(address, None)

    def segment_device(self, address: int) -> int:
        return address if address in self.registered else 0

    def close(self) -> None:
        assert self.daemon is not None
        self.plane_closed_first = self.daemon.frontend.plane is None
        for s in self.slots:
            s.close()


DAEMON = """
[daemon]
default_deadline_ms = 60000.0
[frontend]
endpoints = ["tcp://127.0.0.1:5555"]
[pre_post]
enabled = true
[soc]
dram_contention = 0
[metrics]
heartbeat_s = 0.05
[devices.dla0]
kind = "dla"
backend = "emulated"
core = 0
mode = "timing"
latency_us = 300.0
[devices.gpu]
kind = "gpu"
[models.demo]
devices = ["dla0"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
"""


def test_the_daemon_serves_gpu_pre_post_on_the_plane(
    fake: Fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's wiring on the fake driver: each core's slots built by the GPU service and
    handed to the plane; INFERs, an INFER_BATCH (through the event loop) and shared-memory
    frames (read in place once the segment is mapped and registered) come back with their
    detections; the plane is closed before the GPU's memory is freed."""
    fake.lib.fake_reset()
    FakeService.fake = fake
    FakeService.made = []
    found = GpuProbe(True, name="fake")
    monkeypatch.setattr("dlad.gpu.service.select_backend", lambda requested, gpu: ("cuda", found))
    monkeypatch.setattr("dlad.gpu.service.GpuService", FakeService)
    monkeypatch.setattr("dlad.gpu.driver.plane_functions", fake.functions)
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(DAEMON)
    plan = load_config(cfg).plan()
    canvas = plan.placements[0].loadable.image_size
    daemon = FakeService.daemon = Daemon(plan, endpoints=["tcp://127.0.0.1:0"])
    image = np.arange(6 * 10 * 3, dtype=np.uint8).reshape(6, 10, 3)
    segment = shared_memory.SharedMemory(create=True, size=4096)
    assert segment.buf is not None
    segment.buf[: protocol.SHM_HEADER_BYTES] = protocol.shm_header(bytes(16))
    try:
        with capture_logs() as logs, serve_in_thread(daemon) as endpoint, dealer(endpoint) as sock:
            (service,) = FakeService.made
            sock.send_multipart(protocol.encode(InferRequest(1, "demo", image, conf=0.5)))
            r = recv(sock)
            assert isinstance(r, InferReply)
            assert (r.id, r.status, r.device) == (1, Status.OK, "dla0")
            expected = _expected_rows(image.shape, 0.5, 0.45, 2, canvas)
            np.testing.assert_array_equal(r.detections, expected)
            small = np.ascontiguousarray(image[:3])
            images = (InferRequest(2, "demo", image, max_det=1),
                      InferRequest(2, "demo", small, max_det=1))  # fmt: skip
            batch = protocol.InferBatchRequest(2, "demo", images)
            sock.send_multipart(protocol.encode(batch))
            b = recv(sock)
            assert isinstance(b, protocol.InferBatchReply)
            assert [x.status for x in b.results] == [Status.OK, Status.OK]
            for result, shape in zip(b.results, ((6, 10), (3, 10)), strict=True):
                expected = _expected_rows(shape, 0.25, 0.45, 1, canvas)
                np.testing.assert_array_equal(result.detections, expected)
            offset = 512
            buf = segment.buf
            assert buf is not None
            np.frombuffer(buf, np.uint8)[offset : offset + image.nbytes] = image.reshape(-1)
            ref = ShmRef(segment.name, offset, segment.size, bytes(16))
            for rid in (3, 4):  # the first through the event loop, the second the plane's own
                sock.send_multipart(protocol.encode(InferRequest(rid, "demo", image, shm=ref)))
                s = recv(sock)
                assert isinstance(s, InferReply)
                assert (s.id, s.status) == (rid, Status.OK), s.message
            launches = fake.launches()
            assert len(launches) == 6  # the core's warm-up, then five frames
            (base,) = service.registered  # mapped by the event loop, registered with the GPU
            for params, checksum, _ in launches[4:]:
                assert params[0] == base + offset  # read in place
                assert checksum == int(image.astype(np.uint64).sum())
            assert daemon.frontend.plane is not None
            assert daemon.frontend.plane.counters()["shm_frames"] == 1
            # a failed call: that frame is DEVICE_FAILED, and the heartbeat logs it
            fake.lib.fake_fail_next(b"cuGraphLaunch", 719)
            sock.send_multipart(protocol.encode(InferRequest(5, "demo", image)))
            failed = recv(sock)
            assert isinstance(failed, InferReply)
            assert (failed.id, failed.status) == (5, Status.DEVICE_FAILED)
            assert failed.message.endswith("cuGraphLaunch failed (719)")
            wait_for(lambda: any(e["event"] == "gpu_chain_failed" for e in logs))
            sock.send_multipart(protocol.encode(protocol.StatusRequest(6)))
            status = recv(sock)
            assert isinstance(status, protocol.StatusReply)
            (dla0,) = status.report["devices"]
            assert (dla0["name"], dla0["failed"], dla0["completed"]) == ("dla0", 1, 5)
            assert dla0.get("pre_post") == "gpu"  # a camera sends NV12 here (dlad-cam)
            assert dla0["healthy"] is True  # one failure: not yet UNHEALTHY_AFTER in a row
            # two more in a row: the core is unhealthy (STATUS, the gauge, the log) until a
            # frame goes through again
            ready = daemon.metrics.registry.get_sample_value
            for rid in (7, 8):
                fake.lib.fake_fail_next(b"cuLaunchKernel", 700)
                sock.send_multipart(protocol.encode(InferRequest(rid, "demo", image)))
                assert recv(sock).status is Status.DEVICE_FAILED
            wait_for(lambda: ready("dlad_device_ready", {"device": "dla0"}) == 0)
            sock.send_multipart(protocol.encode(protocol.StatusRequest(9)))
            status = recv(sock)
            assert isinstance(status, protocol.StatusReply)
            (dla0,) = status.report["devices"]
            assert dla0["healthy"] is False
            assert dla0["reason"].startswith("3 consecutive tasks failed; last: dla0: the GPU")
            sock.send_multipart(protocol.encode(InferRequest(10, "demo", image)))
            assert recv(sock).status is Status.OK
            wait_for(lambda: ready("dlad_device_ready", {"device": "dla0"}) == 1)
    finally:
        segment.close()
        segment.unlink()
    assert service.plane_closed_first is True
    logged = [e for e in logs if e["event"] == "gpu_chain_failed"]
    assert sum(e["frames"] for e in logged) == 3
    assert logged[0]["last"] == "dla0: cuGraphLaunch failed (719)"
    assert [e["event"] for e in logs if e["event"].startswith("device_")] == [
        "device_unhealthy", "device_healthy"]  # fmt: skip


def test_the_emulated_core_writes_its_timing_pattern_before_the_post_graph(
    fake: Fake, rigs: list[Rig]
) -> None:
    """As EmulatedDlaCore in timing mode does, the plane's core writes each output's pattern
    at its task's end, before the stream's post graph reads the heads: both data planes
    answer a frame alike (tests/dlad/gpu/test_native_chain.py on a real GPU)."""
    patterns = (bytes(range(1, 65)), bytes(range(100, 117)))
    rig = _rig(rigs, fake, slots=2, patterns=patterns)
    for rid in range(4):
        rig.infer(rid, np.zeros((8, 8, 3), np.uint8))
    assert {rig.reply().status for _ in range(4)} == {Status.OK}
    assert [o.tobytes() for o in rig.slots[0].outputs] == list(patterns)  # a lone frame's slot
    untouched = [bytes(len(p)) for p in patterns]
    assert [o.tobytes() for o in rig.slots[1].outputs] in (list(patterns), untouched)
