"""The GPU's batches as the plane's own engine (dlad/native/gpu_batch_engine.cpp) on the fake CUDA
driver (fake_cuda.c).

A batch of n is queued on the engine's one stream as the torch engine's device-side I/O asks:
each frame uploaded and pre-processed into its slice of the model's input, the model's graph for
a batch of n, each frame's post graph on its slice of the heads (with the frame's own settings),
then the host function that ends it. The fake runs the stream's operations in order and traces
them; the tests read the trace, the pre kernels' parameters and the replies. The real GPU's
results are held to the CPU path by tests/dlad/gpu/test_gpu_batches.py (GPU machines).
"""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import zmq

from dlad import protocol
from dlad.errors import Status
from dlad.native_plane import Health, ModelSettings, NativePlane, PlaneDevice, PlaneGpu
from dlad.protocol import InferReply, InferRequest
from tests.dlad.test_metrics import wait_for
from tests.dlad.test_native_gpu import (
    CANVAS,
    MAX_DET,
    WAIT_MS,
    Fake,
    GpuSlotBuffers,
    _address,
    _expected_pre,
    _expected_rows,
    build_fake,
)

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc builds the fake CUDA driver"),
]

FRAME_BYTES = 1024  # one frame's slice of the model's input
DEFAULTS = (0.3, 0.5, 200)  # the model's conf, iou, max_det ([models.*], not the defaults)
SETTINGS = {"demo": ModelSettings(*DEFAULTS)}


class BatchRig:
    """A plane whose one engine is the GPU's batches on the fake driver, and a DEALER."""

    CONTEXT = 0xBA7C4

    def __init__(
        self, fake: Fake, *, slots: int = 1, max_batch: int = 4, gpu_max_det: int = MAX_DET
    ) -> None:
        fake.lib.fake_reset()
        lib = self.lib = fake.lib
        lib.fake_infer_graph_create.restype = ctypes.c_void_p
        lib.fake_trace.argtypes = [ctypes.c_char_p, ctypes.c_int]
        self.stream = lib.fake_stream_create()
        self.input = np.zeros(max_batch * FRAME_BYTES, np.uint8)
        self.buffers = [[GpuSlotBuffers(fake, staging=False) for _ in range(max_batch)]
                        for _ in range(slots)]  # fmt: skip
        specs = [
            dataclasses.replace(
                buf.spec(), stream=self.stream, input=_address(self.input) + b * FRAME_BYTES,
                ready=0, ready_device=0, done=0, done_device=0,
            )
            for row in self.buffers
            for b, buf in enumerate(row)
        ]  # fmt: skip
        self.graphs = [int(lib.fake_infer_graph_create(n)) for n in range(1, max_batch + 1)]
        gpu = PlaneGpu(
            context=self.CONTEXT, pre_kernel=0x5EED, int8=True, input_scale=0.5, canvas=CANVAS,
            max_det=gpu_max_det, slots=tuple(specs),
        )  # fmt: skip
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        device = PlaneDevice(
            "gpu", 500.0, slots=slots, capacity=64, gpu=gpu, graphs=tuple(self.graphs),
            kind="gpu", max_batch=max_batch, tier=1,
        )  # fmt: skip
        self.plane = NativePlane(
            self.router, devices=[device], models={"demo": ["gpu"]}, settings=SETTINGS,
            cuda=fake.functions(),
            health=Health(quarantine_after=0),
        )  # fmt: skip
        self.plane.start()
        self.client = self.ctx.socket(zmq.DEALER)
        self.client.setsockopt(zmq.LINGER, 0)
        self.client.connect(f"tcp://127.0.0.1:{port}")

    def infer(self, rid: int, image: npt.NDArray[np.uint8], **fields: Any) -> None:
        request = InferRequest(id=rid, model="demo", image=image, **fields)
        self.client.send_multipart(protocol.encode(request), copy=False)

    def replies(self, n: int) -> dict[int, InferReply]:
        out: dict[int, InferReply] = {}
        for _ in range(n):
            assert self.client.poll(WAIT_MS), "no reply"
            reply = protocol.decode_reply(self.client.recv_multipart())
            assert isinstance(reply, InferReply)
            out[reply.id] = reply
        return out

    def trace(self) -> str:
        out = ctypes.create_string_buffer(4096)
        self.lib.fake_trace(out, 4096)
        return out.value.decode()

    def device(self) -> Any:
        return self.plane.state()[0][0]

    def hold(self, held: bool) -> None:
        self.lib.fake_stream_hold(self.stream, int(held))

    def close(self) -> None:
        self.hold(False)
        self.plane.close()
        self.client.close(0)
        self.router.close(0)
        self.ctx.term()
        for row in self.buffers:
            for buf in row:
                buf.close()
        self.lib.fake_stream_destroy(self.stream)
        for g in self.graphs:
            self.lib.fake_graph_destroy(g)


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Fake:
    return build_fake(tmp_path_factory.mktemp("fake_cuda"))


