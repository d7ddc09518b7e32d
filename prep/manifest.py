"""Stage manifests: what went in, with which settings and versions, and what came out.

Every prep stage writes ``manifest.json`` beside its outputs::

    {"stage": "train", "fingerprint": "<sha256>", "created": "...",
     "inputs":  {"dataset": {"path": "...", "sha256": "..."}},
     "settings": {...}, "versions": {"python": "...", "torch": "...", ...},
     "outputs": {"checkpoint": {"path": "fp32.pt", "sha256": "..."}},
     "metrics": {...}}

The fingerprint covers the input hashes, the settings and prep's own version, so a stage is
skipped when and only when none of those changed *and* its outputs are still the files it wrote.
Library versions are recorded but not fingerprinted: upgrading onnx should not retrain a model.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import json
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dlad

MANIFEST = "manifest.json"
_TRACKED = ("torch", "nvidia-modelopt", "onnx", "onnx-graphsurgeon", "onnxruntime", "numpy")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_tree(root: Path, pattern: str = "*") -> str:
    """Hash of every file under ``root`` (relative names and contents), in sorted order."""
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob(pattern) if q.is_file() and q.name != MANIFEST):
        h.update(str(p.relative_to(root)).encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def hash_input(path: Path) -> str:
    return sha256_tree(path) if path.is_dir() else sha256_file(path)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "dlad": dlad.__version__}
    installed = {d.metadata["Name"].lower(): d.version for d in importlib.metadata.distributions()}
    out.update({name: installed[name] for name in _TRACKED if name in installed})
    return out


def fingerprint(stage: str, inputs: Mapping[str, str], settings: Mapping[str, Any]) -> str:
    blob = json.dumps(
        {
            "stage": stage,
            "inputs": dict(sorted(inputs.items())),
            "settings": settings,
            "prep": dlad.__version__,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class StageRecord:
    """What a stage reads: its output directory, hashed inputs and settings."""

    stage: str
    out_dir: Path
    inputs: dict[str, Path]
    settings: dict[str, Any]

    def input_hashes(self) -> dict[str, str]:
        return {k: hash_input(p) for k, p in self.inputs.items()}

    def key(self) -> str:
        return fingerprint(self.stage, self.input_hashes(), self.settings)

    def up_to_date(self) -> bool:
        """True when the manifest matches these inputs and settings and its outputs are intact."""
        path = self.out_dir / MANIFEST
        if not path.is_file():
            return False
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            return False
        if data.get("fingerprint") != self.key():
            return False
        for out in data.get("outputs", {}).values():
            p = self.out_dir / out["path"]
            if not p.exists() or hash_input(p) != out["sha256"]:
                return False
        return True

    def write(self, outputs: Mapping[str, Path], metrics: Mapping[str, Any] | None = None) -> Path:
        """Record the stage's outputs (paths inside ``out_dir``) and metrics."""
        hashes = self.input_hashes()
        data = {
            "stage": self.stage,
            "fingerprint": fingerprint(self.stage, hashes, self.settings),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "inputs": {
                k: {"path": str(self.inputs[k]), "sha256": v} for k, v in sorted(hashes.items())
            },
            "settings": self.settings,
            "versions": versions(),
            "outputs": {
                k: {"path": str(p.relative_to(self.out_dir)), "sha256": hash_input(p)}
                for k, p in outputs.items()
            },
            "metrics": dict(metrics or {}),
        }
        path = self.out_dir / MANIFEST
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        return path


def read_metrics(out_dir: Path) -> dict[str, Any]:
    path = out_dir / MANIFEST
    if not path.is_file():
        return {}
    metrics = json.loads(path.read_text()).get("metrics", {})
    return dict(metrics)
