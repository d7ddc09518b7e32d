"""The torch GPU engine (``dlad.devices.torch_gpu``) over the bundled model's exported program: a
batch computes what each of its frames computes alone, heads in the loadable's shapes, a curve
for every batch size, typed errors for bad batches and for a program of another model. The same
checks run on a CUDA GPU (CUDA graphs, pinned buffers) where there is one (the H200)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch GPU engine needs torch (the [prep] extra)")
pytest.importorskip("onnx", reason="exporting the program needs onnx")

from dlad.devices.gpu_frames import chw16_image_bytes  # noqa: E402
from dlad.devices.torch_gpu import (  # noqa: E402
    TorchGpu,
    TorchGpuError,
    frame_shape,
    write_chw16,
)
from dlad.executors.gpu import GpuExecutor, device_io_engine  # noqa: E402
from dlad.gpu.prepost import HeadSpec  # noqa: E402
from dlad.imaging.post import pack_chw16  # noqa: E402
from dlad.imaging.pre import letterbox, quantize_hwc4  # noqa: E402
from dlad.loadable import (  # noqa: E402
    DataType,
    Loadable,
    chw_vectorized,
    hwc4_input,
    read_loadable,
)
from dlad.models import DEMO  # noqa: E402
from prep.torch_export import export_torch  # noqa: E402
from tests.dlad.engines import assert_batches_run_one_at_a_time  # noqa: E402

if TYPE_CHECKING:
    from dlad.executors.gpu import GpuEngine

pytestmark = pytest.mark.timeout(300)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run on the H200)")
MAX_BATCH = 3


@pytest.fixture(scope="module")
def demo() -> Loadable:
    return read_loadable(DEMO / "fp16_heads.dla0.emu")


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("torch-gpu") / "demo.pt2"
    return export_torch(DEMO / "fp16_heads.dla0.emu", out, max_batch=4)


def _frames(loadable: Loadable, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        quantize_hwc4(
            letterbox(rng.integers(0, 256, (180, 240, 3), np.uint8), loadable.image_size)[0],
            loadable.input_scale,
        )
        for _ in range(n)
    ]


@pytest.fixture(scope="class")
def gpu(request: pytest.FixtureRequest, demo: Loadable, program: Path) -> Iterator[TorchGpu]:
    """One engine per test class, on the class's device."""
    device = request.cls.device
    engine = TorchGpu(demo, program, max_batch=MAX_BATCH, device=device, replays=1)
    yield engine
    engine.close()


