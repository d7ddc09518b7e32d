"""Send one of the bundled held-out images to a running dlad and print the detections.

    dlad --config etc/dlad.toml &          # in another terminal
    python examples/detect.py [IMAGE] [--endpoint tcp://127.0.0.1:5555]

Without IMAGE it sends ``dlad/models/demo/images/000001.jpg`` and also prints what prep's INT8
validation path produced for that image when the model was bundled
(``dlad/models/demo/expected_detections.json``): the two lists are the same.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image

from dlad.models import DEMO
from dlad_client import Client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image", nargs="?", type=Path, default=DEMO / "images" / "000001.jpg")
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5555")
    parser.add_argument("--model", default="demo")
    args = parser.parse_args()

    rgb = np.asarray(Image.open(args.image).convert("RGB"))
    names = json.loads((DEMO / "bundle.json").read_text())
    classes = [c["name"] for c in json.loads((DEMO / "images.json").read_text())["categories"]]
    with Client(args.endpoint, timeout_s=10.0) as client:
        result = client.detect(rgb, model=args.model)
    t = result.timing
    print(
        f"{args.image.name}: {len(result)} detections on {result.device} "
        f"(queue {t.queue_us} us, pre {t.pre_us} us, device {t.device_us} us, "
        f"post {t.post_us} us, total {t.total_us} us)"
    )
    for x1, y1, x2, y2, score, cls in result.detections:
        print(f"  {classes[int(cls)]:>9} {score:.3f}  [{x1:7.1f} {y1:7.1f} {x2:7.1f} {y2:7.1f}]")
    expected = json.loads((DEMO / "expected_detections.json").read_text())["images"]
    if args.image.name in expected and args.image.parent == DEMO / "images":
        print(f"prep's INT8 validation output for {args.image.name} ({names['variant']}):")
        for x1, y1, x2, y2, score, cls in expected[args.image.name]["emulated_int8"]:
            print(
                f"  {classes[int(cls)]:>9} {score:.3f}  [{x1:7.1f} {y1:7.1f} {x2:7.1f} {y2:7.1f}]"
            )


if __name__ == "__main__":
    main()