@pytest.fixture
def rigs() -> Iterator[list[BatchRig]]:
    made: list[BatchRig] = []
    yield made
    for r in made:
        r.close()


FRAMES = [  # shape, format, conf, iou, max_det (None: the model's default)
    ((4, 4, 3), "RGB", None, None, None),
    ((17, 33, 3), "BGR", 0.5, 0.3, 1),
    ((9, 5, 1), "GRAY", 0.1, None, None),
    ((120, 40), "NV12", 0.0, 1.0, 7),  # an 80 x 40 NV12 frame
]


def _queue_behind_a_held_batch(rig: BatchRig, frames: list[tuple[Any, ...]]) -> list[Any]:
    """Frame 100 starts a batch of its own on the held stream; ``frames`` then queue behind it
    (the engine's one slot is busy), and form the next batch once it ends. Returns the images."""
    rig.hold(True)
    rig.infer(100, np.zeros((8, 8, 3), np.uint8), max_det=1)
    wait_for(lambda: rig.device().in_flight == 1)
    rng = np.random.default_rng(7)
    images = []
    for rid, (shape, fmt, conf, iou, max_det) in enumerate(frames):
        images.append(rng.integers(0, 256, size=shape, dtype=np.uint8))
        rig.infer(rid, images[-1], format=fmt, conf=conf, iou=iou, max_det=max_det)
    wait_for(lambda: rig.device().queue_depth == len(frames))
    rig.hold(False)
    return images


def test_a_batch_is_its_pre_kernels_the_graph_of_its_size_and_each_frames_post_graph(
    fake: Fake, rigs: list[BatchRig]
) -> None:
    rigs.append(rig := BatchRig(fake))
    images = _queue_behind_a_held_batch(rig, FRAMES)
    replies = rig.replies(len(FRAMES) + 1)
    # one stream, in order: the lone frame's batch, then the four frames' (each frame uploaded
    # and pre-processed, the model's graph for 4, each frame's post graph), each ended by its
    # host function
    assert rig.trace() == "CK1PH" + "CK" * 4 + "4" + "P" * 4 + "H"
    for rid, (shape, fmt, conf, iou, max_det) in enumerate(FRAMES):
        r = replies[rid]
        assert (r.status, r.device) == (Status.OK, "gpu")
        n = min(max_det or DEFAULTS[2], 2)  # the fake's post graph writes 2 rows at most
        want = _expected_rows(protocol.frame_size(fmt, shape),
                              DEFAULTS[0] if conf is None else conf,
                              DEFAULTS[1] if iou is None else iou, n)  # fmt: skip
        np.testing.assert_array_equal(r.detections, want)  # the frame's own settings
        assert r.timing.device_us > 0
    # frame b of the batch: its own image buffer, pre-processed into slice b of the input
    launches = fake.launches()[1:]
    assert len(launches) == len(FRAMES)
    for b, ((params, checksum, _), image, (_, fmt, *_r)) in enumerate(
        zip(launches, images, FRAMES, strict=True)
    ):
        src = _address(rig.buffers[0][b].image)
        dst = _address(rig.input) + b * FRAME_BYTES
        assert params == _expected_pre(image.shape, fmt, 0, src, dst, True)
        assert checksum == int(image.astype(np.uint64).sum())
    assert rig.device().batches == (1, 0, 0, 1)
    assert rig.plane.counters()["by_status"] == {"OK": len(FRAMES) + 1}


