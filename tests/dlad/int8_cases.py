"""Convolutions and a matmul whose exact int32 sums no int16 pair can hold, with their exact
integer answers: the cases ``test_int8_layout`` runs on this host and, under valgrind, on an
emulated AVX2 CPU without VNNI.

Each case is a Q/DQ graph in the engine's form (uint8 activations at zero point 128, int8 weights
at zero point 0 behind ``DequantizeLinear``, a ``QuantizeLinear`` after the op, so onnxruntime
fuses it into its integer kernel). Every scale is a power of two, so requantisation multiplies
the int32 sum by an exact power of two and rounds half to even: the reference is
``round_half_even(acc / 2**j) + 128`` from an int64 numpy sum, with no float error anywhere.

``python -m tests.dlad.int8_cases`` prints, as JSON, how many output values differ from the
reference under each operand choice, and the kernel path ``"auto"`` takes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from onnx import TensorProto, helper, numpy_helper

from dlad.devices.int8_layout import OperandsChoice, open_session, select_kernel_path

INT16_MAX = 32767


@dataclass(frozen=True)
class Case:
    name: str
    model: bytes
    x: np.ndarray  # uint8 activations (q + 128)
    want: np.ndarray  # uint8 outputs (q + 128)
    max_pair: int  # the largest |sum of two adjacent uint8 x int8 products| (what vpmaddubsw adds)
    max_acc: int  # the largest |int32 sum|
    op: str  # the op onnxruntime must fuse into an integer kernel


def _shift(acc: np.ndarray, axis: int) -> np.ndarray:
    """Per output channel (along ``axis``), the power of two that brings ``max|acc|`` to 127."""
    amax = np.abs(acc).max(axis=tuple(a for a in range(acc.ndim) if a != axis))
    return np.ceil(np.log2(np.maximum(amax, 1) / 127.0)).astype(np.int64)


def _requant(acc: np.ndarray, j: np.ndarray) -> np.ndarray:
    return (np.clip(np.round(acc / np.exp2(j)), -128, 127) + 128).astype(np.uint8)


def _qdq(
    op: str, x_shape: list[int], w: np.ndarray, w_scale: np.ndarray, axis: int, **attrs: Any
) -> bytes:
    x_scale = np.float32(2.0**-4)
    inits = [
        numpy_helper.from_array(np.array(x_scale), "xs"),
        numpy_helper.from_array(np.array(128, np.uint8), "zp"),
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(w_scale.astype(np.float32), "ws"),
        numpy_helper.from_array(np.zeros(w_scale.shape, np.int8), "wz"),
        numpy_helper.from_array(np.array(x_scale * np.float32(2.0**-5)), "ys"),
    ]
    nodes = [
        helper.make_node("DequantizeLinear", ["x", "xs", "zp"], ["xf"]),
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"], axis=axis),
        helper.make_node(op, ["xf", "wf"], ["yf"], **attrs),
        helper.make_node("QuantizeLinear", ["yf", "ys", "zp"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        op,
        [helper.make_tensor_value_info("x", TensorProto.UINT8, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8  # what older onnxruntime releases read too
    return bytes(model.SerializeToString())


def _data(rng: np.random.Generator, x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> Any:
    """Activations biased high (q in [64, 127] mostly) and weights of large magnitude with a
    random sign per element: many adjacent product pairs exceed int16, the sums do not cancel."""
    x = np.where(rng.random(x_shape) < 0.9, rng.integers(192, 256, x_shape), 0).astype(np.uint8)
    mag = rng.integers(96, 128, w_shape)
    sign = np.where(rng.random(w_shape) < 0.8, 1, -1)
    return x, (mag * sign).astype(np.int8)


def conv_case(rng: np.random.Generator, k: int, c_in: int, c_out: int, size: int) -> Case:
    x, w = _data(rng, (1, c_in, size, size), (c_out, c_in, k, k))
    windows = sliding_window_view(x[0].astype(np.int64) - 128, (k, k), axis=(1, 2))
    acc = np.einsum("chwij,ocij->ohw", windows, w.astype(np.int64))  # exact int64 sums
    j = _shift(acc, 0)
    # Per-channel weight scales 2**-(5 + j): the multiplier xs * ws / ys is exactly 2**-j.
    model = _qdq("Conv", list(x.shape), w, np.exp2(-5.0 - j), 0)
    products = x[0, :, :k, :k].astype(np.int64)[None] * w.astype(np.int64)
    pairs = products.reshape(c_out, -1)
    max_pair = int(np.abs(pairs[:, :-1] + pairs[:, 1:]).max())
    want = _requant(acc, j[:, None, None])[None]
    return Case(f"conv{k}x{k}", model, x, want, max_pair, int(np.abs(acc).max()), "QLinearConv")


def matmul_case(rng: np.random.Generator, m: int, k: int, n: int) -> Case:
    x, w = _data(rng, (m, k), (k, n))
    acc = (x.astype(np.int64) - 128) @ w.astype(np.int64)
    j = int(_shift(acc.reshape(1, -1), 0).max())  # one (per-tensor) weight scale
    model = _qdq("MatMul", [m, k], w, np.array(2.0 ** (-5 - j)), 1)
    products = x[:1].astype(np.int64).T * w.astype(np.int64)
    max_pair = int(np.abs(products[:-1] + products[1:]).max())
    want = _requant(acc, np.array(j))
    return Case("matmul", model, x, want, max_pair, int(np.abs(acc).max()), "QLinearMatMul")


def cases(seed: int = 0) -> list[Case]:
    rng = np.random.default_rng(seed)
    return [
        conv_case(rng, 3, 64, 16, 10),
        conv_case(rng, 1, 128, 32, 8),
        matmul_case(rng, 8, 256, 32),
    ]


def mismatches(case: Case, operands: OperandsChoice) -> int:
    """Output values of ``case`` that differ from the exact answer when run on ``operands``."""
    session = open_session(case.model, threads=1, kernel=select_kernel_path(operands))
    (got,) = session.run(None, {"x": case.x})
    return int((got != case.want).sum())


def main() -> None:
    report = {
        "auto": select_kernel_path("auto").operands,
        "mismatches": {
            operands: {c.name: mismatches(c, operands) for c in cases()}
            for operands in ("auto", "u8s8", "u8u8")
        },
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
