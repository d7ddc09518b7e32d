"""A polite client beside a greedy one, a STATUS flood and a junk flood (docs/reliability.md
"Fairness"), against a baseline's code and this code, in one run.

    git worktree add /tmp/before <the baseline's commit>    # the baseline's code
    python bench/fairness.py --before /tmp/before [--seconds 10] [--cases "junk flood"]

The daemon: two emulated DLA cores in timing mode (3.82 ms a frame), pre/post off. The polite
client (the SDK, this process) sends one 64x64 INFER every 50 ms (20/s) with a 100 ms deadline.
Beside it, from another process, either:

- **greedy**: a raw DEALER keeping 200 INFERs in flight (a new one for each reply), or
- **STATUS flood**: a raw DEALER sending STATUS requests as fast as it can (reading the replies);
- **junk flood**: the same with 1-byte messages no decoder takes.

Reported per case and code: the polite client's OK %, OVERLOADED %, other failures (timeouts
included) and its p50/p99 latency.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import zmq
from orin_config import DEMO_LOADABLES, emulated_dlas, running_daemon  # bench/, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "clients")]
from dlad import protocol  # noqa: E402
from dlad_client import Client, ClientTimeout, DladError  # noqa: E402

CONFIG = (
    """
[frontend]
endpoints = ["{endpoint}"]
[pre_post]
enabled = false
[metrics]
enabled = false
"""
    + emulated_dlas(3820.0)
    + '[models.demo]\ndevices = ["dla0", "dla1"]\n'
    + DEMO_LOADABLES
)
IMAGE = np.zeros((64, 64, 3), np.uint8)


def greedy(endpoint: str, seconds: float, window: int = 200) -> int:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    sent = got = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        while sent - got < window:
            sock.send_multipart(protocol.encode(protocol.InferRequest(sent, "demo", IMAGE)))
            sent += 1
        if sock.poll(100):
            sock.recv_multipart()
            got += 1
    sock.close(0)
    ctx.term()
    return sent


def flood(endpoint: str, seconds: float, message: list[bytes] | None = None) -> int:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndhwm = sock.rcvhwm = 100_000
    sock.connect(endpoint)
    sent = 0
    if message is None:
        message = [bytes(f) for f in protocol.encode(protocol.StatusRequest(1))]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(100):
            sock.send_multipart(message)
            sent += 1
        while sock.poll(0):
            sock.recv_multipart()
    sock.close(0)
    ctx.term()
    return sent


def junk(endpoint: str, seconds: float) -> int:
    return flood(endpoint, seconds, [b"\xc1"])


AGGRESSORS = {"greedy": greedy, "STATUS flood": flood, "junk flood": junk}


def polite(endpoint: str, seconds: float) -> tuple[Counter[str], list[float]]:
    outcomes: Counter[str] = Counter()
    latencies: list[float] = []
    with Client(endpoint, timeout_s=2.0) as client:
        t0 = time.monotonic()
        i = 0
        while time.monotonic() < t0 + seconds:
            due = t0 + i * 0.05
            time.sleep(max(due - time.monotonic(), 0))
            i += 1
            start = time.perf_counter()
            try:
                client.detect(IMAGE, deadline_ms=100)
            except ClientTimeout:
                outcomes["TIMEOUT"] += 1
            except DladError as exc:
                outcomes[exc.status.name] += 1
            else:
                outcomes["OK"] += 1
                latencies.append(time.perf_counter() - start)
    return outcomes, latencies


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="a checkout of the baseline")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "fairness")
    p.add_argument("--cases", default=",".join(AGGRESSORS),
                   help=f"comma-separated, of {', '.join(AGGRESSORS)}")  # fmt: skip
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print("| beside | code | polite OK % | OVERLOADED % | other % | p50 ms | p99 ms | "
          "aggressor sent |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    spawn = multiprocessing.get_context("spawn")
    for case in args.cases.split(","):
        aggressor = AGGRESSORS[case]
        for code, tree in (("before", args.before), ("now", None)):
            log = args.out / f"{case.replace(' ', '_')}_{code}.log"
            with running_daemon(CONFIG, log, tree=tree) as (_, endpoint), spawn.Pool(1) as pool:
                other = pool.apply_async(aggressor, (endpoint, args.seconds + 2))
                time.sleep(1.0)  # the aggressor at full tilt first
                outcomes, latencies = polite(endpoint, args.seconds)
                sent = other.get(timeout=120)
            n = sum(outcomes.values())
            ok, over = outcomes["OK"], outcomes["OVERLOADED"]
            rest = n - ok - over
            p50, p99 = (
                (float(np.percentile(latencies, q) * 1e3) for q in (50, 99))
                if latencies else (float("nan"), float("nan"))
            )  # fmt: skip
            others = ", ".join(
                f"{k} {v}" for k, v in outcomes.items() if k not in ("OK", "OVERLOADED")
            )
            print(f"| {case} | {code} | {100 * ok / n:.1f} | {100 * over / n:.1f} "
                  f"| {100 * rest / n:.1f} ({others or '-'}) | {p50:.2f} | {p99:.2f} "
                  f"| {sent} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
