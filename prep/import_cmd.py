"""``prep import``: a user's Ultralytics checkpoint as the FP32 raw-head ONNX the DLA would run.

    prep import --checkpoint yolo11n.pt --out imported/ [--image-size 640] [--nms-free]

Any family prep has: YOLOv5 v7.0, YOLOv8, YOLO11, YOLO26 (``prep.families.import_checkpoint``;
nothing in the file runs). Writes ``fp32.onnx`` (input ``images`` ``[1, 3, S, S]``, the raw
heads ``s8 s16 s32``: with ``--nms-free``, a YOLO26's one-to-one head, the family
``yolo26_one2one``; YOLO11's and YOLO26's attention in DLA layers,
``prep.families.dla_attention``) and ``model.json`` (family, size, class names, image size), then
says which of its layers the DLA runs (``prep check-dla``).

Exit status: 0 written; 1 written, but some layers do not run on the DLA; 2 bad arguments or a
checkpoint that cannot be imported (the message says why).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``import`` on an ``add_subparsers()`` object; returns the new parser."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "import",
        help="an Ultralytics checkpoint (YOLOv5/v8/11/26) as the FP32 raw-head ONNX for the DLA",
    )
    p.add_argument("--checkpoint", type=Path, required=True, help="the Ultralytics .pt file")
    p.add_argument("--out", type=Path, required=True, help="directory to write into")
    p.add_argument("--image-size", type=int, default=640, help="square input size (default 640)")
    p.add_argument(
        "--nms-free", action="store_true",
        help="a YOLO26: its one-to-one head (top-k, no NMS) instead of the one-to-many one",
    )  # fmt: skip
    return p


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``prep import`` for parsed ``args``; returns the exit status (module docstring)."""
    from prep.check_dla import CheckError, check_graph, print_report
    from prep.export import export_onnx
    from prep.families import import_checkpoint
    from prep.ultralytics import CheckpointError

    out = out or sys.stdout
    size = args.image_size
    if size < 32 or size % 32:
        print(f"prep import: --image-size must be a multiple of 32, got {size}", file=sys.stderr)
        return 2
    try:
        if not args.checkpoint.is_file():
            raise CheckpointError(f"no such file: {args.checkpoint}")
        imported = import_checkpoint(args.checkpoint, one2one=args.nms_free)
        model = imported.model
        if imported.family.startswith(("yolo11", "yolo26")):
            from prep.families.dla_attention import dla_legal

            model = dla_legal(model).eval()
        args.out.mkdir(parents=True, exist_ok=True)
        onnx_path = args.out / "fp32.onnx"
        export_onnx(model, onnx_path, size)
        result = check_graph(onnx_path)
    except (CheckpointError, CheckError, ValueError) as e:
        print(f"prep import: {e}", file=sys.stderr)
        return 2
    info = {
        "family": imported.family,
        "variant": imported.variant,
        "class_names": list(imported.class_names),
        "image_size": size,
        "checkpoint": str(args.checkpoint),
    }
    (args.out / "model.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"{args.checkpoint}: {imported.family} ({imported.variant}), "
          f"{len(imported.class_names)} classes -> {onnx_path}", file=out)  # fmt: skip
    print_report(result, out)
    return 0 if result.all_on_dla else 1
