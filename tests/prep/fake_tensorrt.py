"""A recording stand-in for the subset of the ``tensorrt`` module that prep/build_trt.py uses.

Full TensorRT cannot be installed on the project's machines and DLA builds need a Jetson Orin, so
the builder-configuration code is tested against this fake. It is strict where that catches real
mistakes:

* enum names and values follow the TensorRT headers (TensorFormat and DataType from
  NvInferRuntimeBase.h, BuilderFlag per release line: 8.6 has STRICT_TYPES=4, 10.x renumbers
  without it, 11.x drops FP16/INT8/OBEY/PREFER and, before 11.4.1, DIRECT_IO);
* objects accept only attribute names the real bindings have (a typo such as ``config.dla_core``
  raises AttributeError), and TensorRT 11 objects lack the removed weak-typing API
  (``int8_calibrator``, ``set_dynamic_range``, ``IInt8EntropyCalibrator2``);
* the parser reads the real ONNX with ``onnx``: network inputs, outputs and one layer per node,
  with ONNX names, shapes (-1 for dynamic dims) and element types from shape inference;
* the builder refuses, with TensorRT's errors, a network with dynamic inputs and no optimisation
  profile, a profile that misses a dynamic input or does not fit it (rank, fixed dims,
  min <= opt <= max), a dynamic profile on DLA standalone, and INT8 calibration of a dynamic
  network without a calibration profile;
* from TensorRT 11 the parser refuses a QuantizeLinear/DequantizeLinear whose scale is not a
  float32 constant or whose zero point is not int8 0 (11.4.1's DLA pages: "The scale must be
  FP32"; UINT8 and asymmetric Q/DQ need ``kENABLE_UINT8_AND_ASYMMETRIC_QUANTIZATION_DLA``);
* ``Runtime`` exists but records and raises: the product must never create one.

Every attribute set and method call is appended to ``FakeTensorRT.calls`` as a :class:`Call`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import onnx
from onnx import numpy_helper


class TensorFormat(enum.IntEnum):
    LINEAR = 0
    CHW2 = 1
    HWC8 = 2
    CHW4 = 3
    CHW16 = 4
    CHW32 = 5
    DHWC8 = 6
    CDHW32 = 7
    HWC = 8
    DLA_LINEAR = 9
    DLA_HWC4 = 10
    HWC16 = 11
    DHWC = 12


class DeviceType(enum.IntEnum):
    GPU = 0
    DLA = 1


class EngineCapability(enum.IntEnum):
    STANDARD = 0
    SAFETY = 1
    DLA_STANDALONE = 2


class DataType(enum.IntEnum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9


class MemoryPoolType(enum.IntEnum):
    WORKSPACE = 0
    DLA_MANAGED_SRAM = 1
    DLA_LOCAL_DRAM = 2
    DLA_GLOBAL_DRAM = 3
    TACTIC_DRAM = 4
    TACTIC_SHARED_MEMORY = 5


class CalibrationAlgoType(enum.IntEnum):
    LEGACY_CALIBRATION = 0
    ENTROPY_CALIBRATION = 1
    ENTROPY_CALIBRATION_2 = 2
    MINMAX_CALIBRATION = 3


class Severity(enum.IntEnum):
    INTERNAL_ERROR = 0
    ERROR = 1
    WARNING = 2
    INFO = 3
    VERBOSE = 4


# BuilderFlag members in value order (index = value). 8.6 from NvInfer.h 8.6 (STRICT_TYPES=4);
# 10.x per NvInfer.h 10 (STRICT_TYPES and ENABLE_TACTIC_HEURISTIC gone, so everything shifts).
_FLAGS_8_6 = [
    "FP16", "INT8", "DEBUG", "GPU_FALLBACK", "STRICT_TYPES", "REFIT", "DISABLE_TIMING_CACHE",
    "TF32", "SPARSE_WEIGHTS", "SAFETY_SCOPE", "OBEY_PRECISION_CONSTRAINTS",
    "PREFER_PRECISION_CONSTRAINTS", "DIRECT_IO", "REJECT_EMPTY_ALGORITHMS",
    "ENABLE_TACTIC_HEURISTIC", "VERSION_COMPATIBLE", "EXCLUDE_LEAN_RUNTIME", "FP8",
]  # fmt: skip
_FLAGS_10 = [
    "FP16", "INT8", "DEBUG", "GPU_FALLBACK", "REFIT", "DISABLE_TIMING_CACHE", "TF32",
    "SPARSE_WEIGHTS", "SAFETY_SCOPE", "OBEY_PRECISION_CONSTRAINTS", "PREFER_PRECISION_CONSTRAINTS",
    "DIRECT_IO", "REJECT_EMPTY_ALGORITHMS", "VERSION_COMPATIBLE", "EXCLUDE_LEAN_RUNTIME", "FP8",
    "ERROR_ON_TIMING_CACHE_MISS", "BF16",
]  # fmt: skip
_REMOVED_IN_11 = {"FP16", "INT8", "OBEY_PRECISION_CONSTRAINTS", "PREFER_PRECISION_CONSTRAINTS"}
_ONNX_TO_TRT: dict[int, DataType] = {
    onnx.TensorProto.FLOAT: DataType.FLOAT,
    onnx.TensorProto.FLOAT16: DataType.HALF,
    onnx.TensorProto.INT8: DataType.INT8,
    onnx.TensorProto.UINT8: DataType.UINT8,
    onnx.TensorProto.INT32: DataType.INT32,
    onnx.TensorProto.INT64: DataType.INT64,
    onnx.TensorProto.BOOL: DataType.BOOL,
}


@dataclass(frozen=True)
class Call:
    """One recorded interaction: ``target`` object kind, ``op`` (method or ``attr=``), args."""

    target: str
    op: str
    args: tuple[Any, ...]


class _Recorded:
    """Records public attribute sets; rejects names the real binding does not have."""

    _kind = "object"
    _settable: frozenset[str] = frozenset()
    _trt: FakeTensorRT

    def __init__(self, trt: FakeTensorRT) -> None:
        self._trt = trt

    def __setattr__(self, name: str, value: Any) -> None:
        # Before _frozen (set at the end of each __init__) the fake builds its own state.
        if not name.startswith("_") and self.__dict__.get("_frozen", False):
            if name not in self._settable:
                raise AttributeError(f"tensorrt {self._kind} has no settable attribute {name!r}")
            self._trt.calls.append(Call(self._kind, f"{name}=", (value,)))
        object.__setattr__(self, name, value)

    def _record(self, op: str, *args: Any) -> None:
        self._trt.calls.append(Call(self._kind, op, args))


class FakeTensor(_Recorded):
    _kind = "tensor"
    _settable = frozenset({"name", "dtype", "allowed_formats", "shape"})

    def __init__(
        self, trt: FakeTensorRT, name: str, dtype: DataType, shape: tuple[int, ...]
    ) -> None:
        super().__init__(trt)
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.allowed_formats = (1 << len(TensorFormat)) - 1  # TensorRT's default: any format
        self._dynamic_range: tuple[float, float] | None = None
        self._frozen = True

    def __getattr__(self, name: str) -> Any:
        if name == "set_dynamic_range" and self._trt.major < 11:
            return self._set_dynamic_range
        if name == "dynamic_range" and self._trt.major < 11:
            return self._dynamic_range
        raise AttributeError(name)

    def _set_dynamic_range(self, low: float, high: float) -> bool:
        self._record("set_dynamic_range", self.name, low, high)
        self._dynamic_range = (low, high)
        return True


class FakeLayer(_Recorded):
    _kind = "layer"
    _settable = frozenset({"name", "precision"})

    def __init__(self, trt: FakeTensorRT, name: str, op: str, outputs: list[FakeTensor]) -> None:
        super().__init__(trt)
        self.name = name
        self.precision = DataType.FLOAT
        self.type_name = op
        self.outputs = outputs
        self.output_types: dict[int, DataType] = {}
        self._frozen = True

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "precision" and self._trt.major >= 11 and self.__dict__.get("_frozen"):
            raise RuntimeError("strongly typed network: layer precision cannot be set")
        super().__setattr__(name, value)

    @property
    def num_outputs(self) -> int:
        return len(self.outputs)

    def get_output(self, index: int) -> FakeTensor:
        return self.outputs[index]

    def set_output_type(self, index: int, dtype: DataType) -> None:
        if self._trt.major >= 11:
            raise RuntimeError("strongly typed network: output types cannot be set")
        self._record("set_output_type", self.name, index, dtype)
        self.output_types[index] = dtype


class FakeNetwork(_Recorded):
    _kind = "network"

    def __init__(self, trt: FakeTensorRT, flags: int) -> None:
        super().__init__(trt)
        self.flags = flags
        self.inputs: list[FakeTensor] = []
        self.outputs: list[FakeTensor] = []
        self.layers: list[FakeLayer] = []
        self._frozen = True

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    @property
    def num_outputs(self) -> int:
        return len(self.outputs)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def get_input(self, index: int) -> FakeTensor:
        return self.inputs[index]

    def get_output(self, index: int) -> FakeTensor:
        return self.outputs[index]

    def get_layer(self, index: int) -> FakeLayer:
        return self.layers[index]


class FakeParserError:
    def __init__(self, node: int, node_name: str, desc: str) -> None:
        self._node, self._node_name, self._desc = node, node_name, desc

    def node(self) -> int:
        return self._node

    def node_name(self) -> str:
        return self._node_name

    def desc(self) -> str:
        return self._desc


class FakeOnnxParser(_Recorded):
    _kind = "parser"

    def __init__(self, trt: FakeTensorRT, network: FakeNetwork, logger: Any) -> None:
        super().__init__(trt)
        self.network = network
        self.errors: list[FakeParserError] = []
        self._frozen = True

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, index: int) -> FakeParserError:
        return self.errors[index]

    def parse(self, model: bytes, path: str | None = None) -> bool:
        self._record("parse", len(model), path)
        try:
            proto = onnx.shape_inference.infer_shapes(onnx.load_from_string(bytes(model)))
        except Exception as exc:  # noqa: BLE001 - like the real parser: any failure is a parse error
            self.errors.append(FakeParserError(-1, "", f"failed to parse ONNX model: {exc}"))
            return False
        graph = proto.graph
        weights = {t.name: t for t in graph.initializer}
        infos = {v.name: v for v in [*graph.input, *graph.value_info, *graph.output]}
        tensors: dict[str, FakeTensor] = {}

        def make(name: str) -> FakeTensor:
            info = infos.get(name)
            ttype = info.type.tensor_type if info is not None else None
            dims = tuple(
                d.dim_value if d.HasField("dim_value") else -1
                for d in (ttype.shape.dim if ttype is not None else [])
            )
            elem = int(ttype.elem_type) if ttype is not None else onnx.TensorProto.FLOAT
            dtype = _ONNX_TO_TRT.get(elem, DataType.FLOAT)
            tensors[name] = FakeTensor(self._trt, name, dtype, dims)
            return tensors[name]

        for value in graph.input:
            if value.name not in weights:
                self.network.inputs.append(make(value.name))
        for index, node in enumerate(graph.node):
            name = node.name or f"node_of_{node.output[0]}"
            if node.op_type in self._trt.unsupported_ops:
                self.errors.append(
                    FakeParserError(index, name, f"No importer registered for op: {node.op_type}")
                )
                return False
            if problem := self._qdq_problem(node, weights):
                self.errors.append(FakeParserError(index, name, problem))
                return False
            outputs = [make(out) for out in node.output]
            self.network.layers.append(FakeLayer(self._trt, name, node.op_type, outputs))
        self.network.outputs.extend(tensors[v.name] for v in graph.output)
        return True

    def _qdq_problem(self, node: Any, weights: dict[str, Any]) -> str | None:
        if self._trt.major < 11 or node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            return None
        scale = weights.get(node.input[1]) if len(node.input) > 1 else None
        if scale is None or scale.data_type != onnx.TensorProto.FLOAT:
            return "Q/DQ scale must be an FP32 constant"
        zp = weights.get(node.input[2]) if len(node.input) > 2 else None
        if zp is None or zp.data_type != onnx.TensorProto.INT8:
            return "UINT8 / asymmetric Q/DQ need kENABLE_UINT8_AND_ASYMMETRIC_QUANTIZATION_DLA"
        if any(numpy_helper.to_array(zp).ravel() != 0):
            return "asymmetric Q/DQ need kENABLE_UINT8_AND_ASYMMETRIC_QUANTIZATION_DLA"
        return None


class FakeOptimizationProfile(_Recorded):
    _kind = "profile"

    def __init__(self, trt: FakeTensorRT) -> None:
        super().__init__(trt)
        self.shapes: dict[str, tuple[tuple[int, ...], ...]] = {}
        self._frozen = True

    def set_shape(self, name: str, low: Any, opt: Any, high: Any) -> None:
        self._record("set_shape", name, tuple(low), tuple(opt), tuple(high))
        self.shapes[name] = (tuple(low), tuple(opt), tuple(high))


class FakeBuilderConfig(_Recorded):
    _kind = "config"

    def __init__(self, trt: FakeTensorRT) -> None:
        settable = {"default_device_type", "DLA_core", "engine_capability"}
        if trt.major < 11:
            settable.add("int8_calibrator")
        object.__setattr__(self, "_settable", frozenset(settable))
        super().__init__(trt)
        self.default_device_type = DeviceType.GPU
        self.DLA_core = -1
        self.engine_capability = EngineCapability.STANDARD
        self.int8_calibrator: Any = None
        self.flag_set: set[Any] = set()
        self.pool_limits: dict[MemoryPoolType, int] = {}
        self.profiles: list[FakeOptimizationProfile] = []
        self.calibration_profile: list[FakeOptimizationProfile] = []
        self._frozen = True

    def set_flag(self, flag: Any) -> None:
        self._record("set_flag", flag)
        self.flag_set.add(flag)

    def clear_flag(self, flag: Any) -> None:
        self._record("clear_flag", flag)
        self.flag_set.discard(flag)

    def get_flag(self, flag: Any) -> bool:
        return flag in self.flag_set

    def set_memory_pool_limit(self, pool: MemoryPoolType, size: int) -> None:
        self._record("set_memory_pool_limit", pool, size)
        self.pool_limits[pool] = size

    def add_optimization_profile(self, profile: FakeOptimizationProfile) -> int:
        self._record("add_optimization_profile", profile)
        self.profiles.append(profile)
        return len(self.profiles) - 1

    def __getattr__(self, name: str) -> Any:
        if name == "set_calibration_profile" and self._trt.major < 11:
            return self._set_calibration_profile
        raise AttributeError(name)

    def _set_calibration_profile(self, profile: FakeOptimizationProfile) -> None:
        self._record("set_calibration_profile", profile)
        self.calibration_profile.append(profile)


class FakeHostMemory(bytes):
    """What ``build_serialized_network`` returns: bytes with the buffer protocol."""

    @property
    def nbytes(self) -> int:
        return len(self)


class FakeBuilder(_Recorded):
    _kind = "builder"

    def __init__(self, trt: FakeTensorRT, logger: Any) -> None:
        super().__init__(trt)
        self.logger = logger
        self._frozen = True

    @property
    def num_DLA_cores(self) -> int:
        return self._trt.num_dla_cores

    def create_network(self, flags: int = 0) -> FakeNetwork:
        self._record("create_network", flags)
        self._trt.network = FakeNetwork(self._trt, flags)
        return self._trt.network

    def create_builder_config(self) -> FakeBuilderConfig:
        self._record("create_builder_config")
        self._trt.config = FakeBuilderConfig(self._trt)
        return self._trt.config

    def create_optimization_profile(self) -> FakeOptimizationProfile:
        self._record("create_optimization_profile")
        return FakeOptimizationProfile(self._trt)

    def build_serialized_network(
        self, network: FakeNetwork, config: FakeBuilderConfig
    ) -> FakeHostMemory | None:
        """Fails like TensorRT on a few real misconfigurations; reads the calibrator's cache."""
        self._record("build_serialized_network", network, config)
        trt, error = self._trt, int(Severity.ERROR)
        if config.engine_capability == EngineCapability.DLA_STANDALONE:
            if config.default_device_type != DeviceType.DLA:
                self.logger.log(error, "DLA standalone needs default device type DLA")
                return None
            if trt.BuilderFlag.GPU_FALLBACK in config.flag_set:
                self.logger.log(error, "GPU fallback cannot be enabled in DLA standalone mode")
                return None
        if problem := _profile_problem(network, config):
            self.logger.log(error, problem)
            return None
        calibrator = config.int8_calibrator
        if calibrator is not None:
            trt.cache_read = calibrator.read_calibration_cache()
            trt.batch_read = calibrator.get_batch([t.name for t in network.inputs])
        self.logger.log(int(Severity.WARNING), "fake builder: nothing was compiled")
        if trt.build_error is not None:
            self.logger.log(error, trt.build_error)
            return None
        if config.engine_capability == EngineCapability.DLA_STANDALONE:
            trt.blob = FakeHostMemory(f"FAKE-LOADABLE core={config.DLA_core}".encode())
        else:
            trt.blob = FakeHostMemory(b"FAKE-ENGINE gpu")
        return trt.blob


