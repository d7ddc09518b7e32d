"""Send one of the bundled held-out images to a running dlad and print the detections.

    dlad --config etc/dlad.toml &          # in another terminal
    python examples/detect.py [IMAGE] [--endpoint tcp://127.0.0.1:5555] [--model demo]

    dlad --config etc/families.toml &      # the demo, YOLO11n and YOLO26n side by side
    python examples/detect.py --model yolo26n

Without IMAGE it sends the model's bundled ``dlad/models/<model>/images/000001.jpg`` and compares
the reply with what prep's INT8 validation path produced for that image when the model was
bundled (``expected_detections.json`` beside it): it says whether the two lists are the same (to
2e-3 in every value; the emulated core computes the same integers on every host) and exits 1 if
they are not. A model that is not bundled gets the demo's image, and no comparison. A missing or
unreadable image, a bad endpoint (exit 2), no daemon or a daemon's error (exit 1) are one line on
stderr each.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from dlad.errors import DladError
from dlad.models import BUNDLES, DEMO
from dlad_client import Client, ClientTimeout

TOLERANCE = 2e-3


def _read(path: Path) -> np.ndarray | None:
    """The image as RGB, or None after saying on stderr why it cannot be read."""
    try:
        with Image.open(path) as img:
            return np.asarray(img.convert("RGB"))
    except FileNotFoundError:
        print(f"detect.py: {path}: no such file", file=sys.stderr)
    except (UnidentifiedImageError, OSError) as exc:
        print(f"detect.py: {path}: not an image PIL can read ({exc})", file=sys.stderr)
    return None


def _show(rows: object, classes: list[str]) -> None:
    for x1, y1, x2, y2, score, cls in np.asarray(rows, np.float32).reshape(-1, 6):
        print(f"  {classes[int(cls)]:>9} {score:.3f}  [{x1:7.1f} {y1:7.1f} {x2:7.1f} {y2:7.1f}]")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image", nargs="?", type=Path, default=None)
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5555")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait (10)")
    args = parser.parse_args()

    bundled = {b.name: b for b in BUNDLES}
    root = bundled.get(args.model, DEMO)
    image = args.image if args.image is not None else root / "images" / "000001.jpg"
    rgb = _read(image)
    if rgb is None:
        return 2
    bundle = json.loads((root / "bundle.json").read_text())
    classes = [c["name"] for c in json.loads((root / "images.json").read_text())["categories"]]
    try:
        with Client(args.endpoint, timeout_s=args.timeout) as client:
            result = client.detect(rgb, model=args.model)
    except ValueError as exc:  # a malformed endpoint
        print(f"detect.py: {exc}", file=sys.stderr)
        return 2
    except ClientTimeout:
        print(
            f"detect.py: no dlad answered at {args.endpoint} within {args.timeout:g} s "
            "(start one: dlad --config etc/dlad.toml)",
            file=sys.stderr,
        )
        return 1
    except DladError as exc:  # the daemon's answer: NOT_FOUND for an unknown model, ...
        print(f"detect.py: {args.endpoint}: {exc.status.name}: {exc}", file=sys.stderr)
        return 1
    t = result.timing
    print(
        f"{image.name}: {len(result)} detections on {result.device} "
        f"(queue {t.queue_us} us, pre {t.pre_us} us, device {t.device_us} us, "
        f"post {t.post_us} us, total {t.total_us} us)"
    )
    _show(result.detections, classes)
    if args.model not in bundled:
        return 0
    expected = json.loads((root / "expected_detections.json").read_text())["images"]
    if image.name not in expected or image.resolve().parent != root / "images":
        return 0
    recorded = np.asarray(expected[image.name]["emulated_int8"], np.float32).reshape(-1, 6)
    print(f"prep's INT8 validation output for {image.name} ({bundle['variant']}):")
    _show(recorded, classes)
    got = np.asarray(result.detections, np.float32)
    same = got.shape == recorded.shape and bool(np.allclose(got, recorded, atol=TOLERANCE))
    print("the two lists are the same" if same else "the two lists DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
