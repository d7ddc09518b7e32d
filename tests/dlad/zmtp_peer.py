"""A raw ZMTP 3.1 peer (NULL mechanism) for hostile-client tests: it speaks just enough of the
protocol to pass for a DEALER, then floods junk with PING commands among it and hangs up with
a reset (docs/reliability.md, "A flood that vanishes")."""

from __future__ import annotations

import select
import socket
import struct
import time

_GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\0") + bytes(32)


def _command(body: bytes) -> bytes:
    return b"\x04" + bytes([len(body)]) + body


_READY = _command(b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER")
PING = _command(b"\x04PING" + struct.pack(">H", 0))  # no TTL, no context
JUNK = b"\x00\x01\xc1"  # a one-byte message no decoder takes


def flood_and_vanish(host: str, port: int, seconds: float) -> int:
    """Connect, finish the handshake, send junk and PINGs as fast as the socket takes them for
    ``seconds`` (never reading a reply), then reset the connection. Returns the bytes sent."""
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(_GREETING + _READY)
        got = b""
        while b"READY" not in got:  # the server's READY: its handshake (and ZAP's) is done
            more = s.recv(4096)
            if not more:
                raise ConnectionError("the server closed the connection in its handshake")
            got += more
        s.setblocking(False)
        chunk = (JUNK * 15 + PING) * 1024
        sent, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            select.select([], [s], [], 0.05)
            try:
                sent += s.send(chunk)
            except BlockingIOError:
                continue
            except OSError:  # the daemon cut the connection
                break
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return sent
