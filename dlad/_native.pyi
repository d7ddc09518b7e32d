# Types of the C++ core (dlad/native/module.cpp): the native data plane and its scheduler.
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

_Kind = Literal["dla", "gpu"]

def logit_cut(conf: float) -> float: ...
def letterbox_geometry(
    src_w: int, src_h: int, dst_w: int, dst_h: int
) -> tuple[float, int, int, int, int]: ...
def scaled_extent(src: int, scale: float, dst: int) -> int: ...
def yuv_coefficients(colour: int) -> tuple[float, float, float, float, float, int]: ...
def row_bytes(format: int, width: int) -> int: ...

class Scheduler:
    policy: str
    def __init__(
        self,
        alpha: float,
        policy: str,
        interference: Sequence[tuple[str, str, float]],
        pins: Mapping[str, str],
    ) -> None: ...
    def add_device(
        self,
        name: str,
        models: Sequence[str],
        capacity: int,
        max_batch: int,
        known_ns: Mapping[int, float],
        tier: int,
        kind: str,
    ) -> None: ...
    def models(self) -> list[str]: ...
    def admit(
        self,
        id: int,
        model: str,
        deadline_ns: int,
        priority: int,
        stream: str | None,
        owner: str,
        avoid: Sequence[str],
        now: int,
    ) -> tuple[int, tuple[str, int, int, int], list, list]: ...  # type: ignore[type-arg]
    def displace_for(
        self, id: int, model: str, deadline_ns: int, priority: int, stream: str | None, owner: str
    ) -> int | None: ...
    def pinned(self, stream: str, owner: str) -> str | None: ...
    def next_job(self, device: str, now: int) -> tuple[int | None, list[int]]: ...
    def next_batch(
        self, device: str, max_batch: int | None, delay_us: float, now: int
    ) -> tuple[list[int], list[int], int | None]: ...
    def finished(self, device: str, job: int, device_us: float | None) -> None: ...
    def finished_batch(self, device: str, jobs: Sequence[int], device_us: float | None) -> None: ...
    def set_resource(self, device: str, resource: str) -> None: ...
    def host(self, device: str, frames: int, host_ns: float) -> None: ...
    def set_load(self, resource: str, fraction: float) -> None: ...
    def load(self, resource: str) -> float: ...
    def set_available(self, device: str, available: bool) -> list[int]: ...
    def available(self, device: str) -> bool: ...
    def admit_probe(
        self,
        device: str,
        id: int,
        model: str,
        deadline_ns: int,
        priority: int,
        owner: str,
        now: int,
    ) -> tuple[str, int, int, int] | None: ...
    def expire(self, now: int) -> list[int]: ...
    def earliest_deadline(self) -> int | None: ...
    def cancel(self, id: int) -> bool: ...
    def drain(self) -> list[int]: ...
    def queued(self, device: str | None) -> int: ...
    def has_queued(self, stream: str | None, owner: str) -> bool: ...
    def streams_waiting(self) -> int: ...
    def in_flight(self, device: str) -> int: ...
    def service_us(self, device: str, batch: int) -> float: ...
    def snapshot(
        self,
    ) -> list[tuple[str, int, int, int, float, int, int, tuple[int, ...], bool, float, str]]: ...

# The INFER codec (dlad/native/wire.hpp); tests/dlad/test_native_wire.py holds it to protocol.py.
_Image = tuple[str, int, int, int, str | None, tuple[str, int, int, bytes] | None, int]
"""format, height, width, channels, stream, shm (name, offset, size) or None, payload frame"""

def decode_request(
    header: bytes | memoryview,
    payloads: list[int],
    limits: tuple[int, int, int, int, int],
    shm: bool,
) -> (
    tuple[Literal[False], str, str, int | None, int | None]
    | tuple[
        Literal[True], int, int, str, int, int | None, float | None, float | None, int | None,
        bool, list[_Image],
    ]
): ...  # fmt: skip
def is_name(name: str) -> bool: ...
def printable(code_point: int) -> bool: ...
def cudla_status_name(status: int) -> str: ...
def write_refusal_reply(
    id: int | None, kind: int | None, status: int, message: str
) -> tuple[bytes, bool]: ...
def shm_guard_install() -> bool: ...
def shm_watch(base: int, size: int) -> bool: ...
def shm_forget(base: int) -> None: ...
def shm_broken(base: int) -> bool: ...
def shm_faults() -> int: ...
def write_infer_reply(
    id: int,
    status: int,
    message: str,
    device: str | None,
    timing: tuple[int, int, int, int, int, int | None, int | None],
    count: int,
) -> bytes: ...

