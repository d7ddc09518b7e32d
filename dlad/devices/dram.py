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

The model itself is C++ (``dlad/native/dram.hpp``): one instance per daemon, which the native
plane's timing cores and the Python engines' emulated devices share, so that a DLA task in the
plane slows a Python engine's GPU batch as it would on the SoC. Thread-safe; the clock is
injectable, so the model is tested by stepping a fake clock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

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
    """How many times longer a ``victim`` task takes while tasks of kinds ``others`` run (the
    model's own answer: a task of each kind begun on a stopped clock)."""
    model = _model(contention, k, lambda: 0)
    victim_id = model.begin(victim, 1.0)
    for other in others:
        model.begin(other, 1.0)
    return float(model.slowdown(victim_id))


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


def _model(
    contention: float,
    k: Mapping[tuple[EngineKind, EngineKind], float],
    clock: Callable[[], int] | None,
) -> Any:
    """The C++ model (``dlad/native/dram.hpp``). Raises ValueError for a bad contention."""
    from dlad import _native  # noqa: PLC0415 (the C++ core: a daemon has it, an import need not)

    return _native.SharedDram(contention, dict(k), clock)


@dataclass(eq=False, slots=True)
class Transfer:
    """One running task's share of the DRAM: its id in the model, its kind, and once
    :meth:`SharedDram.wait` saw its work done, when that was."""

    id: int
    kind: EngineKind
    done_ns: int | None = None


class SharedDram:
    """The DRAM one emulated Orin's engines share (see the module docstring): the C++ model
    (``dlad/native/dram.hpp``), which the native plane's timing cores share too when the daemon
    hands the plane this object (:attr:`model`).

    Args:
        contention: scales :data:`ORIN_DRAM_K` (0: engines never slow each other; 1: the
            forum's DRAM-bound conv2d). Must be finite and in [0, 10].
        k: the coefficients (victim kind, aggressor kind) -> slowdown per aggressor.
        clock: monotonic nanoseconds (tests step a fake one); by default the monotonic clock,
            which is the engines' own and the plane's.

    Raises ValueError for a bad ``contention``.
    """

    def __init__(
        self,
        contention: float = 1.0,
        *,
        k: Mapping[tuple[EngineKind, EngineKind], float] = ORIN_DRAM_K,
        clock: Callable[[], int] | None = None,
    ) -> None:
        self.model = _model(contention, k, clock)
        self.contention = float(contention)
        self.k = dict(k)
        self._lock = threading.Lock()
        self._running: dict[int, Transfer] = {}
        self.done: dict[EngineKind, int] = {"dla": 0, "gpu": 0}
        """Finished (or abandoned) transfers per kind, of this side's engines."""

    def begin(self, kind: EngineKind, work_ns: float) -> Transfer:
        """Start a task of ``kind`` that takes ``work_ns`` alone; the others slow down. Raises
        ValueError for a kind other than ``"dla"`` or ``"gpu"``."""
        transfer = Transfer(self.model.begin(kind, max(float(work_ns), 0.0)), kind)
        with self._lock:
            self._running[transfer.id] = transfer
        return transfer

    def finish(self, transfer: Transfer) -> None:
        """End ``transfer`` (done or abandoned); the others speed up. Idempotent."""
        with self._lock:
            if self._running.pop(transfer.id, None) is None:
                return
            self.done[transfer.kind] += 1
        self.model.finish(transfer.id)

    def end_ns(self, transfer: Transfer) -> int:
        """When ``transfer`` ends if the running set stays as it is (its clock's ns)."""
        return int(self.model.end_ns(transfer.id))

    def running(self) -> list[EngineKind]:
        """The kinds of this side's transfers running now."""
        with self._lock:
            return [t.kind for t in self._running.values()]

    def wait(
        self,
        transfer: Transfer,
        deadline_ns: int | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> Literal["done", "expired", "stopped"]:
        """Block (without the GIL) until ``transfer``'s work is done, the clock passes
        ``deadline_ns``, or ``stop()`` is true (checked whenever :meth:`wake` is called). Does
        not finish it."""
        while True:
            since = self.model.wakes()  # read first: a wake() after it ends the wait below
            if stop is not None and stop():
                return "stopped"
            waited, done_ns = self.model.wait_for(transfer.id, deadline_ns, since)
            if waited == "done":
                transfer.done_ns = int(done_ns)
                return "done"
            if waited == "expired":
                return "expired"

    def wake(self) -> None:
        """Wake every :meth:`wait`-er to re-check its ``stop``."""
        self.model.wake()
