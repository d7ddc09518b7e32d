"""Bodies of the prep stages (see ``prep.pipeline`` for the layout and the skip logic).

Each ``run_<stage>(chain, record)`` writes into ``record.out_dir`` and returns
``(outputs, metrics)``: the files to hash into the manifest and the numbers worth keeping.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from prep.manifest import StageRecord

if TYPE_CHECKING:
    from prep.pipeline import Chain

log = logging.getLogger("prep")

Result = tuple[dict[str, Path], dict[str, Any]]


def _torch_threads() -> None:
    import os

    import torch

    torch.set_num_threads(max(os.cpu_count() or 1, 1))


# ------------------------------------------------------------------------------------ data
def run_data(chain: Chain, record: StageRecord) -> Result:
    from prep.data.coco import load_coco
    from prep.data.synth import generate_dataset

    d = chain.cfg.data
    if d.source is not None:
        train = load_coco(d.source)
        metrics: dict[str, Any] = {"source": d.source, "images": len(train.images)}
        if d.val_source:
            metrics["val_images"] = len(load_coco(d.val_source).images)
        note = record.out_dir / "source.json"
        note.write_text(json.dumps({"train": d.source, "val": d.val_source}, indent=2) + "\n")
        return {"source": note}, metrics
    train_json = generate_dataset(
        record.out_dir / "train", d.num_train, d.seed, d.synth, workers=d.workers
    )
    # A different seed for the held-out images: no image of the training set can reappear.
    val_json = generate_dataset(
        record.out_dir / "val", d.num_val, d.seed + 1_000_003, d.synth, workers=d.workers
    )
    gt = json.loads(train_json.read_text())
    return (
        {"train": train_json.parent, "val": val_json.parent},
        {
            "train_images": d.num_train,
            "val_images": d.num_val,
            "train_boxes": len(gt["annotations"]),
            "classes": len(gt["categories"]),
        },
    )


def _datasets(chain: Chain) -> tuple[Any, list[int], Any, list[int]]:
    """(train dataset, train ids, val dataset, val ids) per the data settings."""
    from prep.data.coco import load_coco, split

    train_dir, val_dir = chain.dataset_dirs()
    train = load_coco(train_dir)
    if val_dir is not None:
        val = load_coco(val_dir)
        if val.category_ids != train.category_ids:
            raise ValueError(
                f"{val_dir} has categories {val.category_ids}, {train_dir} has {train.category_ids}"
            )
        return train, sorted(train.images), val, sorted(val.images)
    tr_ids, va_ids = split(train, chain.cfg.data.holdout_fraction, chain.cfg.data.seed)
    return train, list(tr_ids), train, list(va_ids)


def run_cache(chain: Chain, record: StageRecord) -> Result:
    from prep.data.coco import LetterboxedArrays

    train, tr_ids, val, va_ids = _datasets(chain)
    size = chain.cfg.model.image_size
    workers = chain.cfg.data.workers
    out = {
        "train": LetterboxedArrays.build(train, tr_ids, size, workers=workers).save(
            record.out_dir / "train.npz"
        ),
        "val": LetterboxedArrays.build(val, va_ids, size, workers=workers).save(
            record.out_dir / "val.npz"
        ),
    }
    meta = record.out_dir / "classes.json"
    meta.write_text(
        json.dumps(
            {
                "class_names": list(train.class_names),
                "category_ids": list(train.category_ids),
                "val_annotations": str(val.ann_file),
            },
            indent=2,
        )
        + "\n"
    )
    out["classes"] = meta
    return out, {"train_images": len(tr_ids), "val_images": len(va_ids), "image_size": size}


def _classes(chain: Chain) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((chain.dir("cache") / "classes.json").read_text())
    return data


def _checkpoint(chain: Chain) -> Any:
    """The trained checkpoint (``prep.train.Checkpoint``)."""
    from prep.train import load_checkpoint

    return load_checkpoint(chain.dir("train") / "fp32.pt")


# ------------------------------------------------------------------------------------ train
def run_train(chain: Chain, record: StageRecord) -> Result:
    from prep.data.coco import LetterboxedArrays
    from prep.families import prep_family
    from prep.model import count_parameters
    from prep.train import save_checkpoint, train

    _torch_threads()
    cfg = chain.cfg
    arrays = LetterboxedArrays.load(chain.dir("cache") / "train.npz")
    classes = _classes(chain)
    nc = len(classes["class_names"])
    if cfg.model.weights:
        from prep.families import import_checkpoint

        imported = import_checkpoint(cfg.model.weights)
        if imported.family != cfg.model.family or len(imported.class_names) != nc:
            raise ValueError(
                f"{cfg.model.weights} is a {imported.family} of {len(imported.class_names)} "
                f"classes; the settings say {cfg.model.family} and the dataset has {nc}"
            )
        model = imported.model
    else:
        model = prep_family(cfg.model.family).build(cfg.model.variant, nc)
    result = train(model, arrays.images, arrays.labels, cfg.train, chain._progress("train"))
    path = record.out_dir / "fp32.pt"
    save_checkpoint(
        path,
        result.model,
        image_size=cfg.model.image_size,
        class_names=classes["class_names"],
        extra={"category_ids": classes["category_ids"], "history": result.history},
    )
    return {"checkpoint": path}, {
        "parameters": count_parameters(result.model),
        "train_seconds": round(result.seconds, 1),
        "epochs_run": result.epochs,
        "final": result.history[-1] if result.history else {},
    }


# ------------------------------------------------------------------------------------ qat
def run_qat(chain: Chain, record: StageRecord) -> Result:
    import copy

    from prep import qat
    from prep.data.coco import LetterboxedArrays
    from prep.train import resolve_device

    _torch_threads()
    cfg = chain.cfg.qat
    ckpt = _checkpoint(chain)
    model = ckpt.model
    arrays = LetterboxedArrays.load(chain.dir("cache") / "train.npz")
    device = resolve_device(cfg.device)
    qmodel, groups = qat.quantize(model, cfg)
    qmodel.to(device)
    draw = qat.batch_sampler(arrays.images, cfg.batch_size, cfg.seed, str(device))
    n_cal = qat.calibrate(qmodel, (draw() for _ in range(cfg.calib_batches)), cfg.calib_method)
    if cfg.quantize_heads and not cfg.train_head_quant:
        qat.set_head_output_quant(qmodel, False)
    teacher = copy.deepcopy(model).eval().fuse().to(device)
    history = qat.finetune(qmodel, teacher, draw, cfg, progress=chain._progress("qat"))
    qat.refresh_weight_amax(qmodel)
    qmodel.cpu()
    path = record.out_dir / "qat.pt"
    qat.save_qat(
        path,
        qmodel,
        cfg,
        extra={
            "image_size": ckpt.image_size,
            "class_names": ckpt.class_names,
            "category_ids": ckpt.extra.get("category_ids"),
            "history": history,
        },
    )
    groups_path = record.out_dir / "shared_quantizers.json"
    groups_path.write_text(json.dumps(groups, indent=2) + "\n")
    return {"checkpoint": path, "groups": groups_path}, {
        **qat.quantizer_summary(qmodel),
        "calibrated": n_cal,
        "shared_groups": len(groups),
        "history": history,
    }


# ------------------------------------------------------------------------------------ export
def run_export(chain: Chain, record: StageRecord) -> Result:
    import copy

    from prep.export import count_ops, export_onnx
    from prep.qat import load_qat, set_head_output_quant

    ckpt = _checkpoint(chain)
    qmodel, _ = load_qat(chain.dir("qat") / "qat.pt")
    # Head-output Q/DQ always goes into the export: it gives the translator the heads' scales.
    set_head_output_quant(qmodel, True)
    size = ckpt.image_size
    fp32 = export_onnx(copy.deepcopy(ckpt.model).fuse(), record.out_dir / "fp32.onnx", size)
    qdq = export_onnx(qmodel, record.out_dir / "qat.onnx", size)
    return (
        {"fp32": record.out_dir / "fp32.onnx", "qat": record.out_dir / "qat.onnx"},
        {"fp32_ops": count_ops(fp32), "qat_ops": count_ops(qdq)},
    )


# ------------------------------------------------------------------------------------ translate
def run_translate(chain: Chain, record: StageRecord) -> Result:
    from prep.translate import translate, write_outputs

    t = chain.cfg.translate
    result = translate(
        chain.dir("export") / "qat.onnx",
        infer_concat_scales=t.infer_concat_scales,
        infer_mul_scales=t.infer_mul_scales,
        extra_ops=("Resize", "Split"),
        trt_version=t.trt_version,
    )
    paths = write_outputs(result, record.out_dir, "model")
    report = result.report
    return (
        {
            "onnx": paths.onnx,
            "precision_config": paths.precision_config,
            "calibration_cache": paths.calibration_cache,
            "layer_arg": paths.layer_arg,
        },
        {
            "int8_tensor_scales": len(result.int8_tensor_scales),
            "inferred": len(report.inferred),
            "missing": result.missing,
            "fp16_nodes": result.fp16_nodes,
            "activation_quantizers": report.activation_quantizers,
            "weight_quantizers": report.weight_quantizers,
        },
    )


# ------------------------------------------------------------------------------------ build
def _model_info(ckpt: Any) -> Any:
    """What the emulated build and the decode read of the trained checkpoint's model."""
    from prep.emulated_build import ModelInfo
    from prep.model import STRIDES, YOLOv5

    model = ckpt.model
    yolov5 = isinstance(model, YOLOv5)
    anchors = model.anchors_px.tolist() if yolov5 else []
    return ModelInfo(
        num_classes=model.num_classes,
        class_names=tuple(ckpt.class_names),
        anchors_px=tuple(tuple((float(w), float(h)) for w, h in level) for level in anchors),
        strides=STRIDES if yolov5 else tuple(int(s) for s in model.stride),
        image_size=ckpt.image_size,
        family=ckpt.family,
    )


