"""systemd's service notification protocol (``sd_notify(3)``), for ``Type=notify`` units.

A unit with ``Type=notify`` gives its service ``$NOTIFY_SOCKET``, a unix datagram socket (a path,
or ``@name`` in the abstract namespace); the service sends it newline-separated ``KEY=value``
lines: ``READY=1`` once it serves, ``WATCHDOG=1`` at least every half ``WatchdogSec`` (systemd
passes it as ``$WATCHDOG_USEC``, and restarts a service that misses it), ``STOPPING=1`` when it
starts to stop, ``STATUS=...`` for ``systemctl status``. The protocol is a datagram of text, so
no library is needed (docs/jetson.md, "systemd").

Without ``$NOTIFY_SOCKET`` (not under systemd, or another unit type) every call does nothing.
A send that fails (systemd gone, the socket full) is logged once and otherwise ignored: a
notification never stops the daemon.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import structlog

__all__ = ["Notifier"]

log = structlog.get_logger("dlad")


class Notifier:
    """Notifications to the service manager named by ``env`` (``os.environ`` by default).

    ``watchdog_s`` is the interval systemd expects ``WATCHDOG=1`` within (``$WATCHDOG_USEC``,
    when ``$WATCHDOG_PID`` is unset or this process), else None.
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        path = env.get("NOTIFY_SOCKET", "")
        self.address: str | bytes | None = None
        if path.startswith("@"):  # the abstract namespace: a leading NUL byte
            self.address = b"\0" + path[1:].encode()
        elif path.startswith("/"):
            self.address = path
        self.watchdog_s: float | None = None
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        mine = not pid or (pid.isdigit() and int(pid) == os.getpid())
        if self.address is not None and usec.isdigit() and int(usec) > 0 and mine:
            self.watchdog_s = int(usec) / 1e6
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def ready(self, status: str) -> None:
        """The daemon serves: ``systemctl start`` returns now."""
        self._send(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")

    def watchdog(self) -> None:
        """The event loop turned (sent from the daemon's heartbeat)."""
        if self.watchdog_s is not None:
            self._send("WATCHDOG=1")

    def stopping(self, status: str) -> None:
        """The daemon drains: systemd waits (``TimeoutStopSec``) instead of killing it."""
        self._send(f"STOPPING=1\nSTATUS={status}")

    def status(self, status: str) -> None:
        self._send(f"STATUS={status}")

    def _send(self, message: str) -> None:
        if self.address is None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message.encode(), self.address)
        except OSError as exc:
            if not self._failed:  # once: a manager that went away is not news every beat
                self._failed = True
                log.warning("sd_notify_failed", socket=os.fsdecode(self.address).lstrip("\0"),
                            reason=exc.strerror or str(exc))  # fmt: skip
