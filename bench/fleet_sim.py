"""A fleet of dlad daemons on loopback: the fleet client against plain round robin, in one run.

    python bench/fleet_sim.py [--daemons 32] [--seconds 30] [--rate 160] [--slo-ms 500]

``--daemons`` daemon processes in timing mode (two emulated DLA cores each, pre/post off), a
quarter of them with engines ``--slow``x slower (an older module, a thermally throttled one).
``--clients`` client processes offer ``--rate`` requests/s in all (Poisson arrivals, open loop:
every request is sent at its time whatever came back), each with a ``--timeout-s`` deadline;
a request counts as goodput when it is answered OK within ``--slo-ms``. A third of the way in,
one daemon is killed (SIGKILL: its frames in flight are lost) and another is slowed: a noisy
neighbour floods it with more frames than its queues hold. The same scenario runs twice, with
fresh daemons each time, through each way of routing:

- ``fleet``: ``dlad_client.AsyncFleet`` over the endpoints (least loaded of two choices,
  retries elsewhere, a circuit breaker, heartbeats every ``--heartbeat-s``);
- ``round-robin``: one ``AsyncClient`` connected to every endpoint: ZeroMQ's DEALER deals the
  requests round robin among the connected daemons (what a Kubernetes Service would do).

Reported per mode: goodput (share of the offered requests OK within the SLO), p50/p99 of the
OK ones, the outcomes by kind, requests left unanswered (none may be: every call ends), and the
recovery after the kill: from the kill until the goodput of 250 ms bins is back within 5 % of
its level before the kill and stays there for a second. The goodput ratio is the headline.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

CONFIG = """
[daemon]
name = "d{index}"
default_deadline_ms = 60000.0
[frontend]
endpoints = ["tcp://127.0.0.1:{port}"]
cheap_requests_per_s = 1000.0
[metrics]
enabled = false
heartbeat_s = 0.5
[pre_post]
enabled = false
[devices.dla0]
kind = "dla"
core = 0
queue_depth = 4
mode = "timing"
latency_us = {latency}
[devices.dla1]
kind = "dla"
core = 1
queue_depth = 4
mode = "timing"
latency_us = {latency}
[models.demo]
devices = ["dla0", "dla1"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
core1 = "bundled:demo/fp16_heads.dla1.emu"
"""
IMAGE_SHAPE = (64, 64, 3)


def start_daemons(
    args: argparse.Namespace, tmp: Path
) -> tuple[list[subprocess.Popen[str]], list[str]]:
    procs, endpoints = [], []
    for i in range(args.daemons):
        slow = i % 4 == 3  # every fourth: never the killed (0) or the flooded (1) one
        latency = args.latency_ms * 1e3 * (args.slow if slow else 1.0)
        port = args.port + i
        cfg = tmp / f"d{i}.toml"
        cfg.write_text(CONFIG.format(index=i, port=port, latency=latency))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "dlad.cli", "--config", str(cfg)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))  # fmt: skip
        endpoints.append(f"tcp://127.0.0.1:{port}")
    for proc in procs:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "listening" in line:
                break
        else:
            raise RuntimeError("a daemon exited before listening")
    for proc in procs:  # nobody reads their logs from here on: let them go nowhere
        assert proc.stdout is not None
        proc.stdout.close()
    return procs, endpoints


def client_main(job: dict[str, Any], out: Any) -> None:
    """One client process: Poisson arrivals at ``job["rate"]`` from monotonic ``job["t0"]`` for
    ``job["seconds"]``; sends back (intended send, end, outcome) per request, the retries and
    how many requests were due."""
    import anyio

    from dlad.errors import DladError
    from dlad_client import AsyncClient, AsyncFleet, ClientTimeout

    mode, endpoints, rate, seconds = job["mode"], job["endpoints"], job["rate"], job["seconds"]
    timeout_s, seed, t0 = job["timeout_s"], job["seed"], job["t0"]
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=int(rate * seconds * 1.5) + 10)
    due = np.cumsum(gaps)
    due = due[due < seconds]
    image = np.zeros(IMAGE_SHAPE, np.uint8)
    records: list[tuple[float, float, str]] = []

    async def one(router: Any, at: float) -> None:
        try:
            result = await router.detect(image, timeout_s=timeout_s)
            # served by a slow daemon: its engine took over 1.5x a fast one's frame time
            outcome = "OK-slow" if result.timing.device_us > 1.5e3 * job["latency_ms"] else "OK"
        except ClientTimeout:
            outcome = "TIMEOUT"
        except DladError as exc:
            outcome = exc.status.name
        records.append((at, time.monotonic() - t0, outcome))

    async def main() -> None:
        if mode == "fleet":
            router: Any = AsyncFleet(endpoints, timeout_s=timeout_s, heartbeat_s=job["heartbeat_s"],
                                     attempt_timeout_s=timeout_s / 3, seed=seed)  # fmt: skip
        else:
            router = AsyncClient(endpoints, timeout_s=timeout_s, max_in_flight=100_000)
        async with router, anyio.create_task_group() as tg:
            for at in due:
                delay = t0 + at - time.monotonic()
                if delay > 0:
                    await anyio.sleep(delay)
                tg.start_soon(one, router, float(at))
        out.send((records, getattr(router, "retries", 0), len(due)))

    anyio.run(main)


def flood_main(endpoint: str, seconds: float) -> None:
    """The noisy neighbour: 16 frames always outstanding at one daemon (it holds 12: two on
    each core, four queued for each), a refused one sent again 50 ms later."""
    import anyio

    from dlad.errors import DladError
    from dlad_client import AsyncClient, ClientTimeout

    image = np.zeros(IMAGE_SHAPE, np.uint8)

    async def one(client: AsyncClient) -> None:
        try:
            await client.detect(image, timeout_s=5.0)
        except (DladError, ClientTimeout):
            await anyio.sleep(0.05)  # refused at once: again soon, not in a spin

    async def worker(client: AsyncClient, end: float) -> None:
        while time.monotonic() < end:
            await one(client)

    async def main() -> None:
        end = time.monotonic() + seconds
        client = AsyncClient(endpoint, max_in_flight=16)
        async with client, anyio.create_task_group() as tg:
            for _ in range(16):
                tg.start_soon(worker, client, end)

    anyio.run(main)


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        procs, endpoints = start_daemons(args, Path(tmp))
        try:
            t0 = time.monotonic() + 2.0  # every client starts at the same moment
            ctx = mp.get_context("spawn")
            pipes, clients = [], []
            for c in range(args.clients):
                mine, theirs = ctx.Pipe(duplex=False)
                job = {"mode": mode, "endpoints": endpoints, "rate": args.rate / args.clients,
                       "seconds": args.seconds, "timeout_s": args.timeout_s, "t0": t0,
                       "heartbeat_s": args.heartbeat_s, "seed": args.seed + c,
                       "latency_ms": args.latency_ms}  # fmt: skip
                proc = ctx.Process(target=client_main, args=(job, theirs))
                proc.start()
                pipes.append(mine)
                clients.append(proc)
            event_at = args.seconds / 3
            time.sleep(max(t0 + event_at - time.monotonic(), 0))
            if "kill" in args.events:
                os.kill(procs[0].pid, signal.SIGKILL)  # a daemon dies
            flood = ctx.Process(target=flood_main, args=(endpoints[1], args.seconds))
            if "flood" in args.events:
                flood.start()  # and another is slowed by a neighbour
            results = [pipe.recv() for pipe in pipes]
            for proc in clients:
                proc.join(30)
            if flood.is_alive():
                flood.terminate()
                flood.join(10)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                proc.wait(30)
    records = [r for recs, _, _ in results for r in recs]
    scheduled = sum(n for _, _, n in results)
    retries = sum(n for _, n, _ in results)
    return summarize(mode, records, retries=retries, offered=scheduled, args=args,
                     event_at=event_at)  # fmt: skip


def summarize(mode: str, records: list[tuple[float, float, str]], *, retries: int, offered: int,
              args: argparse.Namespace, event_at: float) -> dict[str, Any]:  # fmt: skip
    slo = args.slo_ms / 1e3
    good = [(at, end) for at, end, o in records if o.startswith("OK") and end - at <= slo]
    ok_lat = sorted((end - at) * 1e3 for at, end, o in records if o.startswith("OK"))
    outcomes = Counter(o for _, _, o in records)
    # goodput in 250 ms bins of intended send time
    bins = np.arange(0.0, args.seconds + 0.25, 0.25)
    sent, _ = np.histogram([at for at, _, _ in records], bins)
    hit, _ = np.histogram([at for at, _ in good], bins)
    share = np.divide(hit, sent, out=np.zeros_like(hit, dtype=float), where=sent > 0)
    before = share[(bins[:-1] >= 2.0) & (bins[:-1] < event_at)]
    level = float(np.median(before)) if before.size else 1.0
    recovery = None
    after = np.nonzero(bins[:-1] >= event_at)[0]
    for i in after:
        window = share[i : i + 4]  # a second of bins
        if window.size == 4 and (window >= 0.95 * level).all():
            recovery = float(bins[i] - event_at)
            break
    return {
        "mode": mode,
        "offered": offered,
        "goodput": len(good) / max(offered, 1),
        "p50_ms": statistics.median(ok_lat) if ok_lat else None,
        "p99_ms": float(np.percentile(ok_lat, 99)) if ok_lat else None,
        "outcomes": dict(outcomes),
        "unanswered": offered - len(records),  # calls that never ended
        "retries": retries,
        "level_before_kill": level,
        "recovery_s": recovery,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--daemons", type=int, default=32)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=160.0, help="requests/s offered, all clients")
    ap.add_argument("--latency-ms", type=float, default=200.0, help="a fast engine's frame time")
    ap.add_argument("--slow", type=float, default=3.0, help="how much slower a slow daemon is")
    ap.add_argument("--slo-ms", type=float, default=500.0)
    ap.add_argument("--timeout-s", type=float, default=4.0)
    ap.add_argument("--heartbeat-s", type=float, default=0.5)
    ap.add_argument("--port", type=int, default=6200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--events", default="kill,flood", help="what happens a third of the way in")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    fast = args.daemons - args.daemons // 4
    capacity = 2 * 1e3 / args.latency_ms * (fast + (args.daemons // 4) / args.slow)
    print(f"{args.daemons} daemons ({args.daemons // 4} {args.slow:g}x slower), capacity "
          f"{capacity:.0f}/s, offered {args.rate:.0f}/s ({args.rate / capacity:.0%}); cpus "
          f"{os.cpu_count()}, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    rows = [run_mode(mode, args) for mode in ("fleet", "round-robin")]
    for r in rows:
        print(f"{r['mode']:12s} goodput {r['goodput']:.3f}  p50 {r['p50_ms']:.1f} ms  p99 "
              f"{r['p99_ms']:.1f} ms  recovery {r['recovery_s']} s  retries {r['retries']}  "
              f"unanswered {r['unanswered']}  {r['outcomes']}")  # fmt: skip
    ratio = rows[0]["goodput"] / max(rows[1]["goodput"], 1e-9)
    print(f"goodput fleet / round-robin: {ratio:.2f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "rows": rows, "ratio": ratio}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
