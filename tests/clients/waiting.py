"""Waiting on state in the client tests: a state that comes has no event to wait on."""

from __future__ import annotations

from collections.abc import Callable

import anyio


async def until(holds: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll until ``holds()``; fails the test after ``timeout_s`` (a loaded machine may be
    slow, the state still comes)."""
    with anyio.fail_after(timeout_s):
        while not holds():  # noqa: ASYNC110  # state of the code under test, not an event
            await anyio.sleep(0.01)