class Checks:
    """The engine's contract, on one device (a subclass names it)."""

    device = "cpu"

    def test_a_batch_computes_what_each_frame_computes_alone(
        self, gpu: TorchGpu, demo: Loadable
    ) -> None:
        frames = _frames(demo, MAX_BATCH, seed=11)
        batched, timing = gpu.run(frames)
        assert len(batched) == MAX_BATCH
        assert timing.size == MAX_BATCH
        assert timing.modelled_us == gpu.curve_us[MAX_BATCH]
        assert timing.compute_us is not None
        assert 0 < timing.compute_us <= timing.actual_us
        assert timing.start_ns < timing.end_ns
        for frame, heads in zip(frames, batched, strict=True):
            alone, one = gpu.run([frame])
            assert one.size == 1
            assert [h.shape for h in heads] == [(d.c, d.h, d.w) for d in demo.outputs]
            assert all(h.dtype == np.float32 for h in heads)
            for a, b in zip(alone[0], heads, strict=True):
                assert np.all(np.isfinite(b))
                # Batched kernels may sum in another order: fp16 rounding, nothing more.
                np.testing.assert_allclose(a, b, rtol=0, atol=0.02 * float(np.std(a)))
        # Different frames, different heads: the batch is not one frame repeated.
        assert not np.allclose(batched[0][0], batched[1][0])

    def test_heads_are_new_arrays(self, gpu: TorchGpu, demo: Loadable) -> None:
        first, _ = gpu.run(_frames(demo, 1, seed=1))
        kept = first[0][0].copy()
        gpu.run(_frames(demo, 2, seed=2))
        np.testing.assert_array_equal(first[0][0], kept)  # not a view of a reused buffer

    def test_the_curve_has_every_batch_size(self, gpu: TorchGpu) -> None:
        assert sorted(gpu.curve_us) == list(range(1, MAX_BATCH + 1))
        assert all(t > 0 for t in gpu.curve_us.values())
        engine: GpuEngine = gpu  # the executor's protocol (checked by mypy)
        assert engine.max_batch == MAX_BATCH

    def test_bad_batches_raise_value_errors(self, gpu: TorchGpu, demo: Loadable) -> None:
        frame = _frames(demo, 1, seed=3)[0]
        with pytest.raises(ValueError, match=r"1\.\.3 frames, got 0"):
            gpu.run([])
        with pytest.raises(ValueError, match=r"1\.\.3 frames, got 4"):
            gpu.run([frame] * 4)
        with pytest.raises(ValueError, match="frame 1 must be an int8 DLA_HWC4 array"):
            gpu.run([frame, frame[:, :128]])
        with pytest.raises(ValueError, match="frame 0 must be an int8"):
            gpu.run([frame.astype(np.uint8)])
        with pytest.raises(ValueError, match="frame 0 must be an int8"):
            gpu.run([frame.tolist()])

    def test_batches_from_threads_run_one_at_a_time(self, gpu: TorchGpu, demo: Loadable) -> None:
        assert_batches_run_one_at_a_time(gpu, _frames(demo, 2, seed=5), threads=3, timeout_s=120)

    def test_a_program_of_another_model_is_refused(self, demo: Loadable, program: Path) -> None:
        renamed = dataclasses.replace(
            demo, outputs=tuple(dataclasses.replace(d, name=f"p{i}") for i, d in
                                enumerate(demo.outputs))
        )  # fmt: skip
        with pytest.raises(TorchGpuError, match=r"not exported for.*outputs"):
            TorchGpu(renamed, program, max_batch=1, device=self.device)
        with pytest.raises(TorchGpuError, match=r"image_size.*input_shape"):
            TorchGpu(_resized(demo, 320), program, max_batch=1, device=self.device)
        other_weights = dataclasses.replace(demo, sections={"graph": b"another model"})
        with pytest.raises(TorchGpuError, match="graph_sha256"):
            TorchGpu(other_weights, program, max_batch=1, device=self.device)
        with pytest.raises(TorchGpuError, match=r"max_batch 4 \(wanted at least 5\)"):
            TorchGpu(demo, program, max_batch=5, device=self.device)

    def test_a_missing_or_foreign_file_is_refused(self, demo: Loadable, tmp_path: Path) -> None:
        with pytest.raises(TorchGpuError, match="no such program file"):
            TorchGpu(demo, tmp_path / "missing.pt2", device=self.device)
        junk = tmp_path / "junk.pt2"
        junk.write_bytes(b"not a zip archive" * 10)
        with pytest.raises(TorchGpuError, match="cannot load it as an exported program"):
            TorchGpu(demo, junk, device=self.device)
        plain = tmp_path / "plain.pt2"
        module = torch.nn.Linear(2, 2)
        torch.export.save(torch.export.export(module, (torch.zeros(1, 2),)), plain)
        with pytest.raises(TorchGpuError, match=r"without dlad's dlad\.json"):
            TorchGpu(demo, plain, device=self.device)

    def test_a_closed_engine_refuses_batches(self, demo: Loadable, program: Path) -> None:
        engine = TorchGpu(demo, program, max_batch=1, device=self.device, replays=1)
        frame = _frames(demo, 1, seed=4)[0]
        engine.run([frame])
        engine.close()
        engine.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            engine.run([frame])