def run_build(chain: Chain, record: StageRecord) -> Result:
    """Emulated loadables (every head variant, every core) and, where TensorRT exists, TensorRT
    DLA standalone loadables (target ``dla``) and the TensorRT GPU engine (target ``gpu``);
    elsewhere the trtexec commands a user with an Orin runs."""
    b = chain.cfg.build
    outputs: dict[str, Path] = {}
    metrics: dict[str, Any] = {}
    if "emulated" in b.targets:
        from dlad.loadable import read_loadable
        from prep.emulated_build import build_variants, head_variants

        info = _model_info(_checkpoint(chain))
        paths = build_variants(
            chain.dir("translate"),
            info,
            record.out_dir,
            cores=b.cores,
            provenance={"translate": _manifest_fingerprint(chain, "translate")},
        )
        outputs.update(paths)
        metrics["emulated"] = {
            v.name: {
                "latency_us": read_loadable(paths[f"{v.name}.dla{b.cores[0]}"]).latency_us,
                "bytes": paths[f"{v.name}.dla{b.cores[0]}"].stat().st_size,
            }
            for v in head_variants(info.family)
        }
    if "dla" in b.targets or "gpu" in b.targets:
        trt_outputs, trt_metrics = _build_trt(chain, record)
        outputs.update(trt_outputs)
        metrics.update(trt_metrics)
    return outputs, metrics


