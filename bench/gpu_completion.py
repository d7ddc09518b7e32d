"""How the event loop learns that a GPU chain has ended: the process's CPU per chain, each way, in
one run (the H200 via the device tool; needs a CUDA GPU and cuda-python).

    python bench/gpu_completion.py [--chains 1500] [--trials 3] [--slots 2] [--gap-ms 3.7]

Each of ``--slots`` slots, on a uvloop event loop, queues a chain on its own stream (a memset
of 64 MiB: about as long on the H200 as dlad's pre and post kernels together), learns of its end
one of two ways, then sleeps ``--gap-ms`` (the DLA's time in dlad's chain) and queues the next:

- ``waiter``: what dlad does today (``dlad.waiter.Waiter``): the loop records a blocking-sync
  event and hands ``cuEventSynchronize`` to the slot's own thread, which sleeps in the driver
  until the GPU interrupts and then wakes the loop through ``call_soon_threadsafe``;
- ``hostfn``: the loop queues a host function behind the chain (``cuLaunchHostFunc``); the
  driver's own thread calls it when the stream reaches it, and it wakes the loop through
  ``call_soon_threadsafe``. No thread of the daemon's, and no hand-over to one.

Reported per way, median [min, max] over the trials (the ways alternate in every trial): the
process's CPU per chain; per trial, each thread's CPU and context switches a chain
(``daemon_throughput.thread_report``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from daemon_throughput import Threads, read_threads, thread_report
from gpu_prepost import open_gpu
from waiter import Waiter  # bench/, beside this script

from dlad.gpu.driver import GpuContext, _check, _driver

WORK_BYTES = 64 << 20
HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class HostFnCompletions:
    """One stream's chain ends, learnt through host functions: each :meth:`after` queues one
    behind the work already on the stream and returns a future the loop sees settled when
    the stream reaches it (a stream runs its host functions in order, so one callback object
    serves them all: it settles the oldest future)."""

    def __init__(self, stream: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.stream = stream
        self.loop = loop
        self.pending: collections.deque[asyncio.Future[None]] = collections.deque()
        self.callback = HOST_FN(self._reached)  # kept alive as long as the stream is used
        self.fn = _driver().CUhostFn(ctypes.cast(self.callback, ctypes.c_void_p).value)

    def _reached(self, _data: int) -> None:  # the driver's thread
        done = self.pending.popleft()
        self.loop.call_soon_threadsafe(_settle, done)

    def after(self) -> asyncio.Future[None]:
        done = self.loop.create_future()
        self.pending.append(done)
        _check(_driver().cuLaunchHostFunc(self.stream, self.fn, 0), "cuLaunchHostFunc")
        return done


def _settle(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


async def run_way(
    ctx: GpuContext, way: str, chains: int, slots: int, gap_s: float
) -> tuple[Threads, Threads]:
    """``chains`` chains over ``slots`` slots; the process's threads read before and after."""
    drv = _driver()
    loop = asyncio.get_running_loop()
    per_slot = chains // slots

    class Slot:
        def __init__(self, i: int) -> None:
            self.stream = ctx.stream()
            self.buf = ctx.alloc(WORK_BYTES, zero=False)
            self.event = ctx.event(blocking=True)
            self.waiter = Waiter(f"slot{i}-gpu-wait")
            self.hostfn = HostFnCompletions(self.stream, loop)

        def sync(self) -> None:
            ctx.make_current()
            _check(drv.cuEventSynchronize(self.event), "cuEventSynchronize")

        async def ended(self) -> None:
            if way == "waiter":
                _check(drv.cuEventRecord(self.event, self.stream), "cuEventRecord")
                await self.waiter.run(self.sync)
            else:
                await self.hostfn.after()

        async def run(self) -> None:
            for _ in range(per_slot):
                _check(
                    drv.cuMemsetD32Async(self.buf.ptr, 7, WORK_BYTES // 4, self.stream), "memset"
                )
                await self.ended()
                await asyncio.sleep(gap_s)

        def close(self) -> None:
            self.waiter.close()
            _check(drv.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
            self.buf.free()
            drv.cuEventDestroy(self.event)
            drv.cuStreamDestroy(self.stream)

    ctx.make_current()
    slots_ = [Slot(i) for i in range(slots)]
    try:
        for s in slots_:  # each way's thread is started before the count (the waiter's first call)
            await s.ended()
        before = read_threads(os.getpid())
        await asyncio.gather(*(s.run() for s in slots_))
        after = read_threads(os.getpid())  # before the waiters end: an ended thread's CPU is gone
    finally:
        for s in slots_:
            s.close()
    return before, after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=1500)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--gap-ms", type=float, default=3.7)
    args = parser.parse_args()
    ctx, header = open_gpu()
    print(header)
    ways = ("waiter", "hostfn")
    total: dict[str, list[float]] = {w: [] for w in ways}
    n = args.chains // args.slots * args.slots
    for trial in range(args.trials):
        for way in ways if trial % 2 == 0 else ways[::-1]:
            t0 = time.perf_counter()
            before, after = uvloop.run(
                run_way(ctx, way, args.chains, args.slots, args.gap_ms / 1e3)
            )
            rate = n / (time.perf_counter() - t0)
            cpu = sum(r.cpu - before[k].cpu if k in before else r.cpu for k, r in after.items())
            total[way].append(cpu / n * 1e3)
            print(f"trial {trial}, {way}: process CPU {cpu / n * 1e3:.3f} ms a chain "
                  f"({rate:.0f} chains/s)")  # fmt: skip
            print("  " + thread_report(before, after, n, unit="chain"))
    for way in ways:
        xs = total[way]
        print(f"{way}: process CPU a chain, median [min, max] of {args.trials} trials: "
              f"{statistics.median(xs):.3f} ms [{min(xs):.3f}, {max(xs):.3f}]")  # fmt: skip
    ctx.close()


if __name__ == "__main__":
    main()
