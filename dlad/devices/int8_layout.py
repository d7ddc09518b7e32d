"""The emulated core's integer operands: which ones this host's onnxruntime computes exactly.

A DLA multiplies int8 activations by int8 weights and sums the products in 32 bits: the result
is exact. The emulated core runs the same products with onnxruntime's integer kernels (MLAS),
and MLAS picks its kernel by the CPU it runs on:

* **uint8 x int8** (``u8s8``: the graph's own layout, activations ``q + 128``, weights ``w_q``):
  exact where the kernel sums in 32 bits: x86 with AVX-512 VNNI, AVX-VNNI or AMX
  (``vpdpbusd``, ``tdpbusd``), Arm (``sdot``/``udot``/``ummla``, or ``smull`` pairs that cannot
  overflow for weights in [-127, 127]). On x86 with AVX2 or AVX-512 but no VNNI it multiplies with
  ``vpmaddubsw``, which adds *pairs* of products in int16 with saturation: one pair of 255 x 127
  products already overflows, and the sums silently come out smaller.
* **uint8 x uint8** (``u8u8``: weights re-encoded as ``w_q + 128`` at zero point 128, the same
  values): exact on every CPU, x86 (both operands widened to int16, ``vpmaddwd`` 32-bit pair sums;
  or ``vpdpbuud``) and Arm (``umull``/``uadalp``, ``udot``, ``ummla``), but about half the speed
  of the VNNI ``u8s8`` kernels.

Both give the same integers, so the engine takes the faster one that is exact here. Which one
that is is not read from the CPU's feature flags (an emulator or hypervisor can report flags
the kernels do not follow, and onnxruntime may change its dispatch): :func:`u8s8_is_exact` runs
small probe graphs through onnxruntime whose exact sums no int16 pair can hold, in every kernel
shape the engine's convolutions take (3x3 and 1x1 convolutions, depthwise, GEMM and GEMV), and
compares them with the exact integers. The feature flags only name the kernel for people.

onnx and onnxruntime are imported on first use, never at module import.
"""

from __future__ import annotations

import platform
import threading
from dataclasses import dataclass
from functools import cache
from typing import Any, Final, Literal

import numpy as np

__all__ = [
    "KernelPath",
    "NoExactKernelError",
    "Operands",
    "OperandsChoice",
    "cpu_summary",
    "open_session",
    "select_kernel_path",
    "u8s8_is_exact",
    "u8u8_is_exact",
    "weights_to_uint8",
]

Operands = Literal["u8s8", "u8u8"]
OperandsChoice = Literal["auto", "u8s8", "u8u8"]
OPERANDS: Final[tuple[Operands, ...]] = ("u8s8", "u8u8")
_WEIGHTED: Final = frozenset({"Conv", "MatMul", "Gemm"})
"""Ops whose input 1 is a weight: an int8 DequantizeLinear feeding one is re-encoded."""
_PROBE_IR_VERSION: Final = 8
"""ONNX IR version of the probe graphs (opset 13): what every onnxruntime >= 1.10 reads."""
_PROBE_EXACT: Final = 100
"""Every probe's scales put the exact sum at this output value (no rounding tie near it)."""


class NoExactKernelError(RuntimeError):
    """Neither operand layout computes exact sums with this host's onnxruntime."""


@dataclass(frozen=True)
class KernelPath:
    """The integer kernel path an engine runs on.

    Attributes:
        operands: ``"u8s8"`` (the graph's int8 weights) or ``"u8u8"`` (re-encoded weights).
        runtime: ``"onnxruntime <version>"``.
        cpu: the CPU's architecture and integer-relevant features (:func:`cpu_summary`).
        exact: whether the probes found these operands exact on this host.
        reason: why these operands were taken.
    """

    operands: Operands
    runtime: str
    cpu: str
    exact: bool
    reason: str

    def summary(self) -> str:
        """One line for logs: operands, runtime, CPU, exactness."""
        kind = "uint8 x int8" if self.operands == "u8s8" else "uint8 x uint8"
        exact = "exact int32 sums" if self.exact else "NOT exact on this host"
        return f"{kind} ({self.operands}) on {self.runtime}, {self.cpu}: {exact}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping (``dlad status --platform``)."""
        return {
            "operands": self.operands,
            "runtime": self.runtime,
            "cpu": self.cpu,
            "exact": self.exact,
            "reason": self.reason,
            "summary": self.summary(),
        }


