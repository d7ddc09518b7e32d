"""Shared-memory frames: the daemon's side of docs/protocol.md's extension for same-host clients.

A client on this host creates a POSIX shared-memory segment (``/dev/shm/<name>``), writes each
frame into a slot of it and sends an INFER whose header names the segment, the slot's offset and
the segment's size, with no payload frame. The daemon maps the segment read-only on first use and
hands the executors a numpy view of the slot: the frame is never copied through the kernel, and
the CPU pre-processing (or, on an Orin, the GPU, which reads host memory natively) reads it in
place.

What keeps it safe and bounded:

- a slot belongs to the daemon from the notification until its reply (the client's side of the
  rule: ``dlad_client`` frees a slot only when the daemon has answered that request);
- a segment is used only by who can read it: its header holds a token the client names it with
  (protocol.shm_header), which the daemon compares before anything else of it is believed or
  said; until the token matches, every refusal has the same words, so that naming another's
  segment tells nothing of it (whether it exists, its size);
- segments are mapped per client identity (two clients naming the same segment get separate
  mappings, each checked), read-only, opened with ``O_NOFOLLOW`` from ``/dev/shm`` only; the
  name, offset and size are checked against the segment before any frame byte is read;
- a client that shrinks a segment the daemon has mapped (``ftruncate``) cannot kill it: reading
  a page the file no longer has raises SIGBUS, which the C++ guard (``dlad/native/shm_guard.hpp``)
  absorbs, mapping zero pages over the segment; the frames of it in flight are refused
  (BAD_REQUEST) and the segment is dropped;
- at most ``[shm] max_segments`` segments and ``max_bytes`` bytes are mapped at once (more is
  OVERLOADED); a segment no frame in the daemon uses is unmapped after ``idle_s`` unused, so a
  client that dies (its segment unlinked by its resource tracker) or never reads its replies
  leaves nothing mapped once its frames are answered.
"""

from __future__ import annotations

import hmac
import mmap
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import structlog

from dlad import _native
from dlad.config import ShmConfig
from dlad.errors import BadRequest, Overloaded
from dlad.protocol import SHM_HEADER_BYTES, SHM_MAGIC, ShmRef, shm_header

__all__ = ["SHM_DIR", "SharedFrames"]

SHM_DIR = "/dev/shm"  # noqa: S108  # shm_open's namespace, not a temporary file
"""Where POSIX shared-memory objects live on Linux (``shm_open(3)``)."""

log = structlog.get_logger("dlad.shm")

_LOOPBACK = ("127.", "::1", "localhost")  # tcp loopback peers; "localhost:..." is an ipc peer


@dataclass(eq=False, slots=True)
class _Segment:
    name: str
    size: int
    token: bytes
    map: mmap.mmap
    users: int = 0  # frames admitted and not yet answered
    last_used: float = 0.0


@dataclass(slots=True)
class ShmStats:
    segments: int = 0
    mapped_bytes: int = 0
    frames: int = 0  # shared-memory frames resolved since start
    reclaimed: int = 0  # segments unmapped after idling


