"""The closed error hierarchy of dlad: one class per wire status, shared by the daemon and the SDK.

Every reply carries a :class:`Status`; every non-OK status has exactly one class here, and the SDK
raises that class for it, so ``except Overloaded:`` means the same thing on both sides of the wire::

    Exception
     └── DladError                  status             retryable
          ├── BadRequest            BAD_REQUEST        no
          │    └── ProtocolError    BAD_REQUEST        no    the message itself is malformed
          ├── NotFound              NOT_FOUND          no
          ├── Overloaded            OVERLOADED         yes
          ├── DeadlineExceeded      DEADLINE_EXCEEDED  no
          ├── Cancelled             CANCELLED          no
          ├── ShuttingDown          SHUTTING_DOWN      yes
          ├── DeviceFailed          DEVICE_FAILED      yes
          └── InternalError         INTERNAL           no

``retryable`` says whether sending the *same* request again (to this daemon later, or to another
one) can succeed. Inference has no side effects, so a retry is always safe; the flag only says
whether it is useful. A deadline that expired once will expire again for the same frame, so
``DeadlineExceeded`` is not retryable; a client that wants another try sends a new request.

:class:`ProtocolError` is the only class below a status class: the wire decoder raises it with the
offending field and whatever request id and kind it could still read, so the daemon can address
its ``BAD_REQUEST`` reply. On the wire it is plain ``BAD_REQUEST``; :func:`error_for` never
returns it.

Only the standard library is imported.
"""

from __future__ import annotations

import enum
from typing import ClassVar, Final

__all__ = [
    "STATUS_CLASSES", "BadRequest", "Cancelled", "DeadlineExceeded", "DeviceFailed", "DladError",
    "InternalError", "NotFound", "Overloaded", "ProtocolError", "ShuttingDown", "Status",
    "error_for",
]  # fmt: skip


class Status(enum.IntEnum):
    """Outcome of a request, as sent in every reply's ``status`` field (a msgpack int).

    The values are part of protocol v1 and never change meaning; a new status needs a new
    protocol version.
    """

    OK = 0
    BAD_REQUEST = 1
    NOT_FOUND = 2
    OVERLOADED = 3
    DEADLINE_EXCEEDED = 4
    CANCELLED = 5
    SHUTTING_DOWN = 6
    DEVICE_FAILED = 7
    INTERNAL = 8


class DladError(Exception):
    """Base of every error dlad answers or the SDK raises; never raised itself.

    ``message`` is the human-readable text sent in the reply's ``message`` field. ``request_id``
    is the id of the request the error answers, where known (``None`` otherwise), and
    ``request_kind`` its raw ``kind``, where known: with both, the answer is that kind's reply.
    """

    status: ClassVar[Status] = Status.INTERNAL
    retryable: ClassVar[bool] = False

    def __init__(
        self, message: str = "", *, request_id: int | None = None, request_kind: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.request_kind = request_kind

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, request_id={self.request_id!r})"


class BadRequest(DladError):
    """The request is invalid (a field out of range, an image too large, ...); do not resend it."""

    status = Status.BAD_REQUEST


class ProtocolError(BadRequest):
    """A message that does not follow the wire protocol (raised by :mod:`dlad.protocol`).

    ``field`` is the dotted path of the offending field (``"image.height"``, ``"frames"``,
    ``"header"``), also named at the start of ``message``. ``request_kind`` is the raw ``kind``
    integer of the header when it could be read, else ``None``; ``request_id`` likewise.
    """

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        request_id: int | None = None,
        request_kind: int | None = None,
    ) -> None:
        super().__init__(message, request_id=request_id, request_kind=request_kind)
        self.field = field


class NotFound(DladError):
    """The named model does not exist, or (CANCEL) no queued request has that id."""

    status = Status.NOT_FOUND


class Overloaded(DladError):
    """A bounded queue was full: the request was refused at once, never queued. Back off."""

    status = Status.OVERLOADED
    retryable = True


class DeadlineExceeded(DladError):
    """The request's deadline passed before it could be dispatched; it never ran on a device."""

    status = Status.DEADLINE_EXCEEDED


class Cancelled(DladError):
    """The client withdrew the request before it ran: a CANCEL for it, or (for a request with a
    ``stream``) a newer frame of the same stream that superseded it while queued."""

    status = Status.CANCELLED


class ShuttingDown(DladError):
    """The daemon is draining or stopping and takes no new work; another daemon may."""

    status = Status.SHUTTING_DOWN
    retryable = True


class DeviceFailed(DladError):
    """The device running the request faulted or timed out; another device may succeed."""

    status = Status.DEVICE_FAILED
    retryable = True


class InternalError(DladError):
    """A bug in dlad. The daemon stays up; the request got this instead of a result."""

    status = Status.INTERNAL


STATUS_CLASSES: Final[dict[Status, type[DladError]]] = {
    Status.BAD_REQUEST: BadRequest,
    Status.NOT_FOUND: NotFound,
    Status.OVERLOADED: Overloaded,
    Status.DEADLINE_EXCEEDED: DeadlineExceeded,
    Status.CANCELLED: Cancelled,
    Status.SHUTTING_DOWN: ShuttingDown,
    Status.DEVICE_FAILED: DeviceFailed,
    Status.INTERNAL: InternalError,
}
"""The one class for each non-OK status (a bijection; ``OK`` has no class)."""


def error_for(status: Status | int, message: str, *, request_id: int | None = None) -> DladError:
    """The exception for a non-OK wire status, e.g. to raise in the SDK from a reply.

    Raises ValueError if ``status`` is ``OK`` or not a :class:`Status` value (the wire decoder
    refuses unknown statuses before this is reached, so here it is a caller's bug).
    """
    try:
        cls = STATUS_CLASSES[Status(status)]
    except (ValueError, KeyError):
        raise ValueError(f"no error class for status {status!r}") from None
    return cls(message, request_id=request_id)
