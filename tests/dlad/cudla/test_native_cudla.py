"""The native data plane on real DLA cores through cuDLA (dlad/native/cudla_engine.cpp), on the
fake cuDLA/NvSci library (fake_cudla.c, which runs each task on a thread of its own after its
pre-fences are reached and signals its EOF fence), and for GPU pre/post, the fake CUDA driver
(tests/dlad/fake_cuda.c) playing recipe A on the fake's NvSciSync objects.

The daemon opens the cores as the Python data plane does (buffers, fences, the task timeout);
the plane submits every task itself, waits for its EOF fence on a thread of its own and reads
the core's error, and the daemon closes the cores after the plane: the fixture holds every
NvSci and cuDLA object to have been released. Whether a real Orin accepts these calls only an
Orin shows (docs/jetson.md).
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from ctypes import c_uint64, c_void_p
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from dlad import protocol
from dlad.config import load_config
from dlad.daemon import Daemon
from dlad.devices.base import CudlaStatus, DlaError
from dlad.devices.cudla.abi import NvSciSyncAttrKey, NvSciSyncAttrKeyValuePair
from dlad.devices.cudla.backend import CudlaDlaCore
from dlad.devices.cudla.nvsci import _pairs
from dlad.errors import StartupError, Status
from dlad.loadable import read_loadable
from dlad.models import DEMO
from dlad.native_plane import CudaFunctions, Health, NativePlane, PlaneDevice, PlaneGpu
from dlad.protocol import InferReply, InferRequest
from tests.dlad.cudla.fakelib import FAULT_ERROR, FakeLib, fake_loadable
from tests.dlad.serving import serve_in_thread
from tests.dlad.test_daemon import _status, dealer, recv
from tests.dlad.test_metrics import wait_for
from tests.dlad.test_native_gpu import Fake as FakeCuda
from tests.dlad.test_native_gpu import GpuSlotBuffers
from tests.dlad.test_native_gpu import build_fake as build_fake_cuda

pytestmark = [
    pytest.mark.timeout(120),
]

ENV = ("DLAD_CUDLA_LIB", "DLAD_NVSCIBUF_LIB", "DLAD_NVSCISYNC_LIB")
IMAGE = np.zeros((8, 8, 3), np.uint8)
ENGINE_TIMEOUT = 0x40000006  # cudlaErrorDlaErrEngineTimeout

CONFIG = """
[daemon]
drain_timeout_s = 5.0
default_deadline_ms = 60000.0
[frontend]
endpoints = ["tcp://127.0.0.1:5555"]
cheap_requests_per_s = 100000.0  # the tests poll STATUS
[pre_post]
enabled = {pre_post}
backend = "cpu"
[metrics]
heartbeat_s = 0.05
live_timeout_s = 5.0
[devices.dla0]
kind = "dla"
backend = "{backend}"
core = 0
queue_depth = 4
[devices.dla1]
kind = "dla"
backend = "{backend}"
core = 1
queue_depth = 4
[models.demo]
devices = {devices}
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
core1 = "bundled:demo/fp16_heads.dla1.emu"
cudla_core0 = "model.dla0.loadable"
cudla_core1 = "model.dla1.loadable"
"""


@pytest.fixture
def on_fake(fake: FakeLib, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeLib:
    """The fake as the daemon's cuDLA (the environment names it), and the model's TensorRT
    loadables in the fake's format beside the config."""
    for name in ENV:
        monkeypatch.setenv(name, str(fake.path))
    for core in (0, 1):
        lo = read_loadable(DEMO / f"fp16_heads.dla{core}.emu")
        (tmp_path / f"model.dla{core}.loadable").write_bytes(
            fake_loadable(lo.inputs, lo.outputs, core)
        )
    return fake


def _daemon(tmp_path: Path, *, backend: str = "cudla", devices: str = '["dla0", "dla1"]',
            extra: str = "", pre_post: bool = False) -> Daemon:  # fmt: skip
    cfg = tmp_path / "dlad.toml"
    text = CONFIG.format(backend=backend, devices=devices, pre_post=str(pre_post).lower())
    cfg.write_text(text + extra)
    return Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])


