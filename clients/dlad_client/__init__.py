"""dlad's client SDK: :class:`Client` (synchronous) and :class:`AsyncClient` (anyio on asyncio).

Both send INFER, INFER_BATCH, CANCEL and STATUS requests of wire protocol v1
(``docs/protocol.md``) over one ZeroMQ DEALER socket connected to one or more daemons, with many
requests in flight::

    from dlad_client import AsyncClient, Client, Overloaded

    with Client("tcp://127.0.0.1:5555") as client:
        result = client.detect(image)            # H x W x 3 uint8, RGB
        for x1, y1, x2, y2, score, cls in result.detections:
            ...
        handles = [client.submit(frame, stream="cam0") for frame in frames]   # pipelined
        results = [h.result() for h in handles]
        rig = client.detect_batch([left, right], streams=["left", "right"])  # one message:
        # a Result or the error (Cancelled, Overloaded, ...) of each frame, in order

    async with AsyncClient(["tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555"]) as client:
        result = await client.detect(image, pixel_format="BGR", deadline_ms=50)

    # many daemons (a fleet of Orins): least-loaded choice, retries, a circuit breaker
    async with AsyncFleet(resolve="dlad.dlad.svc.cluster.local:5555") as fleet:
        result = await fleet.detect(image, stream="cam0")

Errors: a non-OK reply raises the class of :mod:`dlad_wire.errors` for its status (the same classes
the daemon uses, re-exported here), so ``except Overloaded`` means what the daemon meant::

    Exception
     ├── DladError                  a daemon's answer (``retryable`` says whether a retry helps)
     │    ├── BadRequest            (also raised before sending for an out-of-range field)
     │    │    └── ProtocolError
     │    ├── NotFound, Overloaded, DeadlineExceeded, Cancelled,
     │    └── ShuttingDown, DeviceFailed, InternalError
     ├── TimeoutError
     │    └── ClientTimeout         no reply within the client's own timeout (not a wire status)
     ├── RuntimeError
     │    └── ClientClosed          the client was closed
     └── ValueError, TypeError      a bad image or setting, before anything is sent
"""

__version__ = "0.1.0"  # dlad-client's; the daemon of the same release is dlad.__version__

from dlad_client._async import AsyncClient, AsyncHandle
from dlad_client._client import BatchHandle, Client, Handle
from dlad_client._core import ClientClosed, ClientTimeout, CurveKeys, Result
from dlad_client._fleet import AsyncFleet, Fleet, FleetHandle, MemberState
from dlad_wire.errors import (
    BadRequest,
    Cancelled,
    DeadlineExceeded,
    DeviceFailed,
    DladError,
    InternalError,
    NotFound,
    Overloaded,
    ProtocolError,
    ShuttingDown,
    Status,
)
from dlad_wire.protocol import DaemonStatus, PixelFormat, Timing, YuvFormat

__all__ = [
    "AsyncClient", "AsyncFleet", "AsyncHandle", "BadRequest", "BatchHandle", "Cancelled", "Client",
    "ClientClosed", "ClientTimeout", "CurveKeys", "DaemonStatus", "DeadlineExceeded",
    "DeviceFailed", "DladError", "Fleet", "FleetHandle", "Handle", "InternalError", "MemberState",
    "NotFound", "Overloaded", "PixelFormat", "ProtocolError", "Result", "ShuttingDown", "Status",
    "Timing", "YuvFormat",
]  # fmt: skip
