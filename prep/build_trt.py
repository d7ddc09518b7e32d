"""Build DLA standalone loadables and the GPU engine dlad serves with TensorRT.

Input: the Q/DQ translator's PTQ ONNX (no Q/DQ nodes), its TensorRT calibration cache and its
``fp16_nodes`` list. Output: the bytes ``builder.build_serialized_network`` returns, which for
``EngineCapability.DLA_STANDALONE`` is a cuDLA loadable (only cuDLA can run it, never a TRT
runtime). One loadable is compiled per DLA core. See docs/build.md for the TensorRT versions and
the equivalent trtexec command line (:func:`trtexec_command`).

``device="gpu"`` builds the GPU engine ``dlad.devices.tensorrt_gpu.TensorRtGpu`` serves, from the
same ONNX, cache and FP16 layers: INT8 with those layers in FP16, input ``images`` FP16 linear
NCHW (the daemon dequantises its int8 frames into it; FP16 holds every ``q * scale`` closely
enough that the first INT8 layer requantises it to the same ``q``), FP16 linear outputs (the raw
head convs ``[B, C, H, W]``), and one optimisation profile for batches ``1..max_batch`` (min 1,
opt = max = ``max_batch``). The translator's ONNX fixes batch 1, so its batch dim is made dynamic
first (:func:`with_dynamic_batch`). Beside the engine goes a JSON sidecar (its format is
``dlad.devices.tensorrt_gpu``'s; :func:`gpu_engine_metadata`).

``tensorrt`` is imported inside :func:`build_dla_loadable`, so this module imports anywhere. No
``trt.Runtime`` is ever created: without a GPU it segfaults on first use.

Two TensorRT generations are handled explicitly (``DlaBuildSpec.quantization``):

* ``"implicit"`` (TensorRT 8.6 - 10.7): weakly typed network; INT8/FP16 builder flags,
  ``OBEY_PRECISION_CONSTRAINTS``, per-layer FP16 via ``layer.precision``, INT8 scales from the
  calibration cache (calibrator) or per-tensor dynamic ranges.
* ``"explicit"`` (TensorRT >= 11.4.1, JetPack 7.2.2+ on AGX Orin): every network is strongly
  typed; the precision flags, calibrators and dynamic ranges no longer exist, so precision must
  already be in the ONNX (Q/DQ nodes, Cast nodes, FP16 tensors): ``prep.explicit_qdq`` writes it
  from the translator's outputs. The builder only checks it.

:func:`quantization_for` picks the path for the TensorRT found (or checks the one asked for).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, cast, get_args

from prep.calib_cache import (
    CalibrationCache,
    CalibrationCacheError,
    layer_precisions_arg,
    parse_calibration_cache,
)

InputFormat = Literal[
    "int8:dla_hwc4",
    "int8:dla_linear",
    "int8:chw32",
    "fp16:dla_hwc4",
    "fp16:dla_linear",
    "fp16:chw16",
]
OutputPrecision = Literal["fp16", "int8"]
Device = Literal["dla", "gpu"]
Quantization = Literal["implicit", "explicit"]
QuantizationChoice = Literal["auto", "implicit", "explicit"]
Int8Scales = Literal["calibrator", "dynamic_range"]

# trtexec's format words -> TensorFormat member names (NvInferRuntimeBase.h;
# docs/reference/cudla.md §3.3).
_FORMAT_ENUM = {
    "dla_hwc4": "DLA_HWC4",
    "dla_linear": "DLA_LINEAR",
    "chw": "LINEAR",
    "chw16": "CHW16",
    "chw32": "CHW32",
}
_OUTPUT_FORMAT: dict[str, str] = {"fp16": "fp16:chw16", "int8": "int8:chw32"}
_GPU_IO_FORMAT = "fp16:chw"  # trtexec's word for FP16 TensorFormat.LINEAR
_DLA_MAX_BATCH = 4096
_GPU_MAX_BATCH = 64
_DLA_MAX_DIM = 8192
_ORIN_SRAM_BYTES = 1 << 20  # 1 MiB of managed SRAM per Orin DLA core (TRT MemoryPoolType docs)
_MIB = 1 << 20


class DlaBuildError(RuntimeError):
    """The build cannot run here or TensorRT refused it; the message says why."""


class DlaSpecError(ValueError):
    """A build input (spec field, calibration cache, precision config) is invalid."""


@dataclass(frozen=True)
class DlaBuildSpec:
    """Everything one build needs. Validated on construction (raises :class:`DlaSpecError`).

    ``calibration_cache`` is required for INT8 I/O or INT8 layers in ``"implicit"`` mode and must
    be ``None`` in ``"explicit"`` mode. ``input_shapes`` fixes dynamic input dims (DLA has none:
    the profile is min = opt = max); a dynamic leading dim without an entry becomes ``batch``.
    ``dla_sram_mib`` defaults to 1 MiB, the whole SRAM of an Orin DLA core, as in NVIDIA's DLA
    model recipes (``--memPoolSize=dlaSRAM:1``); TensorRT requires a power of two >= 4 KiB.
    ``device="gpu"`` builds the GPU engine dlad serves (module docstring): FP16 linear I/O, a
    profile for batches 1..``max_batch`` (1..64); the DLA-only fields (``dla_core``,
    ``input_format``, ``output_precision``, ``dla_sram_mib``) are ignored and ``batch`` must stay
    1 (the DLA's static batch). ``max_batch`` is ignored for DLA builds.
    """

    onnx_path: Path
    calibration_cache: Path | None = None
    fp16_layers: tuple[str, ...] = ()
    dla_core: int = 0
    device: Device = "dla"
    quantization: Quantization = "implicit"
    input_format: InputFormat = "int8:dla_hwc4"
    output_precision: OutputPrecision = "fp16"
    int8_scales: Int8Scales = "calibrator"
    input_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    batch: int = 1
    dla_sram_mib: float = 1.0
    workspace_mib: int | None = None
    max_batch: int = 8

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "onnx_path", Path(self.onnx_path))
        if self.calibration_cache is not None:
            set_(self, "calibration_cache", Path(self.calibration_cache))
        set_(self, "fp16_layers", tuple(self.fp16_layers))
        set_(self, "input_shapes", {k: tuple(v) for k, v in dict(self.input_shapes).items()})
        for name, allowed in (
            ("device", Device), ("quantization", Quantization), ("input_format", InputFormat),
            ("output_precision", OutputPrecision), ("int8_scales", Int8Scales),
        ):  # fmt: skip
            if getattr(self, name) not in get_args(allowed):
                raise DlaSpecError(
                    f"{name}={getattr(self, name)!r}; expected one of {get_args(allowed)}"
                )
        if isinstance(self.dla_core, bool) or self.dla_core not in (0, 1):
            raise DlaSpecError(f"dla_core={self.dla_core!r}; an Orin has DLA cores 0 and 1")
        if not all(isinstance(n, str) and n for n in cast("tuple[object, ...]", self.fp16_layers)):
            raise DlaSpecError("fp16_layers must be non-empty layer names")
        if len(set(self.fp16_layers)) != len(self.fp16_layers):
            raise DlaSpecError("fp16_layers lists a layer twice")
        if not 1 <= self.batch <= _DLA_MAX_BATCH:
            raise DlaSpecError(f"batch={self.batch}; DLA allows 1..{_DLA_MAX_BATCH}")
        if type(self.max_batch) is not int or not 1 <= self.max_batch <= _GPU_MAX_BATCH:
            raise DlaSpecError(
                f"max_batch={self.max_batch!r}; the GPU engine's profile takes 1..{_GPU_MAX_BATCH}"
            )
        if self.device == "gpu" and self.batch != 1:
            raise DlaSpecError(
                f"batch={self.batch} is the DLA's static batch; the GPU engine takes batches"
                " 1..max_batch"
            )
        for name, dims in self.input_shapes.items():
            if not dims or any(type(d) is not int or d < 1 for d in cast("tuple[object]", dims)):
                raise DlaSpecError(f"input_shapes[{name!r}]={dims}; dims must be positive ints")
        sram = self.dla_sram_bytes
        if sram < 4096 or sram > _ORIN_SRAM_BYTES or sram & (sram - 1):
            raise DlaSpecError(
                f"dla_sram_mib={self.dla_sram_mib}: TensorRT needs a power of two >= 4 KiB and an"
                " Orin DLA core has 1 MiB of SRAM"
            )
        if self.workspace_mib is not None and self.workspace_mib < 1:
            raise DlaSpecError(f"workspace_mib={self.workspace_mib}; must be >= 1")
        if self.quantization == "explicit" and self.calibration_cache is not None:
            raise DlaSpecError(
                "explicit quantization takes INT8 scales from the ONNX's Q/DQ nodes; TensorRT >= 11"
                " has no calibration cache path, so calibration_cache must be None"
            )
        int8_io = self.input_format.startswith("int8") or self.output_precision == "int8"
        if (
            int8_io
            and self.device == "dla"
            and self.quantization == "implicit"
            and not self.calibration_cache
        ):
            raise DlaSpecError(
                f"{self.input_format} input / {self.output_precision} output need INT8 scales:"
                " give calibration_cache (the translator's *_calib.cache)"
            )

    @property
    def dla_sram_bytes(self) -> int:
        return round(self.dla_sram_mib * _MIB)

    @property
    def output_format(self) -> str:
        """trtexec-style ``precision:format`` of every output: on DLA fp16 -> CHW16, int8 ->
        CHW32; on the GPU ``fp16:chw`` (linear)."""
        return _GPU_IO_FORMAT if self.device == "gpu" else _OUTPUT_FORMAT[self.output_precision]

    @property
    def io_input_format(self) -> str:
        """trtexec-style ``precision:format`` of every input (``fp16:chw`` on the GPU)."""
        return _GPU_IO_FORMAT if self.device == "gpu" else self.input_format


@dataclass(frozen=True)
class BuildReport:
    """What a successful build produced and how it was configured."""

    trt_version: str
    device: Device
    dla_core: int | None
    quantization: Quantization
    out_path: Path
    loadable_bytes: int
    onnx_bytes: int
    num_layers: int
    input_shapes: dict[str, tuple[int, ...]]
    io_formats: dict[str, str]
    fp16_layers: tuple[str, ...]
    builder_flags: tuple[str, ...]
    int8_mode: str
    scales_applied: int
    scales_unused: tuple[str, ...]
    elapsed_s: float
    warnings: tuple[str, ...]
    max_batch: int | None = None
    """The GPU engine's largest batch (None for a DLA loadable)."""
    metadata_path: Path | None = None
    """The GPU engine's JSON sidecar (None for a DLA loadable)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (paths as strings, tuples as lists)."""
        out = asdict(self)
        out["out_path"] = str(self.out_path)
        out["metadata_path"] = None if self.metadata_path is None else str(self.metadata_path)
        return json.loads(json.dumps(out))


# --------------------------------------------------------------------------- versions and inputs
def parse_trt_version(text: str) -> tuple[int, int, int]:
    """``"10.3.0.30"`` -> ``(10, 3, 0)``. Raises :class:`DlaBuildError` on anything else."""
    parts = text.strip().split(".")
    if not text.strip() or not all(p.isdigit() for p in parts[:3]):
        raise DlaBuildError(f"cannot read the TensorRT version {text!r}")
    major, minor, patch = ([int(p) for p in parts[:3]] + [0, 0])[:3]
    return major, minor, patch


def dla_support_problem(version: tuple[int, int, int]) -> str | None:
    """Why this TensorRT version cannot build DLA standalone loadables, or None if it can."""
    shown = ".".join(map(str, version))
    if version < (8, 6, 0):
        return (
            f"TensorRT {shown} predates 8.6, the first release whose DLA standalone path (DLA 3.14,"
            " JetPack 6 / DriveOS 6.0.8) dlad supports; on 8.5 see NVIDIA's trtexec patch"
        )
    if (10, 8, 0) <= version < (11, 0, 0):
        return f"TensorRT {shown}: 10.7 was the last 10.x release that supports DLA"
    if (11, 0, 0) <= version < (11, 4, 0):
        return f"TensorRT {shown}: DLA was removed in TensorRT 11.0-11.3"
    if (11, 4, 0) <= version < (11, 4, 1):
        return f"TensorRT {shown}: 11.4.0 supports DLA only on Windows on ARM, not on Jetson"
    return None


def quantization_for(version: str, asked: QuantizationChoice = "auto") -> Quantization:
    """The build path for TensorRT ``version`` (``"10.3.0.30"``): ``"auto"`` gives
    ``"implicit"`` before 11 (the stripped ONNX + calibration cache) and ``"explicit"`` from 11 on
    (the Q/DQ ONNX; TensorRT 11 has no implicit INT8). An asked path is returned if this TensorRT
    has it. Raises :class:`DlaBuildError` for an unreadable version, ``"implicit"`` on >= 11,
    ``"explicit"`` before 11 (the DLA needs >= 11.4.1: :func:`dla_support_problem`), and
    :class:`DlaSpecError` for another ``asked``."""
    if asked not in get_args(QuantizationChoice):
        choices = get_args(QuantizationChoice)
        raise DlaSpecError(f"quantization={asked!r}; expected one of {choices}")
    strongly_typed = parse_trt_version(version) >= (11, 0, 0)
    if asked == "auto":
        return "explicit" if strongly_typed else "implicit"
    if asked == "implicit" and strongly_typed:
        raise DlaBuildError(
            f"TensorRT {version} has no implicit INT8 (no INT8 flag, no calibrator): use"
            " quantization 'explicit' (the Q/DQ ONNX) or 'auto'"
        )
    if asked == "explicit" and not strongly_typed:
        raise DlaBuildError(
            f"TensorRT {version} builds explicit Q/DQ networks for the DLA only from 11.4.1: use"
            " quantization 'implicit' (the stripped ONNX + calibration cache) or 'auto'"
        )
    return asked


def trt_version_code(version: tuple[int, int, int]) -> int:
    """The number TensorRT writes in cache headers: 8.6.0 -> 8600, 10.3.0 -> 100300."""
    major, minor, patch = version
    return major * (10000 if major >= 10 else 1000) + minor * 100 + patch


def read_calibration_cache(path: Path) -> tuple[CalibrationCache, bytes]:
    """Parse the translator's ``EntropyCalibration2`` cache; returns it and its exact bytes.

    The format lives in :mod:`prep.calib_cache`. Raises :class:`DlaSpecError` when the file is
    unreadable or malformed, or was written for another calibrator (the cache calibrator here
    is an ``IInt8EntropyCalibrator2``).
    """
    raw = _read_file(Path(path), "calibration cache")
    try:
        cache = parse_calibration_cache(raw)
    except CalibrationCacheError as exc:
        raise DlaSpecError(f"{path}: {exc}") from exc
    if cache.algorithm != "EntropyCalibration2":
        raise DlaSpecError(f"{path}: a {cache.algorithm} cache; expected EntropyCalibration2")
    return cache, raw


def load_fp16_layers(precision_config: Path) -> tuple[str, ...]:
    """The ``fp16_nodes`` of a translator ``*_precision_config.json`` (raises DlaSpecError)."""
    try:
        doc = json.loads(_read_file(Path(precision_config), "precision config"))
    except json.JSONDecodeError as exc:
        raise DlaSpecError(f"{precision_config}: not JSON ({exc})") from exc
    nodes = doc.get("fp16_nodes") if isinstance(doc, dict) else None
    if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
        raise DlaSpecError(f"{precision_config}: 'fp16_nodes' must be a list of node names")
    return tuple(dict.fromkeys(nodes))  # the translator may list a consumer twice


def resolve_input_shapes(
    declared: Sequence[tuple[str, tuple[int, ...]]], spec: DlaBuildSpec
) -> tuple[dict[str, tuple[int, ...]], bool]:
    """Static build shape of every network input, and whether the network had dynamic dims.

    ``declared`` dims are -1 where dynamic. For a GPU engine the shape is the profile's largest:
    its batch is ``spec.max_batch``, and the batch dim must be dynamic (:func:`with_dynamic_batch`).
    Raises :class:`DlaSpecError` when a dynamic dim has no value, a given shape contradicts the
    model, or a name in ``spec.input_shapes`` is unknown.
    """
    names = {name for name, _ in declared}
    if unknown := sorted(set(spec.input_shapes) - names):
        raise DlaSpecError(f"input_shapes names {unknown} are not network inputs {sorted(names)}")
    resolved: dict[str, tuple[int, ...]] = {}
    dynamic = False
    gpu = spec.device == "gpu"
    batch = spec.max_batch if gpu else spec.batch
    for name, dims in declared:
        dynamic = dynamic or any(d < 0 for d in dims)
        if gpu and (not dims or dims[0] >= 0):
            raise DlaSpecError(
                f"input {name!r} {dims} has a fixed batch; the GPU engine's profile needs a"
                " dynamic one (with_dynamic_batch / write_dynamic_batch_onnx make it so)"
            )
        given = spec.input_shapes.get(name)
        if given is not None:
            if len(given) != len(dims) or any(
                0 <= d != g for d, g in zip(dims, given, strict=True)
            ):
                raise DlaSpecError(f"input_shapes[{name!r}]={given} contradicts the model's {dims}")
            if gpu and given[0] != batch:
                raise DlaSpecError(
                    f"input_shapes[{name!r}]={given}: the GPU engine's batch is max_batch={batch}"
                )
            shape = given
        else:
            shape = tuple(batch if i == 0 and d < 0 else d for i, d in enumerate(dims))
            if missing := [i for i, d in enumerate(shape) if d < 0]:
                raise DlaSpecError(
                    f"input {name!r} {dims} has dynamic dims {missing}; DLA has no dynamic dims,"
                    " give input_shapes"
                )
            if dims and dims[0] > 0 and dims[0] != spec.batch and spec.batch != 1:
                raise DlaSpecError(f"input {name!r} fixes batch {dims[0]}, spec asks {spec.batch}")
        if (
            spec.device == "dla"
            and shape
            and (shape[0] > _DLA_MAX_BATCH or any(d > _DLA_MAX_DIM for d in shape[1:]))
        ):
            raise DlaSpecError(f"input {name!r} {shape} exceeds DLA limits (batch 4096, dims 8192)")
        resolved[name] = shape
    return resolved, dynamic


def profile_shapes(
    shapes: Mapping[str, tuple[int, ...]], dynamic: bool, spec: DlaBuildSpec
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] | None:
    """The optimisation profile ``{input: (min, opt, max)}`` for ``shapes`` (as
    :func:`resolve_input_shapes` gives them), or None where none is needed: the GPU engine's is
    batch 1 .. ``max_batch`` with opt = max; a DLA network with dynamic dims gets min = opt = max
    (DLA is static); a static DLA network needs none."""
    if spec.device == "gpu":
        return {name: ((1, *s[1:]), s, s) for name, s in shapes.items()}
    return {name: (s, s, s) for name, s in shapes.items()} if dynamic else None


def with_dynamic_batch(onnx_bytes: bytes, dim_name: str = "batch") -> tuple[bytes, bool]:
    """``onnx_bytes`` with the leading dim of every graph input and output made the symbolic
    ``dim_name`` where it was a number, and the stale intermediate shapes (``value_info``, inferred
    at that number) dropped; and whether anything changed (if not, the bytes are returned as
    they were). External-data references are kept as they are. A graph that bakes the batch into
    a constant (a Reshape to ``[1, ...]``) still fails later, in TensorRT's build, with its error.
    Raises :class:`DlaSpecError` for bytes that are not an ONNX model."""
    import onnx
    from google.protobuf.message import DecodeError  # type: ignore[import-untyped,unused-ignore]

    try:
        model = onnx.load_from_string(onnx_bytes)
    except (DecodeError, ValueError) as exc:
        raise DlaSpecError(f"not an ONNX model ({exc})") from exc
    weights = {t.name for t in model.graph.initializer}
    changed = False
    for value in [*model.graph.input, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if value.name not in weights and dims and dims[0].HasField("dim_value"):
            dims[0].dim_param = dim_name  # dim_value and dim_param are a oneof: this clears it
            changed = True
    if not changed:
        return onnx_bytes, False
    del model.graph.value_info[:]
    return model.SerializeToString(), True


def write_dynamic_batch_onnx(src: Path, dst: Path) -> Path:
    """Write :func:`with_dynamic_batch` of ``src`` to ``dst`` (atomically; a copy where nothing
    changes), for trtexec, which cannot make a fixed batch dynamic. Returns ``dst``. Raises
    :class:`DlaSpecError` for an unreadable or non-ONNX ``src``."""
    data, _ = with_dynamic_batch(_read_file(Path(src), "ONNX model"))
    _write_atomic(Path(dst), data)
    return Path(dst)


def tensorrt_available() -> str | None:
    """TensorRT's version if ``import tensorrt`` works here, else None. Never builds or runs."""
    try:
        import tensorrt
    except (ImportError, OSError):
        return None
    return str(getattr(tensorrt, "__version__", "unknown"))


# --------------------------------------------------------------------------- trtexec equivalent
def trtexec_command(spec: DlaBuildSpec, out_path: Path, *, trtexec: str = "trtexec") -> list[str]:
    """The trtexec command line equivalent to :func:`build_dla_loadable` for ``spec``.

    Reads only the ONNX's declared inputs/outputs (for shape flags and per-output formats).
    ``"implicit"`` gives TensorRT 8.6-10.7 syntax; ``"explicit"`` gives 11.x syntax (no precision
    flags). For a GPU engine the ONNX's batch must already be dynamic (trtexec cannot change a
    fixed one; :func:`write_dynamic_batch_onnx` writes such a copy). Raises :class:`DlaSpecError`
    if the ONNX has dynamic dims that cannot be resolved, or a fixed batch for a GPU engine.
    """
    inputs, outputs = _onnx_io(spec.onnx_path)
    cmd = [trtexec, f"--onnx={spec.onnx_path}", f"--saveEngine={out_path}"]
    shapes, dynamic = resolve_input_shapes(inputs, spec)
    profile = profile_shapes(shapes, dynamic, spec)
    if profile is not None:
        for flag, which in (("min", 0), ("opt", 1), ("max", 2)):
            text = ",".join(f"{n}:{'x'.join(map(str, p[which]))}" for n, p in profile.items())
            cmd.append(f"--{flag}Shapes={text}")
    if spec.quantization == "implicit":
        if spec.calibration_cache is not None:
            cmd += ["--int8", "--fp16", f"--calib={spec.calibration_cache}"]
        else:
            cmd.append("--fp16")
        cmd.append("--precisionConstraints=obey")
        if spec.fp16_layers:
            try:
                per_layer = layer_precisions_arg(spec.fp16_layers)
            except ValueError as exc:
                raise DlaSpecError(f"fp16_layers cannot be given to trtexec: {exc}") from exc
            cmd += [f"--layerPrecisions={per_layer}", f"--layerOutputTypes={per_layer}"]
    pools = [] if spec.workspace_mib is None else [f"workspace:{spec.workspace_mib}"]
    if spec.device == "dla":
        cmd += [f"--useDLACore={spec.dla_core}", "--buildDLAStandalone"]
        cmd.append("--inputIOFormats=" + ",".join([spec.input_format] * len(inputs)))
        cmd.append("--outputIOFormats=" + ",".join([spec.output_format] * len(outputs)))
        sram = spec.dla_sram_bytes
        pools.append(f"dlaSRAM:{sram // _MIB}" if sram % _MIB == 0 else f"dlaSRAM:{sram // 1024}K")
    else:
        cmd.append("--inputIOFormats=" + ",".join([spec.io_input_format] * len(inputs)))
        cmd.append("--outputIOFormats=" + ",".join([spec.output_format] * len(outputs)))
    if pools:
        cmd.append("--memPoolSize=" + ",".join(pools))
    return cmd


# --------------------------------------------------------------------------- the build
def build_dla_loadable(
    spec: DlaBuildSpec,
    out_path: Path,
    *,
    trt_module: Any = None,
    cuda_device_count: Callable[[], int | None] | None = None,
) -> BuildReport:
    """Build ``spec`` with TensorRT and write the serialized loadable/engine to ``out_path``.

    ``trt_module`` replaces ``import tensorrt`` (tests); ``cuda_device_count`` replaces the CUDA
    runtime probe (None from it means "cannot tell", and the build goes on). Raises
    :class:`DlaSpecError` for bad inputs and :class:`DlaBuildError` when TensorRT is missing or
    unsupported, there is no CUDA device or no DLA, the ONNX does not parse, the precision
    requests cannot be met, or the builder fails (with TensorRT's own error messages).
    ``out_path`` is written atomically and only on success; for a GPU engine its JSON sidecar
    (``dlad.devices.tensorrt_gpu.engine_metadata_path``) is written after it, and a previous one
    is removed first.
    """
    started = time.perf_counter()
    gpu = spec.device == "gpu"
    onnx_bytes = _read_file(spec.onnx_path, "ONNX model")
    network_bytes, rebatched = with_dynamic_batch(onnx_bytes) if gpu else (onnx_bytes, False)
    cache = read_calibration_cache(spec.calibration_cache) if spec.calibration_cache else None
    trt = trt_module if trt_module is not None else _import_tensorrt(spec.device)
    version_text = str(getattr(trt, "__version__", ""))
    s = _Session(trt, spec, parse_trt_version(version_text))
    s.check_version()
    if (cuda_device_count or _cuda_device_count)() == 0:
        need = "the GPU it will run on" if gpu else "a Jetson Orin (GPU + DLA)"
        raise DlaBuildError(f"no CUDA device: this TensorRT build needs {need}")
    if rebatched:
        s.notes.append(f"{spec.onnx_path.name} fixes the batch; its batch dim was made dynamic")
    s.parse(network_bytes)
    shapes, dynamic = resolve_input_shapes([(t.name, tuple(t.shape)) for t in s.inputs], spec)
    profile = profile_shapes(shapes, dynamic, spec)
    flags = s.configure(profile)
    io_formats = s.configure_io(shapes)
    s.apply_fp16_layers()
    batch = max((v[0] for v in shapes.values() if v), default=1)
    int8_mode, applied, unused = s.apply_int8(cache, batch)
    blob = s.builder.build_serialized_network(s.network, s.config)
    if blob is None:
        errors = [m for sev, m in s.logger.messages if sev <= int(trt.ILogger.Severity.ERROR)]
        raise DlaBuildError("TensorRT build failed:\n  " + "\n  ".join(errors or ["(no message)"]))
    data = bytes(memoryview(blob))
    out_path = Path(out_path)
    meta_path = None
    if gpu:
        from dlad.devices.tensorrt_gpu import engine_metadata_path

        meta_path = engine_metadata_path(out_path)
        meta_path.unlink(missing_ok=True)  # never a sidecar that describes another engine
    _write_atomic(out_path, data)
    if meta_path is not None and profile is not None:
        meta = gpu_engine_metadata(
            engine=data, engine_name=out_path.name, trt_version=version_text,
            max_batch=spec.max_batch, profile=profile,
            outputs={t.name: tuple(t.shape) for t in s.outputs},
            precision={"quantization": spec.quantization, "int8_mode": int8_mode,
                       "builder_flags": list(flags), "fp16_layers": list(spec.fp16_layers)},
            onnx_name=spec.onnx_path.name, onnx_sha256=hashlib.sha256(onnx_bytes).hexdigest(),
        )  # fmt: skip
        _write_atomic(meta_path, (json.dumps(meta, indent=2) + "\n").encode())
    warning = int(trt.ILogger.Severity.WARNING)
    return BuildReport(
        trt_version=version_text, device=spec.device,
        dla_core=None if gpu else spec.dla_core, quantization=spec.quantization,
        out_path=out_path, loadable_bytes=len(data), onnx_bytes=len(onnx_bytes),
        num_layers=int(s.network.num_layers), input_shapes=shapes, io_formats=io_formats,
        fp16_layers=spec.fp16_layers, builder_flags=flags, int8_mode=int8_mode,
        scales_applied=applied, scales_unused=unused, elapsed_s=time.perf_counter() - started,
        warnings=(*s.notes, *(m for sev, m in s.logger.messages if sev == warning)),
        max_batch=spec.max_batch if gpu else None, metadata_path=meta_path,
    )  # fmt: skip


def gpu_engine_metadata(
    *,
    engine: bytes,
    engine_name: str,
    trt_version: str,
    max_batch: int,
    profile: Mapping[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]],
    outputs: Mapping[str, tuple[int, ...]],
    precision: Mapping[str, Any],
    onnx_name: str,
    onnx_sha256: str,
) -> dict[str, Any]:
    """The JSON sidecar of a GPU engine (format version 1 of ``dlad.devices.tensorrt_gpu``):
    the engine's name, sha256 and size, the TensorRT version, ``max_batch``, each input with its
    shape (batch -1), type, format and ``profile``, each output's shape, type and format (every
    I/O is ``HALF``/``LINEAR``), the precision settings and the source ONNX."""
    from dlad.devices.tensorrt_gpu import METADATA_FORMAT, METADATA_VERSION

    def io(shape: tuple[int, ...]) -> dict[str, Any]:
        return {"shape": [-1, *shape[1:]], "dtype": "HALF", "format": "LINEAR"}

    return {
        "format": METADATA_FORMAT,
        "version": METADATA_VERSION,
        "engine": engine_name,
        "engine_sha256": hashlib.sha256(engine).hexdigest(),
        "engine_bytes": len(engine),
        "tensorrt_version": trt_version,
        "max_batch": max_batch,
        "inputs": [
            {
                "name": name,
                **io(high),
                "profile": {"min": list(low), "opt": list(opt), "max": list(high)},
            }
            for name, (low, opt, high) in profile.items()
        ],
        "outputs": [{"name": name, **io(shape)} for name, shape in outputs.items()],
        "precision": dict(precision),
        "onnx": {"name": onnx_name, "sha256": onnx_sha256},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


@dataclass
class _Session:
    """One build's TensorRT objects; each method is one documented step of the build."""

    trt: Any
    spec: DlaBuildSpec
    version: tuple[int, int, int]
    notes: list[str] = field(default_factory=list)
    keep_alive: list[Any] = field(default_factory=list)  # calibrator: TRT holds a raw pointer

    @property
    def strongly_typed(self) -> bool:
        return self.version >= (11, 0, 0)

    def check_version(self) -> None:
        if self.spec.device == "dla" and (problem := dla_support_problem(self.version)):
            raise DlaBuildError(problem)
        shown = ".".join(map(str, self.version))
        if self.strongly_typed and self.spec.quantization == "implicit":
            raise DlaBuildError(
                f"TensorRT {shown} builds only strongly typed networks: its INT8/FP16 flags,"
                " calibrators and dynamic ranges are gone. Use quantization='explicit' with an ONNX"
                " that carries its precision (Q/DQ, FP16 casts), or build with TensorRT <= 10.7"
            )
        if not self.strongly_typed and self.spec.quantization == "explicit":
            raise DlaBuildError(f"quantization='explicit' needs TensorRT >= 11.4.1, not {shown}")

    def parse(self, onnx_bytes: bytes) -> None:
        """Logger -> Builder (DLA cores checked) -> network -> OnnxParser; sets I/O lists."""
        trt = self.trt
        self.logger = _make_logger(trt)
        self.builder = trt.Builder(self.logger)
        if self.spec.device == "dla":
            cores = int(self.builder.num_DLA_cores)
            if cores == 0:
                raise DlaBuildError("TensorRT sees no DLA core: a DLA build needs a Jetson Orin")
            if self.spec.dla_core >= cores:
                raise DlaBuildError(f"DLA core {self.spec.dla_core} requested; {cores} present")
        # Explicit batch is a creation flag before TRT 10; 10 made it the only mode.
        explicit = (
            trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH if self.version < (10,) else None
        )
        self.network = self.builder.create_network(0 if explicit is None else 1 << int(explicit))
        parser = trt.OnnxParser(self.network, self.logger)
        if not parser.parse(onnx_bytes, str(self.spec.onnx_path)):
            errors = [_parser_error_text(parser.get_error(i)) for i in range(parser.num_errors)]
            raise DlaBuildError(
                f"{self.spec.onnx_path}: ONNX parse failed:\n  " + "\n  ".join(errors)
            )
        self.inputs = [self.network.get_input(i) for i in range(self.network.num_inputs)]
        self.outputs = [self.network.get_output(i) for i in range(self.network.num_outputs)]
        self.config = self.builder.create_builder_config()

    def configure(
        self, profile: Mapping[str, tuple[tuple[int, ...], ...]] | None
    ) -> tuple[str, ...]:
        """Device, flags, memory pools and the profile (:func:`profile_shapes`); returns the
        names of the flags set."""
        trt, spec, config = self.trt, self.spec, self.config
        names: list[str] = []
        if spec.device == "dla":
            config.default_device_type = trt.DeviceType.DLA
            config.DLA_core = spec.dla_core
            config.engine_capability = trt.EngineCapability.DLA_STANDALONE
            # A standalone loadable has no GPU to fall back to; say so in the config.
            config.clear_flag(trt.BuilderFlag.GPU_FALLBACK)
            # Standalone mode disallows I/O reformats. 11.0-11.4.0 removed the flag as unneeded;
            # 11.4.1's C++ API lists it as deprecated again. Set it wherever it exists.
            if hasattr(trt.BuilderFlag, "DIRECT_IO"):
                names.append("DIRECT_IO")
            config.set_memory_pool_limit(trt.MemoryPoolType.DLA_MANAGED_SRAM, spec.dla_sram_bytes)
        if not self.strongly_typed:
            names += ["INT8", "FP16"] if spec.calibration_cache is not None else ["FP16"]
            names.append("OBEY_PRECISION_CONSTRAINTS")  # INT8 layers stay INT8, FP16 ones FP16
        for name in names:
            config.set_flag(getattr(trt.BuilderFlag, name))
        if spec.workspace_mib is not None:
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, spec.workspace_mib * _MIB)
        if profile is not None:
            built = self.builder.create_optimization_profile()
            for name, (low, opt, high) in profile.items():
                built.set_shape(name, low, opt, high)  # DLA: min = opt = max (DLA is static)
            config.add_optimization_profile(built)
            if spec.calibration_cache is not None and not self.strongly_typed:
                # Calibration with dynamic shapes runs at the profile's opt shape; the cache
                # calibrator feeds no batches, but TensorRT needs the profile named.
                config.set_calibration_profile(built)
        return tuple(names)

    def configure_io(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
        """I/O types and allowed formats; returns tensor name -> ``type:format`` (trtexec's
        words: DLA as configured; the GPU engine ``fp16:chw``, FP16 linear, throughout)."""
        trt, spec = self.trt, self.spec
        chosen: dict[str, str] = {}
        problems: list[str] = []
        for tensors, text in (
            (self.inputs, spec.io_input_format), (self.outputs, spec.output_format),
        ):  # fmt: skip
            precision, fmt = text.split(":")
            dtype = trt.int8 if precision == "int8" else trt.float16
            for t in tensors:
                shape = shapes.get(t.name) or tuple(t.shape)
                if fmt != "dla_linear" and len(shape) < 3:
                    problems.append(f"{t.name} has rank {len(shape)}; {fmt} needs rank >= 3")
                if fmt == "dla_hwc4" and len(shape) >= 2 and shape[1] not in (1, 3, 4):
                    problems.append(f"{t.name} has {shape[1]} channels; DLA_HWC4 takes 1, 3 or 4")
                if not self.strongly_typed:
                    t.dtype = dtype
                elif t.dtype != dtype:  # TRT >= 11: the ONNX decides types; check, not override
                    problems.append(f"{t.name} is {t.dtype} in the ONNX; {text} needs {precision}")
                t.allowed_formats = 1 << int(getattr(trt.TensorFormat, _FORMAT_ENUM[fmt]))
                chosen[t.name] = text
        if problems:
            raise DlaBuildError(
                f"I/O cannot take the requested {spec.device.upper()} formats:\n  "
                + "\n  ".join(problems)
            )
        return chosen

    def apply_fp16_layers(self) -> None:
        """Pin the fp16 layers to FP16 (TRT <= 10), or check the ONNX typed them so (TRT >= 11)."""
        names, half = self.spec.fp16_layers, self.trt.float16
        layers = {
            (lay := self.network.get_layer(i)).name: lay for i in range(self.network.num_layers)
        }
        if missing := [n for n in names if n not in layers]:
            raise DlaBuildError(f"fp16 layers not in the network: {missing}")
        not_fp16 = []
        for layer in (layers[n] for n in names):
            outs = range(layer.num_outputs)
            if self.strongly_typed:
                if any(layer.get_output(i).dtype != half for i in outs):
                    not_fp16.append(layer.name)
                continue
            layer.precision = half
            for i in outs:
                layer.set_output_type(i, half)
        if not_fp16:
            raise DlaBuildError(
                f"layers {not_fp16} are not FP16 in the ONNX; TensorRT >= 11 takes precision from"
                " the ONNX (e.g. python -m modelopt.onnx.autocast --target_dla)"
            )

    def apply_int8(
        self, cache: tuple[CalibrationCache, bytes] | None, batch: int
    ) -> tuple[str, int, tuple[str, ...]]:
        """INT8 scales (TRT <= 10) from a calibrator or dynamic ranges; (mode, applied, unused)."""
        if self.strongly_typed:
            return "explicit", 0, ()
        if cache is None:
            return "none", 0, ()
        table, raw = cache
        tensors = {t.name: t for t in self.inputs}
        for i in range(self.network.num_layers):
            layer = self.network.get_layer(i)
            for j in range(layer.num_outputs):
                tensors.setdefault(layer.get_output(j).name, layer.get_output(j))
        applied = [name for name in table.scales if name in tensors]
        unused = tuple(name for name in table.scales if name not in tensors)
        if unused:
            self.notes.append(f"{len(unused)} cache scales match no network tensor: {unused[:5]}")
        code = trt_version_code(self.version)
        if table.trt_version != code:  # TRT may ignore it: regenerate with this code if so
            self.notes.append(f"cache header TRT-{table.trt_version}; this TensorRT is TRT-{code}")
        if self.spec.int8_scales == "dynamic_range":
            for name in applied:
                amax = table.scales[name] * 127.0  # the cache holds scale = amax / 127
                tensors[name].set_dynamic_range(-amax, amax)
            return "dynamic_range", len(applied), unused
        calibrator = _make_cache_calibrator(self.trt, raw, batch=batch)
        self.keep_alive.append(calibrator)
        self.config.int8_calibrator = calibrator
        return "calibrator", len(applied), unused


def _make_cache_calibrator(trt: Any, cache: bytes, *, batch: int) -> Any:
    """An ``IInt8EntropyCalibrator2`` that only replays ``cache`` (it never feeds batches)."""

    class CacheCalibrator(trt.IInt8EntropyCalibrator2):  # type: ignore[misc]
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)  # pybind11 needs the base initialised

        def get_batch_size(self) -> int:
            return max(batch, 1)

        def get_batch(self, names: list[str]) -> None:
            return None  # no data: TensorRT must take every scale from the cache

        def read_calibration_cache(self) -> bytes:
            return cache

        def write_calibration_cache(self, data: Any) -> None:
            return None  # the translator's cache is the source of truth; never overwrite it

    return CacheCalibrator()


def _make_logger(trt: Any) -> Any:
    """A ``trt.ILogger`` that keeps warnings and errors (in ``.messages``) for the report: the
    daemon's (:func:`dlad.devices.tensorrt_gpu.capturing_logger`)."""
    from dlad.devices.tensorrt_gpu import capturing_logger

    return capturing_logger(trt)


def _parser_error_text(error: Any) -> str:
    node_name = error.node_name() if hasattr(error, "node_name") else ""
    where = f"node {error.node()}" + (f" ({node_name})" if node_name else "")
    return f"{where}: {error.desc()}"


def _import_tensorrt(device: Device = "dla") -> Any:
    try:
        import tensorrt
    except (ImportError, OSError) as exc:
        what = (
            "the GPU engine is built on the device that runs it (an engine is bound to its"
            " TensorRT release and GPU): on the Jetson"
            if device == "gpu"
            else "DLA loadables are built on a Jetson Orin"
        )
        raise DlaBuildError(
            f"TensorRT is not importable here ({exc}); {what}, where JetPack installs TensorRT"
        ) from exc
    return tensorrt


def _cuda_device_count() -> int | None:
    """CUDA devices per ``cudaGetDeviceCount``; 0 if it fails, None if no libcudart loads."""
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        status = lib.cudaGetDeviceCount(ctypes.byref(count))
        return int(count.value) if status == 0 else 0
    return None


def _onnx_io(path: Path) -> tuple[list[tuple[str, tuple[int, ...]]], list[str]]:
    import onnx
    from google.protobuf.message import DecodeError  # type: ignore[import-untyped,unused-ignore]

    try:
        model = onnx.load(str(path), load_external_data=False)
    except (OSError, DecodeError) as exc:
        raise DlaSpecError(f"{path}: cannot read ONNX ({exc})") from exc
    weights = {t.name for t in model.graph.initializer}  # old exporters list them as inputs too
    inputs = [(v.name, _onnx_dims(v)) for v in model.graph.input if v.name not in weights]
    return inputs, [v.name for v in model.graph.output]


def _onnx_dims(value_info: Any) -> tuple[int, ...]:
    dims = value_info.type.tensor_type.shape.dim
    return tuple(d.dim_value if d.HasField("dim_value") else -1 for d in dims)


def _read_file(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DlaSpecError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