@contextmanager
def _serving(tmp_path: Path, **kwargs: Any) -> Iterator[tuple[Daemon, zmq.Socket]]:
    daemon = _daemon(tmp_path, **kwargs)
    with serve_in_thread(daemon) as endpoint, dealer(endpoint) as sock:
        yield daemon, sock


def _infer(rid: int) -> list[bytes]:
    return [bytes(f) for f in protocol.encode(InferRequest(rid, model="demo", image=IMAGE))]


def _reply(sock: zmq.Socket) -> InferReply:
    reply = recv(sock)
    assert isinstance(reply, InferReply)
    return reply


def _tasks(fake: FakeLib) -> list[str]:
    """The fake's log lines of the tasks submitted."""
    return [c for c in fake.calls() if c.startswith("task ")]


def test_the_plane_submits_each_frame_to_a_cudla_core(on_fake: FakeLib, tmp_path: Path) -> None:
    on_fake.option("task_delay_us", 2000)
    with _serving(tmp_path) as (daemon, sock):
        on_fake.clear_log()
        for rid in range(12):
            sock.send_multipart(_infer(rid))
        replies = [_reply(sock) for _ in range(12)]
        assert sorted(r.id or 0 for r in replies) == list(range(12))
        assert {r.status for r in replies} == {Status.OK}
        assert {r.device for r in replies} <= {"dla0", "dla1"}
        spans: dict[str | None, list[tuple[int, int]]] = {}
        for r in replies:  # the task's span, as the completion thread saw its EOF fence
            start, end = r.timing.start_ns, r.timing.end_ns
            assert start is not None
            assert end is not None
            assert end > start
            assert r.timing.device_us == (end - start) // 1000
            spans.setdefault(r.device, []).append((start, end))
        for core in spans.values():  # one core's tasks run back to back, never overlapping
            core.sort()
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(core))
        tasks = _tasks(on_fake)
        assert len(tasks) == 12  # each frame one task, submitted by the plane
        assert all("waits=0 signals=1" in t for t in tasks)
        names = on_fake.call_names()
        assert names.count("NvSciSyncFenceWait") >= 12  # the engine's thread, per EOF fence
        assert names.count("cudlaGetLastError") >= 12
        report = _status(sock, 99)
        assert sum(d["completed"] for d in report["devices"]) == 12
        assert daemon.frontend.plane is not None
        assert daemon.frontend.plane.counters()["by_status"] == {"OK": 12}
    # the daemon stopped: the fake fixture holds every object to have been released


def test_a_failed_task_is_device_failed_and_the_core_serves_again(
    on_fake: FakeLib, tmp_path: Path
) -> None:
    no_quarantine = "[health]\nquarantine_after = 0\n"  # a timeout would quarantine at once
    with _serving(tmp_path, devices='["dla0"]', extra=no_quarantine) as (_, sock):
        on_fake.task_fault(0, FAULT_ERROR, ENGINE_TIMEOUT, 3)
        for rid in range(3):  # one at a time: the core's error is read before the next
            sock.send_multipart(_infer(rid))
            r = _reply(sock)
            assert (r.id, r.status) == (rid, Status.DEVICE_FAILED)
            assert r.message == "dla0: task failed: cudlaErrorDlaErrEngineTimeout"
        dla0 = _status(sock, 10)["devices"][0]
        assert not dla0["healthy"]
        assert "cudlaErrorDlaErrEngineTimeout" in dla0["reason"]
        sock.send_multipart(_infer(4))
        assert _reply(sock).status == Status.OK
        assert _status(sock, 11)["devices"][0]["healthy"]


