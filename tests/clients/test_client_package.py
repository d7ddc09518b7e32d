"""dlad-client, the SDK's own distribution: it needs none of the daemon, installs only what a
client needs, and carries the wire's C++ rules, the same headers the daemon compiles."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / "clients"
pytestmark = pytest.mark.timeout(300)


def test_the_client_installs_only_what_a_client_needs() -> None:
    project = tomllib.loads((CLIENTS / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["dependencies"]}
    assert names == {"numpy", "msgpack", "msgspec", "pyzmq", "anyio"}
    assert set(project["optional-dependencies"]) == {"fleet", "cameras"}
    daemon = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("dlad-client") for d in daemon["dependencies"])


def test_the_sdk_works_without_the_daemon_installed() -> None:
    """In a process where ``dlad`` cannot be imported at all, the SDK builds, checks and encodes
    requests, and decodes replies, with the wire's C++ rules."""
    code = textwrap.dedent("""
        import importlib.abc, sys

        class NoDaemon(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "dlad" or name.startswith(("dlad.", "prep")):
                    raise ImportError(f"{name} is the daemon's")
                return None

        sys.meta_path.insert(0, NoDaemon())
        import numpy as np
        import dlad_client, dlad_client.cameras, dlad_client.sources, dlad_client.cam
        from dlad_wire import protocol
        from dlad_wire.errors import ProtocolError
        image = np.zeros((6, 4), np.uint8)
        request = protocol.InferRequest(1, "demo", image, format="NV12", stream="cam0")
        assert len(protocol.encode(request)) == 2
        assert protocol.frame_shape("NV12", 4, 4) == (6, 4)
        small = np.zeros((2, 2, 3), np.uint8)
        for bad in ({"model": "a\\x00b"}, {"stream": ""}):
            try:
                protocol.InferRequest(1, **{"model": "m", **bad}, image=small)
            except ProtocolError:
                pass
            else:
                raise AssertionError(bad)
        try:
            protocol.frame_size("NV12", (5, 4))
        except ValueError as exc:
            assert "3H/2 x W" in str(exc)
        assert not [m for m in sys.modules if m == "dlad" or m.startswith("dlad.")]
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_the_client_sdist_holds_the_wires_rules(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp_path)],
                   cwd=CLIENTS, check=True, capture_output=True, timeout=240)  # fmt: skip
    (sdist,) = tmp_path.glob("dlad_client-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        licence = tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("/LICENSE")))
        assert licence is not None
        assert b"Apache License" in licence.read()
    for needed in [
        "pyproject.toml", "setup.py", "README.md", "dlad_wire/native/names.hpp",
        "dlad_wire/native/frames.hpp", "dlad_wire/native/rules.cpp", "dlad_wire/_rules.pyi",
        "dlad_wire/protocol.py", "dlad_client/_client.py",
    ]:  # fmt: skip
        assert needed in names, needed
    assert not [n for n in names if n.startswith(("dlad/", "prep/", "dlad_bench/"))]


def test_the_daemon_compiles_the_wires_headers() -> None:
    """One statement of each rule: the daemon's decoder includes the client's headers, and no
    copy of them lives in the daemon's tree."""
    wire = {p.name for p in (CLIENTS / "dlad_wire" / "native").glob("*.hpp")}
    assert wire == {"names.hpp", "frames.hpp"}
    assert not wire & {p.name for p in (ROOT / "dlad" / "native").glob("*.hpp")}
    assert '#include "names.hpp"' in (ROOT / "dlad/native/wire.hpp").read_text()
    assert '#include "frames.hpp"' in (ROOT / "dlad/native/frame_rules.hpp").read_text()
