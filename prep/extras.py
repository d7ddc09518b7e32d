"""The ``[prep]`` extra: which of its packages this environment lacks, and the one message that
says what to install (``prep`` and the test suite use it)."""

from __future__ import annotations

import importlib.util

__all__ = ["PREP_PACKAGES", "install_hint", "missing", "missing_extra_message"]

PREP_PACKAGES: dict[str, str] = {
    "torch": "torch",
    "modelopt": "nvidia-modelopt",
    "onnx": "onnx",
    "onnx_graphsurgeon": "onnx-graphsurgeon",
    "onnxscript": "onnxscript",
    "faster_coco_eval": "faster-coco-eval",
    "ultralytics": "ultralytics",
}
"""Import name -> distribution name of the extra's packages that ``prep`` imports."""


def install_hint() -> str:
    """The command that installs the extra in a checkout (torch pinned first: see README)."""
    return "pip install torch==2.13.0 -e '.[prep]'  (or: pip install 'dlad[prep]')"


def missing() -> list[str]:
    """Distribution names of the extra's packages that cannot be imported here."""
    return [
        dist for module, dist in PREP_PACKAGES.items() if importlib.util.find_spec(module) is None
    ]


def missing_extra_message(module: str | None, what: str = "prep") -> str | None:
    """The message for a ``ModuleNotFoundError`` of ``module`` if it belongs to the extra
    (``None`` otherwise: a different problem that must not be disguised as this one)."""
    top = (module or "").split(".")[0]
    if top not in PREP_PACKAGES:
        return None
    return (
        f"{what} needs {PREP_PACKAGES[top]}, which comes with the [prep] extra and is not "
        f"installed here; install the extra: {install_hint()}"
    )
