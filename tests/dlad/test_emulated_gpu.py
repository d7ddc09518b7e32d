"""The emulated Orin GPU and its executor: the published batch curve, scaled to the model; the
same integers as the DLA cores; dynamic batches through the daemon; all three engines in one
pool."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import zmq

from dlad import protocol
from dlad.config import load_config
from dlad.daemon import Daemon
from dlad.devices.emulated_gpu import (
    ORIN_DLA_YOLOV5S_MS,
    ORIN_GPU_YOLOV5S_MS,
    EmulatedGpu,
    batch_curve_us,
)
from dlad.devices.int8_engine import engine_for_loadable
from dlad.errors import Status
from dlad.imaging.post import unpack_head
from dlad.imaging.pre import letterbox, quantize_hwc4
from dlad.loadable import DataType, Loadable, read_loadable
from dlad.models import DEMO
from tests.dlad.serving import serve_in_thread

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def demo() -> Loadable:
    return read_loadable(DEMO / "fp16_heads.dla0.emu", expect_core=0)


def test_the_curve_is_nvidias_scaled_to_the_model(demo: Loadable) -> None:
    curve = batch_curve_us(demo, max_batch=16)
    scale = demo.latency_us / (ORIN_DLA_YOLOV5S_MS * 1e3)
    for b, ms in ORIN_GPU_YOLOV5S_MS.items():
        assert curve[b] == pytest.approx(ms * 1e3 * scale)
    assert curve[3] == pytest.approx((curve[2] + curve[4]) / 2)  # interpolated
    times = [curve[b] for b in range(1, 17)]
    assert times == sorted(times)  # a larger batch takes longer ...
    per_image = [curve[b] / b for b in range(1, 17)]
    assert per_image == sorted(per_image, reverse=True)  # ... and less per image
    fixed = batch_curve_us(demo, batch1_us=500.0, max_batch=32)
    assert fixed[1] == pytest.approx(500.0)
    assert fixed[32] == pytest.approx(fixed[16] * 2)  # past 16: the per-image cost of 16


def _frames(demo: Loadable, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    size = demo.image_size
    return [
        quantize_hwc4(letterbox(rng.integers(0, 256, (200, 300, 3), np.uint8), size)[0],
                      demo.input_scale)
        for _ in range(n)
    ]  # fmt: skip


def test_numeric_batches_compute_the_dla_cores_integers(demo: Loadable) -> None:
    gpu = EmulatedGpu(demo, mode="numeric", max_batch=4)
    frames = _frames(demo, 3)
    heads, timing = gpu.run(frames)
    assert timing.size == 3
    assert timing.modelled_us == pytest.approx(gpu.curve_us[3])
    assert timing.compute_us is not None
    assert timing.actual_us >= timing.modelled_us * (1 - 1e-6)  # it never finishes early
    engine = engine_for_loadable(demo)
    for frame, got in zip(frames, heads, strict=True):
        want = [
            unpack_head(b, d.c, d.h, d.w, d.scale if d.data_type == DataType.INT8 else None)
            for d, b in zip(demo.outputs, engine.run(frame), strict=True)
        ]
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


def test_timing_mode_and_bad_batches(demo: Loadable) -> None:
    gpu = EmulatedGpu(demo, mode="timing", max_batch=2, batch1_us=300.0)
    heads, timing = gpu.run(_frames(demo, 2))
    assert timing.compute_us is None
    assert timing.actual_us >= gpu.curve_us[2] * (1 - 1e-6)
    assert [h.shape for h in heads[0]] == [(d.c, d.h, d.w) for d in demo.outputs]
    assert all(np.isfinite(h).all() for h in heads[0])
    for bad in ([], _frames(demo, 3)):
        with pytest.raises(ValueError, match=r"1\.\.2 frames"):
            gpu.run(bad)
    with pytest.raises(ValueError, match="mode"):
        EmulatedGpu(demo, mode="fast")  # type: ignore[arg-type]


POOL = """
[daemon]
default_deadline_ms = 30000.0
drain_timeout_s = 10.0
[frontend]
endpoints = ["tcp://127.0.0.1:5555"]
[devices.dla0]
kind = "dla"
core = 0
mode = "timing"
latency_us = {dla_us}
queue_depth = 16
[devices.dla1]
kind = "dla"
core = 1
mode = "timing"
latency_us = {dla_us}
queue_depth = 16
[devices.gpu]
kind = "gpu"
mode = "timing"
latency_us = {gpu_us}
queue_depth = 16
max_batch = 4
max_queue_delay_us = {delay_us}
[models.demo]
devices = {devices}
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
core1 = "bundled:demo/fp16_heads.dla1.emu"
"""


@contextmanager
def pool(
    tmp_path: Path, devices: list[str], *, dla_us: float = 2000.0, gpu_us: float = 2000.0,
    delay_us: float = 0.0,
) -> Iterator[zmq.Socket]:  # fmt: skip
    cfg = tmp_path / "dlad.toml"
    text = POOL.format(dla_us=dla_us, gpu_us=gpu_us, delay_us=delay_us, devices=devices)
    cfg.write_text(text)
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        with serve_in_thread(daemon) as endpoint:
            sock.connect(endpoint)
            yield sock
    finally:
        sock.close(0)
        ctx.term()


def _infer_all(sock: zmq.Socket, n: int) -> list[protocol.InferReply]:
    image = np.zeros((48, 64, 3), np.uint8)
    for i in range(n):
        sock.send_multipart(protocol.encode(protocol.InferRequest(i, "demo", image)), copy=False)
    replies = []
    for _ in range(n):
        assert sock.poll(30_000), "no reply within 30 s"
        reply = protocol.decode_reply(sock.recv_multipart())
        assert isinstance(reply, protocol.InferReply)
        replies.append(reply)
    return replies


def test_a_partial_batch_waits_for_the_rest_and_runs_as_one(tmp_path: Path) -> None:
    """With a long queue delay, four requests that reach the GPU one by one run as one batch:
    one start and one end on the engine's clock for all four."""
    with pool(tmp_path, ["gpu"], gpu_us=1000.0, delay_us=10_000_000.0) as sock:
        replies = _infer_all(sock, 4)
    assert {r.status for r in replies} == {Status.OK}
    assert {r.device for r in replies} == {"gpu"}
    spans = {(r.timing.start_ns, r.timing.end_ns) for r in replies}
    assert len(spans) == 1


def test_three_engines_serve_one_model_as_a_pool(tmp_path: Path) -> None:
    with pool(tmp_path, ["dla0", "dla1", "gpu"], dla_us=3000.0, gpu_us=1500.0) as sock:
        replies = _infer_all(sock, 40)
    assert sorted(int(r.id or 0) for r in replies) == list(range(40))
    assert {r.status for r in replies} == {Status.OK}
    share = Counter(r.device for r in replies)
    assert set(share) == {"dla0", "dla1", "gpu"}
