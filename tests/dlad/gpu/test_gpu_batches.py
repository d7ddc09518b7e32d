"""The GPU executor's CUDA path (``dlad.executors.gpu.CudaBatches``) on the torch engine: a batch
pre-processed by the CUDA kernels straight into the engine's input, run, and post-processed from
the engine's ``CHW16`` heads on the GPU gives the CPU path's detections (numpy pre-processing, the
same engine's host ``run``, numpy post-processing), for batches of real images; and a daemon with
``engine = "torch"`` and ``[pre_post] backend = "cuda"`` serves through it.

Tolerances: the pre kernel is bit-exact to the numpy reference (docs/gpu.md) and the CUDA path
replays the very graph the host path does, so the engine's input bytes and its heads are asserted
*equal*; the only difference left is the post kernels' ``expf`` against numpy's ``exp``, an ulp or
two, so detections are compared as the post kernels' own parity tests do: same count, order and
classes, scores within 1e-5 relative and boxes within 1e-3 px.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch", reason="the torch GPU engine needs torch (the [prep] extra)")
pytest.importorskip("onnx", reason="exporting the program needs onnx")

from dlad.config import load_config  # noqa: E402
from dlad.daemon import Daemon  # noqa: E402
from dlad.devices.torch_gpu import TorchGpu, frame_shape  # noqa: E402
from dlad.executors.base import Request  # noqa: E402
from dlad.executors.gpu import CudaBatches, CudaBatchResult, GpuEngine, GpuExecutor  # noqa: E402
from dlad.families import family_for  # noqa: E402
from dlad.gpu.prepost import HeadSpec  # noqa: E402
from dlad.gpu.service import GpuService  # noqa: E402
from dlad.imaging.post import pack_chw16  # noqa: E402
from dlad.imaging.pre import letterbox_frame, quantize_hwc4  # noqa: E402
from dlad.loadable import Loadable, read_loadable  # noqa: E402
from dlad.models import DEMO  # noqa: E402
from dlad.protocol import PixelFormat  # noqa: E402
from dlad_client import Client  # noqa: E402
from prep.torch_export import export_torch  # noqa: E402
from tests.dlad.gpu.conftest import PROBE, Device  # noqa: E402
from tests.dlad.serving import serve_in_thread  # noqa: E402

pytestmark = pytest.mark.timeout(300)

IMAGES = sorted((DEMO / "images").glob("*.jpg"))
MAX_BATCH = 16
FORMATS: tuple[PixelFormat, ...] = ("RGB", "BGR", "GRAY", "NV12")


def _skip_without_cuda() -> None:
    if not PROBE.available or not torch.cuda.is_available():
        pytest.skip(f"needs a CUDA GPU (run on the H200): {PROBE.reason or 'torch sees none'}")


@pytest.fixture(scope="module")
def demo() -> Loadable:
    return read_loadable(DEMO / "fp16_heads.dla0.emu")


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _skip_without_cuda()
    out = tmp_path_factory.mktemp("torch-gpu") / "demo.pt2"
    return export_torch(DEMO / "fp16_heads.dla0.emu", out, max_batch=MAX_BATCH)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuService]:
    _skip_without_cuda()
    svc = GpuService(0, cache_dir=tmp_path_factory.mktemp("cache"))
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def engine(demo: Loadable, program: Path, service: GpuService) -> Iterator[TorchGpu]:
    del service  # the primary context first, as in the daemon
    gpu = TorchGpu(demo, program, max_batch=MAX_BATCH, replays=1)
    assert gpu.device_io
    yield gpu
    gpu.close()


@pytest.fixture(scope="module")
def cuda(engine: TorchGpu, demo: Loadable, service: GpuService) -> Iterator[CudaBatches]:
    batches = CudaBatches(engine, demo, service, max_batch=MAX_BATCH, slots=2)
    batches.warm_up()
    yield batches
    batches.close()


def _image(i: int) -> tuple[np.ndarray, PixelFormat]:
    """Image ``i`` of the bundled ones (cycled), in one of the pixel formats (an NV12 frame of
    its green as luma and its blue and red, subsampled, as chroma)."""
    rgb = np.ascontiguousarray(np.asarray(Image.open(IMAGES[i % len(IMAGES)]).convert("RGB")))
    fmt = FORMATS[(i // len(IMAGES)) % len(FORMATS)] if i >= len(IMAGES) else "RGB"
    if fmt == "NV12":
        even = rgb[: rgb.shape[0] // 2 * 2, : rgb.shape[1] // 2 * 2]
        uv = np.stack([even[::2, ::2, 2], even[::2, ::2, 0]], axis=-1)
        return np.concatenate([even[:, :, 1], uv.reshape(uv.shape[0], -1)]), fmt
    if fmt == "BGR":
        return np.ascontiguousarray(rgb[:, :, ::-1]), fmt
    if fmt == "GRAY":
        return np.ascontiguousarray(rgb[:, :, 1]), fmt
    return rgb, fmt


def _requests(
    n: int, *, start: int = 0, conf: float = 0.25, iou: float = 0.45, max_det: int = 300
) -> list[Request]:
    out = []
    for i in range(start, start + n):
        image, fmt = _image(i)
        out.append(Request(image, fmt, conf, iou, max_det, 0, "demo"))
    return out


def _cpu_path(
    engine: GpuEngine, demo: Loadable, requests: list[Request]
) -> tuple[list[np.ndarray], list[list[np.ndarray]], list[np.ndarray]]:
    """The CPU path on the same engine: numpy pre → host ``run`` → numpy post. Returns the
    frames, the heads and the detections."""
    frames, geometries = [], []
    for r in requests:
        canvas, geometry = letterbox_frame(r.image, r.pixel_format, demo.image_size)
        frames.append(quantize_hwc4(canvas, demo.input_scale))
        geometries.append(geometry)
    heads = []
    for at in range(0, len(frames), engine.max_batch):  # in batches the engine takes
        heads += engine.run(frames[at : at + engine.max_batch])[0]
    family = family_for(demo.family)
    dets = [
        family.postprocess(h, demo, g, conf=r.conf, iou=r.iou, max_det=r.max_det)
        for h, g, r in zip(heads, geometries, requests, strict=True)
    ]
    return frames, heads, dets


def _assert_same_detections(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for frame, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, frame
        np.testing.assert_array_equal(g[:, 5], w[:, 5], err_msg=f"frame {frame}")
        np.testing.assert_allclose(g[:, 4], w[:, 4], rtol=1e-5, atol=0, err_msg=f"frame {frame}")
        np.testing.assert_allclose(g[:, :4], w[:, :4], rtol=0, atol=1e-3, err_msg=f"frame {frame}")


def test_the_engine_exposes_the_kernels_layouts(engine: TorchGpu, demo: Loadable) -> None:
    h, w, c = frame_shape(demo)
    assert engine.frame_bytes == h * w * c
    specs = [HeadSpec(d.c, d.h, d.w, s) for d, s in zip(demo.outputs, demo.strides, strict=True)]
    assert engine.head_image_bytes == tuple(s.nbytes for s in specs)
    assert len(engine.head_ptrs) == len(demo.outputs)
    assert engine.input_ptr != 0
    with pytest.raises(ValueError, match=r"1\.\.16 frames, got 17"):
        engine.run_device(17, after=None, done=None)


@pytest.mark.parametrize("n", [1, 3, MAX_BATCH])
def test_a_batch_on_the_gpu_equals_the_cpu_path(
    n: int, cuda: CudaBatches, engine: TorchGpu, demo: Loadable
) -> None:
    requests = _requests(n, start=n)  # n = 16 also covers the BGR and GRAY formats
    result = cuda.process(0, requests)
    # What the pre kernels wrote into the engine's input (before the host path overwrites it).
    cuda.ctx.make_current()
    device = Device(cuda.ctx)
    inputs = [
        device.get(engine.input_ptr + b * engine.frame_bytes, frame_shape(demo), np.int8)
        for b in range(n)
    ]
    heads16 = [cuda.heads(0, b) for b in range(n)]
    frames, heads, want = _cpu_path(engine, demo, requests)
    for b in range(n):
        np.testing.assert_array_equal(inputs[b], frames[b], err_msg=f"input of frame {b}")
        for got, host in zip(heads16[b], heads[b], strict=True):
            np.testing.assert_array_equal(got, pack_chw16(host), err_msg=f"heads of frame {b}")
    _assert_same_detections(result.detections, want)
    if n == MAX_BATCH:  # every bundled image, in every pixel format
        assert sum(len(d) for d in want) > 0
    assert result.overflowed == ()
    _check_timing(result, n)


def _check_timing(result: CudaBatchResult, n: int) -> None:
    t = result.timing
    assert t.size == n
    assert t.compute_us is not None
    assert 0 < t.compute_us <= t.actual_us
    assert t.start_ns < t.end_ns <= result.done_ns
    assert result.locked_us > 0


def test_frames_with_their_own_thresholds(
    cuda: CudaBatches, engine: TorchGpu, demo: Loadable
) -> None:
    settings = [(0.25, 0.45, 300), (0.5, 0.45, 300), (0.1, 0.6, 300), (0.25, 0.45, 1),
                (0.05, 0.3, 20), (0.25, 0.45, 300), (0.7, 0.45, 300)]  # fmt: skip
    requests = []
    for i, (conf, iou, max_det) in enumerate(settings):
        requests.extend(_requests(1, start=i, conf=conf, iou=iou, max_det=max_det))
    result = cuda.process(1, requests)
    _, _, want = _cpu_path(engine, demo, requests)
    _assert_same_detections(result.detections, want)
    for d, (_, _, max_det) in zip(result.detections, settings, strict=True):
        assert len(d) <= max_det  # each frame's own max_det
    assert sum(len(d) for d in want) > 0


def test_an_overflowing_frame_takes_the_numpy_reference(
    engine: TorchGpu, demo: Loadable, service: GpuService
) -> None:
    few = CudaBatches(engine, demo, service, max_batch=4, slots=1, cand_capacity=2)
    try:
        requests = _requests(4, conf=0.05)
        result = few.process(0, requests)
        _, _, want = _cpu_path(engine, demo, requests)
    finally:
        few.close()
    assert result.overflowed  # more than 2 candidates pass conf 0.05 in the bundled images
    for b in result.overflowed:  # the reference's own numbers, on the same (exact) heads
        np.testing.assert_array_equal(result.detections[b], want[b])
    _assert_same_detections(result.detections, want)


def test_two_slots_at_once_keep_their_frames_apart(
    cuda: CudaBatches, engine: TorchGpu, demo: Loadable
) -> None:
    batches = {0: _requests(5, start=0), 1: _requests(6, start=7)}
    results: dict[int, CudaBatchResult] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def worker(slot: int) -> None:
        try:
            barrier.wait(30)
            for _ in range(3):  # a few rounds, so the two slots' batches interleave
                results[slot] = cuda.process(slot, batches[slot])
        except BaseException as exc:  # noqa: BLE001 (reported by the test thread below)
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for slot, requests in batches.items():
        _, _, want = _cpu_path(engine, demo, requests)
        _assert_same_detections(results[slot].detections, want)


CONFIG = """
[frontend]
endpoints = ["tcp://127.0.0.1:5555"]
[pre_post]
backend = "cuda"
[devices.gpu]
kind = "gpu"
engine = "torch"
max_batch = 4
[models.demo]
devices = ["gpu"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
core1 = "bundled:demo/fp16_heads.dla1.emu"
torch = "{program}"
"""


def test_a_daemon_serves_the_torch_engine_with_gpu_pre_post(
    tmp_path: Path, program: Path, engine: TorchGpu, demo: Loadable
) -> None:
    """The plane runs the GPU's batches itself (dlad/native/gpu_batch_engine.hpp): its pre
    kernels into the engine's input, the engine's CUDA graph for the batch's size, each frame's
    post graph; every reply is the CPU path's detections on the same program, with the frame's
    own settings, whatever batch it was in."""
    cfg = tmp_path / "torch.toml"
    cfg.write_text(CONFIG.format(program=program))
    _assert_the_plane_serves_the_cpu_paths_detections(cfg, engine, demo)


def test_a_daemon_serves_the_tensorrt_engine_with_gpu_pre_post(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, demo: Loadable, service: GpuService
) -> None:
    """The same for a TensorRT engine: its graphs hold the layout kernels around the engine
    (dlad/gpu/layout.py). TensorRT is the stand-in (tests/dlad/fake_trt_runtime.py) over the
    real CUDA runtime, its engine a kernel on the stream; everything else is the product's."""
    del service  # the primary context first, as in the daemon
    from cuda.bindings import runtime

    from dlad.devices.tensorrt_gpu import TensorRtGpu
    from tests.dlad.fake_trt_runtime import FakeTensorRT, serialise
    from tests.dlad.test_tensorrt_gpu import VERSION, describe

    monkeypatch.setitem(sys.modules, "tensorrt", FakeTensorRT(runtime, VERSION))
    path = tmp_path / "demo.gpu.engine"
    path.write_bytes(serialise(describe(demo, profile_max=4)))
    cfg = tmp_path / "tensorrt.toml"
    cfg.write_text(CONFIG.replace('engine = "torch"', 'engine = "tensorrt"')
                   .replace('torch = "{program}"', f'tensorrt = "{path}"'))  # fmt: skip
    host = TensorRtGpu(demo, path, max_batch=4, replays=1)  # the CPU path's engine
    try:
        _assert_the_plane_serves_the_cpu_paths_detections(cfg, host, demo)
    finally:
        host.close()


def _assert_the_plane_serves_the_cpu_paths_detections(
    cfg: Path, engine: GpuEngine, demo: Loadable
) -> None:
    """A daemon on ``cfg`` serves 18 frames from three clients at once, with mixed settings,
    through the plane's own GPU engine (the executor's CUDA path handed over); each reply is the
    CPU path's detections on ``engine``."""
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    replies: dict[int, tuple[str | None, np.ndarray]] = {}
    errors: list[BaseException] = []

    def settings(i: int) -> tuple[float, float, int]:
        return (0.25, 0.45, 300) if i % 3 else (0.4, 0.6, 5)

    with serve_in_thread(daemon, start_timeout=180) as endpoint:
        executor = daemon.executors["gpu"]
        assert isinstance(executor, GpuExecutor)
        assert executor.cuda is None  # handed to the plane: no Python per batch
        plane = daemon.frontend.plane
        assert plane is not None

        def client(start: int) -> None:  # three clients at once, so batches form
            try:
                with Client(endpoint, timeout_s=60) as c:
                    for i in range(start, start + 6):
                        image, fmt = _image(i)
                        conf, iou, max_det = settings(i)
                        result = c.detect(image, pixel_format=fmt, conf=conf, iou=iou,
                                          max_det=max_det)  # fmt: skip
                        replies[i] = (result.device, result.detections)
            except BaseException as exc:  # noqa: BLE001 (reported by the test thread below)
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(6 * k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        batches = plane.state()[0][0].batches
    assert not errors, errors
    assert sorted(replies) == list(range(18))
    assert {device for device, _ in replies.values()} == {"gpu"}
    assert sum(batches) >= 1
    requests = []
    for i in range(18):
        image, fmt = _image(i)
        conf, iou, max_det = settings(i)
        requests.append(Request(image, fmt, conf, iou, max_det, 0, "demo"))
    _, _, want = _cpu_path(engine, demo, requests)
    _assert_same_detections([replies[i][1] for i in range(18)], want)
