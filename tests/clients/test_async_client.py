"""The asynchronous client against a fake daemon over real tcp loopback sockets.

Set-up as in ``test_client.py``. Tasks synchronise on ``anyio.wait_all_tasks_blocked`` (every
caller has sent and waits) and on a STATUS round trip (ordered after everything sent before it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import anyio
import numpy as np
import pytest
import zmq
import zmq.asyncio

from dlad.errors import Status
from dlad.protocol import (
    CancelRequest,
    InferReply,
    InferRequest,
    Reply,
    Request,
    StatusRequest,
)
from dlad_client import (
    AsyncClient,
    Cancelled,
    ClientClosed,
    ClientTimeout,
    NotFound,
    Result,
    ShuttingDown,
)
from tests.clients.fake_daemon import (
    CLASS_NAMES,
    FakeDaemon,
    Holding,
    Image,
    check_result,
    images,
    infers,
    report,
)

pytestmark = pytest.mark.timeout(30)


def test_async_client_refuses_bad_settings_and_use_before_entry(
    async_context: zmq.asyncio.Context,
) -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        AsyncClient("tcp://127.0.0.1:1", max_in_flight=0)
    with pytest.raises(ValueError, match="no port"):
        AsyncClient("tcp://127.0.0.1", context=async_context)
    client = AsyncClient("tcp://a b:5555", context=async_context)  # ZeroMQ refuses the host

    async def main() -> None:
        with pytest.raises(RuntimeError, match="enter"):
            await client.status()
        with pytest.raises(ValueError, match="cannot connect"):
            async with client:
                pass

    anyio.run(main, backend="asyncio")


def test_async_50_concurrent_detects_matched_out_of_order(
    async_context: zmq.asyncio.Context, make_daemon: Callable[..., FakeDaemon]
) -> None:
    daemon = make_daemon(Holding(release=50, seed=3))
    batch = images(50, seed=12)
    results: dict[int, Result] = {}

    async def main() -> None:
        async with AsyncClient(daemon.endpoint, context=async_context) as client:

            async def one(i: int) -> None:
                results[i] = await client.detect(batch[i], model="hold")

            async with anyio.create_task_group() as tg:
                for i in range(50):
                    tg.start_soon(one, i)
            assert client.in_flight == 0

    anyio.run(main, backend="asyncio")
    for i, image in enumerate(batch):
        check_result(results[i], image)
    assert len({r.request_id for r in results.values()}) == 50


def test_async_results_carry_the_class_names_the_client_learned(
    async_context: zmq.asyncio.Context, make_daemon: Callable[..., FakeDaemon]
) -> None:
    daemon = make_daemon()
    image = images(1, seed=5)[0]

    async def main() -> None:
        async with AsyncClient(daemon.endpoint, context=async_context) as client:
            assert (await client.detect(image, model="demo")).class_names == ()
            await client.status()  # a report teaches the names too
            assert await client.class_names("demo") == CLASS_NAMES
            result = await client.detect(image, model="demo")
            assert result.labels == [CLASS_NAMES[result.classes[0]]]
            with pytest.raises(NotFound):
                await client.class_names("other")

    anyio.run(main, backend="asyncio")
    assert sum(isinstance(r, StatusRequest) for r in daemon.requests) == 2


def test_async_cancelling_one_detect_does_not_disturb_the_others(
    async_context: zmq.asyncio.Context, make_daemon: Callable[..., FakeDaemon]
) -> None:
    daemon = make_daemon(Holding(seed=5))
    batch = images(50, seed=13)
    results: dict[int, Result] = {}
    victim = 17
    scopes: dict[int, anyio.CancelScope] = {}

    async def main() -> None:
        scopes.update({i: anyio.CancelScope() for i in range(50)})
        async with AsyncClient(daemon.endpoint, context=async_context) as client:

            async def one(i: int) -> None:
                with scopes[i]:
                    results[i] = await client.detect(batch[i], model="hold")

            async with anyio.create_task_group() as tg:
                for i in range(50):
                    tg.start_soon(one, i)
                await anyio.wait_all_tasks_blocked()
                await client.status()  # the fake now holds all 50
                assert len(infers(daemon.requests)) == 50
                scopes[victim].cancel()  # its CANCEL makes the fake answer everything
            assert client.in_flight == 0

    anyio.run(main, backend="asyncio")
    assert scopes[victim].cancelled_caught
    assert sorted(results) == [i for i in range(50) if i != victim]
    for i, result in results.items():
        check_result(result, batch[i])
    sent = {r.id: r for r in infers(daemon.requests)}
    (cancel,) = [r for r in daemon.requests if isinstance(r, CancelRequest)]
    np.testing.assert_array_equal(sent[cancel.id].image, batch[victim])


def test_async_timeout_sends_cancel(
    async_context: zmq.asyncio.Context, make_daemon: Callable[..., FakeDaemon]
) -> None:
    daemon = make_daemon(Holding())
    first, second = images(2, seed=14)

    async def main() -> None:
        async with AsyncClient(daemon.endpoint, context=async_context, timeout_s=0.2) as client:
            await client.status(timeout_s=5.0)  # connected: the short timeout is the reply's
            with pytest.raises(ClientTimeout) as timeout:
                await client.detect(first, model="hold")
            await anyio.wait_all_tasks_blocked()  # the CANCEL is sent by the client's task
            await client.status(timeout_s=5.0)
            held = infers(daemon.requests)[0].id
            assert timeout.value.request_id == held
            assert CancelRequest(held) in daemon.requests
            check_result(await client.detect(second, timeout_s=5.0), second)
            assert client.in_flight == 0

    anyio.run(main, backend="asyncio")


def test_async_errors_status_handles_and_cancel(
    async_context: zmq.asyncio.Context, make_daemon: Callable[..., FakeDaemon]
) -> None:
    holding = Holding()

    def script(request: Request) -> list[Reply]:
        if isinstance(request, InferRequest) and request.model == "draining":
            return [InferReply(request.id, Status.SHUTTING_DOWN, "draining")]
        return holding(request)

    daemon = make_daemon(script)
    first, second = images(2, seed=15)

    async def main() -> None:
        async with AsyncClient(daemon.endpoint, context=async_context) as client:
            with pytest.raises(ShuttingDown) as refused:
                await client.detect(first, model="draining")
            assert refused.value.retryable
            assert await client.status() == report()
            handle = await client.submit(second, model="hold")
            assert not handle.done()
            assert await client.cancel(handle) is True
            with pytest.raises(Cancelled):
                await handle.result()
            assert await client.cancel(handle) is False
            with pytest.raises(ValueError, match="uint8"):
                await client.detect(cast("Image", first.astype(np.float32)))

    anyio.run(main, backend="asyncio")
    assert [type(r) for r in daemon.requests] == [
        InferRequest, StatusRequest, InferRequest, CancelRequest,
    ]  # fmt: skip


def test_async_close_fails_waiting_calls(
    async_context: zmq.asyncio.Context, make_daemon: Callable[..., FakeDaemon]
) -> None:
    daemon = make_daemon(Holding())
    (image,) = images(1, seed=16)
    errors: list[BaseException] = []
    client = AsyncClient(daemon.endpoint, context=async_context)

    async def main() -> None:
        async def waiter() -> None:
            try:
                await client.detect(image, model="hold")
            except ClientClosed as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg, client:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            await client.status()
            assert client.in_flight == 1
        assert client.closed
        with pytest.raises(ClientClosed):
            await client.status()

    anyio.run(main, backend="asyncio")
    assert len(errors) == 1
    assert client._socket is not None
    assert client._socket.closed


def test_async_client_body_exception_propagates_unwrapped(
    async_context: zmq.asyncio.Context, make_daemon: Callable[..., FakeDaemon]
) -> None:
    daemon = make_daemon()

    async def main() -> None:
        async with AsyncClient(daemon.endpoint, context=async_context):
            raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        anyio.run(main, backend="asyncio")


def test_async_a_dropped_handle_gives_its_slot_back_at_its_deadline(
    async_context: zmq.asyncio.Context, make_daemon: Callable[..., FakeDaemon]
) -> None:
    daemon = make_daemon(Holding())
    first, second = images(2, seed=18)

    async def main() -> None:
        async with AsyncClient(daemon.endpoint, context=async_context, max_in_flight=1) as client:
            await client.status()  # connected: the short timeout below is the reply's only
            dropped = await client.submit(first, model="hold", timeout_s=0.1)
            check_result(await client.detect(second, timeout_s=5.0), second)
            assert dropped.done()
            with pytest.raises(ClientTimeout):
                await dropped.result()
            await anyio.wait_all_tasks_blocked()  # the CANCEL is sent by the client's task
            await client.status()
            assert [r.id for r in daemon.requests if isinstance(r, CancelRequest)] == [
                dropped.request_id
            ]

    anyio.run(main, backend="asyncio")
    assert len(infers(daemon.requests)) == 2
