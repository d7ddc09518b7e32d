"""The emulated DLA core's numeric engine: DLA_HWC4 input parsing, CHW32/CHW16 output bytes,
buffer validation, thread safety and lazy imports.

The graphs are built in-test with ``prep.emulate_graph`` from a 1x1 convolution that copies
input channel ``o % C`` to output channel ``o`` (weights 1, bias 0, equal input and output
scales): its int8 output equals its int8 input exactly (the accumulator ``127 q`` requantised
by ``1/127``), so every output byte is known from the input bytes.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any, Literal

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from dlad.devices.int8_engine import (
    EngineConfigError,
    EngineInputError,
    Int8Engine,
    OutputSpec,
    hwc4_channels,
)
from dlad.imaging.post import pack_chw16, pack_chw32, unpack_chw16, unpack_chw32_int8
from dlad.imaging.pre import hwc4_layout, quantize_hwc4
from prep.emulate_graph import EngineGraph, build_int8_graph

SCALE = 1 / 127


def copy_net(c: int, h: int, w: int, c_out: int) -> onnx.ModelProto:
    """``images [1, c, h, w] -> 1x1 conv -> y [1, c_out, h, w]``, ``y[o] = images[o % c]``."""
    weight = np.zeros((c_out, c, 1, 1), np.float32)
    weight[np.arange(c_out), np.arange(c_out) % c] = 1.0
    graph = helper.make_graph(
        [helper.make_node("Conv", ["images", "w", "b"], ["y"], name="copy")],
        "copy",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, c, h, w])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c_out, h, w])],
        [
            numpy_helper.from_array(weight, "w"),
            numpy_helper.from_array(np.zeros(c_out, np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def copy_graph(c: int, h: int, w: int, c_out: int, heads: Literal["int8", "fp16"]) -> EngineGraph:
    return build_int8_graph(
        copy_net(c, h, w, c_out), {"images": SCALE, "y": SCALE}, [], heads=heads
    )


def make_engine(g: EngineGraph, **kwargs: Any) -> Int8Engine:
    args: dict[str, Any] = {
        "input_scale": g.input_scale,
        "input_shape": g.input_shape,
        "outputs": g.outputs,
        **kwargs,
    }
    return Int8Engine(g.to_bytes(), **args)


def expected_head(hwc4: np.ndarray, c: int, w: int, c_out: int) -> np.ndarray:
    """The int8 values the copy net's head must hold, from the input bytes alone."""
    planes = hwc4[:, :w, :c].transpose(2, 0, 1)
    return planes[np.arange(c_out) % c]


@pytest.fixture(scope="module")
def yolo_like() -> tuple[EngineGraph, Int8Engine]:
    g = copy_graph(3, 5, 20, 70, "int8")
    return g, make_engine(g)


