"""A fake dlad for SDK tests: a ROUTER on a random loopback port, served by one thread.

It decodes every request with :mod:`dlad.protocol` (as the daemon does), records it, and sends
whatever replies its *script* returns for it: the script runs on the fake's thread, sees each
request once, in arrival order, and may hold requests back and answer them later (in any order),
since a reply is routed back to the connection its id arrived on. A request that does not decode
is recorded in :attr:`FakeDaemon.refused` and answered with the daemon's error reply.

The fake owns its context; :meth:`FakeDaemon.close` stops the thread and proves that every socket
of that context was closed (``term()`` would hang otherwise). An exception in the script is
re-raised by :meth:`close`, so a broken script fails its test instead of hanging it.

Also here: the scripts the tests use (:func:`answer`, :class:`Holding`) and their test data
(:func:`images`, and :func:`check_result`, which recomputes from the image a test sent what
:func:`detections_for` made of the request on the fake's side).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq

from dlad.errors import ProtocolError, Status
from dlad.protocol import (
    CancelReply,
    CancelRequest,
    DaemonStatus,
    DeviceStatus,
    InferReply,
    InferRequest,
    Reply,
    Request,
    StatusReply,
    StatusRequest,
    Timing,
    decode_request,
    encode,
    encode_error_reply,
)
from dlad_client import Result

Script = Callable[[Request], Sequence[Reply]]


def term_or_fail(context: zmq.Context[Any], timeout_s: float = 5.0) -> None:
    """Terminate ``context``, failing if a socket of it is still open (``term`` blocks then)."""
    thread = threading.Thread(target=context.term, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise AssertionError(f"context {context} did not terminate: sockets were left open")


def detections_for(request: InferRequest) -> np.ndarray:
    """A reply's detections derived from the request (id and image), so a mismatched reply
    shows: one row ``[id, mean, h, w, score, class]`` per request."""
    mean = float(request.image.mean())
    score = 0.5 + (request.id % 50) / 100
    row = [request.id, mean, request.height, request.width, score, request.id % 80]
    return np.array([row], dtype=np.float32)


TIMING = Timing(queue_us=120, pre_us=40, device_us=900, post_us=60, total_us=1150,
                start_ns=5_000_000_000, end_ns=5_000_900_000)  # fmt: skip


def ok_reply(request: InferRequest, device: str = "dla0") -> InferReply:
    """A successful INFER_REPLY carrying :func:`detections_for` the request."""
    return InferReply(request.id, Status.OK, "", device, TIMING, detections_for(request))


CLASS_NAMES = tuple(f"class-{i}" for i in range(80))
"""The fake's model's class names."""


def report(name: str = "fake") -> DaemonStatus:
    """A valid STATUS report of a daemon with two DLA cores and one model."""

    def core(index: int) -> DeviceStatus:
        return {"name": f"dla{index}", "kind": "dla", "core": index, "healthy": True,
                "busy": False, "state": "serving", "reason": "", "in_flight": 0,
                "queue_depth": 0, "completed": 7, "failed": 0,
                "service_time_us": 1500.0,
                "host_us": 0.0, "max_batch": 1, "batches": [7]}  # fmt: skip

    return {
        "name": name, "state": "RUNNING", "live": True, "ready": True, "version": "0.1.0",
        "protocol": 1, "devices": [core(0), core(1)],
        "models": [{"name": "demo", "devices": ["dla0", "dla1"], "input_height": 256,
                    "input_width": 256, "classes": 80, "family": "yolov5",
                    "class_names": list(CLASS_NAMES)}],
        "queues": {"depth": 0, "capacity": 64, "streams": 0},
    }  # fmt: skip


class FakeDaemon:
    """See the module docstring. ``endpoint`` is where to connect."""

    def __init__(self, script: Script) -> None:
        self._script = script
        self._context: zmq.Context[Any] = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.linger = 0
        port = self._router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        # The test thread stops the fake through an inproc PAIR, so the fake's thread can block
        # in poll() without a timeout.
        control = f"inproc://fake-daemon-control-{id(self)}"
        self._control_rx = self._context.socket(zmq.PAIR)
        self._control_rx.linger = 0
        self._control_rx.bind(control)
        self._control_tx = self._context.socket(zmq.PAIR)
        self._control_tx.linger = 0
        self._control_tx.connect(control)
        self._changed = threading.Condition()
        self._requests: list[Request] = []
        self._refused: list[ProtocolError] = []
        self._routes: dict[int, bytes] = {}
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="fake-dlad", daemon=True)
        self._thread.start()

    @property
    def requests(self) -> list[Request]:
        """Every request decoded so far, in arrival order (a copy)."""
        with self._changed:
            return list(self._requests)

    @property
    def refused(self) -> list[ProtocolError]:
        """Every message that did not decode, in arrival order (a copy)."""
        with self._changed:
            return list(self._refused)

    def wait_for(
        self, predicate: Callable[[list[Request]], bool], timeout_s: float = 5.0
    ) -> list[Request]:
        """Block until ``predicate(requests)`` holds (checked at each arrival); returns them."""
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(self._requests), timeout_s):
                raise AssertionError(f"fake daemon: condition not met; got {self._requests}")
            return list(self._requests)

    def close(self) -> None:
        """Stop the thread, close every socket, and prove the context terminates."""
        self._control_tx.send(b"stop")
        self._thread.join(5.0)
        if self._thread.is_alive():
            raise AssertionError("fake daemon thread did not stop")
        self._control_tx.close()
        term_or_fail(self._context)
        if self._failure is not None:
            raise self._failure

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._control_rx, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._control_rx in ready:
                    return
                self._handle(self._router.recv_multipart(copy=False))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread by close()
            self._failure = exc
        finally:
            self._router.close()
            self._control_rx.close()

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity, body = frames[0].bytes, frames[1:]
        try:
            request = decode_request(body)
        except ProtocolError as exc:
            with self._changed:
                self._refused.append(exc)
                self._changed.notify_all()
            self._router.send_multipart([identity, *encode_error_reply(exc)])
            return
        with self._changed:
            self._requests.append(request)
            self._routes[request.id] = identity
            self._changed.notify_all()
        for reply in self._script(request):
            if reply.id is None:
                raise AssertionError("a script reply needs an id to be routed")
            self._router.send_multipart([self._routes[reply.id], *encode(reply)], copy=False)


# ------------------------------------------------------------------------------ scripts


def answer(request: Request) -> list[Reply]:
    """What a healthy daemon with nothing queued answers."""
    if isinstance(request, InferRequest):
        return [ok_reply(request)]
    if isinstance(request, StatusRequest):
        return [StatusReply(request.id, Status.OK, "", report())]
    return [CancelReply(request.id, Status.NOT_FOUND, "nothing queued with that id")]


class Holding:
    """A script that holds every INFER of model ``"hold"`` until ``release`` of them are held
    (then answers them in a shuffled order) or a CANCEL names one (then cancels that one, as the
    daemon would, and answers the others). Everything else gets :func:`answer`."""

    def __init__(self, release: int | None = None, seed: int = 0) -> None:
        self.release = release
        self.held: list[InferRequest] = []
        self.rng = random.Random(seed)

    def __call__(self, request: Request) -> list[Reply]:
        if isinstance(request, InferRequest) and request.model == "hold":
            self.held.append(request)
            return self._flush(None) if len(self.held) == self.release else []
        if isinstance(request, CancelRequest) and any(r.id == request.id for r in self.held):
            return [CancelReply(request.id, Status.OK, ""), *self._flush(request.id)]
        return answer(request)

    def _flush(self, cancelled: int | None) -> list[Reply]:
        replies: list[Reply] = [
            InferReply(r.id, Status.CANCELLED, "cancelled by the client")
            if r.id == cancelled
            else ok_reply(r)
            for r in self.held
        ]
        self.held.clear()
        self.rng.shuffle(replies)
        return replies


# ------------------------------------------------------------------------------ test data

Image = npt.NDArray[np.uint8]


def images(n: int, seed: int, shape: tuple[int, ...] = (24, 32, 3)) -> list[Image]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(n)]


def check_result(result: Result, image: Image) -> None:
    """The detections the fake derives from a request, recomputed here from what was sent."""
    h, w = image.shape[:2]
    rid = result.request_id
    expected = [rid, image.mean(), h, w, 0.5 + (rid % 50) / 100, rid % 80]
    np.testing.assert_allclose(result.detections, [expected], rtol=1e-6)


def infers(requests: list[Request]) -> list[InferRequest]:
    return [r for r in requests if isinstance(r, InferRequest)]