def test_a_task_timeout_quarantines_the_core_and_a_probe_returns_it(
    on_fake: FakeLib, tmp_path: Path
) -> None:
    """A hang (the core's task timeout) quarantines the core at once, as the Python data plane
    does; its first probe runs on the core itself and, passing, returns it."""
    health = "[health]\nprobe_after_s = 0.01\nretry = false\n"
    with _serving(tmp_path, devices='["dla0"]', extra=health) as (_, sock):
        on_fake.task_fault(0, FAULT_ERROR, ENGINE_TIMEOUT, 1)
        sock.send_multipart(_infer(1))
        r = _reply(sock)
        assert (r.status, r.message) == (
            Status.DEVICE_FAILED, "dla0: task failed: cudlaErrorDlaErrEngineTimeout")  # fmt: skip
        wait_for(lambda: _status(sock, 10)["devices"][0]["state"] == "serving"
                 and len(_tasks(on_fake)) == 3)  # fmt: skip
        sock.send_multipart(_infer(2))
        assert _reply(sock).status == Status.OK
        assert len(_tasks(on_fake)) == 4  # the warm-up, the frame, the probe, the frame


def test_a_refused_submission_is_device_failed(on_fake: FakeLib, tmp_path: Path) -> None:
    with _serving(tmp_path, devices='["dla0"]') as (daemon, sock):
        on_fake.fail_next("cudlaSubmitTask", 7)
        sock.send_multipart(_infer(1))
        r = _reply(sock)
        assert (r.status, r.message) == (Status.DEVICE_FAILED,
                                         "dla0: cudlaSubmitTask: cudlaErrorUmd (7)")  # fmt: skip
        sock.send_multipart(_infer(2))
        assert _reply(sock).status == Status.OK
        assert daemon.frontend.plane is not None
        assert daemon.frontend.plane.counters()["by_status"] == {"DEVICE_FAILED": 1, "OK": 1}


@pytest.mark.parametrize(
    ("setup", "key", "words"),
    [
        (lambda f: f.fail_next("cudlaCreateDevice", 8), "devices.dla0.backend",
         "cudlaCreateDevice"),
    ],
    ids=["no-device"],
)  # fmt: skip
def test_a_core_the_plane_cannot_drive_is_refused_at_start(
    on_fake: FakeLib, tmp_path: Path, setup: Any, key: str, words: str
) -> None:
    setup(on_fake)
    daemon = _daemon(tmp_path)
    with pytest.raises(StartupError) as err:
        anyio.run(daemon.serve)
    assert err.value.key == key
    assert words in str(err.value)
    assert daemon.frontend.plane is None  # nothing left running; the fixture: nothing alive


def test_a_core_with_deterministic_semaphores_only_serves_as_a_python_engine(
    on_fake: FakeLib, tmp_path: Path
) -> None:
    """An older cuDLA that refuses syncpoint fences: the plane cannot wait on its EOF fences,
    so the core serves as a Python engine (its executor's fences), saying so in the log."""
    on_fake.option("deterministic_only", 1)
    with capture_logs() as logs, _serving(tmp_path, devices='["dla0"]') as (daemon, sock):
        sock.send_multipart(_infer(1))
        r = _reply(sock)
        assert (r.status, r.device) == (Status.OK, "dla0"), r.message
        assert "dla0" in daemon.executors  # the Python engine's executor
    (warned,) = [e for e in logs if e["event"] == "cudla_python_engine"]
    assert "deterministic semaphores" in warned["reason"]


def test_a_core_whose_pre_post_runs_on_the_cpu_serves_as_a_python_engine(
    on_fake: FakeLib, tmp_path: Path
) -> None:
    """Pre/post-processing on, no GPU: the plane's own cuDLA engine would answer without
    detections, so the core serves as a Python engine that pre- and post-processes each frame
    around its task."""
    with _serving(tmp_path, devices='["dla0"]', pre_post=True) as (daemon, sock):
        sock.send_multipart(_infer(1))
        r = _reply(sock)
        assert (r.status, r.device) == (Status.OK, "dla0"), r.message
        assert r.timing.pre_us > 0 or r.timing.post_us > 0  # the frame was processed around it
        assert "dla0" in daemon.executors
        assert len(_tasks(on_fake)) == 2  # the warm-up, the frame


