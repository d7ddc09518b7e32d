"""The daemon's layers import one way: daemon → frontend → native plane → engines → executors →
devices. Nothing below imports a layer above it (read from the source, so a new import cannot
slip in unnoticed)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DLAD = Path(__file__).resolve().parents[2] / "dlad"

# module (or package) -> the dlad modules it must never import
FORBIDDEN = {
    "native_plane.py": ("dlad.frontend", "dlad.daemon", "dlad.engines", "dlad.executors"),
    "engines": ("dlad.frontend", "dlad.daemon", "dlad.cli", "dlad.native_plane"),
    "executors": ("dlad.frontend", "dlad.daemon", "dlad.cli", "dlad.engines", "dlad.native_plane"),
    "devices": ("dlad.frontend", "dlad.daemon", "dlad.executors", "dlad.engines", "dlad.cli"),
    "frontend.py": ("dlad.daemon", "dlad.cli", "dlad.engines", "dlad.executors"),
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


@pytest.mark.parametrize("where", sorted(FORBIDDEN))
def test_no_layer_imports_one_above_it(where: str) -> None:
    target = DLAD / where
    files = sorted(target.rglob("*.py")) if target.is_dir() else [target]
    assert files
    for path in files:
        bad = {
            name
            for name in _imports(path)
            for banned in FORBIDDEN[where]
            if name == banned or name.startswith(banned + ".")
        }
        assert not bad, f"{path.relative_to(DLAD.parent)} imports {sorted(bad)}"