# ----------------------------------------------------------------------------- the CPU, for people
def _cpu_flags() -> frozenset[str]:
    """The feature flags Linux reports (``flags`` on x86, ``Features`` on Arm); empty elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


@cache
def cpu_summary() -> str:
    """The machine and the features MLAS's integer dispatch looks at, e.g. ``"x86_64 (avx2,
    avx512bw, avx512_vnni)"``; the flags come from ``/proc/cpuinfo`` and are informative only."""
    machine = platform.machine() or "unknown machine"
    wanted = (
        "avx2", "avx512bw", "avx512_vnni", "avx_vnni", "avx_vnni_int8", "amx_int8",
        "asimddp", "i8mm", "sve",
    )  # fmt: skip
    flags = _cpu_flags()
    found = [f for f in wanted if f in flags]
    return f"{machine} ({', '.join(found) or 'no listed features'})"


# ----------------------------------------------------------------------------- re-encoding
def weights_to_uint8(model_bytes: bytes) -> bytes:
    """Re-encode a graph's int8 weights as uint8 at zero point 128: the same values.

    Every ``DequantizeLinear`` of an int8 initializer whose outputs feed only the weight input of
    ``Conv``/``MatMul``/``Gemm`` gets ``w + 128`` (uint8) and zero points ``z + 128`` (uint8);
    nothing else changes. Raises ValueError when the bytes are not an ONNX model or a weight's
    zero point is not an initializer.
    """
    import onnx  # noqa: PLC0415 (lazy: only hosts without exact u8s8 kernels need it)
    from onnx import TensorProto, numpy_helper  # noqa: PLC0415

    try:
        model = onnx.load_from_string(model_bytes)
    except Exception as exc:  # protobuf's DecodeError has no stable import path
        raise ValueError(f"not an ONNX model: {exc}") from exc
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    readers: dict[str, list[tuple[str, int]]] = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            readers.setdefault(name, []).append((node.op_type, index))
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in inits:
            continue
        weight = inits[node.input[0]]
        uses = readers.get(node.output[0], [])
        if weight.data_type != TensorProto.INT8 or not uses:
            continue
        if not all(op in _WEIGHTED and index == 1 for op, index in uses):
            continue
        zp_name = node.input[2] if len(node.input) > 2 else ""
        if zp_name not in inits:
            raise ValueError(f"weight {weight.name!r} needs an initializer zero point to re-encode")
        for tensor in (weight, inits[zp_name]):
            shifted = numpy_helper.to_array(tensor).astype(np.int16) + 128
            tensor.CopyFrom(numpy_helper.from_array(shifted.astype(np.uint8), tensor.name))
    return bytes(model.SerializeToString())


# ----------------------------------------------------------------------------- the probes
_Probe = tuple[str, str, tuple[int, ...], tuple[int, ...], dict[str, Any], int]
_PROBES: Final[tuple[_Probe, ...]] = (
    # name, op, input shape, weight shape, attributes, products summed per output
    ("conv3x3", "Conv", (1, 64, 10, 10), (16, 64, 3, 3), {}, 64 * 9),
    ("conv1x1", "Conv", (1, 128, 8, 8), (32, 128, 1, 1), {}, 128),
    ("conv3x3/s2", "Conv", (1, 32, 11, 11), (16, 32, 3, 3), {"strides": [2, 2]}, 32 * 9),
    ("depthwise3x3", "Conv", (1, 32, 10, 10), (32, 1, 3, 3), {"group": 32}, 9),
    ("gemm", "MatMul", (8, 256), (256, 32), {}, 256),
    ("gemv", "MatMul", (1, 256), (256, 32), {}, 256),
)
"""The kernel shapes MLAS dispatches separately: symmetric convolutions (3x3, 1x1, strided),
depthwise, GEMM and GEMV (one row)."""