def test_auto_where_cudla_does_not_load_serves_the_emulated_core_on_the_plane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """backend = "auto" where cuDLA does not load: the emulated core the config describes
    (numeric here) serves behind the plane as a Python engine."""
    monkeypatch.setattr("dlad.daemon.resolve_backend", lambda backend, loadable: "emulated")
    with _serving(tmp_path, backend="auto") as (_, sock):
        sock.send_multipart(_infer(1))
        r = _reply(sock)
        assert (r.status, r.device in ("dla0", "dla1")) == (Status.OK, True)


# ------------------------------------------------------------------ with GPU pre/post


@pytest.fixture(scope="module")
def cuda(tmp_path_factory: pytest.TempPathFactory) -> FakeCuda:
    if shutil.which("gcc") is None:
        pytest.skip("gcc builds the fake CUDA driver")
    return build_fake_cuda(tmp_path_factory.mktemp("fake_cuda"))


def _perm(fake: FakeLib, perm: int) -> Any:
    """An attribute-list filler that stands for CUDA (cudaDeviceGetNvSciSyncAttributes)."""

    def fill(attr_list: int) -> None:
        array, _keep = _pairs(
            NvSciSyncAttrKeyValuePair, [(NvSciSyncAttrKey.REQUIRED_PERM, c_uint64(perm))]
        )
        assert fake.libraries().NvSciSyncAttrListSetAttrs(c_void_p(attr_list), array, 1) == 0

    return fill


def _address(lib: Any, name: str) -> int:
    return int(ctypes.cast(getattr(lib, name), c_void_p).value or 0)


class ChainRig:
    """A plane with one fake cuDLA core whose frames run a recipe-A chain on the fake GPU."""

    def __init__(self, fake: FakeLib, cuda: FakeCuda, slots: int = 2) -> None:
        cuda.lib.fake_reset()
        self.fake, self.cuda = fake, cuda
        lo = read_loadable(DEMO / "fp16_heads.dla0.emu")
        self.core = CudlaDlaCore(
            0, libs=fake.libraries(), gpu_uuid=bytes(16),
            extra_waiter=_perm(fake, 1), gpu_signaller=_perm(fake, 2),
        )  # fmt: skip
        self.core.load(fake_loadable(lo.inputs, lo.outputs, 0))
        module = self.core._module
        assert module is not None
        self.buffers = [
            ([self.core.alloc_buffer(d) for d in module.inputs],
             [self.core.alloc_buffer(d) for d in module.outputs])
            for _ in range(slots)
        ]  # fmt: skip
        self.ready = [self.core.create_fence(f"ready{i}", signaller="gpu") for i in range(slots)]
        self.done = [self.core.create_fence(f"done{i}") for i in range(slots)]
        spec = self.core.plane_core(
            [(i, o, d) for (i, o), d in zip(self.buffers, self.done, strict=True)]
        )
        nvsci = ("NvSciSyncObjGenerateFence", "NvSciSyncObjSignal", "NvSciSyncFenceDup",
                 "NvSciSyncFenceWait", "NvSciSyncFenceClear")  # fmt: skip
        cuda.lib.fake_set_nvsci.argtypes = [c_void_p] * 6
        cuda.lib.fake_set_nvsci(
            *(_address(fake.lib, n) for n in nvsci), self.core.nvsci.cpu_wait.value
        )
        self.gpu_slots = [GpuSlotBuffers(cuda, False) for _ in range(slots)]
        gpu_specs = []
        for s, ready, done in zip(self.gpu_slots, self.ready, self.done, strict=True):
            gpu_specs.append(
                dataclasses.replace(
                    s.spec(), ready=0, ready_device=0, done=0, done_device=0,
                    ready_semaphore=ready.alloc.obj, done_semaphore=done.alloc.obj,
                )
            )  # fmt: skip
        gpu = PlaneGpu(
            context=0xC0FFEE, pre_kernel=0x5EED, int8=True, input_scale=0.5, canvas=(64, 96),
            max_det=1000, slots=tuple(gpu_specs),
        )  # fmt: skip
        f = cuda.functions()
        functions = CudaFunctions(
            f.ctx_set_current, f.memcpy_htod_async, f.launch_kernel, f.write_value32,
            f.wait_value32, f.graph_launch, f.launch_host_func, wait_geq=0,
            signal_external=cuda.function("fake_signal_external"),
            wait_external=cuda.function("fake_wait_external"),
        )  # fmt: skip
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        device = PlaneDevice("dla0", 1000.0, slots=slots, capacity=64, gpu=gpu, cudla=spec)
        # the chain's failures, one engine: health keeping is another test's (it would quarantine)
        self.plane = NativePlane(
            self.router, devices=[device], models={"demo": ["dla0"]}, cuda=functions,
            cudla=self.core.plane_functions(), health=Health(quarantine_after=0),
        )  # fmt: skip
        self.plane.start()
        self.client = self.ctx.socket(zmq.DEALER)
        self.client.setsockopt(zmq.LINGER, 0)
        self.client.connect(f"tcp://127.0.0.1:{port}")

    def infer(self, rid: int) -> None:
        self.client.send_multipart(protocol.encode(InferRequest(rid, model="demo", image=IMAGE)))

    def reply(self) -> InferReply:
        assert self.client.poll(20_000), "no reply"
        reply = protocol.decode_reply(self.client.recv_multipart())
        assert isinstance(reply, InferReply)
        return reply

    def close(self) -> None:
        self.plane.close()  # its engine waited for the tasks; the streams ran to their end
        self.client.close(0)
        self.router.close(0)
        self.ctx.term()
        for s in self.gpu_slots:
            s.close()
        self.core.close()


