"""``prep bundle``: copy a finished chain's small artifacts into a model directory dlad ships.

The bundle holds what the daemon serves and what a user needs to check it, and nothing large:

- ``<variant>.dla0.emu``, ``<variant>.dla1.emu``: the emulated loadables (one per core);
- ``model_precision_config.json`` and ``model_precision_config_calib.cache``: the translator's
  INT8 scales (with the PTQ ONNX, which is not bundled, they rebuild a real DLA loadable);
- ``images/`` + ``images.json``: a handful of held-out images and their COCO annotations;
- ``bundle.json``: where it came from (stage fingerprints, settings, versions) and its accuracy;
- ``README.md``: the command that regenerates all of it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from prep.manifest import MANIFEST, read_metrics

STAGES = ("data", "cache", "train", "qat", "export", "translate", "build", "validate")


def bundle(
    workdir: Path,
    out: Path,
    *,
    variant: str = "fp16_heads",
    cores: tuple[int, ...] = (0, 1),
    num_images: int = 6,
    command: str = "",
) -> dict[str, Any]:
    """Write the bundle of ``workdir`` into ``out`` (replacing its files); returns bundle.json.

    Raises:
        FileNotFoundError: the chain has not run to ``validate``, or ``variant`` was not built.
    """
    for stage in STAGES:
        if not (workdir / stage / MANIFEST).is_file():
            raise FileNotFoundError(f"{workdir / stage / MANIFEST} missing: run `prep all` first")
    out.mkdir(parents=True, exist_ok=True)
    files: list[str] = []
    for core in cores:
        src = workdir / "build" / f"{variant}.dla{core}.emu"
        if not src.is_file():
            raise FileNotFoundError(f"{src} missing: variant {variant!r} was not built")
        shutil.copyfile(src, out / src.name)
        files.append(src.name)
    for name in ("model_precision_config.json", "model_precision_config_calib.cache"):
        shutil.copyfile(workdir / "translate" / name, out / name)
        files.append(name)

    val = workdir / "data" / "val"
    gt = json.loads((val / "annotations.json").read_text())
    images = sorted(gt["images"], key=lambda im: im["id"])[:num_images]
    keep = {im["id"] for im in images}
    (out / "images").mkdir(exist_ok=True)
    for old in (out / "images").iterdir():
        old.unlink()
    for im in images:
        shutil.copyfile(
            val / "images" / im["file_name"], out / "images" / Path(im["file_name"]).name
        )
    subset = {
        **{k: v for k, v in gt.items() if k not in ("images", "annotations")},
        "images": images,
        "annotations": [a for a in gt["annotations"] if a["image_id"] in keep],
    }
    (out / "images.json").write_text(json.dumps(subset, indent=1) + "\n")
    files.append("images.json")

    expected = expected_detections(workdir, out, variant, [im["file_name"] for im in images])
    (out / "expected_detections.json").write_text(json.dumps(expected, indent=1) + "\n")
    files.append("expected_detections.json")

    manifests = {stage: json.loads((workdir / stage / MANIFEST).read_text()) for stage in STAGES}
    info = {
        "variant": variant,
        "files": files,
        "images": [im["file_name"] for im in images],
        "accuracy": read_metrics(workdir / "validate").get("rows", {}),
        "fingerprints": {s: m["fingerprint"] for s, m in manifests.items()},
        "settings": {s: manifests[s]["settings"] for s in ("data", "train", "qat", "translate")},
        "model": manifests["train"]["settings"].get("model", {}),
        "versions": manifests["train"]["versions"],
        "command": command,
    }
    (out / "bundle.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    (out / "README.md").write_text(_readme(info))
    return info


#: The daemon's default thresholds, used for the recorded detections.
CONF, IOU, MAX_DET = 0.25, 0.45, 300


def expected_detections(workdir: Path, out: Path, variant: str, files: list[str]) -> dict[str, Any]:
    """Detections of the bundled images by the QAT fake-quant model (torch) and by the emulated
    INT8 core (the bundled dla0 loadable), both through dlad's numpy pre/post-processing, and
    ``heads_sha256``: the digest of the core's output bytes on the images in name order
    (``dlad.models.digest.heads_sha256``)."""
    import numpy as np
    from PIL import Image

    from dlad.families import family_for
    from dlad.imaging.pre import letterbox
    from dlad.loadable import read_loadable
    from dlad.models.digest import heads_sha256
    from prep.qat import load_qat
    from prep.validate import emulated_heads, torch_heads

    loadable = read_loadable(out / f"{variant}.dla0.emu")
    qmodel, _ = load_qat(workdir / "qat" / "qat.pt")
    runs = {"qat_fakequant": torch_heads(qmodel), "emulated_int8": emulated_heads(loadable)}
    postprocess = family_for(loadable.family).postprocess
    size = loadable.image_size[0]
    result: dict[str, Any] = {
        "conf_threshold": CONF,
        "iou_threshold": IOU,
        "max_det": MAX_DET,
        "images": {},
    }
    for name in files:
        rgb = np.asarray(Image.open(out / "images" / Path(name).name).convert("RGB"))
        canvas, geometry = letterbox(rgb, size)
        per_model = {}
        for tag, heads_fn in runs.items():
            heads = [h[0] for h in heads_fn(canvas[None])]
            dets = postprocess(heads, loadable, geometry, conf=CONF, iou=IOU, max_det=MAX_DET)
            per_model[tag] = [[round(float(v), 3) for v in row] for row in dets]
        result["images"][Path(name).name] = per_model
    # The core's integers themselves: equal on every host (dlad/devices/int8_layout.py).
    names = sorted(Path(name).name for name in files)
    result["heads_sha256"] = heads_sha256(
        out / f"{variant}.dla0.emu", [out / "images" / n for n in names]
    )
    return result


def _readme(info: dict[str, Any]) -> str:
    rows = info["accuracy"]
    acc = "\n".join(
        f"| {name} | {row['map50_95']:.4f} | {row['map50']:.4f} |" for name, row in rows.items()
    )
    model = info.get("model", {})
    family = str(model.get("family", "yolov5"))
    shown = family.replace("yolov", "YOLOv").replace("yolo", "YOLO").replace("_one2one", "")
    name = f"{shown}{model.get('variant', 'n')} at {model.get('image_size', 256)} px"
    if family.endswith("_one2one"):
        name += " (its NMS-free head)"
    return f"""# Bundled model: {name}

{name} trained by `prep` on its synthetic dataset (8 shape classes), QAT with ModelOpt,
translated to a PTQ model + INT8 scales, and built into emulated DLA loadables
(`{info["variant"]}`: INT8 body, heads as named), one per DLA core. `bundle.json` records the
stage fingerprints, settings and library versions it came from.

Regenerate (about 20 minutes on 2 CPU cores; deterministic data, training varies slightly):

```bash
{info["command"]}
```

Held-out accuracy of the run this came from (COCO mAP, 300 images):

| model | mAP@[.5:.95] | mAP@.5 |
|---|---|---|
{acc}

`images/` holds {len(info["images"])} held-out images (not used in training) and `images.json`
their COCO annotations.
"""
