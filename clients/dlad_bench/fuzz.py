"""Structure-aware fuzzing of a dlad frontend: malformed and mutated multipart messages.

:func:`messages` yields messages built from valid INFER, CANCEL and STATUS requests, each
mutated one or more ways at the level where a decoder can go wrong: the msgpack structure (depth,
types, sizes, duplicate or non-string keys, extension types, invalid UTF-8, truncated or trailing
bytes, bit flips), the fields (missing, unknown, out of range, wrong type, huge), the image
(header/payload size mismatch, oversize dimensions, odd formats) and the frames (none extra, too
many, empty). Every message it yields is under the daemon's ZeroMQ guard (``ZMQ_MAXMSGSIZE``,
twice ``max_message_bytes``), so the daemon owes each one exactly one reply.

:func:`campaign` sends them from one DEALER with a bounded window of messages in flight and
counts the replies. ``bench/fuzz_frontend.py`` runs campaigns from separate processes against a
daemon beside a well-behaved client (docs/reliability.md); the test suite runs a short one.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from dlad import protocol
from dlad.errors import ProtocolError

__all__ = ["CampaignResult", "campaign", "messages"]

_KINDS = (protocol.Kind.INFER, protocol.Kind.CANCEL, protocol.Kind.STATUS,
          protocol.Kind.INFER_BATCH)  # fmt: skip
_FIELDS = ("v", "kind", "id", "model", "image", "stream", "priority", "deadline_ms", "conf",
           "iou", "max_det", "load", "images", "shm")  # fmt: skip
_IMAGE_FIELDS = ("height", "width", "format", "dtype")


def _odd_value(rng: random.Random, max_bytes: int) -> object:
    """A value of a type or size no field expects (or, sometimes, a plausible one)."""
    pick = rng.randrange(16)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice([0, -1, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 255, 256])
    if pick == 3:
        return rng.choice([0.0, -0.0, 1e308, -1e-308, float("nan"), float("inf"), 0.5])
    if pick == 4:
        return "x" * rng.choice([0, 1, 63, 64, 127, 128, 129, 4096])
    if pick == 5:
        return "".join(chr(rng.randrange(0, 0x3000)) for _ in range(rng.randrange(1, 12)))
    if pick == 6:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 16)))
    if pick == 7:
        return [rng.randrange(10) for _ in range(rng.randrange(0, 8))]
    if pick == 8:
        return {"a": 1, "height": 2}
    if pick == 9:
        return _nest(rng.choice([2, 3, 10, 200, 1000]))
    if pick == 10:
        return msgpack.ExtType(rng.randrange(128), b"\x00" * rng.randrange(8))
    if pick == 11:
        return "demo"
    if pick == 12:
        return list(range(min(rng.choice([100, 10_000]), max_bytes // 2)))
    if pick == 13:
        return {str(i): i for i in range(rng.choice([10, 1000]))}
    if pick == 14:
        return rng.randrange(-1000, 1000)
    return rng.random() * 100


def _nest(depth: int) -> object:
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


def _valid(rng: random.Random, width: int, height: int) -> tuple[dict[str, Any], list[bytes]]:
    """A valid request and its payload frames."""
    kind = rng.choice(_KINDS)
    header: dict[str, Any] = {"v": 1, "kind": int(kind), "id": rng.randrange(2**20)}
    if kind in (protocol.Kind.INFER, protocol.Kind.INFER_BATCH):
        header["model"] = "demo"
        images, payloads = [], []
        for _ in range(1 if kind == protocol.Kind.INFER else rng.randrange(1, 4)):
            fmt = rng.choice(protocol.PIXEL_FORMATS)
            image = {"height": height, "width": width, "format": fmt, "dtype": "uint8"}
            if fmt in ("NV12", "YUYV") and rng.random() < 0.5:
                image["colorspace"] = rng.choice(protocol.COLORSPACES)
                image["color_range"] = rng.choice(protocol.COLOR_RANGES)
            if rng.random() < 0.3:
                image["stream"] = f"cam{rng.randrange(4)}"
            images.append(image)
            payloads.append(bytes(math.prod(protocol.frame_shape(fmt, height, width))))
        if kind == protocol.Kind.INFER_BATCH:
            header["images"] = images
        else:
            stream = images[0].pop("stream", None)
            header["image"] = images[0]
            if stream is not None:
                header["stream"] = stream
        return header, payloads
    if kind == protocol.Kind.STATUS and rng.random() < 0.5:
        header["load"] = rng.random() < 0.5
    return header, []


def _image_maps(header: dict[str, Any]) -> list[dict[str, Any]]:
    """The header's image maps still intact (an INFER's ``image``, an INFER_BATCH's ``images``)."""
    images = header.get("images")
    found = [header.get("image"), *(images if isinstance(images, list) else [])]
    return [m for m in found if isinstance(m, dict)]


def _mutate_header(rng: random.Random, header: dict[str, Any], max_bytes: int) -> None:
    pick = rng.randrange(6)
    if pick == 0 and header:
        del header[rng.choice(list(header))]
    elif pick == 1:
        header[rng.choice([*_FIELDS, "zz", "", "\x00"])] = _odd_value(rng, max_bytes)
    elif pick == 2 and (maps := _image_maps(header)):
        image = rng.choice(maps)
        key = rng.choice([*_IMAGE_FIELDS, "extra", "stream", "shm"])
        image[key] = rng.choice(
            [_odd_value(rng, max_bytes), 0, 1, 4096, 4097, 65536, -3, "rgba", "float32"]
        )
    elif pick == 3:
        header["id"] = rng.choice([-1, 2**64, 2**64 - 1, "7", 1.5, None, [1], _nest(50)])
    elif pick == 4:
        header["v"] = rng.choice([0, 2, 255, -1, "1", None, 1.0])
    else:
        header["kind"] = rng.choice([0, 2, 4, 5, 6, 7, 8, 255, 256, -1, "1", None, 1.0])