def _profile_problem(network: FakeNetwork, config: FakeBuilderConfig) -> str | None:
    """TensorRT's complaint about the network's dynamic inputs and the config's profiles."""
    dynamic = [t for t in network.inputs if any(d < 0 for d in t.shape)]
    if not dynamic:
        return None
    if not config.profiles:
        return (
            "4: [network.cpp::validate] Network has dynamic or shape inputs, but no optimization"
            " profile has been defined."
        )
    for profile in config.profiles:
        for t in dynamic:
            if t.name not in profile.shapes:
                return f"4: [network.cpp::validate] optimization profile is missing {t.name}"
            low, opt, high = profile.shapes[t.name]
            fits = all(len(s) == len(t.shape) for s in (low, opt, high)) and all(
                (d < 0 or lo == op == hi == d) and 1 <= lo <= op <= hi
                for d, lo, op, hi in zip(t.shape, low, opt, high, strict=True)
            )
            if not fits:
                return (
                    f"4: [shapeMachine.cpp] profile {low}/{opt}/{high} does not fit {t.name}"
                    f" {t.shape}"
                )
            if config.engine_capability == EngineCapability.DLA_STANDALONE and low != high:
                return f"DLA standalone needs static shapes: {t.name} has {low}..{high}"
    if config.int8_calibrator is not None and not config.calibration_profile:
        return "4: [network.cpp::validate] Calibration profile must be set for dynamic shapes"
    return None