def test_the_gpu_chain_meets_the_cudla_task_through_nvscisync(
    fake: FakeLib, cuda: FakeCuda
) -> None:
    """Recipe A in the plane: the stream signals the ready object after the pre kernel (CUDA
    filling the task's pre-fence at the call), the task waits on it, and the stream waits on
    the task's EOF fence before the post graph: a stream held before its signal holds the DLA
    task, and every post graph runs after its task."""
    ran: list[int] = []
    lock = threading.Lock()

    def task(core: int, inputs: Any, outputs: Any) -> int:
        with lock:
            ran.append(time.monotonic_ns())
        return 0

    fake.set_callback(task)
    fake.option("task_delay_us", 3000)  # a post graph that did not wait would run first
    rig = ChainRig(fake, cuda)
    try:
        first = rig.gpu_slots[0]
        cuda.lib.fake_stream_hold(first.stream, 1)
        rig.infer(0)
        # the frame's chain is queued and its task submitted, waiting on the held stream
        wait_for(lambda: bool(_tasks(fake)))
        assert "waits=1 signals=1" in _tasks(fake)[0]
        assert ran == []  # the DLA waits for the stream's signal
        cuda.lib.fake_stream_hold(first.stream, 0)
        r = rig.reply()
        assert len(cuda.signals()) == 1
        assert ran[0] >= cuda.signals()[0]  # the task ran once the stream had signalled
        assert (r.id, r.status, r.device) == (0, Status.OK, "dla0")
        assert r.detections is not None
        assert len(r.detections) == 2  # what the fake post graph writes
        for rid in range(1, 9):
            rig.infer(rid)
        replies = [rig.reply() for _ in range(8)]
        assert {x.status for x in replies} == {Status.OK}
        assert sorted(x.id or 0 for x in replies) == list(range(1, 9))
        posts = sorted(cuda.posts())
        assert len(ran) == len(posts) == 9
        # each post graph ran after its own task: the k-th post after at least k + 1 tasks
        for task_at, post_at in zip(sorted(ran), posts, strict=True):
            assert post_at > task_at
    finally:
        rig.close()
        fake.set_callback(None)


def test_plane_core_refuses_what_the_plane_cannot_submit(fake: FakeLib) -> None:
    lo = read_loadable(DEMO / "fp16_heads.dla0.emu")
    with CudlaDlaCore(0, libs=fake.libraries()) as core:
        with pytest.raises(DlaError, match="no module is loaded"):
            core.plane_core([])
        module = core.load(fake_loadable(lo.inputs, lo.outputs, 0))
        inputs = [core.alloc_buffer(d) for d in module.inputs]
        outputs = [core.alloc_buffer(d) for d in module.outputs]
        cpu = core.create_fence("cpu", signaller="cpu")
        with pytest.raises(DlaError, match="not a DLA fence of this core"):
            core.plane_core([(inputs, outputs, cpu)])
        done = core.create_fence("done")
        with pytest.raises(DlaError, match="not this core's module's"):
            core.plane_core([(outputs, inputs, done)])
        spec = core.plane_core([(inputs, outputs, done)])
        assert spec.slots[0].inputs == tuple(
            ctypes.cast(b.registered, c_void_p).value for b in inputs
        )
        assert spec.timeout_us > 0
        assert spec.wait_context == core.nvsci.cpu_wait.value


