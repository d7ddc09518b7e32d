"""The daemon on its native data plane: the plane serves INFERs, the event loop the rest, and a
client sees one daemon: its replies and words, STATUS, CANCEL, INFER_BATCH, the metrics, the
drain and the linger after it."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import shared_memory
from pathlib import Path

import anyio
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from prometheus_client import generate_latest
from structlog.testing import capture_logs

from dlad import protocol
from dlad.auth import write_keypair
from dlad.config import load_config
from dlad.daemon import Daemon
from dlad.errors import DladError, Overloaded, StartupError, Status
from dlad.gpu.driver import GpuProbe
from dlad.loadable import read_loadable
from dlad.models import DEMO
from dlad.shm import SharedFrames
from dlad_client import Client, CurveKeys
from tests.dlad.serving import serve_in_thread
from tests.dlad.test_daemon import _mutations, _status, dealer, recv
from tests.dlad.test_metrics import wait_for

pytestmark = [
    pytest.mark.timeout(60),
]

IMAGE = np.zeros((8, 8, 3), np.uint8)

CONFIG = """
[daemon]
drain_timeout_s = 5.0
default_deadline_ms = 60000.0
{daemon}
[frontend]
endpoints = ["tcp://127.0.0.1:5555"]
cheap_requests_per_s = 100000.0  # the tests poll STATUS
[pre_post]
enabled = false
[shm]
idle_s = {idle}
[soc]
dram_contention = 0
[metrics]
heartbeat_s = 0.05
live_timeout_s = 5.0
[devices.dla0]
kind = "dla"
backend = "emulated"
core = 0
queue_depth = {depth}
mode = "timing"
latency_us = {latency}
[devices.dla1]
kind = "dla"
backend = "emulated"
core = 1
queue_depth = {depth}
mode = "timing"
latency_us = {latency}
[models.demo]
devices = ["dla0", "dla1"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
core1 = "bundled:demo/fp16_heads.dla1.emu"
"""


def _config(*, latency: float = 1000.0, depth: int = 4, daemon: str = "", idle: float = 30.0,
            text: str = CONFIG) -> str:  # fmt: skip
    return text.format(latency=latency, depth=depth, daemon=daemon, idle=idle)


@contextmanager
def native(
    tmp_path: Path, *, latency: float = 1000.0, depth: int = 4, daemon: str = "",
    idle: float = 30.0,
) -> Iterator[tuple[Daemon, str]]:  # fmt: skip
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(_config(latency=latency, depth=depth, daemon=daemon, idle=idle))
    d = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    with serve_in_thread(d) as endpoint:
        yield d, endpoint


def _infer(rid: int, **fields: object) -> list[bytes]:
    fields.setdefault("model", "demo")
    return [bytes(f) for f in protocol.encode(protocol.InferRequest(rid, image=IMAGE, **fields))]  # type: ignore[arg-type]


def _pending(daemon: Daemon) -> int:
    plane = daemon.frontend.plane
    return 0 if plane is None else plane.pending


def test_infers_are_served_by_the_plane_and_counted_everywhere(tmp_path: Path) -> None:
    with native(tmp_path) as (daemon, ep), dealer(ep) as sock:
        for rid in range(12):
            sock.send_multipart(_infer(rid, stream=None if rid % 3 else f"cam{rid}"))
        replies = [recv(sock) for _ in range(12)]
        assert sorted(int(r.id or 0) for r in replies) == list(range(12))
        assert {r.status for r in replies} == {Status.OK}
        assert {r.device for r in replies} <= {"dla0", "dla1"}
        report = _status(sock, 99)
        assert daemon.frontend.plane is not None
        assert daemon.frontend.plane.counters()["by_status"] == {"OK": 12}  # the plane's
        assert daemon.counters.by_status == {"OK": 13}  # with the STATUS reply
        assert daemon.counters.received == 13
    assert [d["name"] for d in report["devices"]] == ["dla0", "dla1"]
    assert sum(d["completed"] for d in report["devices"]) == 12
    assert {d["state"] for d in report["devices"]} == {"serving"}
    assert report["queues"] == {"depth": 0, "capacity": 8, "streams": 0}
    assert report["models"][0]["devices"] == ["dla0", "dla1"]
    demo = read_loadable(DEMO / "fp16_heads.dla0.emu")
    assert report["models"][0]["family"] == "yolov5"
    assert report["models"][0]["class_names"] == list(demo.class_names)
    metrics = generate_latest(daemon.metrics.registry).decode()
    ok = [line for line in metrics.splitlines()
          if line.startswith("dlad_requests_total{") and 'status="OK"' in line]  # fmt: skip
    assert sum(float(line.rsplit(" ", 1)[1]) for line in ok) == 12  # observed by the heartbeat


def test_what_the_plane_leaves_is_answered_with_the_frontends_words(tmp_path: Path) -> None:
    with native(tmp_path) as (_, ep), dealer(ep) as sock:
        sock.send_multipart(_infer(1, stream="caméra"))  # any printable name: the plane's
        ok = recv(sock)
        assert (ok.id, ok.status, ok.device in ("dla0", "dla1")) == (1, Status.OK, True)
        sock.send_multipart(_infer(2, model="modèle"))
        missing = recv(sock)
        assert (missing.id, missing.status) == (2, Status.NOT_FOUND)
        assert missing.message == "no device serves model 'modèle'"
        sock.send_multipart([b"\xc1", b"junk"])  # malformed: a typed reply, the daemon stays
        assert recv(sock).status is Status.BAD_REQUEST
        header = msgpack.unpackb(_infer(3)[0])
        header["image"]["height"] = 9  # the payload no longer fits: refused, naming frames[1]
        sock.send_multipart([msgpack.packb(header), IMAGE.tobytes()])
        bad = recv(sock)
        assert (bad.id, bad.status) == (3, Status.BAD_REQUEST)
        assert bad.message == "frames[1]: image payload is 192 bytes, the header says 216"
        sock.send_multipart(_infer(4))
        assert recv(sock).status is Status.OK


def test_an_infer_batch_runs_in_the_plane_and_gets_one_reply(tmp_path: Path) -> None:
    with native(tmp_path, latency=50_000.0, depth=2) as (_, ep), dealer(ep) as sock:
        items = tuple(protocol.InferRequest(7, "demo", IMAGE) for _ in range(10))
        sock.send_multipart(protocol.encode(protocol.InferBatchRequest(7, "demo", items)))
        # The event loop handles what the plane forwards in order: once STATUS is answered,
        # the batch is in the plane (an INFER sent meanwhile could have overtaken it).
        _status(sock, 70)
        sock.send_multipart(_infer(7))  # its id is in flight (the batch's)
        early = recv(sock)
        assert (early.id, early.status) == (7, Status.BAD_REQUEST)
        assert early.message == "request id 7 is already in flight on this connection"
        reply = recv(sock)
        assert isinstance(reply, protocol.InferBatchReply)
        assert (reply.id, reply.status, len(reply.results)) == (7, Status.OK, 10)
        statuses = Counter(r.status for r in reply.results)
        # two cores with two slots and two queued each take 8; the rest find full queues
        assert statuses == {Status.OK: 8, Status.OVERLOADED: 2}
        assert all(r.device in ("dla0", "dla1") for r in reply.results if r.status is Status.OK)
        others = tuple(protocol.InferRequest(8, "other", IMAGE) for _ in range(2))
        sock.send_multipart(protocol.encode(protocol.InferBatchRequest(8, "other", others)))
        other = recv(sock)
        assert isinstance(other, protocol.InferBatchReply)
        assert [r.status for r in other.results] == [Status.NOT_FOUND] * 2


def test_cancel_reaches_the_plane(tmp_path: Path) -> None:
    with native(tmp_path, latency=200_000.0, depth=4) as (_, ep), dealer(ep) as sock:
        for rid in range(5):  # 4 run (two cores, two slots), the fifth queues
            sock.send_multipart(_infer(rid))
        wait_for(lambda: _status(sock, 100)["queues"]["depth"] >= 1)
        sock.send_multipart(protocol.encode(protocol.CancelRequest(4)))
        replies = {type(r).__name__: r for r in (recv(sock), recv(sock))}
        infer, cancel = replies["InferReply"], replies["CancelReply"]
        assert (infer.id, infer.status, infer.message) == (
            4, Status.CANCELLED, "cancelled by the client")  # fmt: skip
        assert (cancel.id, cancel.status) == (4, Status.OK)
        sock.send_multipart(protocol.encode(protocol.CancelRequest(0)))
        running = recv(sock)
        assert (running.status, running.message) == (
            Status.NOT_FOUND, "request 0 is already running (or answered)")  # fmt: skip
        sock.send_multipart(protocol.encode(protocol.CancelRequest(77)))
        unknown = recv(sock)
        assert (unknown.status, unknown.message) == (Status.NOT_FOUND, "request 77 is not queued")


def test_the_drain_finishes_what_runs_and_the_socket_answers_after_it(tmp_path: Path) -> None:
    linger = "close_linger_ms = 3000.0"
    with (
        native(tmp_path, latency=300_000.0, depth=4, daemon=linger) as (daemon, ep),
        dealer(ep) as sock,
    ):
        for rid in range(6):  # 4 run, 2 queue
            sock.send_multipart(_infer(rid))
        wait_for(lambda: _status(sock, 100)["queues"]["depth"] >= 2)
        daemon.stop_threadsafe()
        first = [recv(sock) for _ in range(6)]
        by_status = Counter(r.status for r in first)
        assert by_status == {Status.SHUTTING_DOWN: 2, Status.OK: 4}
        assert daemon.lingering.wait(30)  # drained: the socket is the event loop's again
        sock.send_multipart(_infer(50))
        sock.send_multipart(protocol.encode(protocol.StatusRequest(51)))
        late = [recv(sock), recv(sock)]
        assert (late[0].id, late[0].status) == (50, Status.SHUTTING_DOWN)
        assert isinstance(late[1], protocol.StatusReply)
        assert late[1].report["state"] == "DRAINING"


POLLING = """
[daemon]
default_deadline_ms = 60000.0
[frontend]
endpoints = ["tcp://127.0.0.1:5555"]
cheap_requests_per_s = 100000.0  # the test polls STATUS
"""
"""A daemon's first sections, for a test that polls STATUS."""

EVERY_KIND = f"""{POLLING}[pre_post]
backend = "cpu"
[soc]
dram_contention = 1.0
[devices.dla0]
kind = "dla"
backend = "emulated"
core = 0
mode = "numeric"
[devices.dla1]
kind = "dla"
backend = "emulated"
core = 1
mode = "timing"
latency_us = 2000.0
[devices.dla1.faults]
error_rate = 1.0
[devices.gpu]
kind = "gpu"
engine = "emulated"
mode = "numeric"
max_batch = 4
[models.demo]
devices = ["dla0"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
[models.faulty]
devices = ["dla1"]
[models.faulty.loadables]
core1 = "bundled:demo/fp16_heads.dla1.emu"
[models.batched]
devices = ["gpu"]
[models.batched.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
"""


def test_every_engine_kind_serves_on_the_plane(tmp_path: Path) -> None:
    """A numeric core, a faulty core and the emulated GPU, with pre/post-processing on the CPU:
    each runs behind the plane (a Python engine) and answers as the Python data plane does,
    the detections the ones prep recorded for the image; the faulty core, whose warm-up
    failed, is quarantined from the start."""
    expected = json.loads((DEMO / "expected_detections.json").read_text())["images"]["000001.jpg"]
    rgb = Image.open(DEMO / "images" / "000001.jpg").convert("RGB")
    image = np.ascontiguousarray(np.asarray(rgb))
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(EVERY_KIND)
    d = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    with serve_in_thread(d) as ep, dealer(ep) as sock:
        for rid, model in enumerate(["demo", "batched", "batched", "demo"]):
            sock.send_multipart(protocol.encode(protocol.InferRequest(rid, model, image)))
        replies = sorted((recv(sock) for _ in range(4)), key=lambda r: r.id or 0)
        for r, device in zip(replies, ["dla0", "gpu", "gpu", "dla0"], strict=True):
            assert isinstance(r, protocol.InferReply)
            assert (r.status, r.device) == (Status.OK, device), r.message
            np.testing.assert_allclose(
                r.detections, np.asarray(expected["emulated_int8"], np.float32), atol=2e-3
            )
            assert r.timing.device_us > 0
            assert r.timing.pre_us > 0
        sock.send_multipart(protocol.encode(protocol.InferRequest(9, "faulty", image)))
        failed = recv(sock)  # its warm-up failed: quarantined from the start
        assert isinstance(failed, protocol.InferReply)
        words = "no healthy device serves model 'faulty' now (dla1 quarantined)"
        assert (failed.status, failed.message) == (Status.DEVICE_FAILED, words)
        report = _status(sock, 10)
    devices = {x["name"]: x for x in report["devices"]}
    assert sorted(devices) == ["dla0", "dla1", "gpu"]
    assert (devices["dla0"]["completed"], devices["gpu"]["completed"]) == (2, 2)
    assert (devices["dla1"]["state"], devices["dla1"]["healthy"]) == ("quarantined", False)
    assert devices["dla1"]["reason"].startswith("warm-up failed: dla1: warm-up task failed")
    assert devices["gpu"]["max_batch"] == 4


def test_pre_post_without_a_gpu_runs_on_the_cpu_unless_cuda_is_required(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the probe finds no GPU, ``auto`` pre/post-processes on the CPU: the timing cores
    then run as Python engines of the plane and answer with detections; ``cuda`` refuses to
    start, naming the key, and leaves nothing running."""
    monkeypatch.setattr("dlad.gpu.service.probe", lambda: GpuProbe(False, "no driver here"))
    cfg = tmp_path / "dlad.toml"
    text = _config().replace("[pre_post]\nenabled = false", "[pre_post]\nenabled = true")
    cfg.write_text(text)
    d = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    with serve_in_thread(d) as ep, dealer(ep) as sock:
        sock.send_multipart(_infer(1))
        r = recv(sock)
        assert (r.status, r.device in ("dla0", "dla1")) == (Status.OK, True)
        assert r.detections is not None  # decoded from the timing core's pattern
        assert r.timing.pre_us > 0
    cfg.write_text(text.replace("enabled = true", 'enabled = true\nbackend = "cuda"')
                   + '[devices.gpu]\nkind = "gpu"\n')  # fmt: skip
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    with pytest.raises(StartupError) as err:
        anyio.run(daemon.serve)
    assert err.value.key == "pre_post.backend"
    assert daemon.frontend.plane is None  # nothing left running


def test_a_cudla_core_that_cannot_open_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A core the daemon takes for a cuDLA one (backend = "auto" where cuDLA loads) whose
    library or loadable then fails: the daemon says which and starts nothing
    (tests/dlad/cudla/test_native_cudla.py serves through the fake library)."""
    monkeypatch.setattr("dlad.daemon.resolve_backend", lambda backend, loadable: "cudla")
    monkeypatch.setenv("DLAD_CUDLA_LIB", str(tmp_path / "nowhere.so"))
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(_config().replace(
        'backend = "emulated"\ncore = 1', 'backend = "auto"\ncore = 1'))  # fmt: skip
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    with pytest.raises(StartupError) as err:
        anyio.run(daemon.serve)
    assert err.value.key == "devices.dla0.backend"
    assert "DLA core 0 cannot serve the native plane" in str(err.value)
    assert daemon.frontend.plane is None  # nothing left running


SLOT = 1 << 20
TOKEN = bytes(range(16))  # the test segments' token


def _new_segment(size: int, name: str | None = None) -> shared_memory.SharedMemory:
    """A segment of ``size`` bytes whose header holds TOKEN."""
    seg = shared_memory.SharedMemory(name=name, create=True, size=size)
    assert seg.buf is not None
    seg.buf[: protocol.SHM_HEADER_BYTES] = protocol.shm_header(TOKEN)
    return seg


def _shm_header(rid: int, name: str, size: int, offset: int = protocol.SHM_HEADER_BYTES) -> bytes:
    header = {"v": 1, "kind": 1, "id": rid, "model": "demo",
              "shm": {"name": name, "offset": offset, "size": size, "token": TOKEN},
              "image": {"height": 8, "width": 8, "format": "RGB", "dtype": "uint8"}}  # fmt: skip
    return msgpack.packb(header)


@pytest.fixture
def segment() -> Iterator[shared_memory.SharedMemory]:
    seg = _new_segment(SLOT)
    yield seg
    seg.close()
    with contextlib.suppress(FileNotFoundError):  # a test may have replaced it
        seg.unlink()


def test_shared_memory_frames_are_taken_by_the_plane_once_their_segment_is_mapped(
    tmp_path: Path,
) -> None:
    with native(tmp_path) as (daemon, ep), Client(ep, shm_slot_bytes=SLOT, max_in_flight=4) as c:
        results = [h.result() for h in [c.submit(IMAGE) for _ in range(20)]]
        assert c.shm is not None
        assert c.shm.inline == 0  # every frame went through a slot
        plane = daemon.frontend.plane
        assert plane is not None
        assert daemon.frontend.shm is not None
        assert daemon.frontend.shm.segments == 1  # mapped once, by the event loop
        taken = plane.counters()["shm_frames"]
    assert len(results) == 20
    # The first frame (at most the first few, sent before the segment was registered) went
    # through the event loop, which mapped the segment; the plane took the rest itself.
    assert 16 <= taken < 20  # four slots: at most four sent before


def test_bad_notifications_are_bad_requests_before_and_after_the_segment_is_known(
    tmp_path: Path, segment: shared_memory.SharedMemory
) -> None:
    with native(tmp_path) as (daemon, ep), dealer(ep) as sock:
        cases = [
            (_shm_header(1, "dlad-no-such-segment", SLOT), "is not this client's"),
            (_shm_header(2, segment.name, SLOT // 2), "the request says"),
            (_shm_header(3, segment.name, SLOT, offset=SLOT - 10), "ends past"),
        ]
        for header, words in cases:
            sock.send_multipart([header])
            reply = recv(sock)
            assert reply.status is Status.BAD_REQUEST
            assert words in reply.message, reply.message
        sock.send_multipart([_shm_header(4, segment.name, SLOT)])  # maps and registers it
        assert recv(sock).status is Status.OK
        sock.send_multipart([_shm_header(5, segment.name, SLOT)])  # the plane's own
        assert recv(sock).status is Status.OK
        assert daemon.frontend.plane is not None
        assert daemon.frontend.plane.counters()["shm_frames"] == 1
        for header, words in cases[1:]:  # known now: the plane forwards what does not fit
            sock.send_multipart([header])
            reply = recv(sock)
            assert reply.status is Status.BAD_REQUEST
            assert words in reply.message, reply.message
        assert daemon.frontend.plane.counters()["shm_frames"] == 1


def test_an_idle_segment_is_let_go_and_mapped_again_when_used(
    tmp_path: Path, segment: shared_memory.SharedMemory
) -> None:
    with native(tmp_path, idle=0.05) as (daemon, ep), dealer(ep) as sock:
        shm = daemon.frontend.shm
        assert shm is not None
        sock.send_multipart([_shm_header(1, segment.name, SLOT)])
        assert recv(sock).status is Status.OK
        wait_for(lambda: not shm.segments)  # the heartbeat reclaims it
        sock.send_multipart([_shm_header(2, segment.name, SLOT)])
        assert recv(sock).status is Status.OK
        assert _mapped(shm) == 1
        assert shm.stats.reclaimed >= 1


def _mapped(shm: SharedFrames) -> int:
    return shm.segments  # read again (mypy narrows the loop's last read)


def test_a_segment_made_again_at_another_size_is_mapped_again(tmp_path: Path) -> None:
    first = _new_segment(SLOT)
    name = first.name
    try:
        with native(tmp_path) as (daemon, ep), dealer(ep) as sock:
            sock.send_multipart([_shm_header(1, name, SLOT)])
            assert recv(sock).status is Status.OK
            first.close()
            first.unlink()
            first = _new_segment(2 * SLOT, name)
            sock.send_multipart([_shm_header(2, name, 2 * SLOT)])
            again = recv(sock)
            assert again.status is Status.OK, again.message
            sock.send_multipart([_shm_header(3, name, 2 * SLOT)])
            assert recv(sock).status is Status.OK
            assert daemon.frontend.plane is not None
            assert daemon.frontend.plane.counters()["shm_frames"] == 1  # the third
            assert daemon.frontend.shm is not None
            assert daemon.frontend.shm.mapped_bytes == 2 * SLOT  # the old map let go
    finally:
        first.close()
        first.unlink()


# ------------------------------------------------ every message answered once, in its own words
@pytest.fixture(scope="module")
def plane_ep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One daemon for the generated messages (pre/post off, timing mode)."""
    tmp = tmp_path_factory.mktemp("answers")
    cfg = tmp / "dlad.toml"
    cfg.write_text(_config(latency=200.0, depth=16))
    with serve_in_thread(Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])) as ep:
        yield ep


def _answer(endpoint: str, frames: list[bytes]) -> tuple[object, ...]:
    """What a daemon answers ``frames`` with, less what may differ run to run (the device an
    OK ran on, its timing)."""
    with dealer(endpoint) as sock:
        sock.send_multipart(frames)
        reply = recv(sock)
    if isinstance(reply, protocol.InferReply):
        assert reply.status is not Status.OK or reply.device in ("dla0", "dla1")
        return ("INFER_REPLY", reply.id, reply.status, reply.message, reply.count)
    return (type(reply).__name__, reply.id, reply.status, getattr(reply, "message", ""))


def _raw_infer(
    rid: int, model: str, stream: str | None, priority: int, deadline: int | None
) -> list[bytes]:
    """An INFER built by hand: its names may be ones the SDK would refuse to send."""
    header, payload = _infer(0)
    h = msgpack.unpackb(header)
    h.update(id=rid, model=model, priority=priority)
    if stream is not None:
        h["stream"] = stream
    if deadline is not None:
        h["deadline_ms"] = deadline
    return [msgpack.packb(h), payload]


def _requests() -> st.SearchStrategy[list[bytes]]:
    names = st.sampled_from(["demo", "other", "modèle", "", "x" * 129, "tab\there"])
    good = st.builds(
        _raw_infer, st.integers(0, 2**64 - 1), names, st.none() | names, st.integers(-1, 8),
        st.none() | st.integers(-1, 60_000),
    )  # fmt: skip
    return st.one_of(good, _mutations())


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=_requests())
def test_every_message_gets_one_typed_answer(plane_ep: str, frames: list[bytes]) -> None:
    """Whatever a client sends (good INFERs, other models, bad names, broken headers) gets one
    typed answer (``_answer`` reads exactly one), never INTERNAL, and the same message the
    same answer twice."""
    first = _answer(plane_ep, frames)
    assert first[2] is not Status.INTERNAL, first
    assert _answer(plane_ep, frames) == first


@pytest.mark.parametrize("model", ["demo", "other"])
def test_a_good_infer_runs_and_an_unknown_model_is_not_found(plane_ep: str, model: str) -> None:
    kind, rid, status, message, _ = _answer(plane_ep, _raw_infer(7, model, "cam", 1, 5000))
    assert (kind, rid) == ("INFER_REPLY", 7)
    if model == "demo":
        assert status is Status.OK, message
    else:
        assert (status, message) == (Status.NOT_FOUND, "no device serves model 'other'")


def test_with_curve_a_client_is_its_key_across_connections(tmp_path: Path) -> None:
    """The plane's in-flight cap counts a key's requests over all its connections, as the
    Python frontend does; a key not allowed gets nothing."""
    write_keypair(tmp_path / "keys", "server")
    write_keypair(tmp_path / "keys", "alice")
    (tmp_path / "allowed").mkdir()
    (tmp_path / "allowed" / "alice.key").write_bytes((tmp_path / "keys" / "alice.key").read_bytes())
    auth = ('[auth]\nmode = "curve"\nserver_secret_key = "keys/server.key_secret"\n'
            'client_keys_dir = "allowed"\n')  # fmt: skip
    text = _config(latency=300_000.0, depth=8).replace(
        "cheap_requests_per_s", "max_in_flight_per_client = 2\ncheap_requests_per_s"
    )
    (tmp_path / "dlad.toml").write_text(auth + text)
    daemon = Daemon(load_config(tmp_path / "dlad.toml").plan(), endpoints=["tcp://127.0.0.1:0"])
    keys = CurveKeys.from_files(tmp_path / "keys" / "server.key",
                                tmp_path / "keys" / "alice.key_secret")  # fmt: skip
    with (
        serve_in_thread(daemon) as ep,
        Client(ep, curve=keys) as one,
        Client(ep, curve=keys) as two,
    ):
        held = [one.submit(IMAGE), one.submit(IMAGE)]  # the cap, on one connection
        wait_for(lambda: _pending(daemon) >= 2)  # both admitted
        with pytest.raises(Overloaded, match="this client has 2 requests in flight"):
            two.detect(IMAGE)  # another connection, the same key
        assert one.status()["devices"][0]["in_flight"] >= 1  # STATUS through the plane
        daemon.stop_threadsafe()
        for handle in held:
            with contextlib.suppress(DladError):
                handle.result()


def test_a_reply_the_plane_could_not_send_is_counted_and_logged(tmp_path: Path) -> None:
    """A client gone before its reply: the plane counts the drop, the heartbeat puts it in
    dlad_replies_dropped_total and the log."""
    with capture_logs() as logs, native(tmp_path, latency=50_000.0) as (daemon, ep):
        with dealer(ep) as sock:
            sock.send_multipart(_infer(1))
            wait_for(lambda: _pending(daemon) >= 1)  # admitted
        # the connection is closed; the reply finds no one (ROUTER_MANDATORY: counted)
        registry = daemon.metrics.registry
        wait_for(lambda: bool(registry.get_sample_value("dlad_replies_dropped_total")))
        assert registry.get_sample_value("dlad_replies_dropped_total") == 1
    assert [e["dropped"] for e in logs if e["event"] == "reply_dropped"] == [1]


GPU_TIMING = f"""{POLLING}[pre_post]
enabled = false
[devices.gpu]
kind = "gpu"
engine = "emulated"
mode = "timing"
latency_us = 20000.0
max_batch = 4
max_queue_delay_us = 2000000.0
[models.demo]
devices = ["gpu"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
"""


def test_the_emulated_gpu_in_timing_mode_batches_in_the_plane(tmp_path: Path) -> None:
    """With pre/post off, the emulated Orin GPU in timing mode is the plane's own engine (no
    Python per batch): frames sent together run as one batch, which takes the batch curve's
    time for its size, and STATUS counts it by size."""
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(GPU_TIMING)
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    image = np.zeros((8, 8, 3), np.uint8)
    with serve_in_thread(daemon) as ep, dealer(ep) as sock:
        plane = daemon.frontend.plane
        assert plane is not None
        executor = daemon.executors["gpu"]
        curve = executor.batch_service_us  # type: ignore[attr-defined]
        for rid in range(4):  # queued within the 2 s a partial batch may wait to fill
            sock.send_multipart(protocol.encode(protocol.InferRequest(rid, "demo", image)))
        replies = [recv(sock) for _ in range(4)]
        report = _status(sock, 10)
        threads = {p.read_text().strip() for p in Path("/proc/self/task").glob("*/comm")}
    assert "gpu-emulated" in threads  # the plane's timing engine
    assert not [t for t in threads if t.startswith("gpu-py")]  # no Python engine's threads
    assert all(isinstance(r, protocol.InferReply) and r.status is Status.OK for r in replies)
    (gpu,) = report["devices"]
    assert gpu["batches"] == [0, 0, 0, 1]  # the four, one batch
    spans = {r.timing.device_us for r in replies if isinstance(r, protocol.InferReply)}
    assert len(spans) == 1  # the batch's span is each of its frames'
    assert spans.pop() >= curve[4] - 1  # the curve's time for a batch of four