# ------------------------------------------------------------------------- bytes in, bytes out
@settings(max_examples=40, deadline=None)
@given(
    c=st.sampled_from([1, 3]),
    h=st.integers(1, 9),
    w=st.integers(1, 40),
    extra_px=st.integers(0, 24),
    c_out=st.sampled_from([1, 3, 16, 31, 32, 33, 64, 70]),
    heads=st.sampled_from(["int8", "fp16"]),
    seed=st.integers(0, 2**32 - 1),
    operands=st.sampled_from(["auto", "u8u8"]),
)
def test_hwc4_in_chw_out_bytes(
    c: int, h: int, w: int, extra_px: int, c_out: int, heads: Any, seed: int, operands: str
) -> None:
    """Any row pitch, garbage in the padding channel and row padding (ignored); outputs
    byte-identical to ``pack_chw32`` / ``pack_chw16`` of their logical heads, padding zero;
    on the host's operands and on the re-encoded uint8 weights alike."""
    g = copy_graph(c, h, w, c_out, heads)
    eng = make_engine(g, operands=operands)
    assert eng.kernel.exact
    rng = np.random.default_rng(seed)
    hwc4 = rng.integers(-128, 128, (h, w + extra_px, hwc4_channels(c))).astype(np.int8)
    (out,) = eng.run(hwc4)
    spec = g.outputs[0]
    want_q = expected_head(hwc4, c, w, c_out)
    if heads == "int8":
        assert out.dtype == np.int8
        assert out.shape == (-(-c_out // 32), h, w, 32)
        logical = unpack_chw32_int8(out, c_out, SCALE)
        np.testing.assert_array_equal(pack_chw32(logical, SCALE), out)
        np.testing.assert_array_equal(out.transpose(0, 3, 1, 2).reshape(-1, h, w)[:c_out], want_q)
    else:
        assert out.dtype == np.float16
        assert out.shape == (-(-c_out // 16), h, w, 16)
        logical = unpack_chw16(out, c_out)
        np.testing.assert_array_equal(pack_chw16(logical), out)
        want = (want_q.astype(np.float32) * np.float32(g.input_scale)).astype(np.float16)
        np.testing.assert_array_equal(out.transpose(0, 3, 1, 2).reshape(-1, h, w)[:c_out], want)
    lanes = out.transpose(0, 3, 1, 2).reshape(-1, h, w)
    assert not lanes[c_out:].any(), "padding channels must be zero"
    assert out.nbytes == spec.size_bytes


def test_quantize_hwc4_output_is_consumed_exactly() -> None:
    """The real pre-processing output (default and explicit row pitch) drives the engine."""
    g = copy_graph(3, 6, 21, 3, "int8")
    eng = make_engine(g)
    canvas = np.random.default_rng(1).integers(0, 256, (6, 21, 3), dtype=np.uint8)
    for pitch in (None, 40):
        hwc4 = quantize_hwc4(canvas, g.input_scale, row_pitch_px=pitch)
        (out,) = eng.run(hwc4)
        np.testing.assert_array_equal(out[0, :, :, :3], hwc4[:, :21, :3])
    assert eng.input_hwc4_shape == (6, hwc4_layout(3, 6, 21, 1)[0], 4)


def test_out_buffers_are_filled_in_place(yolo_like: tuple[EngineGraph, Int8Engine]) -> None:
    g, eng = yolo_like
    hwc4 = np.random.default_rng(2).integers(-128, 128, (5, 32, 4)).astype(np.int8)
    fresh = eng.run(hwc4)
    dirty = [np.full(s.packed_shape, 0x55, dtype=s.numpy_dtype) for s in g.outputs]
    got = eng.run(hwc4, out=dirty)
    assert all(a is b for a, b in zip(got, dirty, strict=True))
    for a, b in zip(got, fresh, strict=True):
        np.testing.assert_array_equal(a, b)
    assert [b.shape for b in eng.new_outputs()] == [s.packed_shape for s in g.outputs]


def test_concurrent_runs_equal_sequential(yolo_like: tuple[EngineGraph, Int8Engine]) -> None:
    _, eng = yolo_like
    rng = np.random.default_rng(3)
    inputs = [rng.integers(-128, 128, (5, 32, 4)).astype(np.int8) for _ in range(12)]
    want = [eng.run(x)[0] for x in inputs]
    got: list[np.ndarray | None] = [None] * len(inputs)
    errors: list[BaseException] = []

    def worker(indices: range) -> None:
        try:
            for i in indices:
                got[i] = eng.run(inputs[i])[0]
        except Exception as exc:  # noqa: BLE001 (handed to the main thread, asserted below)
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(range(k, 12, 4),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert not any(t.is_alive() for t in threads)
    for a, b in zip(got, want, strict=True):
        assert a is not None
        np.testing.assert_array_equal(a, b)


def test_output_spec_sizes_follow_the_dla_formats() -> None:
    """255 channels: CHW32 int8 pads to 8 groups of 32, CHW16 fp16 to 16 groups of 16."""
    int8 = OutputSpec("s8", 255, 84, 84, "int8", 0.05)
    fp16 = OutputSpec("s8", 255, 84, 84, "fp16", None)
    assert int8.packed_shape == (8, 84, 84, 32)
    assert int8.size_bytes == 256 * 84 * 84
    assert fp16.packed_shape == (16, 84, 84, 16)
    assert fp16.size_bytes == 256 * 84 * 84 * 2


# ------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: np.zeros((5, 32, 4), np.float32), "3-D int8"),
        (lambda: np.zeros((5, 32, 4), np.uint8), "3-D int8"),
        (lambda: np.zeros((5, 128), np.int8), "3-D int8"),
        (lambda: [[0]], "3-D int8"),
        (lambda: np.zeros((4, 32, 4), np.int8), r"not DLA_HWC4 \[5\]\[>=20\]\[4\]"),
        (lambda: np.zeros((5, 19, 4), np.int8), "not DLA_HWC4"),
        (lambda: np.zeros((5, 32, 3), np.int8), "not DLA_HWC4"),
    ],
)
def test_bad_input_buffers(
    yolo_like: tuple[EngineGraph, Int8Engine], make: Any, message: str
) -> None:
    _, eng = yolo_like
    with pytest.raises(EngineInputError, match=message):
        eng.run(make())


def test_bad_out_buffers(yolo_like: tuple[EngineGraph, Int8Engine]) -> None:
    g, eng = yolo_like
    x = np.zeros((5, 32, 4), np.int8)
    (spec,) = g.outputs
    good = np.zeros(spec.packed_shape, np.int8)
    readonly = good.copy()
    readonly.flags.writeable = False
    strided = np.zeros((*spec.packed_shape[:3], 64), np.int8)[..., ::2]
    bads: list[Any] = [
        [],
        [good, good],
        [np.zeros(spec.packed_shape, np.uint8)],
        [np.zeros((1, *spec.packed_shape[1:]), np.int8)],
        [readonly],
        [strided],
        good,
    ]
    for bad in bads:
        with pytest.raises(EngineInputError, match="out"):
            eng.run(x, out=bad)


def test_bad_construction() -> None:
    g = copy_graph(3, 5, 20, 70, "int8")
    spec = g.outputs[0]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input_scale": float("nan")}, "input_scale"),
        ({"input_scale": 0.0}, "input_scale"),
        ({"input_shape": (3, 5)}, "input_shape"),
        ({"input_shape": (2, 5, 20)}, "1, 3 or 4 channels"),
        ({"input_shape": (3, 5, 21)}, r"expected tensor\(uint8\) \[1, 3, 5, 21\]"),
        ({"threads": 0}, "threads"),
        ({"outputs": []}, "at least one output"),
        ({"outputs": [spec, spec]}, "repeat"),
        ({"outputs": [spec._replace(name="nope")]}, "'nope' is missing"),
        ({"outputs": [spec._replace(channels=64)]}, r"expected tensor\(uint8\) \[1, 64"),
        ({"outputs": [spec._replace(dtype="fp16", scale=None)]}, r"tensor\(float16\)"),
        ({"outputs": [spec._replace(scale=None)]}, "needs a finite positive scale"),
        ({"outputs": [spec._replace(dtype="fp16")]}, "takes no scale"),
        ({"outputs": [(*spec[:4], "int4", 0.1)]}, "dtype must be"),
        ({"outputs": [("s8", 3)]}, r"\(name, C, H, W, dtype, scale\)"),
        ({"operands": "s8s8"}, "operands must be"),
    ]
    for kwargs, message in cases:
        with pytest.raises(EngineConfigError, match=message):
            make_engine(g, **kwargs)
    for data in (b"", b"not an onnx model"):
        for operands in ("auto", "u8u8"):
            with pytest.raises(EngineConfigError, match=r"model_bytes|cannot load"):
                Int8Engine(
                    data,
                    input_scale=SCALE,
                    input_shape=(3, 5, 20),
                    outputs=[spec],
                    operands=operands,
                )


def test_signed_activation_graph_is_refused() -> None:
    """The TensorRT-style int8 (zero point 0) graph is for comparison only: its input is int8."""
    s8 = build_int8_graph(
        copy_net(3, 5, 20, 3),
        {"images": SCALE, "y": SCALE},
        [],
        heads="int8",
        activation_dtype="int8",
    )
    with pytest.raises(EngineConfigError, match=r"tensor\(int8\)"):
        make_engine(s8)


def test_import_is_lazy() -> None:
    code = (
        "import sys, dlad.devices.int8_engine; "
        "bad = {'onnxruntime', 'onnx', 'torch'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
