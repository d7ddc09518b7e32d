"""Engine health: judged by the results of its tasks, quarantined, re-probed, returned.

The warm-up task says an engine can run; only its results say it still does. The keeper watches
every outcome (``observe``):

- An engine whose warm-up failed, whose last ``[health] quarantine_after`` tasks all failed, or
  whose task hung (the task timeout fired), is **quarantined**: the scheduler takes it out of
  placement, its queued jobs move to the other engines of its model (the frontend places them
  again, or answers them when none can take them), and its jobs in flight finish or fail as they
  will (a failure is retried elsewhere by the frontend, ``[health] retry``).
- A quarantined engine rests ``probe_after_s``, then gets a **probe**: one task on a blank frame,
  queued for it alone (:meth:`~dlad.scheduler.Scheduler.admit_probe`) and run by its own loop
  like any job. A passed probe returns it to placement; a failed one doubles its rest, up to
  ``probe_max_s``.

Probes have negative job ids: no client asked for them, and their outcomes end here.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import anyio
import numpy as np
import structlog

from dlad.config import HealthConfig
from dlad.executors.base import Executor, Outcome, Request
from dlad.native_scheduler import Scheduling
from dlad.scheduler import Job

__all__ = ["PROBE_DEADLINE_S", "EngineState", "HealthKeeper"]

log = structlog.get_logger("dlad")

EngineState = Literal["serving", "quarantined"]
PROBE_DEADLINE_S = 86_400.0
"""A probe's deadline: it waits for its engine however long (a hung task ends at its timeout)."""
_BLANK = np.zeros((64, 64, 3), np.uint8)
_BLANK.flags.writeable = False

Requeue = Callable[[Sequence[Job[Request]], str], Awaitable[None]]
"""Place these jobs again, avoiding the named device (the frontend answers what cannot be)."""
OnChange = Callable[[str, EngineState, str], None]
"""An engine's state changed: its name, new state and why."""


@dataclass
class _Watch:
    state: EngineState = "serving"
    reason: str = ""
    rest_s: float = 0.0
    probe_at_ns: int = 0
    probe_id: int | None = None
    quarantines: int = 0
    since_ns: int = 0


class HealthKeeper:
    """Quarantine and probing for a daemon's executors (see the module docstring).

    Args:
        config: ``[health]``.
        scheduler: takes engines out of placement and queues probes.
        executors: by name; their ``stats.consecutive_failures`` count failed tasks.
        requeue: places a quarantined engine's queued jobs again.
        on_change: told each change of state (metrics, log).
    """

    def __init__(
        self,
        config: HealthConfig,
        scheduler: Scheduling[Request],
        executors: Mapping[str, Executor],
        *,
        requeue: Requeue,
        on_change: OnChange,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.config = config
        self._scheduler = scheduler
        self._executors = executors
        self._requeue = requeue
        self._on_change = on_change
        self._clock = clock
        self._watches: dict[str, _Watch] = {}
        self._probes: dict[int, str] = {}  # probe job id -> engine
        self._ids = itertools.count(-1, -1)
        self._wake = anyio.Event()

    def state(self, name: str) -> tuple[EngineState, str]:
        """``name``'s state and why it is in it ("" while serving)."""
        w = self._watch(name)
        return w.state, w.reason

    def quarantines(self, name: str) -> int:
        """How often ``name`` was quarantined since start."""
        return self._watch(name).quarantines

    def _watch(self, name: str) -> _Watch:
        w = self._watches.get(name)  # once per outcome: no _Watch built to be thrown away
        if w is None:
            w = self._watches[name] = _Watch()
        return w

    async def observe(self, out: Outcome) -> bool:
        """Judge an outcome. Returns True when it was a probe's (no client waits for it)."""
        name = self._probes.pop(out.job_id, None)
        if name is not None:
            self._probe_ended(name, out)
            return True
        w = self._watch(out.device)
        n = self.config.quarantine_after
        if w.state != "serving" or n == 0 or out.error is None:
            return False
        failures = self._executors[out.device].stats.consecutive_failures
        if out.hung:
            await self.quarantine(out.device, f"a task hung: {out.error}")
        elif failures >= n:
            await self.quarantine(
                out.device, f"{failures} tasks failed in a row; last: {out.error}"
            )
        return False

    async def quarantine(self, name: str, reason: str) -> None:
        """Take ``name`` out of placement now (its queued jobs placed again), to be probed."""
        w = self._watch(name)
        w.state, w.reason, w.since_ns = "quarantined", reason[:200], self._clock()
        w.quarantines += 1
        w.rest_s = self.config.probe_after_s
        w.probe_at_ns = w.since_ns + int(w.rest_s * 1e9)
        queued = self._scheduler.set_available(name, False)
        log.warning("device_quarantined", device=name, reason=w.reason, moved=len(queued))
        self._on_change(name, "quarantined", w.reason)
        self._wake.set()
        await self._requeue(queued, name)

    def _probe_ended(self, name: str, out: Outcome) -> None:
        w = self._watch(name)
        w.probe_id = None
        if out.error is None:
            fenced_s = (self._clock() - w.since_ns) / 1e9
            w.state, w.reason = "serving", ""
            executor = self._executors[name]
            if executor.warm == "failed":  # the probe did what the warm-up could not
                executor.warm, executor.warm_error = "ok", ""
            self._scheduler.set_available(name, True)
            log.info("device_returned", device=name, quarantined_s=round(fenced_s, 3))
            self._on_change(name, "serving", "a probe passed")
            return
        w.rest_s = min(2 * w.rest_s, self.config.probe_max_s)
        w.probe_at_ns = self._clock() + int(w.rest_s * 1e9)
        log.info("probe_failed", device=name, reason=str(out.error)[:200], next_in_s=w.rest_s)
        self._wake.set()

    async def run(self) -> None:
        """Probe quarantined engines when their rest is over, until cancelled."""
        while True:
            self._wake = anyio.Event()
            now = self._clock()
            waiting = [(w.probe_at_ns, name) for name, w in self._watches.items()
                       if w.state == "quarantined" and w.probe_id is None]  # fmt: skip
            for at, name in waiting:
                if at <= now:
                    self._probe(name)
            later = [at for at, _ in waiting if at > now]
            if later:
                with anyio.move_on_after((min(later) - now) / 1e9):
                    await self._wake.wait()
            else:
                await self._wake.wait()

    def _probe(self, name: str) -> None:
        executor = self._executors[name]
        model = min(executor.models)
        now = self._clock()
        request = Request(
            image=_BLANK, pixel_format="RGB", conf=0.25, iou=0.45, max_det=1,
            received_ns=now, model=model,
        )  # fmt: skip
        job = Job(next(self._ids), model, now + int(PROBE_DEADLINE_S * 1e9), request)
        self._probes[job.id] = name
        self._watch(name).probe_id = job.id
        self._scheduler.admit_probe(name, job)
        executor.wake()