class FakeILogger:
    Severity = Severity

    def __init__(self) -> None:
        pass

    def log(self, severity: Any, msg: str) -> None:
        raise NotImplementedError


class FakeIInt8EntropyCalibrator2:
    def __init__(self) -> None:
        pass

    def get_algorithm(self) -> CalibrationAlgoType:
        return CalibrationAlgoType.ENTROPY_CALIBRATION_2


class FakeTensorRT:
    """Module-like stand-in; attributes mirror ``tensorrt`` for the given version.

    ``unsupported_ops`` makes the parser fail on those ONNX op types; ``build_error`` makes
    ``build_serialized_network`` log that error and return None. After a run, ``network``,
    ``config``, ``blob``, ``cache_read`` and ``calls`` hold what the code under test did.
    """

    def __init__(
        self,
        version: str = "10.3.0.30",
        *,
        num_dla_cores: int = 2,
        unsupported_ops: frozenset[str] = frozenset(),
        build_error: str | None = None,
        direct_io_in_11: bool = True,
    ) -> None:
        self.__version__ = version
        head = version.partition(".")[0]
        self.major = int(head) if head.isdigit() else 10  # unreadable versions: any API will do
        self.num_dla_cores = num_dla_cores
        self.unsupported_ops = unsupported_ops
        self.build_error = build_error
        self.calls: list[Call] = []
        self.network: FakeNetwork | None = None
        self.config: FakeBuilderConfig | None = None
        self.blob: FakeHostMemory | None = None
        self.cache_read: Any = None
        self.batch_read: Any = "not called"

        names = _FLAGS_8_6 if self.major < 10 else _FLAGS_10
        if self.major >= 11:
            drop = _REMOVED_IN_11 | (set() if direct_io_in_11 else {"DIRECT_IO"})
            names = [n for n in names if n not in drop]
        values = _FLAGS_8_6 if self.major < 10 else _FLAGS_10
        self.BuilderFlag = enum.IntEnum("BuilderFlag", {n: values.index(n) for n in names})  # type: ignore[misc]
        creation = {"EXPLICIT_BATCH": 0, "EXPLICIT_PRECISION": 1}
        if self.major >= 10:  # 10 adds STRONGLY_TYPED in slot 1; 11 ignores it (always strong)
            creation = {"EXPLICIT_BATCH": 0, "STRONGLY_TYPED": 1}
        if self.major >= 11:
            creation = {"STRONGLY_TYPED": 1}
        self.NetworkDefinitionCreationFlag = enum.IntEnum("NetworkDefinitionCreationFlag", creation)  # type: ignore[misc]
        self.TensorFormat = TensorFormat
        self.DeviceType = DeviceType
        self.EngineCapability = EngineCapability
        self.DataType = DataType
        self.MemoryPoolType = MemoryPoolType
        self.CalibrationAlgoType = CalibrationAlgoType
        self.float32, self.float16, self.int8 = DataType.FLOAT, DataType.HALF, DataType.INT8
        self.int32, self.bool, self.uint8 = DataType.INT32, DataType.BOOL, DataType.UINT8
        self.ILogger = FakeILogger
        if self.major < 11:
            self.IInt8EntropyCalibrator2 = FakeIInt8EntropyCalibrator2

    def Builder(self, logger: Any) -> FakeBuilder:
        self.calls.append(Call("trt", "Builder", (logger,)))
        if not isinstance(logger, FakeILogger):
            raise TypeError("Builder needs a tensorrt.ILogger")
        return FakeBuilder(self, logger)

    def OnnxParser(self, network: FakeNetwork, logger: Any) -> FakeOnnxParser:
        self.calls.append(Call("trt", "OnnxParser", (network, logger)))
        return FakeOnnxParser(self, network, logger)

    def Runtime(self, logger: Any) -> None:
        self.calls.append(Call("trt", "Runtime", (logger,)))
        raise AssertionError("trt.Runtime must never be created by the build path")

    def calls_to(self, target: str, op: str) -> list[tuple[Any, ...]]:
        """Arguments of every recorded ``target.op`` call, in order."""
        return [c.args for c in self.calls if c.target == target and c.op == op]