def _packed(value: object, bin_type: bool = True) -> bytes:
    """``value`` packed, or, if msgpack cannot hold it (an int past 64 bits), its text."""
    try:
        return msgpack.packb(value, use_bin_type=bin_type)  # type: ignore[no-any-return]
    except (ValueError, TypeError, OverflowError):
        return msgpack.packb(repr(value)[:32])  # type: ignore[no-any-return]


def _pack(rng: random.Random, header: dict[str, Any]) -> bytes:
    """Pack ``header`` field by field; sometimes with a duplicate or non-string key."""
    items: list[tuple[object, object]] = list(header.items())
    bin_type = rng.random() < 0.9
    if items and rng.random() < 0.05:  # a duplicate key: the first pair repeated
        items = [items[0], *items]
    if rng.random() < 0.03:  # a non-string key
        items.append((rng.choice([1, 2.5, b"k", None]), 1))
    body = b"".join(_packed(k, bin_type) + _packed(v, bin_type) for k, v in items)
    return _map_prefix(len(items)) + body


def _map_prefix(n: int) -> bytes:
    return bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    raw = bytearray(data)
    pick = rng.randrange(5)
    if pick == 0 and raw:  # flip bits
        for _ in range(rng.randrange(1, 4)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    elif pick == 1:  # truncate
        del raw[rng.randrange(len(raw) + 1) :]
    elif pick == 2:  # trailing bytes
        raw += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
    elif pick == 3:  # an invalid UTF-8 or reserved byte somewhere
        raw.insert(rng.randrange(len(raw) + 1), rng.choice([0xC1, 0xFF, 0xA3, 0xD9, 0xDD]))
    else:  # a header claiming a huge array or string it does not contain
        raw = bytearray(rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdb\x7f\xff\xff\xff", b"\xc6\xff"]))
    return bytes(raw)


def _mutate_payload(rng: random.Random, payload: bytes | None, max_bytes: int) -> bytes:
    pick = rng.randrange(4)
    if payload is None or pick == 0:
        return bytes(rng.randrange(0, 64))
    if pick == 1:
        return payload[: rng.randrange(len(payload) + 1)]
    if pick == 2:
        return payload + bytes(rng.randrange(1, 64))
    return bytes(min(max_bytes + rng.randrange(1, 1024), 2 * max_bytes - 1024))  # over the limit


def messages(
    seed: int, *, max_message_bytes: int, width: int = 8, height: int = 8
) -> Iterator[list[bytes]]:
    """An endless stream of mutated requests (reproducible from ``seed``), each under twice
    ``max_message_bytes`` in all. About one in eight is left valid."""
    rng = random.Random(seed)
    while True:
        header, payloads = _valid(rng, width, height)
        mutations = 0 if rng.random() < 0.125 else rng.randrange(1, 4)
        for _ in range(mutations):
            _mutate_header(rng, header, max_message_bytes)
        packed = _pack(rng, header)
        if mutations and rng.random() < 0.25:
            packed = _mutate_bytes(rng, packed)
        if mutations and rng.random() < 0.2:
            at = rng.randrange(len(payloads) + 1)  # one of them, or one more
            old = payloads[at] if at < len(payloads) else None
            payloads[at : at + 1] = [_mutate_payload(rng, old, max_message_bytes)]
        frames = [packed, *payloads]
        if mutations and rng.random() < 0.05:  # frame count
            frames = rng.choice([[packed, b"", b""], [packed, b"x", b"y", b"z"], [b""]])
        if sum(map(len, frames)) >= 2 * max_message_bytes:  # the ZeroMQ guard would drop it
            frames = [packed[: 2 * max_message_bytes - 1]]
        yield frames


@dataclass
class CampaignResult:
    """What one campaign sent and got back."""

    sent: int = 0
    replies: int = 0
    undecodable: int = 0  # replies the SDK's decoder refuses (a daemon bug)
    statuses: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def unanswered(self) -> int:
        return self.sent - self.replies


def campaign(
    endpoint: str,
    count: int,
    *,
    seed: int,
    max_message_bytes: int,
    window: int = 64,
    reply_timeout_s: float = 30.0,
    context: zmq.Context[Any] | None = None,
) -> CampaignResult:
    """Send ``count`` messages from :func:`messages` to ``endpoint`` from one DEALER, at most
    ``window`` unanswered at a time, and count the replies (waiting at most
    ``reply_timeout_s`` for each one once the window is full or the messages are all sent)."""
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvhwm = sock.sndhwm = 4 * window
    sock.connect(endpoint)
    result = CampaignResult()
    source = messages(seed, max_message_bytes=max_message_bytes)
    t0 = time.monotonic()

    def receive(timeout_s: float) -> bool:
        if not sock.poll(int(timeout_s * 1000)):
            return False
        frames = sock.recv_multipart()
        result.replies += 1
        try:
            reply = protocol.decode_reply(frames)
        except ProtocolError:
            result.undecodable += 1
        else:
            result.statuses[reply.status.name] += 1
        return True

    try:
        while result.sent < count:
            while result.sent - result.replies >= window:
                if not receive(reply_timeout_s):
                    return result  # the daemon stopped answering
            while receive(0):
                pass
            sock.send_multipart(next(source), copy=False)
            result.sent += 1
        while result.replies < result.sent and receive(reply_timeout_s):
            pass
        return result
    finally:
        result.seconds = time.monotonic() - t0
        sock.close(0)
