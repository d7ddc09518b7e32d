"""The prep chain as stages over one work directory, each skipped when its inputs are unchanged.

::

    <workdir>/
      data/{train,val}/        images/ + annotations.json (generated, or your COCO directory)
      cache/{train,val}.npz    letterboxed to the model's input size
      train/fp32.pt            FP32 training (or an imported Ultralytics checkpoint, fine-tuned)
      qat/qat.pt               BN-folded, quantized, calibrated, QAT-fine-tuned model
      export/{fp32,qat}.onnx   raw heads s8/s16/s32; qat.onnx carries Q/DQ
      translate/               PTQ ONNX, *_precision_config.json, calibration cache, layer arg
      build/                   emulated loadables; TensorRT DLA loadables where TensorRT and a
                               DLA exist; the TensorRT GPU engine (target gpu) where TensorRT is
      validate/                mAP of FP32 and QAT (fake-quant) on the held-out images

Settings come from a TOML preset (``prep/presets/*.toml``) that maps one-to-one onto
:class:`ChainConfig`; unknown keys and wrong types are errors naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from prep.data.synth import SynthConfig
from prep.families import PREP_FAMILIES
from prep.manifest import StageRecord, read_metrics
from prep.qat import QATConfig
from prep.train import TrainConfig
from prep.validate import EvalSettings

log = logging.getLogger("prep")

PRESETS = Path(__file__).parent / "presets"
STAGES = ("data", "cache", "train", "qat", "export", "translate", "build", "validate")


class ConfigError(ValueError):
    """A preset or override that does not fit :class:`ChainConfig` (names the key)."""


@dataclass(frozen=True)
class DataConfig:
    """Where images come from. Without ``source`` a synthetic dataset is generated."""

    source: str | None = None
    val_source: str | None = None
    holdout_fraction: float = 0.1
    num_train: int = 2000
    num_val: int = 300
    seed: int = 0
    workers: int = 2
    synth: SynthConfig = field(default_factory=SynthConfig)
    """Generator knobs (``[data.synth]`` in a preset); see docs/data.md."""


@dataclass(frozen=True)
class ModelConfig:
    family: str = "yolov5"  # the model family: a name of prep.families.PREP_FAMILIES
    variant: str = "n"
    image_size: int = 320
    weights: str | None = None  # an Ultralytics checkpoint or state dict to start from


@dataclass(frozen=True)
class TranslateConfig:
    trt_version: int = 8600
    infer_concat_scales: bool = True
    infer_mul_scales: bool = True


BuildTarget = typing.Literal["emulated", "dla", "gpu"]
GPU_MAX_BATCH = 64
"""The largest ``build.max_batch`` (the GPU engine's profile; prep.build_trt's bound)."""


@dataclass(frozen=True)
class BuildConfig:
    cores: tuple[int, ...] = (0, 1)
    output_precision: str = "fp16"  # TensorRT build: "fp16" -> CHW16 heads, "int8" -> CHW32
    targets: tuple[BuildTarget, ...] = ("emulated", "dla")
    """``emulated``: dlad's emulated loadables (all head variants, every core); ``dla``:
    TensorRT DLA standalone loadables, where TensorRT and an Orin exist (else skipped); ``gpu``:
    the TensorRT GPU engine dlad's ``tensorrt`` GPU device serves (``model.gpu.engine`` and its
    JSON sidecar), where TensorRT exists (else skipped, like ``dla``). Not in the default: the
    engine is built on the device that runs it."""
    max_batch: int = 8
    """The GPU engine's largest batch (its profile is 1..max_batch; 1..64)."""
    quantization: str = "auto"
    """The TensorRT path: ``auto`` (by the TensorRT found: ``implicit`` up to 10.7, ``explicit``
    from 11; without TensorRT the commands of both are written), ``implicit`` (the stripped
    ONNX + calibration cache) or ``explicit`` (the Q/DQ ONNX)."""

    def __post_init__(self) -> None:
        if self.quantization not in ("auto", "implicit", "explicit"):
            raise ConfigError(
                f"build.quantization: {self.quantization!r} is not auto, implicit or explicit"
            )
        if not 1 <= self.max_batch <= GPU_MAX_BATCH:
            raise ConfigError(
                f"build.max_batch: {self.max_batch} is not in 1..{GPU_MAX_BATCH} (the GPU"
                " engine's optimisation profile)"
            )


@dataclass(frozen=True)
class ChainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    qat: QATConfig = field(default_factory=QATConfig)
    translate: TranslateConfig = field(default_factory=TranslateConfig)
    build: BuildConfig = field(default_factory=BuildConfig)
    validate: EvalSettings = field(default_factory=EvalSettings)


# ------------------------------------------------------------------------------------ config io
def _convert(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(names)}")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        kwargs[key] = _value(hints[key], value, f"{where}.{key}")
    return cls(**kwargs)


