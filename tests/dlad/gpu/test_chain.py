"""Fence chaining (GPU → emulated DLA → GPU) and the daemon serving with GPU pre/post: its
detections equal the CPU path's on the same images."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dlad.config import load_config
from dlad.daemon import Daemon
from dlad.devices.base import CudlaStatus, DlaError, Task
from dlad.devices.emulated import EmulatedDlaCore
from dlad.families import post_program
from dlad.families.yolov5 import ANCHORS, postprocess, program
from dlad.gpu.fences import FencePoller, MappedFence, word_reached
from dlad.gpu.prepost import GpuPipeline, HeadSpec
from dlad.gpu.service import GpuService
from dlad.imaging.post import unpack_head
from dlad.imaging.pre import letterbox, quantize_hwc4
from dlad.loadable import DataType, read_loadable
from dlad.models import DEMO
from dlad_client import Client
from tests.dlad.serving import serve_in_thread

pytestmark = pytest.mark.timeout(300)

IMAGES = sorted((DEMO / "images").glob("*.jpg"))


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuService]:
    from tests.dlad.gpu.conftest import PROBE

    if not PROBE.available:
        pytest.skip(f"needs a CUDA GPU (run on the H200): {PROBE.reason}")
    svc = GpuService(0, cache_dir=tmp_path_factory.mktemp("cache"))
    yield svc
    svc.close()


def test_word_reached_is_wrap_safe() -> None:
    assert word_reached(5, 5)
    assert word_reached(6, 5)
    assert not word_reached(4, 5)
    assert word_reached(3, 0xFFFFFFFE + 4)  # the word wrapped past 2**32
    assert not word_reached(0xFFFFFFFF, 2**32 + 1)


def test_gpu_signal_wakes_dla_and_dla_signal_releases_stream(service: GpuService) -> None:
    # GPU pre → fence A → emulated DLA task (numeric) → fence B → GPU post, queued at once;
    # the result equals the CPU reference on the same DLA outputs.
    loadable = read_loadable(DEMO / "fp16_heads.dla0.emu", expect_core=0)
    with EmulatedDlaCore(0, mode="numeric", allocator=service.host_array) as core:
        module = core.load(DEMO / "fp16_heads.dla0.emu")
        inputs = [core.alloc_buffer(d) for d in module.inputs]
        outputs = [core.alloc_buffer(d) for d in module.outputs]
        slot = service.slot(loadable, inputs[0].raw, [b.raw for b in outputs], max_det=300)
        total = 0
        for frame, path in enumerate(IMAGES):
            rgb = np.ascontiguousarray(np.asarray(Image.open(path).convert("RGB")))
            canvas, geometry = letterbox(rgb, loadable.image_size)
            p = slot.pipeline
            src = p.upload(rgb)
            p.pre(src, rgb.shape, "RGB", geometry, slot.input_ptr, input_scale=loadable.input_scale)
            a = slot.ready.next_value()
            slot.ready.expect_gpu_signal(a)
            p.signal(slot.ready.device_ptr, a)
            b = slot.done.next_value()
            task = Task(module, inputs, outputs, wait=((slot.ready, a),), signal=((slot.done, b),))
            handle = core.submit(task)
            p.wait(slot.done.device_ptr, b)
            p.post(slot.head_ptrs, [geometry])
            (result,) = p.synchronize()
            assert handle.status is CudlaStatus.SUCCESS, frame
            # The DLA read exactly the reference's input bytes.
            np.testing.assert_array_equal(
                inputs[0].array[0], quantize_hwc4(canvas, loadable.input_scale)
            )
            heads = [
                unpack_head(
                    buf.array, d.c, d.h, d.w, d.scale if d.data_type == DataType.INT8 else None
                )
                for d, buf in zip(module.outputs, outputs, strict=True)
            ]
            expected = postprocess(
                heads, np.asarray(loadable.anchors_px, np.float32), loadable.strides, geometry
            )
            total += len(expected)
            np.testing.assert_array_equal(result.detections[:, 5], expected[:, 5])
            np.testing.assert_allclose(
                result.detections[:, :5], expected[:, :5], rtol=1e-5, atol=1e-3
            )
        assert total > 0


def test_poller_advances_fence_written_by_gpu(service: GpuService) -> None:
    poller = FencePoller()
    try:
        fence = MappedFence(service.ctx, poller)
        reached = threading.Event()
        fence.on_reached(1, reached.set)
        fence.expect_gpu_signal(1)
        fence._word[0] = 1  # what cuStreamWriteValue32 does from the GPU
        assert reached.wait(5)
        assert fence.value == 1
        fence.free()
    finally:
        poller.close()


def test_gpu_signal_wakes_fence_through_its_event(service: GpuService) -> None:
    # The daemon's GPU -> DLA path: word write + blocking-sync event, no polling.
    fence = MappedFence(service.ctx, service.poller, "event-path")
    pipe = GpuPipeline(service.ctx, (64, 64), [HeadSpec(18, 2, 2, 8)], program(ANCHORS[:1], 18))
    try:
        reached = threading.Event()
        fence.on_reached(1, reached.set)
        fence.gpu_signal(pipe, 1)
        assert reached.wait(5)
        assert fence.word == 1
        fence.gpu_signal(pipe, 2)
        assert fence.wait(2, 5)
        assert fence.value == 2
        with pytest.raises(DlaError):
            fence.gpu_signal(pipe, 2)  # values only grow
    finally:
        pipe.close()
        fence.free()


CONFIG = """
[frontend]
endpoints = ["tcp://127.0.0.1:5555"]
[pre_post]
backend = "{backend}"
[devices.dla0]
kind = "dla"
core = 0
[devices.dla1]
kind = "dla"
core = 1
[devices.gpu]
kind = "gpu"
[models.demo]
devices = ["dla0", "dla1"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
core1 = "bundled:demo/fp16_heads.dla1.emu"
"""


@contextmanager
def running(tmp_path: Path, backend: str) -> Iterator[str]:
    cfg = tmp_path / f"{backend}.toml"
    cfg.write_text(CONFIG.format(backend=backend))
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    with serve_in_thread(daemon, start_timeout=120) as endpoint:
        yield endpoint


def _detect_all(endpoint: str) -> list[np.ndarray]:
    out = []
    with Client(endpoint, timeout_s=30) as client:
        for path in IMAGES:
            rgb = np.ascontiguousarray(np.asarray(Image.open(path).convert("RGB")))
            for fmt, img in (("RGB", rgb), ("BGR", np.ascontiguousarray(rgb[:, :, ::-1]))):
                result = client.detect(img, pixel_format=fmt, conf=0.25)  # type: ignore[arg-type]
                out.append(result.detections.copy())
            gray = np.ascontiguousarray(rgb[:, :, 1])
            out.append(client.detect(gray, pixel_format="GRAY").detections.copy())
    return out


def test_daemon_gpu_detections_equal_cpu(tmp_path: Path, service: GpuService) -> None:
    del service  # only for the skip: the daemon opens its own context
    with running(tmp_path, "cuda") as endpoint:
        gpu = _detect_all(endpoint)
    with running(tmp_path, "cpu") as endpoint:
        cpu = _detect_all(endpoint)
    assert sum(len(d) for d in cpu) > 0
    for g, c in zip(gpu, cpu, strict=True):
        assert g.shape == c.shape
        np.testing.assert_array_equal(g[:, 5], c[:, 5])
        np.testing.assert_allclose(g[:, :5], c[:, :5], rtol=1e-5, atol=1e-3)


def test_a_bounded_pipeline_never_grows_its_upload_buffer(service: GpuService) -> None:
    """The daemon's pipelines allocate room for the largest admitted image up front: growing
    mid-run (free + alloc) would wait for the whole GPU while another slot's stream waits on a
    DLA task, a stall only the task timeout ends. A larger image is refused, not grown into."""
    loadable = read_loadable(DEMO / "fp16_heads.dla0.emu", expect_core=0)
    heads = [HeadSpec(d.c, d.h, d.w, s) for d, s in zip(loadable.outputs, loadable.strides,
                                                         strict=True)]  # fmt: skip
    for staging in (False, True):  # device memory filled by DMA; pinned memory read in place
        pipe = GpuPipeline(
            service.ctx, loadable.image_size, heads, post_program(loadable),
            max_image_bytes=48 * 64 * 3, staging=staging,
        )  # fmt: skip
        bring = pipe.stage if staging else pipe.upload
        try:
            first = bring(np.zeros((48, 64, 3), np.uint8))
            assert bring(np.zeros((8, 8, 3), np.uint8)) == first  # the same buffer
            with pytest.raises(ValueError, match="exceeds"):
                bring(np.zeros((49, 64, 3), np.uint8))
        finally:
            pipe.close()
    assert service.max_image_bytes == 0  # this fixture's service grows on demand


@pytest.mark.parametrize("frames", ["copy", "in-place", "auto"])
def test_frames_reach_the_gpu_chain_copied_or_in_place(
    tmp_path: Path, service: GpuService, frames: str
) -> None:
    """``[pre_post] gpu_frames``: a frame is DMA-copied to the GPU (``copy``), or the pre kernel
    reads it in host memory (``in-place``; ``auto`` mixes the two): from a message, after a
    CPU copy into the slot's pinned buffer; from a client's segment, registered with the GPU
    when the daemon maps it, where the client wrote it. Every way gives the detections of the
    CPU reference path, for frames of two sizes in turn (a slot's buffer holds the largest
    admitted image)."""
    del service  # only for the skip: the daemon opens its own context
    cfg = tmp_path / "shm.toml"
    text = CONFIG.format(backend="cuda").replace(
        "[pre_post]\n", f'[pre_post]\ngpu_frames = "{frames}"\n'
    )
    cfg.write_text(text)
    big = np.ascontiguousarray(np.asarray(Image.open(IMAGES[0]).convert("RGB")))
    small = np.ascontiguousarray(big[::2, ::3])
    with running(tmp_path, "cpu") as endpoint, Client(endpoint, timeout_s=30) as client:
        want = [client.detect(im, conf=0.01).detections.copy() for im in (big, small)]
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    with serve_in_thread(daemon, start_timeout=120) as endpoint:
        gpu = daemon._gpu
        assert gpu is not None
        assert gpu.read_frames_in_place == (frames != "copy")
        integrated = gpu.ctx.integrated  # auto: message frames in place on an Orin only
        assert gpu.stage_frames == (frames == "in-place" or (frames == "auto" and integrated))
        with Client(endpoint, timeout_s=30) as client:
            inline = [client.detect(im, conf=0.01).detections.copy() for im in (big, small, big)]
        with Client(endpoint, timeout_s=30, shm_slot_bytes=big.nbytes, shm_slots=2) as client:
            shared = [client.detect(im, conf=0.01).detections.copy() for im in (big, small, big)]
            assert gpu._frames  # the segment is registered while mapped
        assert daemon.frontend.shm_frames == 3
    assert min(len(w) for w in want) > 0
    for got in (inline, shared):
        for d, w in zip(got, [want[0], want[1], want[0]], strict=True):
            assert d.shape == w.shape
            np.testing.assert_array_equal(d[:, 5], w[:, 5])
            np.testing.assert_allclose(d[:, :5], w[:, :5], rtol=1e-5, atol=1e-3)
