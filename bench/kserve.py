"""The KServe ports against the ZeroMQ path: requests/s and the daemon's CPU per request, one run.

    python bench/kserve.py [--seconds 5] [--concurrency 8] [--size 640x480]
        [--latency-us 3820] [--json FILE]

One daemon process: two emulated DLA cores in timing mode (``--latency-us`` a frame; 3.82 ms is
YOLOv5s-672 on an Orin DLA, published), pre/post-processing off, so that what differs between
the three ways in is the front door itself. Each way keeps ``--concurrency`` requests of one
``--size`` RGB image in flight for ``--seconds`` (closed loop), all over loopback TCP:

* ``zeromq``: the SDK's AsyncClient (msgpack header + the image's bytes);
* ``grpc``: ``tritonclient.grpc.aio`` (protobuf, the image in ``raw_input_contents``);
* ``http``: ``tritonclient.http.aio`` (JSON + Triton's binary tensor data).

Reported per way: answers/s, p50 and p99 latency at the client, and the daemon process's CPU
time per answer (user + system, from /proc), with the ratio to the ZeroMQ path's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "clients"), str(ROOT / "bench")]

from orin_config import demo_model, emulated_dlas, running_daemon  # noqa: E402

from dlad_client import AsyncClient  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def closed_loop(
    one: Callable[[], Awaitable[Any]], concurrency: int, seconds: float
) -> tuple[int, list[float]]:
    """Keep ``concurrency`` calls of ``one`` going for ``seconds``; (answers, latencies s)."""
    end = time.perf_counter() + seconds
    latencies: list[float] = []

    async def worker() -> None:
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            await one()
            latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(latencies), latencies


async def measure(way: str, args: argparse.Namespace, ports: dict[str, int],
                  image: np.ndarray, daemon: psutil.Process) -> dict[str, Any]:  # fmt: skip
    """One way's figures: a warm-up second, then ``--seconds`` measured."""
    closers: list[Callable[[], Awaitable[Any]]] = []
    if way == "zeromq":
        client = AsyncClient(f"tcp://127.0.0.1:{ports['zmq']}")
        await client.__aenter__()
        closers.append(lambda: client.__aexit__(None, None, None))

        async def one() -> Any:
            return await client.detect(image)

    elif way == "grpc":
        import tritonclient.grpc.aio as grpcclient

        g = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['grpc']}")
        closers.append(g.close)
        tensor = grpcclient.InferInput("IMAGE", list(image.shape), "UINT8")
        tensor.set_data_from_numpy(image)

        async def one() -> Any:
            return await g.infer("demo", [tensor])

    else:
        import tritonclient.http.aio as httpclient

        h = httpclient.InferenceServerClient(f"127.0.0.1:{ports['http']}",
                                             conn_limit=args.concurrency)  # fmt: skip
        closers.append(h.close)
        tensor = httpclient.InferInput("IMAGE", list(image.shape), "UINT8")
        tensor.set_data_from_numpy(image, binary_data=True)

        async def one() -> Any:
            return await h.infer("demo", [tensor])

    try:
        await closed_loop(one, args.concurrency, 1.0)  # warm-up: connections, caches
        before = daemon.cpu_times()
        t0 = time.perf_counter()
        answered, latencies = await closed_loop(one, args.concurrency, args.seconds)
        wall = time.perf_counter() - t0
        after = daemon.cpu_times()
    finally:
        for close in closers:
            await close()
    cpu = (after.user + after.system) - (before.user + before.system)
    ms = np.asarray(latencies) * 1e3
    return {
        "way": way,
        "answered": answered,
        "per_s": answered / wall,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "daemon_cpu_us_per_answer": cpu / answered * 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--size", default="640x480")
    p.add_argument("--latency-us", type=float, default=3820.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    w, h = (int(v) for v in args.size.split("x"))
    image = np.random.default_rng(0).integers(0, 256, (h, w, 3), np.uint8)
    ports = {"zmq": free_port(), "http": free_port(), "grpc": free_port()}
    config = (
        f'[frontend]\nendpoints = ["{{endpoint}}", "tcp://127.0.0.1:{ports["zmq"]}"]\n'
        "[pre_post]\nenabled = false\n[metrics]\nenabled = false\n"
        f'[kserve]\nenabled = true\nhttp = "127.0.0.1:{ports["http"]}"\n'
        f'grpc = "127.0.0.1:{ports["grpc"]}"\n'
        + emulated_dlas(args.latency_us, queue_depth=32) + demo_model(["dla0", "dla1"])
    )  # fmt: skip
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "dlad-bench-kserve.log"
    with running_daemon(config, log) as (proc, _):
        daemon = psutil.Process(proc.pid)
        rows = [asyncio.run(measure(way, args, ports, image, daemon))
                for way in ("zeromq", "grpc", "http")]  # fmt: skip
    base = rows[0]["daemon_cpu_us_per_answer"]
    print(f"{args.size} RGB, {args.concurrency} in flight, {args.seconds:g} s a way, two "
          f"emulated DLA cores at {args.latency_us:g} µs; {platform.node()}, "
          f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}")  # fmt: skip
    print(f"{'way':8} {'answers/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'daemon CPU µs/answer':>21} {'vs zeromq':>9}")  # fmt: skip
    for r in rows:
        cpu = r["daemon_cpu_us_per_answer"]
        print(f"{r['way']:8} {r['per_s']:10.0f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
              f"{cpu:21.0f} {cpu / base:9.2f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
