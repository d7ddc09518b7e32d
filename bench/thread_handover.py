"""What one blocking call handed from the event loop to a thread and back costs: anyio's
``to_thread.run_sync`` against :class:`dlad.waiter.Waiter` (one thread of its own), in the same
run, as process CPU and wall time per call of a function that returns at once.

    python bench/thread_handover.py [--calls 20000] [--trials 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio
from waiter import Waiter  # bench/, beside this script


def _noop() -> int:
    return 1


async def _measure(calls: int) -> tuple[float, float, float, float]:
    t, w = time.process_time(), time.perf_counter()
    for _ in range(calls):
        await anyio.to_thread.run_sync(_noop)
    anyio_cpu, anyio_wall = time.process_time() - t, time.perf_counter() - w
    waiter = Waiter("handover")
    t, w = time.process_time(), time.perf_counter()
    for _ in range(calls):
        await waiter.run(_noop)
    own_cpu, own_wall = time.process_time() - t, time.perf_counter() - w
    waiter.close()
    us = 1e6 / calls
    return anyio_cpu * us, anyio_wall * us, own_cpu * us, own_wall * us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    ratios = []
    for trial in range(args.trials):
        a_cpu, a_wall, w_cpu, w_wall = anyio.run(_measure, args.calls)
        ratios.append(a_cpu / w_cpu)
        print(
            f"trial {trial + 1}: anyio.to_thread {a_cpu:.1f} µs CPU / {a_wall:.1f} µs wall a call; "
            f"Waiter {w_cpu:.1f} / {w_wall:.1f}; CPU ratio {a_cpu / w_cpu:.2f}"
        )
    print(f"CPU ratio anyio / Waiter: median {statistics.median(ratios):.2f} "
          f"[{min(ratios):.2f}, {max(ratios):.2f}]")  # fmt: skip


if __name__ == "__main__":
    main()
