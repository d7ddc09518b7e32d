"""The TensorRT GPU engine (``dlad.devices.tensorrt_gpu``) against the strict TensorRT / CUDA
runtime stand-in (``tests/dlad/fake_trt_runtime.py``), over the bundled model's geometry.

The fake engine computes a known function of its input buffer (each head channel ``c`` is
``gain * avgpool(x[c % 3]) + offset * c``), so the heads are compared with a reference computed
here from the int8 frames alone: wrong dequantisation, channel order, H/W layout, batch rows or
output order all change them. Its events run on a virtual clock, so the measured times are exact.
No real TensorRT or CUDA is involved anywhere (none is installable here).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import pytest

from dlad.devices.tensorrt_gpu import (
    METADATA_FORMAT,
    TensorRtGpu,
    TensorRtGpuError,
    TensorRtRunError,
    engine_metadata_path,
)
from dlad.gpu.driver import CudaError as CudaDriverError
from dlad.imaging.post import pack_chw16
from dlad.imaging.pre import quantize_hwc4
from dlad.loadable import DataType, Loadable, chw_vectorized, hwc4_input, read_loadable
from dlad.models import DEMO
from tests.dlad.engines import assert_batches_run_one_at_a_time
from tests.dlad.fake_trt_runtime import (
    ApiMisuse,
    CudaError,
    FakeContext,
    FakeCudart,
    FakeLayouts,
    Fakes,
    FakeStream,
    FakeTensorRT,
    MemcpyKind,
    engine_description,
    install,
    serialise,
)

if TYPE_CHECKING:
    from dlad.executors.gpu import GpuEngine

pytestmark = pytest.mark.timeout(60)

VERSION = "10.3.0.30"
MAX_BATCH = 3
ITEM = {"HALF": 2, "FLOAT": 4}
ATOL = {"HALF": 6e-3, "FLOAT": 2e-5}  # fp16: input and output rounding; fp32: summation order


@pytest.fixture(scope="module")
def demo() -> Loadable:
    return read_loadable(DEMO / "fp16_heads.dla0.emu")


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> Fakes:
    cuda = FakeCudart(device_count=2)
    return install(monkeypatch, Fakes(FakeTensorRT(cuda, VERSION), cuda))


def describe(
    loadable: Loadable,
    *,
    profile_max: int = 4,
    dtype: str = "HALF",
    version: str = VERSION,
) -> dict[str, Any]:
    """A fake engine built for ``loadable``: dynamic batch 1..``profile_max``, outputs listed in
    the reverse of the loadable's order (the engine must map them by name), each with its own
    gain and offset."""
    c, (h, w) = loadable.inputs[0].c, loadable.image_size
    top = [profile_max, c, h, w]
    inputs = [{
        "name": loadable.inputs[0].name, "shape": [-1, c, h, w], "dtype": dtype,
        "format": "LINEAR", "profile": [[1, c, h, w], top, top],
    }]  # fmt: skip
    outputs = [
        {"name": d.name, "shape": [-1, d.c, d.h, d.w], "dtype": dtype, "format": "LINEAR",
         "gain": 1.25 + 0.5 * k, "offset": 0.01 * (k + 1)}
        for k, d in reversed(list(enumerate(loadable.outputs)))
    ]  # fmt: skip
    return engine_description(inputs, outputs, version=version)


def write_engine(path: Path, desc: dict[str, Any]) -> Path:
    path.write_bytes(serialise(desc))
    return path


def frames_for(loadable: Loadable, n: int, seed: int) -> list[npt.NDArray[np.int8]]:
    rng = np.random.default_rng(seed)
    h, w = loadable.image_size
    return [
        quantize_hwc4(rng.integers(0, 256, (h, w, 3), np.uint8), loadable.input_scale)
        for _ in range(n)
    ]


def reference_heads(
    frame: npt.NDArray[np.int8], loadable: Loadable, desc: dict[str, Any]
) -> list[npt.NDArray[np.float64]]:
    """What the fake engine must compute for ``frame``, from the int8 frame alone, in float64,
    in the loadable's output order."""
    h, w = loadable.image_size
    x = frame[:, :w, :3].astype(np.float64).transpose(2, 0, 1) * loadable.input_scale
    by_name = {o["name"]: o for o in desc["outputs"]}
    out = []
    for d in loadable.outputs:
        sh, sw = h // d.h, w // d.w
        pooled = x.reshape(3, d.h, sh, d.w, sw).mean(axis=(2, 4))
        gain, offset = by_name[d.name]["gain"], by_name[d.name]["offset"]
        out.append(np.stack([gain * pooled[c % 3] + offset * c for c in range(d.c)]))
    return out


