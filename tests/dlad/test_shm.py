"""Shared-memory frames (docs/protocol.md, "Shared-memory frames"): the SDK's slots, the
daemon's segment table, and every refusal a bad notification gets."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import anyio
import msgpack
import numpy as np
import pytest

from dlad import _native, protocol
from dlad.config import ShmConfig, load_config
from dlad.daemon import Daemon
from dlad.errors import BadRequest, Overloaded, Status
from dlad.shm import SHM_DIR, SharedFrames
from dlad_client import AsyncClient, Client
from dlad_client._core import ShmSlots
from tests.dlad.serving import serve_in_thread
from tests.dlad.test_daemon import CONFIG, IMAGE, dealer, recv, running
from tests.dlad.test_metrics import wait_for

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason=f"needs {SHM_DIR} (Linux)")

SLOT = 4 << 20  # fits the 640 x 480 x 3 demo image (921,600 B)
H = protocol.SHM_HEADER_BYTES  # a segment's header: frames lie after it
TOKEN = bytes(range(16))  # the test segments' token (protocol.shm_header)


def _infer_header(rid: int, shm: dict[str, object], image: np.ndarray = IMAGE) -> bytes:
    h, w, _ = image.shape
    header = {"v": 1, "kind": 1, "id": rid, "model": "demo", "shm": shm,
              "image": {"height": h, "width": w, "format": "RGB", "dtype": "uint8"}}  # fmt: skip
    return msgpack.packb(header)


def test_frames_from_shared_memory_get_the_same_detections_as_inline(tmp_path: Path) -> None:
    with running(tmp_path, mode="numeric", latency=500.0) as (daemon, ep):
        with Client(ep) as plain:
            inline = plain.detect(IMAGE)
        with Client(ep, shm_slot_bytes=SLOT, max_in_flight=4) as client:
            copied = client.detect(IMAGE)  # copied into a free slot once
            frame = client.frame(IMAGE.shape)
            assert frame is not None
            frame[...] = IMAGE  # rendered in place: no copy at all
            in_place = client.detect(frame)
            handles = [client.submit(IMAGE) for _ in range(4)]
            pipelined = [h.result() for h in handles]
            assert client.shm is not None
            assert client.shm.inline == 0
            assert client.shm.free == 4  # every slot back once its reply came
        assert daemon.frontend.shm is not None
        assert daemon.frontend.shm_frames == 6
    for r in (copied, in_place, *pipelined):
        np.testing.assert_array_equal(r.detections, inline.detections)
    assert len(inline) > 0


def test_the_async_client_sends_shared_memory_frames(tmp_path: Path) -> None:
    async def main(ep: str) -> list[np.ndarray]:
        async with AsyncClient(ep, shm_slot_bytes=SLOT, max_in_flight=3) as client:
            async with anyio.create_task_group() as tg:
                out: list[np.ndarray] = []

                async def one() -> None:
                    out.append((await client.detect(IMAGE)).detections)

                for _ in range(6):
                    tg.start_soon(one)
            assert client.shm is not None
            assert (client.shm.inline, client.shm.free) == (0, 3)
            return out

    with running(tmp_path, mode="numeric", latency=500.0) as (daemon, ep):
        with Client(ep) as plain:
            inline = plain.detect(IMAGE).detections
        results = anyio.run(main, ep)
        assert daemon.frontend.shm is not None
        assert daemon.frontend.shm_frames == 6
    for det in results:
        np.testing.assert_array_equal(det, inline)


def test_a_frame_too_big_for_a_slot_or_with_every_slot_taken_goes_inline() -> None:
    slots = ShmSlots(2, 4096)
    try:
        big = np.zeros((64, 64, 3), np.uint8)  # 12,288 B > one slot
        assert slots.place(1, big) is None
        small = np.ones((16, 16, 3), np.uint8)
        a, b = slots.place(2, small), slots.place(3, small)
        assert a is not None
        assert b is not None
        assert (a.offset, b.offset) == (H, H + 4096)
        assert slots.place(4, small) is None  # both slots are the daemon's
        assert slots.inline == 2
        slots.answered(2)
        c = slots.place(5, small)
        assert c is not None
        assert c.offset == H  # the answered slot is reused
        with open(os.path.join(SHM_DIR, slots.name), "rb") as f:  # what the daemon maps
            assert f.read(H) == protocol.shm_header(c.token)
            written = np.frombuffer(f.read(small.nbytes), np.uint8)
        np.testing.assert_array_equal(written, small.reshape(-1))
    finally:
        slots.close()
    assert not os.path.exists(os.path.join(SHM_DIR, slots.name))  # unlinked on close


def test_a_client_for_another_host_cannot_ask_for_shared_memory() -> None:
    with pytest.raises(ValueError, match="on this host"):
        Client("tcp://10.1.2.3:5555", shm_slot_bytes=SLOT)
    with pytest.raises(ValueError, match="needs shm_slot_bytes"):
        Client("tcp://127.0.0.1:5555", shm_slots=4)
    assert SharedFrames.peer_is_local("127.0.0.1")
    assert SharedFrames.peer_is_local("::1")
    assert SharedFrames.peer_is_local("localhost:0:0:1234")  # an ipc:// peer
    assert not SharedFrames.peer_is_local("10.0.0.7")
    assert not SharedFrames.peer_is_local("")


@pytest.fixture
def segment() -> Iterator[shared_memory.SharedMemory]:
    seg = shared_memory.SharedMemory(create=True, size=2 * SLOT)
    assert seg.buf is not None
    seg.buf[:H] = protocol.shm_header(TOKEN)
    np.frombuffer(seg.buf, np.uint8)[H : H + IMAGE.nbytes] = IMAGE.reshape(-1)
    yield seg
    seg.close()
    seg.unlink()


@pytest.mark.parametrize(
    ("shm", "frames", "field"),
    [
        (
            {"name": "dlad-no-such-segment", "offset": H, "size": 2 * SLOT, "token": TOKEN},
            1,
            "is not this client's",
        ),
        (
            {"name": "{seg}", "offset": H, "size": 2 * SLOT, "token": bytes(16)},
            1,
            "is not this client's",
        ),
        (
            {"name": "{seg}", "offset": 2 * SLOT - 1000, "size": 2 * SLOT, "token": TOKEN},
            1,
            "ends past",
        ),
        ({"name": "{seg}", "offset": H, "size": SLOT, "token": TOKEN}, 1, "the request says"),
        ({"name": "{seg}", "offset": 2 * SLOT, "size": 2 * SLOT, "token": TOKEN}, 1, "shm.offset"),
        ({"name": "{seg}", "offset": 0, "size": 2 * SLOT, "token": TOKEN}, 1, "shm.offset"),
        ({"name": "../etc/passwd", "offset": H, "size": 4096, "token": TOKEN}, 1, "shm.name"),
        ({"name": ".hidden", "offset": H, "size": 4096, "token": TOKEN}, 1, "shm.name"),
        ({"name": "{seg}", "offset": H, "size": 2 * SLOT}, 1, "shm"),
        ({"name": "{seg}", "offset": H, "size": 2 * SLOT, "token": TOKEN[:8]}, 1, "shm.token"),
        ({"name": "{seg}", "offset": -1, "size": 2 * SLOT, "token": TOKEN}, 1, "shm.offset"),
        ({"name": "{seg}", "offset": H, "size": 2 * SLOT, "token": TOKEN}, 2, "frames"),
        ({"name": "{seg}", "offset": H, "size": 2 * SLOT, "token": TOKEN, "extra": 1}, 1, "shm"),
    ],
)
def test_a_bad_notification_is_a_bad_request_and_the_daemon_goes_on(
    tmp_path: Path, segment: shared_memory.SharedMemory, shm: dict[str, object], frames: int,
    field: str,
) -> None:  # fmt: skip
    shm = {k: (v.format(seg=segment.name) if isinstance(v, str) else v) for k, v in shm.items()}
    header = _infer_header(41, shm)
    with running(tmp_path) as (daemon, ep), dealer(ep) as sock:
        sock.send_multipart([header] if frames == 1 else [header, IMAGE.tobytes()])
        reply = recv(sock)
        assert (reply.id, reply.status) == (41, Status.BAD_REQUEST)
        assert isinstance(reply, protocol.InferReply)  # an INFER's refusal, whoever found it
        assert field in reply.message, reply.message
        # and a good notification on the same connection is served
        good = {"name": segment.name, "offset": H, "size": 2 * SLOT, "token": TOKEN}
        sock.send_multipart([_infer_header(42, good)])
        ok = recv(sock)
        assert (ok.id, ok.status) == (42, Status.OK), ok.message
        assert daemon.frontend.pending == 0


def test_a_segment_serves_only_who_holds_its_token(
    tmp_path: Path, segment: shared_memory.SharedMemory
) -> None:
    """A client naming another's segment without its token is refused in the same words as for
    a name no segment has, whatever size it claims: nothing of the segment is read or told
    (before, it got OK and the owner's detections, and refusals named the file's size)."""
    other = f"dlad-test-none-{os.getpid()}"
    with running(tmp_path) as (daemon, ep), dealer(ep) as owner, dealer(ep) as stranger:
        mine = {"name": segment.name, "offset": H, "size": 2 * SLOT, "token": TOKEN}
        owner.send_multipart([_infer_header(1, mine)])
        assert recv(owner).status == Status.OK  # mapped and registered for its owner
        words = []
        for rid, shm in enumerate([
            mine | {"token": bytes(16)},
            mine | {"token": bytes(16), "size": 4 * SLOT},
            mine | {"name": other, "token": bytes(16)},
            mine | {"name": other},
        ], start=2):  # fmt: skip
            stranger.send_multipart([_infer_header(rid, shm)])
            reply = recv(stranger)
            assert (reply.id, reply.status) == (rid, Status.BAD_REQUEST)
            words.append(reply.message.replace(other, segment.name))
        assert len(set(words)) == 1, words
        assert str(2 * SLOT) not in words[0]
        stranger.send_multipart([_infer_header(6, mine)])  # who can read it knows its token
        assert recv(stranger).status == Status.OK
        owner.send_multipart([_infer_header(7, mine | {"token": bytes(16)})])
        assert recv(owner).status == Status.BAD_REQUEST  # its own, registered: the token counts
        assert daemon.frontend.pending == 0


def test_a_daemon_with_shm_off_refuses_shared_memory_frames(
    tmp_path: Path, segment: shared_memory.SharedMemory
) -> None:
    cfg = tmp_path / "off.toml"
    fields = {"mode": "timing", "latency": 2000.0, "depth": 4, "scheduler": "", "faults0": "",
              "faults1": ""}  # fmt: skip
    cfg.write_text("[shm]\nenabled = false\n" + CONFIG.format(**fields))
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    with serve_in_thread(daemon) as ep, dealer(ep) as sock:
        good = {"name": segment.name, "offset": H, "size": 2 * SLOT, "token": TOKEN}
        sock.send_multipart([_infer_header(5, good)])
        reply = recv(sock)
    assert (reply.id, reply.status) == (5, Status.BAD_REQUEST)
    assert "enabled = false" in reply.message


def test_segments_stay_mapped_while_used_and_are_reclaimed_when_idle(
    segment: shared_memory.SharedMemory,
) -> None:
    now = [100.0]
    frames = SharedFrames(ShmConfig(idle_s=10.0, max_segments=1), clock=lambda: now[0])
    ref = protocol.ShmRef(segment.name, H, 2 * SLOT, TOKEN)
    view = frames.resolve("client-a", ref, IMAGE.nbytes)
    np.testing.assert_array_equal(np.frombuffer(view, np.uint8), IMAGE.reshape(-1))
    assert view.readonly
    frames.hold("client-a", segment.name)
    del view
    now[0] += 60.0
    assert frames.reclaim() == 0  # a frame in flight keeps it mapped
    # the segment budget is full: another client's segment is refused, not mapped
    with pytest.raises(Overloaded, match="most"):
        frames.resolve("client-b", ref, IMAGE.nbytes)
    frames.release("client-a", segment.name)
    now[0] += 9.0
    assert frames.reclaim() == 0  # answered 9 s ago: not idle long enough
    now[0] += 1.0
    assert frames.reclaim() == 1
    assert (frames.segments, frames.mapped_bytes, frames.closing) == (0, 0, 0)
    frames.resolve("client-b", ref, IMAGE.nbytes)  # room again
    frames.close()
    with pytest.raises(BadRequest, match="ends past"):
        frames.resolve(
            "client-b", protocol.ShmRef(segment.name, 2 * SLOT - 10, 2 * SLOT, TOKEN), 11
        )


def test_the_byte_budget_bounds_what_is_mapped(segment: shared_memory.SharedMemory) -> None:
    frames = SharedFrames(ShmConfig(max_bytes=1 << 20))
    with pytest.raises(Overloaded, match="budget"):
        frames.resolve("c", protocol.ShmRef(segment.name, H, 2 * SLOT, TOKEN), 100)
    assert frames.segments == 0


CRASHING_CLIENT = textwrap.dedent(
    """
    import sys
    import numpy as np
    from dlad_client import Client
    c = Client(sys.argv[1], shm_slot_bytes=4 << 20)
    c.submit(np.zeros((480, 640, 3), np.uint8))
    print(c.shm.name, flush=True)
    sys.stdin.read()  # until killed
    """
)


def test_a_client_that_dies_leaves_nothing_mapped_or_linked(tmp_path: Path) -> None:
    with running(tmp_path) as (daemon, ep):
        shm = daemon.frontend.shm
        assert shm is not None
        shm.config = ShmConfig(idle_s=0.05)  # reclaimed at the next heartbeat once idle
        proc = subprocess.Popen(
            [sys.executable, "-c", CRASHING_CLIENT, ep],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
        proc.stdout.close()
        wait_for(lambda: daemon.frontend.shm_frames == 1)
        os.kill(proc.pid, signal.SIGKILL)  # no close(), no reply read
        proc.wait()
        assert proc.stdin is not None
        proc.stdin.close()
        wait_for(lambda: shm.segments == 0 and not shm.closing)
        assert daemon.frontend.pending == 0
    # the dead client's resource tracker unlinks its segment
    wait_for(lambda: not os.path.exists(os.path.join(SHM_DIR, name)))


def test_an_async_client_makes_its_segment_on_entry_and_unlinks_it_on_exit(
    tmp_path: Path,
) -> None:
    before = set(os.listdir(SHM_DIR))
    client = AsyncClient("tcp://127.0.0.1:5555", shm_slot_bytes=SLOT, shm_slots=2)
    assert client.shm is None  # nothing made before entry: nothing left if never entered
    assert set(os.listdir(SHM_DIR)) == before

    async def main() -> tuple[str, set[str]]:
        async with client as c:
            assert c.shm is not None
            return c.shm.name, set(os.listdir(SHM_DIR))

    name, during = anyio.run(main)
    assert name in during
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    with pytest.raises(ValueError, match="shm_slots must be"):
        AsyncClient("ipc:///tmp/x.sock", shm_slot_bytes=SLOT, shm_slots=0)


def test_a_fifo_named_as_a_segment_is_refused_without_blocking_the_daemon(tmp_path: Path) -> None:
    """A client that puts a FIFO where a segment should be gets BAD_REQUEST, and the daemon
    goes on serving: the open must not wait for a writer (it did, with the event loop in it)."""
    name = f"dlad-test-fifo-{os.getpid()}"
    path = os.path.join(SHM_DIR, name)
    os.mkfifo(path)
    try:
        with running(tmp_path) as (daemon, ep), dealer(ep) as sock:
            try:
                shm = {"name": name, "offset": H, "size": SLOT, "token": TOKEN}
                sock.send_multipart([_infer_header(7, shm)])
                reply = recv(sock)
            finally:  # were the daemon stuck in open(), a writer would free it: the test ends
                with contextlib.suppress(OSError):
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            assert (reply.id, reply.status) == (7, Status.BAD_REQUEST)
            assert isinstance(reply, protocol.InferReply)
            assert "is not this client's" in reply.message
            sock.send_multipart(protocol.encode(protocol.StatusRequest(8)))
            assert recv(sock).id == 8
            assert daemon.frontend.pending == 0
    finally:
        os.unlink(path)


TRUNCATING_CLIENT = textwrap.dedent(
    """
    import json, os, sys
    from multiprocessing import shared_memory
    import msgpack, numpy as np, zmq
    endpoint, name, slot = sys.argv[1], sys.argv[2], int(sys.argv[3])
    image = np.load(sys.argv[4])
    seg = shared_memory.SharedMemory(name=name, create=True, size=slot)
    token = os.urandom(16)
    seg.buf[:64] = b"DLADSHM1" + token + bytes(40)  # protocol.shm_header(token)
    np.frombuffer(seg.buf, np.uint8)[64 : 64 + image.nbytes] = image.reshape(-1)
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(endpoint)
    h, w, _ = image.shape
    def infer(rid):
        header = {"v": 1, "kind": 1, "id": rid, "model": "demo",
                  "shm": {"name": name, "offset": 64, "size": slot, "token": token},
                  "image": {"height": h, "width": w, "format": "RGB", "dtype": "uint8"}}
        sock.send_multipart([msgpack.packb(header)])
    def replies(n):
        out = []
        for _ in range(n):
            assert sock.poll(30_000), "no reply"
            reply = msgpack.unpackb(sock.recv_multipart()[0])
            out.append((reply["id"], reply["status"], reply["message"]))
        return json.dumps(sorted(out))
    infer(1)
    print(replies(1), flush=True)
    os.ftruncate(seg._fd, 0)  # the attack: the segment shrinks under the daemon's mapping
    for rid in range(2, 10):
        infer(rid)
    print(replies(8), flush=True)
    infer(10)  # the segment, named again
    print(replies(1), flush=True)
    seg.close()
    seg.unlink()
    """
)


def test_a_segment_truncated_under_the_daemon_is_refused_and_the_daemon_lives(
    tmp_path: Path,
) -> None:
    """A client maps a segment, gets a frame of it served, shrinks the file to 0 bytes and
    sends eight more frames of it: each is answered BAD_REQUEST (none is served from pages the
    file no longer has), the daemon reads no page past the file's end (before, SIGBUS killed it
    with every frame in it), and it goes on serving. Named again, the segment no longer has the
    header that holds its token: refused as any segment not the client's."""
    image = tmp_path / "image.npy"
    np.save(image, IMAGE)
    name = f"dlad-test-trunc-{os.getpid()}"
    with running(tmp_path) as (daemon, ep), dealer(ep) as sock:
        out = subprocess.run(
            [sys.executable, "-c", TRUNCATING_CLIENT, ep, name, str(SLOT), str(image)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        first, refused, again = (json.loads(line) for line in out.stdout.splitlines())
        assert first == [[1, int(Status.OK), ""]]
        assert [(rid, status) for rid, status, _ in refused] == [
            (rid, int(Status.BAD_REQUEST)) for rid in range(2, 10)
        ]
        for _, _, message in refused:
            assert "truncated" in message or "is not this client's" in message, message
        assert again[0][:2] == [10, int(Status.BAD_REQUEST)]
        assert "is not this client's" in again[0][2]
        sock.send_multipart(protocol.encode(protocol.StatusRequest(11)))
        assert recv(sock).id == 11  # alive
        assert daemon.frontend.pending == 0


def test_the_guard_reads_zeros_where_a_mapped_segment_shrank() -> None:
    seg = shared_memory.SharedMemory(create=True, size=1 << 20)
    try:
        assert seg.buf is not None
        seg.buf[:H] = protocol.shm_header(TOKEN)
        seg.buf[H : H + 8] = b"\x01" * 8
        frames = SharedFrames(ShmConfig())
        ref = protocol.ShmRef(seg.name, H, 1 << 20, TOKEN)
        faults = _native.shm_faults()
        view = frames.resolve("c", ref, (1 << 20) - H)
        assert bytes(view[:8]) == b"\x01" * 8
        assert not frames.broken("c", seg.name)
        os.ftruncate(seg._fd, 0)  # type: ignore[attr-defined]  # the client's fd
        assert not np.frombuffer(view, np.uint8).any()  # zeros, not SIGBUS
        assert frames.broken("c", seg.name)
        assert _native.shm_faults() == faults + 1  # one fault: the whole range was replaced
        del view
        with pytest.raises(BadRequest, match="is not this client's"):
            frames.resolve("c", ref, 4096)  # dropped and opened again: its header is gone
        assert frames.segments == 0
        frames.close()
    finally:
        seg.close()
        seg.unlink()