def _manifest_fingerprint(chain: Chain, stage: str) -> str:
    data: dict[str, Any] = json.loads((chain.dir(stage) / "manifest.json").read_text())
    return str(data["fingerprint"])


def _build_trt(chain: Chain, record: StageRecord) -> Result:
    """The TensorRT targets: ``model.dla<N>.loadable`` per core (``dla``) and
    ``model.gpu.engine`` with its sidecar (``gpu``; built from ``model_gpu.onnx``, the
    translator's ONNX with a dynamic batch, which the trtexec command reads too). The path
    follows the TensorRT found (``prep.build_trt.quantization_for``): up to 10.7 the stripped
    ONNX + calibration cache (``implicit``), from 11 the Q/DQ ONNX ``model_qdq.onnx`` (and
    ``model_gpu_qdq.onnx``; ``explicit``, ``prep.explicit_qdq``). The trtexec commands always go
    to ``trtexec_commands.json`` (explicit ones keyed ``<target>_explicit``); without TensorRT
    nothing is built (a warning, and ``skipped`` in the metrics) and the DLA's commands of both
    paths are written, for the JetPack that runs them."""
    from prep.build_trt import (
        DlaBuildSpec,
        QuantizationChoice,
        build_dla_loadable,
        load_fp16_layers,
        quantization_for,
        tensorrt_available,
        trtexec_command,
        write_dynamic_batch_onnx,
    )
    from prep.explicit_qdq import write_explicit_onnx

    tdir, out_dir = chain.dir("translate"), record.out_dir
    b = chain.cfg.build
    ptq, cache = tdir / "model_noqdq.onnx", tdir / "model_precision_config_calib.cache"
    fp16 = load_fp16_layers(tdir / "model_precision_config.json")
    version = tensorrt_available()
    asked = cast("QuantizationChoice", b.quantization)
    if version is not None:
        modes: tuple[str, ...] = (quantization_for(version, asked),)
    else:
        modes = ("implicit", "explicit") if asked == "auto" else (asked,)
    jobs: dict[str, tuple[DlaBuildSpec, Path]] = {}
    outputs: dict[str, Path] = {}
    for mode in modes:
        explicit = mode == "explicit"
        common: dict[str, Any] = {
            "calibration_cache": None if explicit else cache, "fp16_layers": fp16,
            "quantization": mode,
        }  # fmt: skip
        key = "{}_explicit" if explicit else "{}"
        if "dla" in b.targets:
            dla_onnx = ptq
            if explicit:
                dla_onnx = write_explicit_onnx(
                    ptq, cache, fp16, out_dir / "model_qdq.onnx",
                    output_precision=b.output_precision,  # type: ignore[arg-type]
                )  # fmt: skip
                outputs["qdq_onnx"] = dla_onnx
            for core in b.cores:
                spec = DlaBuildSpec(
                    onnx_path=dla_onnx,
                    dla_core=core,
                    output_precision=b.output_precision,  # type: ignore[arg-type]
                    **common,
                )
                jobs[key.format(f"dla{core}")] = (spec, out_dir / f"model.dla{core}.loadable")
        # The GPU engine is built where it runs, by the TensorRT there: its path is that one's.
        if "gpu" in b.targets and (version is not None or not explicit):
            if explicit:
                gpu_onnx = write_explicit_onnx(
                    ptq, cache, fp16, out_dir / "model_gpu_qdq.onnx", device="gpu"
                )
                outputs["gpu_qdq_onnx"] = gpu_onnx
            else:
                gpu_onnx = write_dynamic_batch_onnx(ptq, out_dir / "model_gpu.onnx")
                outputs["gpu_onnx"] = gpu_onnx
            spec = DlaBuildSpec(onnx_path=gpu_onnx, device="gpu", max_batch=b.max_batch, **common)
            jobs[key.format("gpu")] = (spec, out_dir / "model.gpu.engine")
    commands = {key: trtexec_command(spec, out) for key, (spec, out) in jobs.items()}
    cmd_path = out_dir / "trtexec_commands.json"
    cmd_path.write_text(json.dumps(commands, indent=2) + "\n")
    outputs["trtexec_commands"] = cmd_path
    if version is None:
        log.warning(
            "build: TensorRT is not installed here; not built: %s. DLA loadables need a Jetson "
            "Orin, and the GPU engine is built on the device that runs it (the trtexec commands "
            "are in %s: TensorRT <= 10.7 runs the plain keys, >= 11.4.1 the *_explicit ones)",
            ", ".join(jobs),
            cmd_path,
        )
        return outputs, {"tensorrt": None, "built": [], "skipped": "TensorRT not installed"}
    built = []
    for key, (spec, out) in jobs.items():
        report = build_dla_loadable(spec, out)
        outputs[key] = out
        if report.metadata_path is not None:
            outputs[f"{key}_metadata"] = report.metadata_path
        built.append(report.to_dict())
    return outputs, {"tensorrt": version, "quantization": modes[0], "built": built}