def _resized(demo: Loadable, size: int) -> Loadable:
    """``demo`` as if built for ``size`` x ``size`` images (a valid loadable of another size)."""
    inp = hwc4_input("images", 3, size, size, scale=demo.input_scale)
    outs = tuple(
        chw_vectorized(d.name, d.c, size // s, size // s, vec=16, data_type=DataType.HALF)
        for d, s in zip(demo.outputs, demo.strides, strict=True)
    )
    return dataclasses.replace(demo, inputs=(inp,), outputs=outs, image_size=(size, size))


class TestOnCpu(Checks):
    device = "cpu"

    def test_without_cuda_there_is_no_device_io(self, gpu: TorchGpu, demo: Loadable) -> None:
        assert not gpu.device_io
        assert device_io_engine(gpu) is None
        h, w, c = frame_shape(demo)
        assert gpu.frame_bytes == h * w * c  # layouts are known without a device
        specs = [HeadSpec(d.c, d.h, d.w, s) for d, s in zip(demo.outputs, demo.strides,
                                                            strict=True)]  # fmt: skip
        assert gpu.head_image_bytes == tuple(spec.nbytes for spec in specs)
        with pytest.raises(RuntimeError, match="no device-side I/O"):
            _ = gpu.input_ptr
        with pytest.raises(RuntimeError, match="no device-side I/O"):
            gpu.wait_input_free(0)
        with pytest.raises(RuntimeError, match="no device-side I/O"):
            gpu.run_device(1, after=None, done=None)

    def test_the_executor_keeps_an_engine_without_device_io_on_the_cpu_path(
        self, gpu: TorchGpu, demo: Loadable
    ) -> None:
        service: Any = object()  # never touched: the engine has no device I/O to offer it
        executor = GpuExecutor(
            "gpu", model="demo", loadable=demo, engine=gpu, capacity=4, max_batch=MAX_BATCH,
            max_queue_delay_us=0.0, gpu=service,
        )  # fmt: skip
        assert executor.backend == "cpu"
        assert executor.cuda is None
        executor.close()


@pytest.mark.parametrize("c", [1, 7, 16, 39, 255])
def test_chw16_heads_are_pack_chw16(c: int) -> None:
    # What every captured graph writes after the program, against the numpy packer the
    # post-processing reference unpacks (dlad.imaging.post); fp16-exact values, fresh each run.
    rng = np.random.default_rng(c)
    heads = rng.standard_normal((3, c, 5, 7)).astype(np.float16).astype(np.float32)
    out = torch.full((4, -(-c // 16), 5, 7, 16), 0.0, dtype=torch.float16)
    write_chw16([torch.from_numpy(heads)], [out])
    for b in range(3):
        np.testing.assert_array_equal(out[b].numpy(), pack_chw16(heads[b]))  # padding zero too
    assert not out[3].any()  # only the batch's images are written
    assert out[0].numpy().nbytes == chw16_image_bytes(c, 5, 7) == HeadSpec(c, 5, 7, 8).nbytes


@needs_cuda
class TestOnCuda(Checks):
    device = "cuda"

    def test_the_timing_is_the_gpus(self, gpu: TorchGpu, demo: Loadable) -> None:
        _, timing = gpu.run(_frames(demo, 2, seed=6))
        assert timing.compute_us is not None
        host_us = (timing.end_ns - timing.start_ns) / 1e3
        assert timing.compute_us < timing.actual_us <= host_us  # replay < stream span < call

    def test_device_io_is_offered(self, gpu: TorchGpu) -> None:
        # The CUDA path through it is tested in tests/dlad/gpu/test_gpu_batches.py.
        assert gpu.device_io
        assert gpu.input_ptr != 0
        assert len(set(gpu.head_ptrs)) == len(gpu.head_ptrs)


@pytest.mark.skipif(CUDA, reason="checks the error of a host without CUDA")
def test_cuda_without_a_gpu_is_a_typed_error(demo: Loadable, program: Path) -> None:
    with pytest.raises(TorchGpuError, match="sees no CUDA GPU"):
        TorchGpu(demo, program, device="cuda")


def test_bad_arguments_raise_value_errors(demo: Loadable, program: Path) -> None:
    with pytest.raises(ValueError, match="max_batch must be an int >= 1"):
        TorchGpu(demo, program, max_batch=0, device="cpu")
    with pytest.raises(ValueError, match="replays must be an int >= 1"):
        TorchGpu(demo, program, replays=0, device="cpu")
    with pytest.raises(ValueError, match="device must be 'cuda', 'cuda:N' or 'cpu'"):
        TorchGpu(demo, program, device="meta")


def test_without_torch_the_error_says_so(
    demo: Loadable, program: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(TorchGpuError, match="needs torch"):
        TorchGpu(demo, program, device="cpu")


def test_importing_the_engine_does_not_import_torch() -> None:
    code = "import sys, dlad.devices.torch_gpu; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"
