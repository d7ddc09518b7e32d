"""The Orin's shared DRAM: engines that run at once slow each other down.

On an Orin the GPU and both DLA cores read and write the same LPDDR5, and a memory-bound workload
on one engine lengthens the tasks of the others (NVIDIA's DLA-SW FAQ, "Why is the latency higher
when running workloads on two DLA cores and GPU?"; cuDLA-samples issue #18). The emulated Orin
models it here, between its emulated engines: each running task has an amount of *work* (its
time alone: the modelled latency of a DLA task, the batch curve's time of a GPU batch) and
progresses at ``1 / slowdown``, where

    slowdown(victim) = 1 + contention * sum(K[victim kind, other kind] for each other running task)

The rate changes whenever a task starts or ends, so a task's end is re-projected at every change
(:meth:`SharedDram.end_ns`) and an engine thread in :meth:`SharedDram.wait` is woken to wait
for the new end.

**Calibration** (:data:`ORIN_DRAM_K`, ``docs/latency.md`` "Shared DRAM"). An NVIDIA-forum
measurement on AGX Orin at MAXN (pure conv2d, trtexec INT8, ``--useSpinWait``): the GPU alone
405.3 qps, one DLA alone 132.7 qps; the GPU and both DLAs at once: the GPU 229.2, each DLA 113.1.
So with both DLAs running the GPU is 1.768x slower (``K[gpu, dla] = 0.384``), and a DLA beside the
GPU and the other DLA 1.173x (``K[dla, gpu] + K[dla, dla] = 0.173``). That one figure does not
split between the GPU and the other DLA; it is split in proportion to the two aggressors'
alone throughputs on the same network (their DRAM traffic: 405.3 : 132.7), giving
``K[dla, gpu] = 0.131`` and ``K[dla, dla] = 0.043``. ``contention = 1`` is that DRAM-bound
workload; ``contention = 0`` is NVIDIA's MLPerf ResNet-50 (native ``chw4`` INT8 I/O, static
batches: GPU 4,500/s, one DLA 600/s, all three configured at 6,100/s and measured at 6,424/s,
above the isolated sum: no visible penalty). Real engines contend for real and ignore this.

Thread-safe; the clock is injectable, so the model is tested by stepping a fake clock.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "ORIN_DRAM_K",
    "EngineKind",
    "SharedDram",
    "Transfer",
    "saturated_rates",
    "slowdown",
]

EngineKind = Literal["dla", "gpu"]

ORIN_DRAM_K: Final[Mapping[tuple[EngineKind, EngineKind], float]] = {
    ("gpu", "dla"): (405.3 / 229.2 - 1) / 2,
    ("dla", "gpu"): (132.7 / 113.1 - 1) * 405.3 / (405.3 + 132.7),
    ("dla", "dla"): (132.7 / 113.1 - 1) * 132.7 / (405.3 + 132.7),
}
"""``K[victim, aggressor]``: how much one running task of the aggressor's kind slows the victim
at ``contention = 1`` (module docstring). A pair not listed (two GPU engines: an Orin has one)
adds nothing."""


def slowdown(
    victim: EngineKind,
    others: Iterable[EngineKind],
    contention: float,
    k: Mapping[tuple[EngineKind, EngineKind], float] = ORIN_DRAM_K,
) -> float:
    """How many times longer a ``victim`` task takes while tasks of kinds ``others`` run."""
    return 1.0 + contention * sum(k.get((victim, other), 0.0) for other in others)


def saturated_rates(
    engines: Mapping[str, tuple[EngineKind, float]],
    contention: float,
    k: Mapping[tuple[EngineKind, EngineKind], float] = ORIN_DRAM_K,
) -> dict[str, float]:
    """Items/s of each engine when all of ``engines`` (name -> kind, µs per item alone) are busy
    all the time: the contention-aware ideal a saturated pool is measured against."""
    rates = {}
    for name, (kind, us_per_item) in engines.items():
        others = [other_kind for other, (other_kind, _) in engines.items() if other != name]
        rates[name] = 1e6 / (us_per_item * slowdown(kind, others, contention, k))
    return rates


@dataclass(eq=False, slots=True)
class Transfer:
    """One running task's share of the DRAM: its kind, the work (ns alone) it has left as of
    the DRAM's last change, and the slowdown it runs at since then."""

    id: int
    kind: EngineKind
    left_ns: float
    slowdown: float = 1.0
    done_ns: int | None = None  # when its work was done, as :meth:`SharedDram.wait` projected


