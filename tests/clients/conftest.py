"""Fixtures of the SDK tests: contexts proven closed at teardown, fake daemons closed too."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from dlad.protocol import Reply, Request
from tests.clients.fake_daemon import FakeDaemon, answer, term_or_fail


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    term_or_fail(ctx)


@pytest.fixture
def make_daemon() -> Iterator[Callable[..., FakeDaemon]]:
    daemons: list[FakeDaemon] = []

    def make(script: Callable[[Request], list[Reply]] = answer) -> FakeDaemon:
        daemons.append(FakeDaemon(script))
        return daemons[-1]

    yield make
    for daemon in daemons:
        daemon.close()


@pytest.fixture
def async_context() -> Iterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    term_or_fail(ctx)
