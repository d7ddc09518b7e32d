"""Models that ship with dlad (see each directory's README.md); ``demo`` is the default."""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).parent
DEMO = MODELS_DIR / "demo"
BUNDLES = sorted(d for d in MODELS_DIR.iterdir() if (d / "bundle.json").is_file())
"""Every bundled model's directory (``prep bundle`` wrote each)."""
