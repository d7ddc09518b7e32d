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
process's CPU per chain, and each thread's (``/proc/self/task``), with its context switches.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
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
from gpu_prepost import open_gpu

from dlad.gpu.driver import GpuContext, _check, _driver
from dlad.waiter import Waiter

WORK_BYTES = 64 << 20
HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def threads() -> dict[str, tuple[float, int]]:
    """Each thread name's (CPU seconds, context switches) so far, threads of one name summed."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, tuple[float, int]] = {}
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            name = "loop" if int(task.name) == os.getpid() else (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            status = (task / "status").read_text().splitlines()
            switches = sum(int(v) for k, _, v in (ln.partition(":") for ln in status)
                           if k.endswith("ctxt_switches"))  # fmt: skip
            cpu, n = out.get(name, (0.0, 0))
            out[name] = (cpu + (int(fields[11]) + int(fields[12])) / tick, n + switches)
    return out


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
) -> dict[str, tuple[float, int]]:
    """``chains`` chains over ``slots`` slots; each thread's (CPU s, switches) they cost."""
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
        before = threads()
        await asyncio.gather(*(s.run() for s in slots_))
        after = threads()  # before the waiters' threads end: an ended thread's CPU is gone
    finally:
        for s in slots_:
            s.close()
    return {
        name: (cpu - before.get(name, (0.0, 0))[0], n - before.get(name, (0.0, 0))[1])
        for name, (cpu, n) in after.items()
    }


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
    by_thread: dict[str, dict[str, list[tuple[float, int]]]] = {w: {} for w in ways}
    for trial in range(args.trials):
        for way in ways if trial % 2 == 0 else ways[::-1]:
            t0 = time.perf_counter()
            spent = uvloop.run(run_way(ctx, way, args.chains, args.slots, args.gap_ms / 1e3))
            n = args.chains // args.slots * args.slots
            cpu = sum(c for c, _ in spent.values()) / n * 1e3
            total[way].append(cpu)
            for name, (c, k) in spent.items():
                if c > 0 or k > 0:
                    by_thread[way].setdefault(name, []).append((c / n * 1e3, k))
            print(f"trial {trial} {way}: {cpu:.3f} ms CPU a chain "
                  f"({n / (time.perf_counter() - t0):.0f} chains/s)")  # fmt: skip
    for way in ways:
        xs = total[way]
        print(f"{way}: process CPU a chain {statistics.median(xs):.3f} ms "
              f"[{min(xs):.3f}, {max(xs):.3f}]")  # fmt: skip
        n = args.chains // args.slots * args.slots
        for name, rows in sorted(by_thread[way].items(), key=lambda kv: -kv[1][0][0]):
            cpu = statistics.median(c for c, _ in rows)
            sw = statistics.median(k for _, k in rows) / n
            print(f"  {name}: {cpu:.3f} ms, {sw:.2f} switches a chain")
    ctx.close()


if __name__ == "__main__":
    main()