class SharedFrames:
    """The client segments the daemon has mapped, by (client identity, segment name).

    Everything is called on the daemon's event loop.
    """

    def __init__(
        self, config: ShmConfig, *, clock: Callable[[], float] = time.monotonic, root: str = SHM_DIR
    ) -> None:
        self.config = config
        self._clock = clock
        self._root = root
        self._segments: dict[tuple[str, str], _Segment] = {}
        self._closing: list[mmap.mmap] = []  # unmapped, closed once no frame view remains
        self.stats = ShmStats()
        if not _native.shm_guard_install():
            raise OSError("cannot install the SIGBUS guard of shared-memory segments")
        # Told of each mapping's base address and size, and of its end (the GPU registers
        # segments so that its pre-processing reads frames without a CPU copy).
        self.on_map: Callable[[int, int], None] | None = None
        self.on_unmap: Callable[[int], None] | None = None

    @staticmethod
    def peer_is_local(peer: str) -> bool:
        """Whether a connection's ``Peer-Address`` (ZeroMQ message metadata) is this host: an
        ``ipc://`` peer or a loopback tcp one."""
        return peer.startswith(_LOOPBACK)

    def resolve(self, owner: str, ref: ShmRef, nbytes: int) -> memoryview:
        """The ``nbytes`` at ``ref.offset`` of ``owner``'s segment ``ref.name`` (mapped now if
        new), read-only. Raises BadRequest (the segment does not exist, is not the size the
        client says, or the frame does not fit in it) or Overloaded (the map limits)."""
        if ref.offset + nbytes > ref.size:
            raise BadRequest(
                f"shm: a {nbytes}-byte frame at offset {ref.offset} ends past the segment's "
                f"{ref.size} bytes"
            )
        key = (owner, ref.name)
        seg = self._segments.get(key)
        if seg is not None and not hmac.compare_digest(seg.token, ref.token):
            raise _not_yours(ref)
        if seg is not None and self.broken(owner, ref.name):  # the client shrank it
            if seg.users:
                raise BadRequest(
                    f"shm: segment {ref.name!r} was truncated while frames of it are in "
                    "flight; a client must not resize a segment in use"
                )
            self._unmap(key)  # mapped again below: its size is checked
            seg = None
        if seg is None or seg.size != ref.size:
            seg = self._map(key, ref)
        seg.last_used = self._clock()
        self.stats.frames += 1
        return memoryview(seg.map)[ref.offset : ref.offset + nbytes]

    def hold(self, owner: str, name: str) -> None:
        """A frame of this segment was admitted: it stays mapped until :meth:`release`."""
        seg = self._segments.get((owner, name))
        if seg is not None:
            seg.users += 1

    def release(self, owner: str, name: str) -> None:
        """A frame of this segment was answered."""
        seg = self._segments.get((owner, name))
        if seg is not None and seg.users > 0:
            seg.users -= 1
            seg.last_used = self._clock()

    def size_of(self, owner: str, name: str) -> int | None:
        """The size of ``owner``'s segment ``name`` as mapped, or None where it is not."""
        seg = self._segments.get((owner, name))
        return None if seg is None else seg.size

    def broken(self, owner: str, name: str) -> bool:
        """Whether ``owner``'s segment ``name`` is mapped and a read of it found the file
        shrunk (the guard then reads zeros there)."""
        seg = self._segments.get((owner, name))
        return seg is not None and _native.shm_broken(_address(seg.map))

    def address_of(self, owner: str, name: str) -> int:
        """Where ``owner``'s segment ``name`` is mapped in this process (0: it is not)."""
        seg = self._segments.get((owner, name))
        return 0 if seg is None else _address(seg.map)

    def unmap(self, owner: str, name: str) -> None:
        """Unmap ``owner``'s segment ``name`` now, whatever holds it (the native data plane's
        reclaim: it has let the segment go)."""
        if (owner, name) in self._segments:
            self._unmap((owner, name))
            self.stats.reclaimed += 1
        self._close_pending()

    def reclaim(self) -> int:
        """Unmap the segments no frame uses that have idled ``idle_s``; returns how many."""
        now = self._clock()
        idle = [k for k, s in self._segments.items()
                if not s.users and now - s.last_used >= self.config.idle_s]  # fmt: skip
        for key in idle:
            self._unmap(key)
        self.stats.reclaimed += len(idle)
        self._close_pending()
        return len(idle)

    def close(self) -> None:
        """Unmap everything (the daemon's end)."""
        for key in list(self._segments):
            self._unmap(key)
        self._close_pending()

    @property
    def segments(self) -> int:
        return len(self._segments)

    @property
    def closing(self) -> int:
        """Maps of unmapped segments still waiting for their last frame view to go."""
        return len(self._closing)

    @property
    def mapped_bytes(self) -> int:
        return sum(s.size for s in self._segments.values())

    # ------------------------------------------------------------------ internals
    def _map(self, key: tuple[str, str], ref: ShmRef) -> _Segment:
        old = self._segments.get(key)
        if old is not None:
            if old.users:
                raise BadRequest(
                    f"shm: segment {ref.name!r} was {old.size} bytes while frames of it are "
                    f"in flight; a client must not resize a segment in use"
                )
            self._unmap(key)
        cfg = self.config
        if len(self._segments) >= cfg.max_segments:
            self.reclaim()
        if len(self._segments) >= cfg.max_segments:
            raise Overloaded(f"shm: {cfg.max_segments} client segments are mapped, the most")
        if self.mapped_bytes + ref.size > cfg.max_bytes:
            self.reclaim()
            if self.mapped_bytes + ref.size > cfg.max_bytes:
                raise Overloaded(
                    f"shm: mapping {ref.size} more bytes would pass the {cfg.max_bytes}-byte "
                    f"budget of client segments"
                )
        path = os.path.join(self._root, ref.name)
        try:
            # O_NONBLOCK: opening a FIFO (or a device) a client put there must not block the
            # event loop; its type is refused below, before anything reads it.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            raise _not_yours(ref) from None
        try:
            st = os.fstat(fd)
            # a read, not the map: a file shrunk meanwhile reads short instead of faulting
            if not (stat.S_ISREG(st.st_mode) and st.st_size > SHM_HEADER_BYTES) or not (
                hmac.compare_digest(os.pread(fd, SHM_HEADER_BYTES, 0), shm_header(ref.token))
            ):
                raise _not_yours(ref)
            # from here the client has shown the segment is theirs: its size may be told
            if st.st_size != ref.size:
                raise BadRequest(
                    f"shm: segment {ref.name!r} is {st.st_size} bytes, the request says {ref.size}"
                )
            m = mmap.mmap(fd, ref.size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        if not _native.shm_watch(_address(m), ref.size):
            m.close()
            raise Overloaded("shm: the guard watches as many segments as it can; try later")
        seg = _Segment(ref.name, ref.size, ref.token, m)
        self._segments[key] = seg
        if self.on_map is not None:
            self.on_map(_address(m), ref.size)
        log.info("shm_mapped", segment=ref.name, bytes=ref.size, client=key[0][:16])
        return seg

    def _unmap(self, key: tuple[str, str]) -> None:
        m = self._segments.pop(key).map
        if self.on_unmap is not None:
            self.on_unmap(_address(m))
        self._closing.append(m)

    def _close_pending(self) -> None:
        """Close the maps of unmapped segments whose last frame view has gone (a view still
        alive, e.g. a frame a worker thread holds, keeps its map until the next pass)."""
        self._closing = [m for m in self._closing if not _closed(m)]


def _not_yours(ref: ShmRef) -> BadRequest:
    """The one refusal of a segment whose header does not hold the request's token, for
    whatever reason (none by that name, not a file, too small, unreadable, another token)."""
    return BadRequest(
        f"shm: segment {ref.name!r} is not this client's: no segment of that name starts with "
        f"the header ({SHM_MAGIC!r}) holding this token (docs/protocol.md, Shared-memory frames)"
    )


def _closed(m: mmap.mmap) -> bool:
    """Close ``m`` (its guard first: its range may be reused); False while a view of it is
    still alive (try again later; it stays guarded)."""
    address, size = _address(m), len(m)
    _native.shm_forget(address)
    try:
        m.close()
    except BufferError:
        _native.shm_watch(address, size)
        return False
    return True


def _address(m: mmap.mmap) -> int:
    """Where ``m`` is mapped (a read-only map has no writable buffer for ctypes: numpy's)."""
    return int(np.frombuffer(m, np.uint8, count=1).ctypes.data)
