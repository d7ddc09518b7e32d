"""The closed error hierarchy: one class per non-OK status, and back."""

from __future__ import annotations

import inspect

import pytest

from dlad.errors import (
    STATUS_CLASSES,
    BadRequest,
    DeadlineExceeded,
    DeviceFailed,
    DladError,
    InternalError,
    Overloaded,
    ProtocolError,
    ShuttingDown,
    Status,
    error_for,
)
from dlad_wire import errors

pytestmark = pytest.mark.timeout(30)


def _all_subclasses(cls: type[DladError]) -> set[type[DladError]]:
    out: set[type[DladError]] = set()
    for sub in cls.__subclasses__():
        out |= {sub, *_all_subclasses(sub)}
    return out


def test_status_values_are_the_wire_codes() -> None:
    assert {s.name: int(s) for s in Status} == {
        "OK": 0, "BAD_REQUEST": 1, "NOT_FOUND": 2, "OVERLOADED": 3, "DEADLINE_EXCEEDED": 4,
        "CANCELLED": 5, "SHUTTING_DOWN": 6, "DEVICE_FAILED": 7, "INTERNAL": 8,
    }  # fmt: skip


def test_status_to_class_is_a_bijection() -> None:
    assert set(STATUS_CLASSES) == set(Status) - {Status.OK}
    assert len(set(STATUS_CLASSES.values())) == len(STATUS_CLASSES)
    for status, cls in STATUS_CLASSES.items():
        assert cls.status is status
        assert cls.__bases__ == (DladError,)
    # and back: a class's status leads to that same class
    assert {STATUS_CLASSES[cls.status] for cls in STATUS_CLASSES.values()} == set(
        STATUS_CLASSES.values()
    )


def test_hierarchy_is_closed() -> None:
    """Every error class in the module is a status class or refines one (ProtocolError)."""
    module_classes = {
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, DladError) and obj is not DladError
    }
    assert module_classes == set(STATUS_CLASSES.values()) | {ProtocolError}
    for cls in _all_subclasses(DladError):
        if cls.__module__ != errors.__name__:
            continue  # a test's own subclass elsewhere is not part of the product
        assert issubclass(cls, STATUS_CLASSES[cls.status])
    assert ProtocolError.status is Status.BAD_REQUEST
    assert issubclass(ProtocolError, BadRequest)


def test_the_docstring_draws_every_class() -> None:
    doc = errors.__doc__ or ""
    for cls in (DladError, ProtocolError, *STATUS_CLASSES.values()):
        assert cls.__name__ in doc
    for status in Status:
        if status is not Status.OK:
            assert status.name in doc


def test_retryable() -> None:
    retryable = {cls for cls in STATUS_CLASSES.values() if cls.retryable}
    assert retryable == {Overloaded, ShuttingDown, DeviceFailed}
    assert not DeadlineExceeded.retryable
    assert not ProtocolError.retryable


@pytest.mark.parametrize("status", [s for s in Status if s is not Status.OK])
def test_error_for_gives_the_status_class(status: Status) -> None:
    exc = error_for(int(status), "why", request_id=7)
    assert type(exc) is STATUS_CLASSES[status]
    assert exc.status is status
    assert (exc.message, str(exc), exc.request_id) == ("why", "why", 7)
    with pytest.raises(type(exc)):
        raise exc


@pytest.mark.parametrize("status", [Status.OK, 0, 9, -1, 255])
def test_error_for_refuses_ok_and_unknown(status: int) -> None:
    with pytest.raises(ValueError, match="no error class"):
        error_for(status, "x")


def test_protocol_error_carries_what_was_read() -> None:
    exc = ProtocolError("image.height: bad", field="image.height", request_id=3, request_kind=1)
    assert (exc.field, exc.request_id, exc.request_kind) == ("image.height", 3, 1)
    assert isinstance(exc, BadRequest)
    assert "request_id=3" in repr(exc)
    assert error_for(exc.status, exc.message).__class__ is BadRequest
    assert InternalError().message == ""