# What may happen to a frame of the chain, and the reply's words it must get.
FATES = {
    "ok": None,
    "task fails": "dla0: task failed: cudlaErrorDlaErrEngineTimeout",
    "submit refused": "dla0: cudlaSubmitTask: cudlaErrorUmd (7)",
    "signal fails": "dla0: the GPU chain could not be queued: "
    "cuSignalExternalSemaphoresAsync failed (999)",
    "wait fails": "dla0: the GPU chain could not be queued: "
    "cuWaitExternalSemaphoresAsync failed (999)",
    "post fails": "dla0: the GPU chain could not be queued: cuGraphLaunch failed (999)",
}


@given(fates=st.lists(st.sampled_from(sorted(FATES)), min_size=1, max_size=12),
       burst=st.integers(0, 6))  # fmt: skip
@example(fates=["ok", "wait fails", "task fails"], burst=2)  # the failure both frames'
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
def test_every_frame_of_the_chain_is_answered_once_whatever_fails(
    fake: FakeLib, cuda: FakeCuda, fates: list[str], burst: int
) -> None:
    """Failures anywhere in a cuDLA core's chain (the core's task, its submission, the CUDA
    calls before and after it) answer that frame DEVICE_FAILED with what failed, and nothing
    else: the slots come back (a burst after them is served on both), and at close every
    cuDLA and NvSci object is released."""
    before = fake.live()
    fake.clear_log()
    rig = ChainRig(fake, cuda)
    try:
        for rid, fate in enumerate(fates):  # one at a time: each injection is that frame's
            if fate == "task fails":
                fake.task_fault(0, FAULT_ERROR, ENGINE_TIMEOUT, 1)
            elif fate == "submit refused":
                fake.fail_next("cudlaSubmitTask", 7)
            else:
                call = {"signal fails": b"cuSignalExternalSemaphoresAsync",
                        "wait fails": b"cuWaitExternalSemaphoresAsync",
                        "post fails": b"cuGraphLaunch"}.get(fate)  # fmt: skip
                if call is not None:
                    cuda.lib.fake_fail_next(call, 999)
            rig.infer(rid)
            r = rig.reply()
            # (a frame answered at a CUDA failure leaves its task running: the next frame's
            # task may end before that one's status is read, and cuDLA's error is the
            # handle's, not a task's; a failure is then reported on both, never lost)
            assert r.id == rid
            if FATES[fate] is None:
                assert r.status == Status.OK
            else:
                assert (r.status, r.message) == (Status.DEVICE_FAILED, FATES[fate])
        for rid in range(100, 100 + burst):
            rig.infer(rid)
        replies = [rig.reply() for _ in range(burst)]
        assert sorted(r.id or 0 for r in replies) == list(range(100, 100 + burst))
        assert {r.status for r in replies} <= {Status.OK}
        counts = rig.plane.counters()["by_status"]
        failed = sum(FATES[f] is not None for f in fates)
        assert counts.get("DEVICE_FAILED", 0) == failed
        assert counts.get("OK", 0) == len(fates) - failed + burst
    finally:
        rig.close()
    assert fake.live() == before


def test_the_planes_status_names_are_the_python_backends() -> None:
    """A failed frame's words name cuDLA's status as DlaError does (CudlaStatus.c_name)."""
    from dlad import _native

    for status in CudlaStatus:
        assert _native.cudla_status_name(int(status)) == status.c_name
    assert _native.cudla_status_name(0x12345) == CudlaStatus.ERROR_UNKNOWN.c_name
