"""Fixtures of the cudla backend's tests: the fake library, built once per session with gcc."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.dlad.cudla.fakelib import FakeLib, build_fake, gcc_problem


@pytest.fixture(scope="session")
def fake_so(tmp_path_factory: pytest.TempPathFactory) -> Path:
    problem = gcc_problem()
    if problem:
        pytest.skip(problem)
    return build_fake(tmp_path_factory.mktemp("fake_cudla"))


@pytest.fixture(scope="session")
def fake_old_so(tmp_path_factory: pytest.TempPathFactory) -> Path:
    problem = gcc_problem()
    if problem:
        pytest.skip(problem)
    return build_fake(tmp_path_factory.mktemp("fake_cudla_old"), old_release=True)


@pytest.fixture
def fake(fake_so: Path) -> Iterator[FakeLib]:
    """The fake, reset; at teardown every object the test made must have been released."""
    lib = FakeLib(fake_so)
    lib.reset()
    before = lib.live()
    yield lib
    lib.set_callback(None)
    assert lib.live() == before, "objects left alive in the fake"
    lib.reset()