def _value(tp: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _convert(tp, value, where)  # type: ignore[arg-type]
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        for a in args:
            if a is type(None) and value is None:
                return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _value(a, value, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: {value!r} is not {tp}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected an array, got {value!r}")
        return tuple(_value(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp in (int, str, bool):
        if type(value) is not tp:
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp}")


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> ChainConfig:
    """Read a TOML preset (or the defaults) and apply ``{"section.key": value}`` overrides.

    Raises:
        ConfigError: unknown key, wrong type, an unknown model family, or a file that is not
            TOML.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"{path}: {e}") from None
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if not key:
            raise ConfigError(f"override {dotted!r} must be section.key")
        data.setdefault(section, {})[key] = value
    cfg = typing.cast("ChainConfig", _convert(ChainConfig, data, str(path or "defaults")))
    if cfg.model.family not in PREP_FAMILIES:
        raise ConfigError(f"{path or 'defaults'}: model.family {cfg.model.family!r} is not one "
                          f"of {list(PREP_FAMILIES)}")  # fmt: skip
    return cfg


def resolve_preset(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" and p.exists():
        return p
    candidate = PRESETS / f"{name_or_path}.toml"
    if candidate.exists():
        return candidate
    known = sorted(q.stem for q in PRESETS.glob("*.toml"))
    raise ConfigError(f"no preset {name_or_path!r}; built-in presets: {known}")


# ------------------------------------------------------------------------------------ stages
ProgressFactory = Callable[[str], Callable[[int, int, dict[str, float]], None]]


@dataclass
class Chain:
    """One work directory and its settings; ``run(stage)`` runs a stage if it is out of date."""

    workdir: Path
    cfg: ChainConfig
    progress: ProgressFactory | None = None
    force: bool = False

    def dir(self, stage: str) -> Path:
        return self.workdir / stage

    # ---- paths other stages read
    def dataset_dirs(self) -> tuple[Path, Path | None]:
        d = self.cfg.data
        if d.source is None:
            return self.dir("data") / "train", self.dir("data") / "val"
        return Path(d.source), Path(d.val_source) if d.val_source else None

    def run(self, stage: str) -> dict[str, Any]:
        """Run ``stage`` unless its manifest is current; return its metrics."""
        if stage not in STAGES:
            raise ConfigError(f"unknown stage {stage!r}; stages are {list(STAGES)}")
        record = self._record(stage)
        if not self.force and record.up_to_date():
            log.info("%s: up to date, skipped", stage)
            return read_metrics(record.out_dir)
        from prep import stages

        body = {
            "data": stages.run_data,
            "cache": stages.run_cache,
            "train": stages.run_train,
            "qat": stages.run_qat,
            "export": stages.run_export,
            "translate": stages.run_translate,
            "build": stages.run_build,
            "validate": stages.run_validate,
        }[stage]
        start = time.perf_counter()
        record.out_dir.mkdir(parents=True, exist_ok=True)
        outputs, metrics = body(self, record)
        metrics = {**metrics, "seconds": round(time.perf_counter() - start, 2)}
        record.write(outputs, metrics)
        log.info("%s: done in %.1f s", stage, metrics["seconds"])
        return metrics

    def run_all(self, until: str = "validate") -> dict[str, dict[str, Any]]:
        results = {}
        for stage in STAGES[: STAGES.index(until) + 1]:
            results[stage] = self.run(stage)
        return results

    def _record(self, stage: str) -> StageRecord:
        c = self.cfg
        settings: dict[str, Any]
        inputs: dict[str, Path] = {}
        if stage == "data":
            settings = dataclasses.asdict(c.data)
            if c.data.source is not None:
                inputs["source"] = Path(c.data.source) / "annotations.json"
        elif stage == "cache":
            settings = {"image_size": c.model.image_size, **dataclasses.asdict(c.data)}
            inputs["data"] = self.dir("data") / "manifest.json"
        elif stage == "train":
            settings = {"model": dataclasses.asdict(c.model), "train": dataclasses.asdict(c.train)}
            inputs["train_cache"] = self.dir("cache") / "train.npz"
            if c.model.weights:
                inputs["weights"] = Path(c.model.weights)
        elif stage == "qat":
            settings = dataclasses.asdict(c.qat)
            inputs = {
                "fp32": self.dir("train") / "fp32.pt",
                "train_cache": self.dir("cache") / "train.npz",
            }
        elif stage == "export":
            settings = {"image_size": c.model.image_size}
            inputs = {"fp32": self.dir("train") / "fp32.pt", "qat": self.dir("qat") / "qat.pt"}
        elif stage == "translate":
            settings = dataclasses.asdict(c.translate)
            inputs = {"qat_onnx": self.dir("export") / "qat.onnx"}
        elif stage == "build":
            settings = dataclasses.asdict(c.build)
            inputs = {
                "translate": self.dir("translate") / "manifest.json",
                "fp32": self.dir("train") / "fp32.pt",
            }
        else:  # validate
            settings = dataclasses.asdict(c.validate)
            inputs = {
                "fp32": self.dir("train") / "fp32.pt",
                "qat": self.dir("qat") / "qat.pt",
                "val_cache": self.dir("cache") / "val.npz",
                "build": self.dir("build") / "manifest.json",
            }
        missing = [str(p) for p in inputs.values() if not p.exists()]
        if missing:
            raise FileNotFoundError(
                f"stage {stage!r} needs {missing}; run the earlier stages first (prep all)"
            )
        return StageRecord(stage, self.dir(stage), inputs, settings)

    def _progress(self, name: str) -> Callable[[int, int, dict[str, float]], None] | None:
        return self.progress(name) if self.progress else None


def dump_config(cfg: ChainConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg), indent=2)
