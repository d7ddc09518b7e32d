"""``prep``: the offline half of dlad, one subcommand per stage plus ``all``.

Every stage reads and writes one work directory (``--workdir``), takes its settings from a
preset (``--preset demo``, a TOML file, see ``prep/presets/``) with ``--set section.key=value``
overrides, writes a manifest beside its outputs and is skipped when nothing it depends on
changed (``--force`` runs it anyway).

``prep translate --onnx FILE`` and ``prep build --onnx FILE`` also work on files made elsewhere
(e.g. a QAT ONNX from NVIDIA's sample). ``prep torch-export --loadable X.emu --out X.pt2`` writes
the torch GPU engine's program from an emulated loadable (``prep.torch_export``); it takes no
work directory or preset.

Exit status: 0 success, 1 a stage failed, 2 bad arguments or settings, or a package of the
``[prep]`` extra that the command needs is not installed (the message says how to install it).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import tomllib

from prep import check_dla, import_cmd, profile_cmd
from prep.extras import missing_extra_message

STAGES = ("data", "cache", "train", "qat", "export", "translate", "build", "validate")

log = logging.getLogger("prep")


def _parse_set(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"prep: --set needs section.key=value, got {item!r}")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # a bare word is a string: --set model.variant=s
        out[key.strip()] = value
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prep",
        description="Prepare a YOLOv5 detector for dlad: data, train, QAT, export, "
        "Q/DQ translation, DLA build, validation.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--workdir", type=Path, default=Path("runs/demo"), help="work directory")
    common.add_argument("--preset", default="demo", help="preset name or TOML file (demo)")
    common.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting (repeatable), e.g. --set train.epochs=3",
    )
    common.add_argument("--force", action="store_true", help="run even if up to date")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    sub = p.add_subparsers(dest="command", required=True)
    helps = {
        "data": "generate the synthetic dataset (or register a COCO directory)",
        "cache": "letterbox the train/val images into arrays",
        "train": "FP32 training",
        "qat": "fold BN, quantize (ModelOpt), calibrate, QAT fine-tune",
        "export": "ONNX export of the FP32 and QAT models (raw heads s8/s16/s32)",
        "translate": "Q/DQ ONNX -> PTQ ONNX + scales JSON + TensorRT calibration cache",
        "build": "emulated loadables; TensorRT DLA loadables / GPU engine (need TensorRT)",
        "validate": "COCO mAP of FP32 and QAT (fake-quant) on the held-out images",
    }
    for stage in STAGES:
        sp = sub.add_parser(stage, parents=[common], help=helps[stage])
        if stage == "translate":
            sp.add_argument("--onnx", type=Path, help="translate this Q/DQ ONNX instead")
            sp.add_argument("--out", type=Path, help="output directory for --onnx")
            sp.add_argument("--trt-version", type=int, default=None, help="cache header version")
        if stage == "build":
            sp.add_argument(
                "--onnx", type=Path, help="build this PTQ ONNX instead (one target: dla or gpu)"
            )
            sp.add_argument("--calib", type=Path, help="calibration cache for --onnx")
            sp.add_argument(
                "--precision-config", type=Path,
                help="the translator's *_precision_config.json for --onnx (its fp16_nodes run"
                " in FP16)",
            )  # fmt: skip
            sp.add_argument(
                "--core", type=int, choices=(0, 1), default=None,
                help="DLA core to build for (default: build.cores; 0 with --onnx)",
            )  # fmt: skip
            sp.add_argument(
                "--target", action="append", choices=("emulated", "dla", "gpu"),
                help="build only these (repeatable): emulated loadables, TensorRT DLA standalone"
                " loadables, the TensorRT GPU engine (default: build.targets)",
            )  # fmt: skip
            sp.add_argument(
                "--max-batch", type=int, default=None,
                help="the GPU engine's largest batch, 1..64 (default: build.max_batch)",
            )  # fmt: skip
            sp.add_argument(
                "--quantization", choices=("auto", "implicit", "explicit"), default=None,
                help="TensorRT path for --onnx: implicit (the stripped ONNX + --calib, TensorRT"
                " <= 10.7), explicit (a Q/DQ ONNX, TensorRT >= 11.4.1; written from the stripped"
                " ONNX when --calib is given) or auto, by the TensorRT found (default). The build"
                " stage always picks auto",
            )  # fmt: skip
            sp.add_argument("--out", type=Path, help="loadable or engine path for --onnx")
    profile_cmd.add_parser(sub)
    check_dla.add_parser(sub)
    import_cmd.add_parser(sub)
    bp = sub.add_parser(
        "bundle",
        parents=[common],
        help="copy a finished run's loadables and samples into a model dir",
    )
    bp.add_argument("--out", type=Path, default=Path("dlad/models/demo"), help="bundle directory")
    bp.add_argument("--variant", default="fp16_heads", help="head variant to bundle")
    tp = sub.add_parser(
        "torch-export",
        help="the torch GPU engine's .pt2 from an emulated loadable (same integers as the DLA)",
    )
    tp.add_argument("--loadable", type=Path, required=True, help="the emulated loadable (.emu)")
    tp.add_argument("--out", type=Path, help="the program to write (default: the loadable's .pt2)")
    tp.add_argument(
        "--max-batch", type=int, default=16, help="largest batch the program takes (default 16)"
    )
    sub.add_parser("all", parents=[common], help="run every stage in order (skips current ones)")
    sub.add_parser("config", parents=[common], help="print the effective settings")
    return p


def _progress_factory(
    quiet: bool,
) -> Callable[[str], Callable[[int, int, dict[str, float]], None]] | None:
    if quiet or not sys.stderr.isatty():
        return _log_progress
    from rich.progress import (
        BarColumn,
        Progress,
        TaskID,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    def factory(name: str) -> Callable[[int, int, dict[str, float]], None]:
        progress = Progress(
            TextColumn(f"[bold]{name}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            transient=False,
        )
        task: TaskID | None = None

        def update(step: int, total: int, info: dict[str, float]) -> None:
            nonlocal task
            if task is None:
                progress.start()
                task = progress.add_task(name, total=total, info="")
            text = "  ".join(f"{k} {v:.4g}" for k, v in info.items())
            progress.update(task, completed=step, info=text)
            if step >= total:
                progress.stop()

        return update

    return factory


def _log_progress(name: str) -> Callable[[int, int, dict[str, float]], None]:
    def update(step: int, total: int, info: dict[str, float]) -> None:
        if step == total or step % max(total // 10, 1) == 0:
            text = " ".join(f"{k}={v:.4g}" for k, v in info.items())
            log.info("%s %d/%d %s", name, step, total, text)

    return update


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except ModuleNotFoundError as e:  # a package of the [prep] extra, named with the fix
        message = missing_extra_message(e.name, f"prep {args.command}")
        if message is None:
            raise
        print(f"prep: {message}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "profile":
        return profile_cmd.run(args)
    if args.command == "check-dla":
        return check_dla.run(args)
    if args.command == "import":
        return import_cmd.run(args)
    if args.command == "torch-export":
        return _torch_export(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from prep.pipeline import Chain, ConfigError, dump_config, load_config, resolve_preset

    try:
        overrides = _parse_set(args.set)
        if args.command == "build" and args.max_batch is not None:
            overrides["build.max_batch"] = args.max_batch  # checked with the settings
        if args.command == "build" and args.onnx is None:
            if args.quantization not in (None, "auto"):
                print(
                    "prep: build --quantization applies to --onnx; the build stage picks the path"
                    " by the TensorRT it finds (implicit up to 10.7, explicit from 11.4.1) and,"
                    " without TensorRT, writes the trtexec commands of both",
                    file=sys.stderr,
                )
                return 2
            if args.target:  # prep build --target dla --core N, prep build --target gpu
                overrides["build.targets"] = list(dict.fromkeys(args.target))
            if args.core is not None:
                overrides["build.cores"] = [args.core]
        cfg = load_config(resolve_preset(args.preset), overrides)
    except ConfigError as e:
        print(f"prep: {e}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(dump_config(cfg))
        return 0
    try:
        if args.command == "translate" and args.onnx is not None:
            return _translate_file(args, cfg.translate.trt_version)
        if args.command == "build" and args.onnx is not None:
            return _build_file(args, cfg.build.max_batch)
        if args.command == "bundle":
            from prep.bundle import bundle

            sets = "".join(f" --set {shlex.quote(s)}" for s in args.set)
            common = f"--preset {args.preset} --workdir {args.workdir}{sets}"
            command = f"prep all {common} && prep bundle {common} --out {args.out}"
            bundle(args.workdir, args.out, variant=args.variant, command=command)
            print(f"wrote {args.out}")
            return 0
        chain = Chain(args.workdir, cfg, progress=_progress_factory(args.quiet), force=args.force)
        if args.command == "all":
            chain.run_all()
            _print_summary(chain)
        else:
            chain.run(args.command)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        log.error("%s failed: %s", args.command, e)
        return 1
    return 0


def _translate_file(args: argparse.Namespace, default_version: int) -> int:
    from prep.translate import translate, write_outputs

    out = args.out or args.onnx.parent / "translated"
    result = translate(
        args.onnx, trt_version=args.trt_version or default_version, extra_ops=("Resize",)
    )
    paths = write_outputs(result, out, args.onnx.stem)
    for path in (paths.onnx, paths.precision_config, paths.calibration_cache, paths.layer_arg):
        print(f"wrote {path}")
    return 0


def _build_file(args: argparse.Namespace, max_batch: int) -> int:
    """``prep build --onnx FILE``: one TensorRT target, ``dla`` (the default; ``--core``) or
    ``gpu`` (``--max-batch``). Exit 2 for another target or several; the build's own errors
    propagate to :func:`_run` (exit 1), as the DLA build's always have: a ``--quantization`` the
    TensorRT found does not have is a ``DlaBuildError``. The explicit path with ``--calib``
    first writes the Q/DQ ONNX (``<onnx stem>_qdq.onnx`` beside the output) from the stripped
    ONNX, the cache and the fp16 nodes; without ``--calib`` the ONNX is taken as explicit."""
    from prep.build_trt import (
        DlaBuildSpec,
        Quantization,
        QuantizationChoice,
        build_dla_loadable,
        load_fp16_layers,
        quantization_for,
        tensorrt_available,
    )
    from prep.explicit_qdq import write_explicit_onnx

    targets = list(dict.fromkeys(args.target or ["dla"]))
    if targets not in (["dla"], ["gpu"]):
        print(
            f"prep: build --onnx builds one TensorRT target, dla or gpu; got {targets}",
            file=sys.stderr,
        )
        return 2
    fp16 = load_fp16_layers(args.precision_config) if args.precision_config else ()
    asked: QuantizationChoice = args.quantization or "auto"  # argparse checked the choice
    version = tensorrt_available()  # none: the build below says TensorRT is not importable
    mode: Quantization
    if version is not None:
        mode = quantization_for(version, asked)
    else:
        mode = "implicit" if asked == "auto" else asked
    gpu = targets == ["gpu"]
    core = 0 if args.core is None else args.core
    out = args.out or args.onnx.with_suffix(".gpu.engine" if gpu else f".dla{core}.loadable")
    onnx_path, calib = args.onnx, args.calib
    if mode == "explicit" and calib is not None:
        if version is not None:
            onnx_path = write_explicit_onnx(
                args.onnx, calib, fp16, out.parent / f"{args.onnx.stem}_qdq.onnx",
                device="gpu" if gpu else "dla",
            )  # fmt: skip
            print(f"wrote {onnx_path}")
        calib = None  # the explicit path's scales are the Q/DQ ONNX's
    common: dict[str, Any] = {
        "onnx_path": onnx_path, "calibration_cache": calib, "fp16_layers": fp16,
        "quantization": mode,
    }  # fmt: skip
    if gpu:
        spec = DlaBuildSpec(device="gpu", max_batch=max_batch, **common)
    else:
        spec = DlaBuildSpec(dla_core=core, **common)
    report = build_dla_loadable(spec, out)
    print(report)
    return 0


def _torch_export(args: argparse.Namespace) -> int:
    """Exit 0 written; 2 an unreadable, invalid or unrebuildable loadable or a bad argument;
    1 torch.export failed."""
    from prep.torch_export import TorchExportFailure, export_torch

    out = args.out or args.loadable.with_suffix(".pt2")
    try:
        path = export_torch(args.loadable, out, max_batch=args.max_batch)
    except (OSError, ValueError) as e:  # LoadableError and TorchExportError are ValueErrors
        print(f"prep torch-export: {e}", file=sys.stderr)
        return 2
    except TorchExportFailure as e:
        print(f"prep torch-export: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


def _print_summary(chain: Any) -> None:
    from prep.manifest import read_metrics

    rows = read_metrics(chain.dir("validate")).get("rows", {})
    for name, row in rows.items():
        print(f"{name:>14}: mAP@[.5:.95] {row['map50_95']:.4f}   mAP@.5 {row['map50']:.4f}")


if __name__ == "__main__":
    sys.exit(main())
