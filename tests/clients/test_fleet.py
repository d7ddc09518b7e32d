"""The fleet client (dlad_client._fleet) on live daemons in timing mode: it spreads frames by
load, keeps streams home, retries what another daemon can serve, opens the circuit of a daemon
that stops answering (its frames in flight go elsewhere at once), and follows DNS."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import anyio
import numpy as np
import pytest
import zmq

from dlad.config import load_config
from dlad.daemon import Daemon
from dlad.errors import NotFound, Overloaded
from dlad_client import AsyncFleet, Fleet, Result
from dlad_client._fleet import dns_endpoints
from tests.clients.waiting import until
from tests.dlad.serving import serve_in_thread

pytestmark = pytest.mark.timeout(120)

IMAGE = np.zeros((64, 64, 3), np.uint8)
CONFIG = """
[daemon]
name = "{name}"
default_deadline_ms = 30000.0
[frontend]
endpoints = ["tcp://127.0.0.1:5555"]
cheap_requests_per_s = 100000.0
[metrics]
enabled = false
[pre_post]
enabled = false
[devices.dla0]
kind = "dla"
core = 0
queue_depth = {depth}
mode = "timing"
latency_us = {latency}
[models.demo]
devices = ["dla0"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
"""


@contextmanager
def daemons(tmp_path: Path, *specs: tuple[float, int]) -> Iterator[list[str]]:
    """One single-core daemon per (latency µs, queue depth), on loopback; yields endpoints."""
    with ExitStack() as stack:
        endpoints = []
        for i, (latency, depth) in enumerate(specs):
            cfg = tmp_path / f"d{i}.toml"
            cfg.write_text(CONFIG.format(name=f"d{i}", latency=latency, depth=depth))
            daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
            endpoints.append(stack.enter_context(serve_in_thread(daemon)))
        yield endpoints


def _by_endpoint(fleet: AsyncFleet | Fleet) -> dict[str, int]:
    return {m.endpoint: m.ok for m in fleet.members}


async def _pile_onto(
    fleet: AsyncFleet, endpoint: str, frames: int, held: int, then: Callable[[], object]
) -> list[Result]:
    """Send ``frames`` at once, ``endpoint`` made to look fastest so that they go there; once
    it holds ``held`` of them, ``then()`` (the daemon dies, drains...); returns the results."""
    fleet._members[endpoint].prior_s = 1e-6
    results: list[Result] = []

    async def one() -> None:
        results.append(await fleet.detect(IMAGE))

    async with anyio.create_task_group() as tg:
        for _ in range(frames):
            tg.start_soon(one)
        await until(lambda: fleet._members[endpoint].in_flight >= held)
        then()
    return results


def test_frames_go_mostly_where_the_wait_is_shortest(tmp_path: Path) -> None:
    async def main(endpoints: list[str]) -> dict[str, int]:
        async with AsyncFleet(endpoints, heartbeat_s=0.2, seed=1) as fleet:
            async with anyio.create_task_group() as tg:
                for _ in range(8):  # eight cameras, 15 frames each, back to back
                    tg.start_soon(_camera, fleet, 15)
            return _by_endpoint(fleet)

    async def _camera(fleet: AsyncFleet, n: int) -> None:
        for _ in range(n):
            assert isinstance(await fleet.detect(IMAGE), Result)

    with daemons(tmp_path, (2_000.0, 16), (2_000.0, 16), (60_000.0, 16)) as eps:
        ok = anyio.run(main, eps)
    assert sum(ok.values()) == 120
    fast, slow = ok[eps[0]] + ok[eps[1]], ok[eps[2]]
    assert slow < fast / 4, ok  # a 30x slower daemon: far fewer frames, yet not shut out
    assert min(ok[eps[0]], ok[eps[1]]) > 0


def test_a_stream_stays_on_its_daemon_while_it_is_available(tmp_path: Path) -> None:
    async def main(endpoints: list[str]) -> Counter[str]:
        seen: Counter[str] = Counter()
        async with AsyncFleet(endpoints, seed=3) as fleet:
            for _ in range(12):
                before = _by_endpoint(fleet)
                await fleet.detect(IMAGE, stream="cam7")
                after = _by_endpoint(fleet)
                seen.update(e for e in after if after[e] > before[e])
        return seen

    with daemons(tmp_path, (1_000.0, 8), (1_000.0, 8), (1_000.0, 8)) as eps:
        seen = anyio.run(main, eps)
    assert len(seen) == 1, seen
    assert next(iter(seen.values())) == 12


def test_a_full_daemon_s_refusal_is_retried_on_another(tmp_path: Path) -> None:
    async def main(endpoints: list[str]) -> tuple[int, int]:
        async with AsyncFleet(endpoints, heartbeat_s=5.0, backoff_s=0.001, seed=5) as fleet:
            results = []

            async def one() -> None:
                results.append(await fleet.detect(IMAGE, timeout_s=20.0))

            async with anyio.create_task_group() as tg:
                for _ in range(24):  # far more at once than the small daemon holds
                    tg.start_soon(one)
            assert all(isinstance(r, Result) for r in results)
            return len(results), fleet.retries

    # a daemon of 1 queued frame at 200 ms beside one of 64 at 2 ms: the heartbeat is too slow
    # to have told the fleet, so the small one refuses (OVERLOADED) and the fleet retries
    with daemons(tmp_path, (200_000.0, 1), (2_000.0, 64)) as eps:
        answered, retries = anyio.run(main, eps)
    assert answered == 24
    assert retries > 0


def test_answers_another_daemon_would_repeat_are_not_retried(tmp_path: Path) -> None:
    async def main(endpoints: list[str]) -> None:
        async with AsyncFleet(endpoints) as fleet:
            with pytest.raises(NotFound, match="nope"):
                await fleet.detect(IMAGE, model="nope")
            assert fleet.retries == 0

    with daemons(tmp_path, (1_000.0, 4), (1_000.0, 4)) as eps:
        anyio.run(main, eps)


@contextmanager
def silent_daemon() -> Iterator[str]:
    """A ROUTER that takes every message and never answers: a daemon that hangs."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def swallow() -> None:
        while not stop.is_set():
            if sock.poll(50):
                sock.recv_multipart()

    thread = threading.Thread(target=swallow)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join()
        sock.close(0)
        ctx.term()


def test_a_daemon_that_stops_answering_is_cut_out_and_its_frames_go_elsewhere(
    tmp_path: Path,
) -> None:
    async def main(endpoints: list[str], silent: str) -> None:
        fleet = AsyncFleet([*endpoints, silent], heartbeat_s=0.2, timeout_s=30.0,
                           attempt_timeout_s=25.0, breaker_after=1, seed=11)  # fmt: skip
        async with fleet:
            # the first heartbeat went unanswered: the circuit is open before any frame
            (hung,) = [m for m in fleet.members if m.endpoint == silent]
            assert (hung.available, hung.failures) == (False, 1)
            with anyio.fail_after(10):  # long before the 25 s attempt timeout
                for _ in range(10):
                    assert isinstance(await fleet.detect(IMAGE), Result)
            assert {m.endpoint: m.sent for m in fleet.members}[silent] == 0

    with daemons(tmp_path, (1_000.0, 8)) as eps, silent_daemon() as silent:
        anyio.run(main, eps, silent)


def test_frames_in_flight_at_a_daemon_that_hangs_are_retried_at_once(tmp_path: Path) -> None:
    async def main(endpoints: list[str], silent: str) -> tuple[int, int]:
        # the breaker needs two misses: the silent daemon is chosen before the first heartbeat
        fleet = AsyncFleet([*endpoints, silent], heartbeat_s=0.3, timeout_s=30.0,
                           attempt_timeout_s=25.0, breaker_after=2, seed=2)  # fmt: skip
        async with fleet:
            fleet._members[silent].failures = 0  # as if it had answered the first heartbeat
            results = []

            async def one() -> None:
                results.append(await fleet.detect(IMAGE))

            with anyio.fail_after(10):  # the circuit opens at the second missed heartbeat
                async with anyio.create_task_group() as tg:
                    for _ in range(12):
                        tg.start_soon(one)
            sent = {m.endpoint: m.sent for m in fleet.members}[silent]
            return len(results), sent

    with daemons(tmp_path, (1_000.0, 16)) as eps, silent_daemon() as silent:
        answered, sent_to_silent = anyio.run(main, eps, silent)
    assert answered == 12
    assert sent_to_silent > 0  # some went there first, and were answered elsewhere


def test_members_follow_what_the_resolver_says(tmp_path: Path) -> None:
    async def main(endpoints: list[str]) -> None:
        current = [endpoints[0]]
        fleet = AsyncFleet(resolve=lambda: list(current), refresh_s=0.1, heartbeat_s=0.1)
        async with fleet:
            assert [m.endpoint for m in fleet.members] == [endpoints[0]]
            current[:] = endpoints[1:]  # a rollout: the first pod leaves, two come
            await until(lambda: [m.endpoint for m in fleet.members] == sorted(endpoints[1:]))
            for _ in range(6):
                await fleet.detect(IMAGE)
            assert sum(m.ok for m in fleet.members) == 6

    with daemons(tmp_path, (1_000.0, 4), (1_000.0, 4), (1_000.0, 4)) as eps:
        anyio.run(main, eps)


def test_dns_names_resolve_to_one_endpoint_per_address() -> None:
    found = dns_endpoints("localhost:5555")()
    assert "tcp://127.0.0.1:5555" in found
    with pytest.raises(ValueError, match="host:port"):
        dns_endpoints("localhost")


def test_with_no_daemon_available_the_call_ends_within_its_timeout() -> None:
    async def main() -> None:
        with silent_daemon() as silent:
            async with AsyncFleet([silent], heartbeat_s=0.1, breaker_after=1) as fleet:
                with anyio.fail_after(5), pytest.raises(Overloaded, match="no daemon"):
                    await fleet.detect(IMAGE, timeout_s=0.5)

    anyio.run(main)


def test_the_sync_fleet_serves_several_threads(tmp_path: Path) -> None:
    with daemons(tmp_path, (1_000.0, 16), (1_000.0, 16)) as eps, Fleet(eps) as fleet:
        out: list[Result] = []

        def camera() -> None:
            handles = [fleet.submit(IMAGE) for _ in range(5)]
            out.extend(h.result(20) for h in handles)

        threads = [threading.Thread(target=camera) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(out) == 15
        assert isinstance(fleet.detect(IMAGE), Result)
        assert sum(m.ok for m in fleet.members) == 16
    with pytest.raises(RuntimeError, match="closed"):
        fleet.detect(IMAGE)


def test_bad_settings_raise_value_error() -> None:
    with pytest.raises(ValueError, match="one of them"):
        AsyncFleet()
    with pytest.raises(ValueError, match="non-empty"):
        AsyncFleet([])
    with pytest.raises(ValueError, match="scheme"):
        AsyncFleet(["127.0.0.1:5555"])
    with pytest.raises(ValueError, match="max_attempts"):
        AsyncFleet(["tcp://127.0.0.1:5555"], max_attempts=0)


def test_frames_at_a_daemon_whose_process_dies_are_retried_at_once(tmp_path: Path) -> None:
    """SIGKILL closes the daemon's sockets: the connection's drop takes it out of the fleet
    and its frames in flight go to another daemon, long before a heartbeat or an attempt
    timeout could tell (both are set far out here)."""
    with socket.socket() as probe:  # a free port for the daemon's process
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cfg = tmp_path / "dies.toml"
    text = CONFIG.format(name="dies", latency=3_000_000.0, depth=8)  # 3 s a frame
    text = text.replace("tcp://127.0.0.1:5555", f"tcp://127.0.0.1:{port}")
    cfg.write_text(text.replace('mode = "timing"', 'mode = "timing"\ntask_timeout_ms = 60000.0'))
    command = [sys.executable, "-m", "dlad.cli", "--config", str(cfg)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        next(line for line in proc.stdout if "listening" in line)
        endpoint = f"tcp://127.0.0.1:{port}"

        async def main(survivor: str) -> tuple[int, float]:
            fleet = AsyncFleet([endpoint, survivor], heartbeat_s=30.0, attempt_timeout_s=30.0,
                               timeout_s=60.0, seed=4)  # fmt: skip
            async with fleet:
                killed: list[float] = []

                def kill() -> None:
                    proc.kill()
                    killed.append(anyio.current_time())

                results = await _pile_onto(fleet, endpoint, 4, 2, kill)
                took = anyio.current_time() - killed[0]
                sent = {m.endpoint: m.sent for m in fleet.members}[endpoint]
                assert len(results) == 4
                return sent, took

        with daemons(tmp_path, (1_000.0, 8)) as (survivor,):
            sent, took = anyio.run(main, survivor)
        assert sent >= 2
        assert took < 2.5  # before the frames there would end (3 s), not the 30 s timeouts
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


@contextmanager
def srv_server(records: dict[str, list[tuple[str, int, str]]]) -> Iterator[tuple[str, int]]:
    """A DNS server on loopback answering SRV queries: name -> [(target, port, address)], the
    targets' A records in the additional section (as a headless Service's DNS does)."""
    import dns.message
    import dns.rdataclass
    import dns.rdatatype
    import dns.rrset

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                wire, peer = sock.recvfrom(4096)
            except TimeoutError:
                continue
            query = dns.message.from_wire(wire)
            reply = dns.message.make_response(query)
            qname = query.question[0].name.to_text()
            for target, port, address in records.get(qname, []):
                reply.answer.append(dns.rrset.from_text(
                    qname, 5, "IN", "SRV", f"0 50 {port} {target}"))  # fmt: skip
                reply.additional.append(dns.rrset.from_text(target, 5, "IN", "A", address))
            sock.sendto(reply.to_wire(), peer)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        yield sock.getsockname()
    finally:
        stop.set()
        thread.join()
        sock.close()


def test_srv_names_resolve_to_each_records_address_and_port() -> None:
    name = "_zmq._tcp.dlad.dlad.svc.cluster.local."
    pods = [("pod-a.dlad.dlad.svc.cluster.local.", 5555, "10.42.0.7"),
            ("pod-b.dlad.dlad.svc.cluster.local.", 5556, "10.42.1.9")]  # fmt: skip
    with srv_server({name: pods}) as server:
        found = dns_endpoints(name.rstrip("."), nameserver=server)()
        assert found == ["tcp://10.42.0.7:5555", "tcp://10.42.1.9:5556"]
        with pytest.raises(OSError, match="SRV lookup"):
            dns_endpoints("_zmq._tcp.nobody.local", nameserver=server)()


def test_a_daemon_that_drains_hands_its_queued_frames_to_the_others(tmp_path: Path) -> None:
    """A rolling update: one daemon drains (SIGTERM's path). Its queued frames come back
    SHUTTING_DOWN and are sent elsewhere, it gets no new ones, and every frame is answered."""
    cfg = tmp_path / "drains.toml"
    cfg.write_text(CONFIG.format(name="drains", latency=400_000.0, depth=8))
    draining = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])

    async def main(doomed: str, survivor: str) -> tuple[list[Result], int, bool]:
        fleet = AsyncFleet([doomed, survivor], heartbeat_s=0.2, timeout_s=30.0, seed=8)
        async with fleet:
            # once it holds four: the one running goes on, the rest are answered SHUTTING_DOWN
            results = await _pile_onto(fleet, doomed, 6, 4, draining.stop_threadsafe)
            (member,) = [m for m in fleet.members if m.endpoint == doomed]
            return results, fleet.retries, member.available

    with serve_in_thread(draining) as doomed, daemons(tmp_path, (1_000.0, 16)) as (survivor,):
        results, retries, available = anyio.run(main, doomed, survivor)
    assert len(results) == 6
    assert retries >= 1
    assert not available  # draining: out of the choice