def _probe_models() -> list[tuple[str, bytes, dict[str, np.ndarray]]]:
    """QDQ graphs in the engine's form (uint8 activations at zero point 128, int8 weights at
    zero point 0, per-channel weight scales) whose inputs are all 255 and weights all 127: every
    pair of products is 2 * 255 * 127 = 64770 > 32767, so a saturating kernel cannot hide. The
    scales put the exact result at :data:`_PROBE_EXACT` (output ``_PROBE_EXACT + 128``)."""
    from onnx import TensorProto, helper, numpy_helper  # noqa: PLC0415

    x_scale, w_scale = np.float32(0.02), np.float32(0.01)
    models = []
    for name, op, x_shape, w_shape, attrs, terms in _PROBES:
        out_ch = w_shape[0] if op == "Conv" else w_shape[1]
        y_scale = np.float32(terms * 127 * 127 * float(x_scale) * float(w_scale) / _PROBE_EXACT)
        inits = [
            numpy_helper.from_array(np.array(x_scale), "xs"),
            numpy_helper.from_array(np.array(128, np.uint8), "zp"),
            numpy_helper.from_array(np.full(w_shape, 127, np.int8), "w"),
            numpy_helper.from_array(np.full(out_ch, w_scale), "ws"),
            numpy_helper.from_array(np.zeros(out_ch, np.int8), "wz"),
            numpy_helper.from_array(np.array(y_scale), "ys"),
        ]
        nodes = [
            helper.make_node("DequantizeLinear", ["x", "xs", "zp"], ["xf"]),
            helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"], axis=int(op != "Conv")),
            helper.make_node(op, ["xf", "wf"], ["yf"], **attrs),
            helper.make_node("QuantizeLinear", ["yf", "ys", "zp"], ["y"]),
        ]
        graph = helper.make_graph(
            nodes,
            name,
            [helper.make_tensor_value_info("x", TensorProto.UINT8, list(x_shape))],
            [helper.make_tensor_value_info("y", TensorProto.UINT8, None)],
            inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        model.ir_version = _PROBE_IR_VERSION  # not the installed onnx's newest: ORT may be older
        models.append((name, model.SerializeToString(), {"x": np.full(x_shape, 255, np.uint8)}))
    return models


def _probe(operands: Operands) -> tuple[str, ...]:
    """The names of the probes whose sums come out wrong with ``operands`` (empty: exact)."""
    import onnxruntime as ort  # noqa: PLC0415 (lazy: the daemon starts without it)

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    wrong = []
    for name, model, feed in _probe_models():
        data = weights_to_uint8(model) if operands == "u8u8" else model
        try:
            session = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
            (y,) = session.run(None, feed)
        except Exception as exc:  # onnxruntime's errors share no base class but Exception
            raise NoExactKernelError(
                f"onnxruntime {ort.__version__} cannot run the INT8 kernel probe {name!r} "
                f"({operands}): {exc}"
            ) from exc
        if not np.all(y == _PROBE_EXACT + 128):
            wrong.append(name)
    return tuple(wrong)


_probe_lock = threading.Lock()


@cache
def _probe_once(operands: Operands) -> tuple[str, ...]:
    return _probe(operands)


def _probe_cached(operands: Operands) -> tuple[str, ...]:
    with _probe_lock:  # two cores loading at once: the second waits for the first's result
        return _probe_once(operands)


def u8s8_is_exact() -> bool:
    """Whether this host's onnxruntime sums uint8 x int8 products exactly (probed once)."""
    return not _probe_cached("u8s8")


def u8u8_is_exact() -> bool:
    """Whether this host's onnxruntime sums uint8 x uint8 products exactly (probed once)."""
    return not _probe_cached("u8u8")


def select_kernel_path(choice: OperandsChoice = "auto") -> KernelPath:
    """The operands an engine runs on: ``"auto"`` takes ``u8s8`` where it is exact here, else
    ``u8u8``; ``"u8s8"`` or ``"u8u8"`` force one (for benchmarks and tests that compare them).

    Raises:
        ValueError: ``choice`` is none of the three.
        NoExactKernelError: ``"auto"`` on a host where neither layout is exact, or an
            onnxruntime that cannot run the probes.
        ImportError: onnxruntime or onnx is not installed.
    """
    import onnxruntime as ort  # noqa: PLC0415

    if choice not in ("auto", *OPERANDS):
        raise ValueError(f"operands must be 'auto', 'u8s8' or 'u8u8', got {choice!r}")
    runtime = f"onnxruntime {ort.__version__}"
    if choice != "auto":
        exact = not _probe_cached(choice)
        return KernelPath(choice, runtime, cpu_summary(), exact, "asked for")
    if u8s8_is_exact():
        why = "the uint8 x int8 kernel sums exactly on this host (probed)"
        return KernelPath("u8s8", runtime, cpu_summary(), True, why)
    if u8u8_is_exact():
        wrong = ", ".join(_probe_cached("u8s8"))
        why = f"uint8 x int8 sums saturate on this host (probes {wrong}); uint8 x uint8 is exact"
        return KernelPath("u8u8", runtime, cpu_summary(), True, why)
    raise NoExactKernelError(
        f"{runtime} on {cpu_summary()} computes neither uint8 x int8 nor uint8 x uint8 "
        "convolutions exactly; the emulated DLA core cannot run here"
    )


def open_session(model_bytes: bytes, *, threads: int, kernel: KernelPath) -> Any:
    """An onnxruntime CPU session for an engine graph, on ``kernel``'s operands (the graph's
    weights re-encoded for ``u8u8``).

    The session is the engine's: all graph optimizations (the Q/DQ pairs fuse into integer
    kernels), ``threads`` intra-op threads that sleep between runs, sequential execution.

    Raises:
        ValueError: the bytes are not an ONNX model (``u8u8``).
        Exception: onnxruntime's own errors for a graph it cannot load (they share no base
            class but Exception).
    """
    import onnxruntime as ort  # noqa: PLC0415 (lazy: the daemon starts without it)

    data = weights_to_uint8(model_bytes) if kernel.operands == "u8u8" else model_bytes
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    # Idle worker threads would otherwise spin between frames, taking CPU from the daemon's
    # other threads (pre/post-processing, the other emulated core).
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