class SharedDram:
    """The DRAM one emulated Orin's engines share (see the module docstring).

    Args:
        contention: scales :data:`ORIN_DRAM_K` (0: engines never slow each other; 1: the
            forum's DRAM-bound conv2d). Must be finite and in [0, 10].
        k: the coefficients (victim kind, aggressor kind) -> slowdown per aggressor.
        clock: monotonic nanoseconds; it must be the clock of the engines' own timing.

    Raises ValueError for a bad ``contention``.
    """

    def __init__(
        self,
        contention: float = 1.0,
        *,
        k: Mapping[tuple[EngineKind, EngineKind], float] = ORIN_DRAM_K,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        if not 0.0 <= contention <= 10.0:
            raise ValueError(f"contention must be in [0, 10], got {contention!r}")
        self.contention = float(contention)
        self._k = dict(k)
        self._clock = clock
        self._cv = threading.Condition()
        self._running: dict[int, Transfer] = {}
        self._ids = itertools.count()
        self._last_ns = clock()
        self.done: dict[EngineKind, int] = {"dla": 0, "gpu": 0}
        """Finished (or abandoned) transfers per kind."""

    # ------------------------------------------------------------------ the model

    def begin(self, kind: EngineKind, work_ns: float) -> Transfer:
        """Start a task of ``kind`` that takes ``work_ns`` alone; the others slow down."""
        if kind not in ("dla", "gpu"):
            raise ValueError(f"an engine kind is 'dla' or 'gpu', got {kind!r}")
        with self._cv:
            self._advance()
            transfer = Transfer(next(self._ids), kind, max(float(work_ns), 0.0))
            self._running[transfer.id] = transfer
            self._rerate()
        return transfer

    def finish(self, transfer: Transfer) -> None:
        """End ``transfer`` (done or abandoned); the others speed up. Idempotent."""
        with self._cv:
            if self._running.pop(transfer.id, None) is None:
                return
            self._advance()
            self.done[transfer.kind] += 1
            self._rerate()

    def end_ns(self, transfer: Transfer) -> int:
        """When ``transfer`` ends if the running set stays as it is (its own clock's ns)."""
        with self._cv:
            now = self._clock()
            left = transfer.left_ns - (now - self._last_ns) / transfer.slowdown
            return now + max(round(left * transfer.slowdown), 0)

    def running(self) -> list[EngineKind]:
        """The kinds of the transfers running now."""
        with self._cv:
            return [t.kind for t in self._running.values()]

    # ------------------------------------------------------------------ waiting

    def wait(
        self,
        transfer: Transfer,
        deadline_ns: int | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> Literal["done", "expired", "stopped"]:
        """Block until ``transfer``'s work is done, the clock passes ``deadline_ns``, or
        ``stop()`` is true (checked whenever :meth:`wake` is called). Does not finish it."""
        with self._cv:
            while True:
                if stop is not None and stop():
                    return "stopped"
                now = self._clock()
                left = transfer.left_ns - (now - self._last_ns) / transfer.slowdown
                end = now + max(left * transfer.slowdown, 0.0)
                if now >= end:
                    # the work ran out before this wake-up (a sleeper wakes late): when it did
                    transfer.done_ns = round(now + min(left * transfer.slowdown, 0.0))
                    return "done"
                if deadline_ns is not None and now >= deadline_ns:
                    return "expired"
                until = end if deadline_ns is None else min(end, deadline_ns)
                self._cv.wait((until - now) / 1e9)

    def wake(self) -> None:
        """Wake every :meth:`wait`-er to re-check its ``stop``."""
        with self._cv:
            self._cv.notify_all()

    # ------------------------------------------------------------------ internals

    def _advance(self) -> None:
        """Charge every running transfer the work it did since the last change (lock held)."""
        now = self._clock()
        elapsed = now - self._last_ns
        for t in self._running.values():
            t.left_ns = max(t.left_ns - elapsed / t.slowdown, 0.0)
        self._last_ns = now

    def _rerate(self) -> None:
        """New slowdowns for the running set; wakes the waiters to re-project (lock held)."""
        kinds = [t.kind for t in self._running.values()]
        for t in self._running.values():
            others = list(kinds)
            others.remove(t.kind)
            t.slowdown = slowdown(t.kind, others, self.contention, self._k)
        self._cv.notify_all()
