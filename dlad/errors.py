"""The daemon's errors: the wire's closed hierarchy (``dlad_wire.errors``, shared with the SDK:
one class per wire status) and :class:`StartupError`.

:class:`StartupError` stands outside the hierarchy: it is no wire status but the daemon's own
failure to start (a port taken, a core that cannot load), which ``dlad`` reports in one line.
"""

from __future__ import annotations

from dlad_wire.errors import *  # noqa: F403  # the wire's hierarchy, one declaration
from dlad_wire.errors import __all__ as _WIRE

__all__ = [*_WIRE, "StartupError"]  # noqa: PLE0604


class StartupError(RuntimeError):
    """The daemon could not start serving (not a wire status): a port or socket it must bind is
    taken or refused, or a device cannot open its core or load its loadable. ``key`` names the
    config setting to look at (``frontend.endpoints[0]``, ``metrics.port``, ``devices.dla0``)."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message