# The plane's DRAM model (dlad/native/dram.hpp), for tests.
class SharedDram:
    contention: float
    def __init__(
        self,
        contention: float,
        k: Mapping[tuple[_Kind, _Kind], float],
        clock: Callable[[], int] | None = None,
    ) -> None: ...
    def begin(self, kind: str, work_ns: float) -> int: ...
    def finish(self, id: int) -> None: ...
    def end_ns(self, id: int) -> int: ...
    def done_ns(self, id: int) -> int: ...
    def slowdown(self, id: int) -> float: ...
    def wake(self) -> None: ...
    def wakes(self) -> int: ...
    def wait_for(
        self, id: int, deadline_ns: int | None, since: int
    ) -> tuple[Literal["done", "expired", "woken"], int]: ...

# The native data plane (dlad/native/plane.hpp); used through dlad/native_plane.py.
class Plane:
    def __init__(
        self,
        libzmq: str,
        router: int,
        forward: int,
        limits: tuple[int, int, int, int, int],
        # name, latency_us, slots, capacity, gpu, cudla, kind, max_batch, max_queue_delay_us,
        # curve_us, tier, run, graphs (native_plane.PlaneDevice)
        devices: Sequence[
            tuple[
                str,
                float,
                int,
                int,
                tuple[Any, ...] | None,
                tuple[Any, ...] | None,
                str,
                int,
                float,
                Mapping[int, float],
                int,
                Callable[..., Any] | None,
                Sequence[int],
            ]
        ],
        models: Mapping[str, Sequence[str]],
        settings: Mapping[str, tuple[float, float, int]],
        default_deadline_ms: float,
        max_deadline_ms: float,
        max_in_flight_per_client: int,
        max_buffered_bytes: int,
        policy: str,
        alpha: float,
        pins: Mapping[str, str],
        shm: bool,
        curve: bool,
        cuda: tuple[int, int, int, int, int, int, int, int, int, int] | None,
        cudla: tuple[int, int, int, int] | None,
        dram: SharedDram | None,
        health: tuple[int, bool, float, float],
        cheap_requests_per_s: float,
    ) -> None: ...
    def start(self) -> None: ...
    def close(self) -> None: ...
    def cancel(self, client: bytes, request_id: int) -> int: ...
    def submit(
        self,
        client: bytes,
        owner: str,
        request_id: int,
        tag: int | None,
        items: Sequence[
            tuple[
                str,
                str | None,
                int,
                int | None,
                int,
                str | None,
                int,
                tuple[int, int, int, bool, float | None, float | None, int | None],
                bytes,
            ]
        ],
        conn: bytes,
    ) -> tuple[int, str] | None: ...
    # name, queue_depth, capacity, in_flight, service_time_us, completed, busy_ns, failed,
    # failing, last_failure, quarantined, quarantines, max_batch, batches, host_us
    def state(
        self,
    ) -> tuple[
        list[
            tuple[
                str,
                int,
                int,
                int,
                float,
                int,
                int,
                int,
                int,
                str,
                str | None,
                int,
                int,
                tuple[int, ...],
                float,
            ]
        ],
        int,
        int,
    ]: ...
    def quarantine(self, device: str, reason: str) -> None: ...
    def probe_now(self, device: str) -> bool: ...
    def warm_up(self, devices: list[str]) -> None: ...
    def take_events(self) -> list[tuple[int, str, str, float, bytes, int, str]]: ...
    def add_segment(
        self, owner: str, name: str, size: int, token: bytes, host: int, device: int
    ) -> bool: ...
    def drop_segment(self, owner: str, name: str) -> bool: ...
    def idle_segments(self, idle_ms: float) -> list[tuple[str, str]]: ...
    def take_observations(self) -> list[tuple[str, str, int, int, int, int]]: ...
    def drain(self, timeout_ms: float) -> None: ...
    def send(self, client: bytes, frames: Sequence[bytes], conn: bytes) -> None: ...
    def spoke(self, fd: int) -> bool: ...
    def connection_opened(self, fd: int) -> None: ...
    def connection_closed(self, fd: int) -> int: ...
    @property
    def pending(self) -> int: ...
    @property
    def buffered_bytes(self) -> int: ...
    @property
    def draining(self) -> bool: ...
    def counters(self) -> dict[str, Any]: ...

def wire_constants() -> dict[str, object]: ...
