"""The emulated DLA core's integers on this host: digests to compare across machines.

Runs the bundled demo model's INT8 engine (dla0) on its six held-out images, in name order,
under every operand choice (``auto``, ``u8s8``, ``u8u8``; see ``dlad/devices/int8_layout.py``),
and prints, as one JSON object, the kernel path this host takes, one SHA-256 per choice over all
output buffers' bytes,
whether each matches the digest recorded in ``dlad/models/demo/expected_detections.json``, and
how many outputs of the large-sum cases (``tests/dlad/int8_cases.py``) differ from the exact
integers. Run it on two hosts (or under ``valgrind --tool=none``, which shows programs an AVX2
CPU without AVX-512 or VNNI) and compare the ``auto`` digests: they must be equal.

    .venv/bin/python bench/int8_digest.py
    valgrind -q --tool=none .venv/bin/python bench/int8_digest.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.dlad.int8_cases, when run from a checkout

from dlad.devices.int8_layout import OperandsChoice, select_kernel_path  # noqa: E402
from dlad.models import DEMO  # noqa: E402
from dlad.models.digest import heads_sha256  # noqa: E402


def main() -> None:
    from tests.dlad.int8_cases import cases, mismatches

    recorded = json.loads((DEMO / "expected_detections.json").read_text()).get("heads_sha256")
    report: dict[str, Any] = {"kernel_path": select_kernel_path("auto").to_dict()}
    choices: tuple[OperandsChoice, ...] = ("auto", "u8s8", "u8u8")
    images = sorted((DEMO / "images").glob("*.jpg"))
    loadable = DEMO / "fp16_heads.dla0.emu"
    report["heads_sha256"] = {c: heads_sha256(loadable, images, operands=c) for c in choices}
    report["matches_recorded"] = {c: d == recorded for c, d in report["heads_sha256"].items()}
    report["large_sum_mismatches"] = {
        c: {case.name: mismatches(case, c) for case in cases()} for c in choices
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