# ------------------------------------------------------------------------------------ validate
def run_validate(chain: Chain, record: StageRecord) -> Result:
    """mAP of FP32 (torch), QAT fake-quant (torch) and the INT8 emulated DLA for every head
    variant, all on the same held-out images through the same post-processing and evaluator;
    each emulated row also carries the loadable's modelled DLA latency."""
    from dlad.loadable import read_loadable
    from prep.data.coco import LetterboxedArrays
    from prep.emulated_build import head_variants
    from prep.qat import load_qat
    from prep.train import resolve_device
    from prep.validate import HeadsFn, emulated_heads, evaluate, postprocessor, torch_heads

    _torch_threads()
    settings = chain.cfg.validate
    classes = _classes(chain)
    arrays = LetterboxedArrays.load(chain.dir("cache") / "val.npz")
    gt = json.loads(Path(classes["val_annotations"]).read_text())
    ckpt = _checkpoint(chain)
    model = ckpt.model
    qmodel, _ = load_qat(chain.dir("qat") / "qat.pt")
    info = _model_info(ckpt)
    post = postprocessor(info, settings)
    device = str(resolve_device(chain.cfg.train.device))
    runs: list[tuple[str, HeadsFn, float | None]] = [
        ("fp32", torch_heads(model, device), None),
        ("qat_fakequant", torch_heads(qmodel, device), None),
    ]
    core = chain.cfg.build.cores[0]
    if "emulated" in chain.cfg.build.targets:
        for variant in head_variants(info.family):
            loadable = read_loadable(chain.dir("build") / f"{variant.name}.dla{core}.emu")
            runs.append(
                (f"int8_emulated_{variant.name}", emulated_heads(loadable), loadable.latency_us)
            )
    rows: dict[str, dict[str, Any]] = {}
    for name, heads, latency_us in runs:
        res = evaluate(heads, arrays, gt, classes["category_ids"], post, settings=settings)
        rows[name] = {
            "map50_95": res.map50_95,
            "map50": res.map50,
            "images": res.num_images,
            "detections": res.num_detections,
        }
        if latency_us is not None:
            rows[name]["modelled_dla_latency_ms"] = round(latency_us / 1000, 3)
        log.info("validate %s: mAP@[.5:.95] %.4f  mAP@.5 %.4f", name, res.map50_95, res.map50)
    base = rows["fp32"]["map50_95"]
    metrics = {
        "rows": rows,
        "minus_fp32_map50_95": {k: v["map50_95"] - base for k, v in rows.items() if k != "fp32"},
    }
    path = record.out_dir / "metrics.json"
    path.write_text(json.dumps(metrics, indent=2) + "\n")
    return {"metrics": path}, metrics