def span_us(fakes: Fakes, loadable: Loadable, b: int, dtype: str = "HALF") -> tuple[float, float]:
    """The fake's virtual-clock (stream span, execution) for a batch of ``b``: one copy in, the
    execution, one copy out per head (each copy 1 µs + bytes / 20 GB/s)."""
    c, (h, w) = loadable.inputs[0].c, loadable.image_size
    copies = [b * c * h * w * ITEM[dtype]] + [
        b * d.c * d.h * d.w * ITEM[dtype] for d in loadable.outputs
    ]
    execute = fakes.trt.exec_base_ns + fakes.trt.exec_per_frame_ns * b
    return (sum(1000 + n // 20 for n in copies) + execute) / 1e3, execute / 1e3


@pytest.fixture
def engine(fakes: Fakes, demo: Loadable, tmp_path: Path) -> Iterator[TensorRtGpu]:
    path = write_engine(tmp_path / "demo.gpu.engine", describe(demo))
    gpu = TensorRtGpu(demo, path, max_batch=MAX_BATCH, replays=2)
    yield gpu
    gpu.close()


# ------------------------------------------------------------------------------ numerics


@pytest.mark.parametrize("dtype", ["HALF", "FLOAT"])
def test_a_batch_computes_what_each_frame_computes_alone(
    fakes: Fakes, demo: Loadable, tmp_path: Path, dtype: str
) -> None:
    desc = describe(demo, dtype=dtype)
    gpu = TensorRtGpu(
        demo, write_engine(tmp_path / "e.engine", desc), max_batch=MAX_BATCH, replays=1
    )
    frames = frames_for(demo, MAX_BATCH, seed=11)
    batched, timing = gpu.run(frames)
    assert len(batched) == MAX_BATCH
    for frame, heads in zip(frames, batched, strict=True):
        assert [h.shape for h in heads] == [(d.c, d.h, d.w) for d in demo.outputs]
        assert all(h.dtype == np.float32 for h in heads)
        alone, one = gpu.run([frame])
        assert one.size == 1
        for a, b, want in zip(alone[0], heads, reference_heads(frame, demo, desc), strict=True):
            np.testing.assert_array_equal(a, b)  # rows are independent: exactly the same
            np.testing.assert_allclose(b, want, rtol=0, atol=ATOL[dtype])
    assert not np.allclose(batched[0][0], batched[1][0])  # not one frame repeated
    assert timing.size == MAX_BATCH
    assert timing.modelled_us == gpu.curve_us[MAX_BATCH]
    actual, compute = span_us(fakes, demo, MAX_BATCH, dtype)
    assert (timing.actual_us, timing.compute_us) == pytest.approx((actual, compute), rel=1e-9)
    assert timing.start_ns < timing.end_ns
    gpu.close()


def test_a_non_square_image_keeps_height_and_width_apart(
    fakes: Fakes, demo: Loadable, tmp_path: Path
) -> None:
    inp = hwc4_input("images", 3, 256, 320, scale=demo.input_scale)
    outs = tuple(
        chw_vectorized(d.name, d.c, 256 // s, 320 // s, vec=16, data_type=DataType.HALF)
        for d, s in zip(demo.outputs, demo.strides, strict=True)
    )
    wide = dataclasses.replace(demo, inputs=(inp,), outputs=outs, image_size=(256, 320))
    desc = describe(wide, dtype="FLOAT")
    gpu = TensorRtGpu(wide, write_engine(tmp_path / "w.engine", desc), max_batch=2, replays=1)
    frames = frames_for(wide, 2, seed=3)
    heads, _ = gpu.run(frames)
    for frame, got in zip(frames, heads, strict=True):
        for g, want in zip(got, reference_heads(frame, wide, desc), strict=True):
            np.testing.assert_allclose(g, want, rtol=0, atol=ATOL["FLOAT"])
    gpu.close()


def test_the_padding_channel_is_ignored(engine: TensorRtGpu, demo: Loadable) -> None:
    frame = frames_for(demo, 1, seed=5)[0]
    dirty = frame.copy()
    dirty[..., 3] = np.random.default_rng(6).integers(-128, 128, dirty.shape[:2], dtype=np.int8)
    clean, _ = engine.run([frame])
    noisy, _ = engine.run([dirty])
    for a, b in zip(clean[0], noisy[0], strict=True):
        np.testing.assert_array_equal(a, b)


def test_heads_are_new_arrays(engine: TensorRtGpu, demo: Loadable) -> None:
    first, _ = engine.run(frames_for(demo, 1, seed=1))
    kept = first[0][0].copy()
    engine.run(frames_for(demo, 2, seed=2))
    np.testing.assert_array_equal(first[0][0], kept)  # not a view of the pinned buffer


def test_only_the_batch_rows_are_copied(engine: TensorRtGpu, fakes: Fakes, demo: Loadable) -> None:
    fakes.cuda.calls.clear()
    engine.run(frames_for(demo, 2, seed=7))
    c, (h, w) = demo.inputs[0].c, demo.image_size
    assert fakes.cuda.copies(MemcpyKind.cudaMemcpyHostToDevice) == [2 * c * h * w * 2]
    assert fakes.cuda.copies(MemcpyKind.cudaMemcpyDeviceToHost) == [
        2 * d.c * d.h * d.w * 2 for d in demo.outputs
    ]
    (context,) = fakes.trt.engines[0].contexts
    assert context.input_shapes == {"images": (2, c, h, w)}
    assert context.address_sets == dict.fromkeys(["images", *(d.name for d in demo.outputs)], 1)


# ------------------------------------------------------------------------------ the curve


def test_the_curve_is_the_median_span_of_every_batch_size(
    engine: TensorRtGpu, fakes: Fakes, demo: Loadable
) -> None:
    assert sorted(engine.curve_us) == list(range(1, MAX_BATCH + 1))
    for b, t in engine.curve_us.items():
        assert t == pytest.approx(span_us(fakes, demo, b)[0], rel=1e-9)
    (context,) = fakes.trt.engines[0].contexts
    # one untimed run, then `replays` (2) timed ones, per size
    assert context.executions == [b for b in range(1, MAX_BATCH + 1) for _ in range(3)]
    protocol: GpuEngine = engine  # the executor's protocol (checked by mypy)
    assert protocol.max_batch == MAX_BATCH


# ------------------------------------------------------------------------------ bad batches


def test_bad_batches_raise_value_errors(engine: TensorRtGpu, demo: Loadable) -> None:
    frame = frames_for(demo, 1, seed=3)[0]
    with pytest.raises(ValueError, match=r"1\.\.3 frames, got 0"):
        engine.run([])
    with pytest.raises(ValueError, match=r"1\.\.3 frames, got 4"):
        engine.run([frame] * 4)
    with pytest.raises(ValueError, match="frame 1 must be an int8 DLA_HWC4 array"):
        engine.run([frame, frame[:, :128]])
    with pytest.raises(ValueError, match="frame 0 must be an int8"):
        engine.run([frame.astype(np.uint8)])
    bad: Any = [frame.tolist()]
    with pytest.raises(ValueError, match="frame 0 must be an int8"):
        engine.run(bad)


def test_bad_arguments_raise_value_errors(fakes: Fakes, demo: Loadable, tmp_path: Path) -> None:
    path = write_engine(tmp_path / "e.engine", describe(demo))
    for kwargs, match in (
        ({"max_batch": 0}, "max_batch must be an int >= 1"),
        ({"max_batch": True}, "max_batch must be an int >= 1"),
        ({"replays": 0}, "replays must be an int >= 1"),
        ({"device_index": -1}, "device_index must be an int >= 0"),
    ):
        with pytest.raises(ValueError, match=match):
            TensorRtGpu(demo, path, **kwargs)
    assert fakes.cuda.calls == []


# ------------------------------------------------------------------------------ refusals


def _mutated(demo: Loadable, change: str) -> dict[str, Any]:
    desc = describe(demo)
    (inp,) = desc["inputs"]
    s8 = next(o for o in desc["outputs"] if o["name"] == "s8")
    if change == "renamed output":
        s8["name"] = "p8"
    elif change == "head shape":
        s8["shape"] = [-1, 40, 32, 32]
    elif change == "small profile":
        inp["profile"] = [[1, 3, 256, 256], [2, 3, 256, 256], [2, 3, 256, 256]]
    elif change == "profile not from 1":
        inp["profile"] = [[2, 3, 256, 256], [4, 3, 256, 256], [4, 3, 256, 256]]
    elif change == "int8 input":
        inp["dtype"] = "INT8"
    elif change == "vectorised output":
        s8["format"] = "CHW16"
    elif change == "input name":
        inp["name"] = "input"
    elif change == "input size":
        inp["shape"] = [-1, 3, 320, 320]
    return desc


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("renamed output",
         r"outputs \['p8', 's16', 's32'\] \(the loadable's: \['s16', 's32', 's8'\]\)"),
        ("head shape", r"s8 has shape \(-1, 40, 32, 32\) \(wanted \[B, 39, 32, 32\]\)"),
        ("small profile",
         r"profile is \(1, 3, 256, 256\)\.\.\(2, 3, 256, 256\); wanted batches 1\.\.>= 3"),
        ("profile not from 1", r"images's profile is \(2, 3, 256, 256\)"),
        ("int8 input", r"images is INT8 \(this engine takes FLOAT or HALF\)"),
        ("vectorised output", r"s8 has format CHW16 \(wanted LINEAR\)"),
        ("input name", r"inputs \['input'\] \(the loadable's: \['images'\]\)"),
        ("input size", r"images has shape \(-1, 3, 320, 320\)"),
    ],
)  # fmt: skip
def test_an_engine_of_another_model_is_refused(
    fakes: Fakes, demo: Loadable, tmp_path: Path, change: str, match: str
) -> None:
    path = write_engine(tmp_path / "e.engine", _mutated(demo, change))
    with pytest.raises(TensorRtGpuError, match=rf"not built for loadable '{demo.name}'.*{match}"):
        TensorRtGpu(demo, path, max_batch=MAX_BATCH, replays=1)
    assert fakes.cuda.live() == {"device": 0, "host": 0, "stream": 0, "event": 0, "graph": 0}


def test_missing_junk_and_foreign_version_engines(
    fakes: Fakes, demo: Loadable, tmp_path: Path
) -> None:
    with pytest.raises(TensorRtGpuError, match="no such engine file"):
        TensorRtGpu(demo, tmp_path / "missing.engine")
    junk = tmp_path / "junk.engine"
    junk.write_bytes(b"\x00not an engine" * 10)
    with pytest.raises(
        TensorRtGpuError, match=r"cannot deserialise it; TensorRT said: .*Magic tag"
    ):
        TensorRtGpu(demo, junk)
    old = write_engine(tmp_path / "old.engine", describe(demo, version="8.6.2.3"))
    with pytest.raises(
        TensorRtGpuError, match=r"TensorRT 10\.3\.0\.30 cannot deserialise.*got 8\.6"
    ):
        TensorRtGpu(demo, old)
    assert fakes.cuda.live() == {"device": 0, "host": 0, "stream": 0, "event": 0, "graph": 0}


def test_without_tensorrt_the_error_says_so(
    fakes: Fakes, demo: Loadable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_engine(tmp_path / "e.engine", describe(demo))
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` raises ImportError
    with pytest.raises(TensorRtGpuError, match="needs TensorRT's Python bindings"):
        TensorRtGpu(demo, path)
    assert fakes.cuda.calls == []


def test_without_cuda_python_the_error_says_so(
    fakes: Fakes, demo: Loadable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_engine(tmp_path / "e.engine", describe(demo))
    for name in ("cuda", "cuda.bindings", "cuda.bindings.runtime"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(TensorRtGpuError, match=r"needs cuda-python's CUDA runtime bindings"):
        TensorRtGpu(demo, path)


def test_older_cuda_python_layout_works(
    monkeypatch: pytest.MonkeyPatch, demo: Loadable, tmp_path: Path
) -> None:
    cuda = FakeCudart()
    fakes = install(monkeypatch, Fakes(FakeTensorRT(cuda, VERSION), cuda), layout="legacy")
    gpu = TensorRtGpu(
        demo, write_engine(tmp_path / "e.engine", describe(demo)), max_batch=1, replays=1
    )
    assert sorted(gpu.curve_us) == [1]
    gpu.close()
    assert fakes.cuda.live() == {"device": 0, "host": 0, "stream": 0, "event": 0, "graph": 0}


@pytest.mark.parametrize(
    ("cuda", "index", "match"),
    [
        (FakeCudart(device_count=0), 0, "no CUDA device: cudaGetDeviceCount answers cudaErrorNo"),
        (FakeCudart(driver=False), 0, "cudaErrorInsufficientDriver"),
        (FakeCudart(device_count=1), 1, r"no CUDA device 1: the CUDA runtime sees 1 device\(s\)"),
    ],
)  # fmt: skip
def test_no_cuda_device_is_a_typed_error(
    monkeypatch: pytest.MonkeyPatch, demo: Loadable, tmp_path: Path,
    cuda: FakeCudart, index: int, match: str,
) -> None:  # fmt: skip
    install(monkeypatch, Fakes(FakeTensorRT(cuda, VERSION), cuda))
    path = write_engine(tmp_path / "e.engine", describe(demo))
    with pytest.raises(TensorRtGpuError, match=match):
        TensorRtGpu(demo, path, device_index=index)


# ------------------------------------------------------------------------------ resources


def test_close_frees_every_allocation_and_is_idempotent(
    fakes: Fakes, demo: Loadable, tmp_path: Path
) -> None:
    gpu = TensorRtGpu(
        demo, write_engine(tmp_path / "e.engine", describe(demo)), max_batch=2, replays=1
    )
    heads = len(demo.outputs)
    assert fakes.cuda.live() == {
        "device": 1 + heads,
        "host": 1 + heads,
        "stream": 1,
        "event": 4,
        "graph": 0,
    }
    frame = frames_for(demo, 1, seed=4)[0]
    gpu.run([frame])
    gpu.close()
    assert fakes.cuda.live() == {"device": 0, "host": 0, "stream": 0, "event": 0, "graph": 0}
    calls = len(fakes.cuda.calls)
    gpu.close()  # idempotent: nothing is freed twice (the fake raises on a double free)
    assert len(fakes.cuda.calls) == calls
    with pytest.raises(RuntimeError, match="closed"):
        gpu.run([frame])
    with pytest.raises(RuntimeError, match="closed"):
        gpu.warm_up()


@pytest.mark.parametrize("call", ["cudaMalloc", "cudaHostAlloc", "cudaEventCreate"])
def test_a_failed_setup_frees_what_it_allocated(
    monkeypatch: pytest.MonkeyPatch, demo: Loadable, tmp_path: Path, call: str
) -> None:
    cuda = FakeCudart(fail={call: CudaError.cudaErrorMemoryAllocation})
    install(monkeypatch, Fakes(FakeTensorRT(cuda, VERSION), cuda))
    path = write_engine(tmp_path / "e.engine", describe(demo))
    with pytest.raises(TensorRtGpuError, match=rf"cannot set the engine up.*{call} failed \(2\)"):
        TensorRtGpu(demo, path, max_batch=2)
    assert cuda.live() == {"device": 0, "host": 0, "stream": 0, "event": 0, "graph": 0}


def test_a_failing_execution_at_warm_up_is_a_typed_error(
    fakes: Fakes, demo: Loadable, tmp_path: Path
) -> None:
    fakes.trt.execute_fails = True
    path = write_engine(tmp_path / "e.engine", describe(demo))
    with pytest.raises(
        TensorRtGpuError, match=r"failed on a batch of 1 at warm-up.*fake execution failure"
    ):
        TensorRtGpu(demo, path, max_batch=2)
    assert fakes.cuda.live() == {"device": 0, "host": 0, "stream": 0, "event": 0, "graph": 0}


def test_a_failing_batch_names_the_call(engine: TensorRtGpu, fakes: Fakes, demo: Loadable) -> None:
    fakes.cuda.fail["cudaStreamSynchronize"] = CudaError.cudaErrorIllegalAddress
    with pytest.raises(TensorRtRunError, match=r"cudaStreamSynchronize failed \(700\)") as info:
        engine.run(frames_for(demo, 1, seed=8))
    assert (info.value.call, info.value.code) == ("cudaStreamSynchronize", 700)
    del fakes.cuda.fail["cudaStreamSynchronize"]


# ------------------------------------------------------------------------------ threads


def test_batches_from_threads_run_one_at_a_time_on_the_engines_device(
    fakes: Fakes, demo: Loadable, tmp_path: Path
) -> None:
    # Device 1: a thread's CUDA current device starts at 0, so every run must set it (the fake
    # refuses an execution on another device than the engine's).
    path = write_engine(tmp_path / "e.engine", describe(demo))
    gpu = TensorRtGpu(demo, path, max_batch=2, device_index=1, replays=1)
    assert_batches_run_one_at_a_time(gpu, frames_for(demo, 2, seed=5), threads=4, timeout_s=30)
    gpu.close()


# ------------------------------------------------------------------------------ metadata


def _sidecar(engine: Path, **overrides: Any) -> Path:
    meta = {
        "format": METADATA_FORMAT, "version": 1, "engine": engine.name,
        "engine_sha256": hashlib.sha256(engine.read_bytes()).hexdigest(),
        "tensorrt_version": VERSION, "max_batch": 4,
    } | overrides  # fmt: skip
    path = engine_metadata_path(engine)
    path.write_text(json.dumps(meta))
    return path


def test_the_sidecar_is_read_and_checked(fakes: Fakes, demo: Loadable, tmp_path: Path) -> None:
    path = write_engine(tmp_path / "demo.gpu.engine", describe(demo))
    assert engine_metadata_path(path) == tmp_path / "demo.gpu.engine.json"
    _sidecar(path)
    gpu = TensorRtGpu(demo, path, max_batch=1, replays=1)
    assert gpu.metadata is not None
    assert gpu.metadata["tensorrt_version"] == VERSION
    gpu.close()
    _sidecar(path, engine_sha256="0" * 64)
    with pytest.raises(TensorRtGpuError, match=r"describes another engine.*stale"):
        TensorRtGpu(demo, path, max_batch=1)
    _sidecar(path, format="something-else")
    with pytest.raises(TensorRtGpuError, match="not a dlad-tensorrt-gpu version 1 document"):
        TensorRtGpu(demo, path, max_batch=1)
    engine_metadata_path(path).write_text("{")
    with pytest.raises(TensorRtGpuError, match="metadata is not JSON"):
        TensorRtGpu(demo, path, max_batch=1)
    old = write_engine(tmp_path / "old.engine", describe(demo, version="10.7.0.23"))
    _sidecar(old, tensorrt_version="10.7.0.23")
    with pytest.raises(TensorRtGpuError, match=r"\(built with TensorRT '10\.7\.0\.23'\)"):
        TensorRtGpu(demo, old, max_batch=1)


# ------------------------------------------------------------------------------ the stand-in


def test_the_stand_in_refuses_misuse(fakes: Fakes, demo: Loadable, tmp_path: Path) -> None:
    """The strictness the tests above rely on: each misuse the product might commit raises."""
    runtime = fakes.trt.Runtime(fakes.trt.Logger())
    eng = runtime.deserialize_cuda_engine(serialise(describe(demo)))
    assert eng is not None
    ctx = eng.create_execution_context()
    cuda = fakes.cuda
    _, stream = cuda.cudaStreamCreateWithFlags(cuda.cudaStreamNonBlocking)
    assert isinstance(stream, FakeStream)
    with pytest.raises(ApiMisuse, match="before set_input_shape"):
        ctx.execute_async_v3(int(stream))
    with pytest.raises(ApiMisuse, match="outside the profile"):
        ctx.set_input_shape("images", (5, 3, 256, 256))
    ctx.set_input_shape("images", (1, 3, 256, 256))
    with pytest.raises(ApiMisuse, match="no address set"):
        ctx.execute_async_v3(int(stream))
    ptrs: dict[str, int] = {}
    for name in ("images", "s8", "s16", "s32"):
        _, ptrs[name] = cuda.cudaMalloc(4 * 3 * 256 * 256 * 2)
        ctx.set_tensor_address(name, ptrs[name])
    with pytest.raises(ApiMisuse, match="the stream's int handle"):
        ctx.execute_async_v3(stream)  # the object, not int(stream)
    with pytest.raises(ApiMisuse, match="not the handle of a live stream"):
        ctx.execute_async_v3(int(stream) + 1)
    assert ctx.execute_async_v3(int(stream))
    cuda.cudaFree(ptrs["s8"])
    with pytest.raises(ApiMisuse, match="used after free"):
        cuda.cudaStreamSynchronize(stream)
    with pytest.raises(ApiMisuse, match="double free"):
        cuda.cudaFree(ptrs["s8"])
    _, host = cuda.cudaHostAlloc(16, cuda.cudaHostAllocDefault)
    with pytest.raises(ApiMisuse, match="overrun"):
        cuda.cudaMemcpyAsync(ptrs["images"], host, 32, MemcpyKind.cudaMemcpyHostToDevice, stream)
    with pytest.raises(ApiMisuse, match="no device allocation"):
        cuda.cudaMemcpyAsync(host, ptrs["images"], 16, MemcpyKind.cudaMemcpyHostToDevice, stream)


def _real_cudart() -> Any:
    """cuda-python's CUDA runtime where it imports and sees a GPU (the H200), else None."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    err, count = runtime.cudaGetDeviceCount()
    return runtime if int(err) == 0 and count > 0 else None


REAL_CUDART = _real_cudart()


@pytest.mark.skipif(REAL_CUDART is None, reason="needs cuda-python and a CUDA GPU (the H200)")
def test_on_a_real_cuda_runtime(
    monkeypatch: pytest.MonkeyPatch, demo: Loadable, tmp_path: Path
) -> None:
    """The product's stream, events, device and pinned buffers and copies, on a real GPU with
    cuda-python's real runtime; only TensorRT is the stand-in (its engine computes through the
    real device buffers)."""
    trt = FakeTensorRT(REAL_CUDART, VERSION)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)  # cuda.bindings stays the real one
    desc = describe(demo)
    gpu = TensorRtGpu(
        demo, write_engine(tmp_path / "e.engine", desc), max_batch=MAX_BATCH, replays=2
    )
    assert sorted(gpu.curve_us) == [1, 2, 3]
    assert all(t > 0 for t in gpu.curve_us.values())
    frames = frames_for(demo, MAX_BATCH, seed=21)
    batched, timing = gpu.run(frames)
    for frame, heads in zip(frames, batched, strict=True):
        for got, want in zip(heads, reference_heads(frame, demo, desc), strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=ATOL["HALF"])
    assert timing.compute_us is not None
    assert 0 < timing.compute_us < timing.actual_us <= (timing.end_ns - timing.start_ns) / 1e3
    gpu.close()
    gpu.close()
    with pytest.raises(RuntimeError, match="closed"):
        gpu.run(frames)


@pytest.mark.skipif(REAL_CUDART is None, reason="needs cuda-python and a CUDA GPU (the H200)")
def test_device_io_on_a_real_cuda_runtime(
    monkeypatch: pytest.MonkeyPatch, demo: Loadable, tmp_path: Path
) -> None:
    """The capture on a real GPU: the real layout kernels and the stand-in engine's kernel in
    one graph per batch size; a launched graph (as the plane launches it) writes the CHW16 of
    the heads the host path computes for the same frames, bit for bit."""
    from cuda.bindings import driver

    from dlad.gpu.driver import GpuContext
    from dlad.gpu.layout import GpuLayouts

    cudart = REAL_CUDART
    monkeypatch.setitem(sys.modules, "tensorrt", FakeTensorRT(cudart, VERSION))
    ctx = GpuContext(0, cache_dir=tmp_path / "kernels")
    gpu = TensorRtGpu(
        demo, write_engine(tmp_path / "e.engine", describe(demo)), max_batch=MAX_BATCH,
        replays=1, layouts=GpuLayouts(ctx),
    )  # fmt: skip
    h2d = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
    d2h = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
    for n in (MAX_BATCH, 2, 1):
        frames = frames_for(demo, n, seed=50 + n)
        staged = np.ascontiguousarray(np.stack(frames))
        assert int(cudart.cudaMemcpy(gpu.input_ptr, staged.ctypes.data, staged.nbytes, h2d)[0]) == 0
        graph = driver.CUgraphExec(gpu.graph_execs[n - 1])
        assert int(driver.cuGraphLaunch(graph, driver.CUstream(0))[0]) == 0
        assert int(cudart.cudaDeviceSynchronize()[0]) == 0
        host, _ = gpu.run(frames)
        for k, (ptr, nbytes) in enumerate(zip(gpu.head_ptrs, gpu.head_image_bytes, strict=True)):
            got = np.empty(n * nbytes, np.uint8)
            assert int(cudart.cudaMemcpy(got.ctypes.data, ptr, got.nbytes, d2h)[0]) == 0
            want = np.stack([pack_chw16(heads[k].astype(np.float16)) for heads in host])
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16).ravel())
    gpu.close()
    ctx.close()


def test_importing_the_engine_does_not_import_tensorrt_or_cuda() -> None:
    code = (
        "import sys, dlad.devices.tensorrt_gpu; "
        "print(sorted(m for m in ('tensorrt', 'cuda', 'cuda.bindings') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------ device I/O
# Built with layout kernels (the GPU service's, where pre/post-processing runs on CUDA), the
# engine keeps batches on the device: one graph per batch size, captured at start, reads the
# static DLA_HWC4 frames and writes CHW16 heads, the layouts the GPU's pre/post kernels speak;
# the native plane launches those graphs (dlad/native/gpu_batch_engine.hpp).


@pytest.fixture
def io_engine(fakes: Fakes, demo: Loadable, tmp_path: Path) -> Iterator[TensorRtGpu]:
    path = write_engine(tmp_path / "demo.gpu.engine", describe(demo))
    gpu = TensorRtGpu(demo, path, max_batch=MAX_BATCH, replays=1, layouts=FakeLayouts(fakes.cuda))
    yield gpu
    gpu.close()


def _chw16_heads(
    cuda: FakeCudart, gpu: TensorRtGpu, ptrs: Sequence[int], n: int
) -> list[list[npt.NDArray[np.float16]]]:
    """The first ``n`` images of each CHW16 head at ``ptrs``, per frame."""
    out = []
    for i in range(n):
        frame = []
        for ptr, nbytes, d in zip(ptrs, gpu.head_image_bytes, gpu.loadable.outputs, strict=True):
            raw = cuda.region(ptr + i * nbytes, nbytes, device=True).view(np.float16)
            frame.append(raw.reshape(-(-d.c // 16), d.h, d.w, 16).copy())
        out.append(frame)
    return out


def _write_frames(
    cuda: FakeCudart, gpu: TensorRtGpu, frames: Sequence[npt.NDArray[np.int8]]
) -> None:
    for i, f in enumerate(frames):
        cuda.region(gpu.input_ptr + i * gpu.frame_bytes, gpu.frame_bytes, device=True)[:] = f.view(
            np.uint8
        ).ravel()


def test_one_graph_per_batch_size_is_captured_around_the_engine(
    io_engine: TensorRtGpu, fakes: Fakes, demo: Loadable
) -> None:
    assert io_engine.device_io
    assert io_engine.device == "cuda:0"
    executables = [g for g in fakes.cuda.graphs if g.executable]
    assert [int(g) for g in executables] == list(io_engine.graph_execs)
    heads = len(demo.outputs)
    for g in executables:  # the frames into the engine's input, the engine, each head out
        assert [name for name, _ in g.ops] == ["to_nchw", "execute"] + ["to_chw16"] * heads
    assert io_engine.frame_bytes == int(np.prod(io_engine._frame_shape))
    assert io_engine.head_image_bytes == tuple(-(-d.c // 16) * d.h * d.w * 32 for d in demo.outputs)


@pytest.mark.parametrize("dtype", ["HALF", "FLOAT"])
def test_a_launched_graph_writes_the_host_paths_heads_as_chw16(
    fakes: Fakes, demo: Loadable, tmp_path: Path, dtype: str
) -> None:
    """A batch of n through graph n (what the plane launches) gives, per frame, the heads the
    host path computes for the same frames, as fp16 CHW16."""
    path = write_engine(tmp_path / "e.engine", describe(demo, dtype=dtype))
    gpu = TensorRtGpu(demo, path, max_batch=MAX_BATCH, replays=1, layouts=FakeLayouts(fakes.cuda))
    for n in (MAX_BATCH, 1):
        frames = frames_for(demo, n, seed=30 + n)
        _write_frames(fakes.cuda, gpu, frames)
        stream = fakes.cuda.streams[0]
        assert fakes.cuda.cudaGraphLaunch(gpu.graph_execs[n - 1], stream)[0] == 0
        assert fakes.cuda.cudaStreamSynchronize(stream)[0] == 0
        got = _chw16_heads(fakes.cuda, gpu, gpu.head_ptrs, n)
        host, _ = gpu.run(frames)
        for frame_got, frame_host in zip(got, host, strict=True):
            for g, h in zip(frame_got, frame_host, strict=True):
                np.testing.assert_array_equal(g, pack_chw16(h.astype(np.float16)))
    gpu.close()


def test_run_device_queues_a_batch_and_its_head_copies(
    io_engine: TensorRtGpu, fakes: Fakes, demo: Loadable
) -> None:
    cuda = fakes.cuda
    frames = frames_for(demo, 2, seed=40)
    _write_frames(cuda, io_engine, frames)
    targets = [cuda.cudaMalloc(MAX_BATCH * n)[1] for n in io_engine.head_image_bytes]
    after, done = cuda.cudaEventCreate()[1], cuda.cudaEventCreate()[1]
    stream = cuda.streams[0]
    io_engine.wait_input_free(stream)  # nothing has read the frames yet: no wait queued
    assert not [c for c, _ in cuda.calls if c == "cudaStreamWaitEvent"]
    batch = io_engine.run_device(2, after=after, done=done, heads_to=targets)
    timing = batch.timing()
    assert batch.size == timing.size == 2
    assert timing.compute_us is not None
    assert 0 < timing.compute_us < timing.actual_us
    host, _ = io_engine.run(frames)
    for frame_got, frame_host in zip(_chw16_heads(cuda, io_engine, targets, 2), host, strict=True):
        for g, h in zip(frame_got, frame_host, strict=True):
            np.testing.assert_array_equal(g, pack_chw16(h.astype(np.float16)))
    io_engine.wait_input_free(stream)  # now the next writer waits for the graph's read
    waits = [args for c, args in cuda.calls if c == "cudaStreamWaitEvent"]
    assert [w[0] for w in waits] == [stream, stream]
    assert waits[0][1] is after
    with pytest.raises(ValueError, match=r"1\.\.3 frames"):
        io_engine.run_device(0, after=None, done=done)
    with pytest.raises(ValueError, match="heads_to needs"):
        io_engine.run_device(1, after=None, done=done, heads_to=targets[:1])


def test_without_layout_kernels_there_is_no_device_io(engine: TensorRtGpu) -> None:
    assert not engine.device_io
    for member in ("input_ptr", "head_ptrs", "graph_execs"):
        with pytest.raises(RuntimeError, match="no device-side I/O"):
            getattr(engine, member)


def test_layout_kernels_of_another_device_are_refused(
    fakes: Fakes, demo: Loadable, tmp_path: Path
) -> None:
    path = write_engine(tmp_path / "e.engine", describe(demo))
    with pytest.raises(ValueError, match="on CUDA device 1, the engine on 0"):
        TensorRtGpu(demo, path, layouts=FakeLayouts(fakes.cuda, device_index=1))


@pytest.mark.parametrize("failing", ["layout", "execute", "cudaGraphInstantiate"])
def test_a_failed_capture_ends_it_and_frees_everything(
    monkeypatch: pytest.MonkeyPatch, fakes: Fakes, demo: Loadable, tmp_path: Path, failing: str
) -> None:
    layouts = FakeLayouts(fakes.cuda)
    path = write_engine(tmp_path / "e.engine", describe(demo))
    if failing == "layout":
        layouts.fail = CudaDriverError("cuLaunchKernel(layout_hwc4_nchw)", 719, "LAUNCH_FAILED")
        match = r"cuLaunchKernel\(layout_hwc4_nchw\) failed \(719\): capturing a batch of 1"
    elif failing == "execute":  # warm-up's eager runs pass; the first captured enqueue fails
        eager = FakeContext.execute_async_v3

        def fails_in_capture(self: FakeContext, handle: object) -> bool:
            stream = fakes.cuda.live_stream(handle)
            return (stream is None or stream.capture is None) and eager(self, handle)

        monkeypatch.setattr(FakeContext, "execute_async_v3", fails_in_capture)
        match = r"execute_async_v3 failed"
    else:
        fakes.cuda.fail["cudaGraphInstantiate"] = CudaError.cudaErrorInvalidValue
        match = r"cudaGraphInstantiate failed \(1\)"
    with pytest.raises(TensorRtGpuError, match=match):
        TensorRtGpu(demo, path, max_batch=2, replays=1, layouts=layouts)
    assert all(s.capture is None for s in fakes.cuda.streams)
    assert fakes.cuda.live() == {"device": 0, "host": 0, "stream": 0, "event": 0, "graph": 0}


def test_close_destroys_the_graphs(io_engine: TensorRtGpu, fakes: Fakes) -> None:
    assert fakes.cuda.live()["graph"] == 2 * MAX_BATCH  # each size: its graph and executable
    io_engine.close()
    assert fakes.cuda.live() == {"device": 0, "host": 0, "stream": 0, "event": 0, "graph": 0}
    assert not io_engine.device_io
    with pytest.raises(RuntimeError, match="closed"):
        io_engine.graph_execs  # noqa: B018