def test_a_frame_the_gpu_cannot_take_fails_alone(fake: Fake, rigs: list[BatchRig]) -> None:
    rigs.append(rig := BatchRig(fake, gpu_max_det=5))
    frames = [((6, 6, 3), "RGB", None, None, 3), ((6, 6, 3), "RGB", None, None, 9),
              ((6, 6, 3), "RGB", None, None, 4)]  # fmt: skip
    _queue_behind_a_held_batch(rig, frames)
    replies = rig.replies(len(frames) + 1)
    assert replies[1].status is Status.DEVICE_FAILED
    assert "max_det 9 is above the GPU's 5" in replies[1].message
    assert (replies[0].status, replies[2].status) == (Status.OK, Status.OK)
    # the frame the GPU cannot take was never queued: a batch of two ran
    assert rig.trace() == "CK1PH" + "CKCK2PPH"


def test_a_failed_driver_call_fails_its_batch_and_the_engine_goes_on(
    fake: Fake, rigs: list[BatchRig]
) -> None:
    rigs.append(rig := BatchRig(fake))
    image = np.zeros((8, 8, 3), np.uint8)
    for rid, call in enumerate(("cuGraphLaunch", "cuLaunchKernel")):
        fake.lib.fake_fail_next(call.encode(), 700)
        rig.infer(rid, image)
        r = rig.replies(1)[rid]
        assert r.status is Status.DEVICE_FAILED
        assert f"{call}" in r.message
        assert "(700)" in r.message
    rig.infer(9, image)
    assert rig.replies(1)[9].status is Status.OK
    # each failed batch's slot came back once the stream had run what was queued of it
    assert rig.trace() == "CKH" + "CH" + "CK1PH"


def test_two_slots_keep_their_batches_apart_on_the_one_stream(
    fake: Fake, rigs: list[BatchRig]
) -> None:
    rigs.append(rig := BatchRig(fake, slots=2, max_batch=2))
    rig.hold(True)
    image = np.full((8, 8, 3), 3, np.uint8)
    rig.infer(1, image, conf=0.3)
    wait_for(lambda: rig.device().in_flight == 1)
    rig.infer(2, image, conf=0.6)
    wait_for(lambda: rig.device().in_flight == 2)  # both queued before either ran
    rig.hold(False)
    replies = rig.replies(2)
    assert rig.trace() == "CK1PH" * 2
    for rid, conf in ((1, 0.3), (2, 0.6)):
        np.testing.assert_array_equal(
            replies[rid].detections, _expected_rows(image.shape, conf, DEFAULTS[1], 2)
        )
    # each slot's frame in its own buffers, both into the input's first slice
    sources = {params[0] for params, _, _ in fake.launches()}
    assert sources == {_address(rig.buffers[0][0].image), _address(rig.buffers[1][0].image)}


def test_closing_waits_for_the_batch_the_gpu_still_runs(fake: Fake, rigs: list[BatchRig]) -> None:
    """The plane closes while a batch is queued on a stream that has not run it: the engine
    waits for the batch's host function (the GPU may still read its buffers and the frame's
    pixels), and once the stream runs, the close ends and the client has its answer."""
    rigs.append(rig := BatchRig(fake))
    rig.hold(True)
    rig.infer(1, np.zeros((8, 8, 3), np.uint8))
    wait_for(lambda: rig.device().in_flight == 1)
    closing = threading.Thread(target=rig.plane.close)
    closing.start()
    rig.hold(False)  # before or after the close began to wait: it ends either way
    closing.join(timeout=60)
    assert not closing.is_alive()
    assert rig.trace() == "CK1PH"  # the batch ran whole, its host function included
