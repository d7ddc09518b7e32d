"""dlad.waiter.Waiter: the blocking call per frame on a thread of its own."""

from __future__ import annotations

import functools
import threading

import anyio
import anyio.lowlevel
import pytest

from dlad.waiter import Waiter


def test_results_exceptions_and_order_come_back_to_the_caller() -> None:
    seen: list[int] = []

    def call(i: int) -> int:
        seen.append(i)
        return i * 2

    def fail() -> None:
        raise ValueError("boom")

    async def main() -> list[int]:
        waiter = Waiter("test-wait")
        try:
            out = [await waiter.run(functools.partial(call, i)) for i in range(5)]
            with pytest.raises(ValueError, match="boom"):
                await waiter.run(fail)
            out.append(
                await waiter.run(functools.partial(call, 9))
            )  # the thread survives a failed call
            return out
        finally:
            waiter.close()

    assert anyio.run(main) == [0, 2, 4, 6, 8, 18]
    assert seen == [0, 1, 2, 3, 4, 9]


def test_a_cancelled_caller_still_waits_for_its_call_to_return() -> None:
    started, release = threading.Event(), threading.Event()
    returned = threading.Event()

    def blocking() -> str:
        started.set()
        release.wait(30)
        returned.set()
        return "done"

    async def main() -> list[bool]:
        waiter = Waiter("test-wait")
        scope = anyio.CancelScope()
        ended: list[bool] = []  # whether the call had returned when the caller ended
        try:
            async with anyio.create_task_group() as tg:

                async def caller() -> None:
                    with scope:
                        await waiter.run(blocking)
                    ended.append(returned.is_set())

                tg.start_soon(caller)
                await anyio.to_thread.run_sync(started.wait, 30)
                scope.cancel()  # the caller is cancelled while the call blocks
                for _ in range(20):  # the loop runs the caller's cancellation many times over
                    await anyio.lowlevel.checkpoint()
                assert ended == []
                release.set()
            return ended
        finally:
            waiter.close()

    assert anyio.run(main) == [True]


def test_closed_waiter_refuses_calls_and_its_thread_ends() -> None:
    async def main() -> Waiter:
        waiter = Waiter("test-wait")
        assert await waiter.run(lambda: 1) == 1
        waiter.close()
        waiter.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            await waiter.run(lambda: 2)
        return waiter

    waiter = anyio.run(main)
    thread = waiter._thread
    assert thread is not None
    thread.join(30)
    assert not thread.is_alive()
