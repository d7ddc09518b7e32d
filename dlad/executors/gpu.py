"""The GPU executor: the same logical model as the DLA cores, run in dynamic batches.

It pulls batches from the scheduler (:meth:`dlad.scheduler.Scheduler.next_batch`: up to
``max_batch`` jobs of its model, a partial batch waiting at most ``max_queue_delay_us`` and never
past the point where a full one could still meet its earliest deadline), and runs ``slots``
loops (default 2) so one batch is pre- or post-processed while another runs on the engine, which
takes one batch at a time. A slot forms its batch *just in time*: while another batch is on the
engine, it waits until that batch is expected to leave, less the time pre-processing takes
(learned), or until it does leave, whichever is first. A batch formed the moment the previous
one started would take only what had arrived by then, and under load the engine would run
small, inefficient batches while frames queue behind them. Per batch:

1. pre-process every frame on worker threads: letterbox → quantise to ``DLA_HWC4`` int8;
2. run the batch on the engine (a worker thread; the emulated Orin GPU today,
   ``dlad/devices/emulated_gpu.py``): one head set per frame, and the batch's time;
3. post-process every frame with the decoder its loadable names; one outcome per job, keyed by
   job id, all with the batch's device time; the scheduler learns the batch size's service time.

A batch that fails fails each of its jobs with DEVICE_FAILED and counts as one failed task.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import anyio
import numpy as np
import numpy.typing as npt
import structlog

from dlad.devices.emulated_gpu import GpuBatchTiming
from dlad.errors import DeadlineExceeded, DeviceFailed, InternalError
from dlad.executors.base import Executor, OnOutcome, Outcome, Request
from dlad.imaging.decoders import decoder_for
from dlad.imaging.pre import Letterbox, letterbox, quantize_hwc4, to_rgb
from dlad.loadable import Loadable
from dlad.scheduler import Job, Scheduler

__all__ = ["GpuEngine", "GpuExecutor"]

log = structlog.get_logger("dlad.executors.gpu")


class GpuEngine(Protocol):
    """What the GPU executor runs a batch on (``EmulatedGpu`` implements it)."""

    max_batch: int
    curve_us: dict[int, float]

    def run(
        self, frames: Sequence[npt.NDArray[np.int8]]
    ) -> tuple[list[list[npt.NDArray[np.float32]]], GpuBatchTiming]: ...


class GpuExecutor(Executor):
    """The GPU serving one model in batches (see the module docstring).

    Args:
        name: the device's name (``gpu``).
        model: the model it serves.
        loadable: the model's loadable (input size and scale, head geometry, decoder).
        engine: what runs the batches; its ``curve_us`` seeds the scheduler's estimates.
        scheduler: the daemon's scheduler, which it pulls its batches from.
        capacity: its queue bound in the scheduler.
        max_batch: the largest batch it takes (<= the engine's).
        max_queue_delay_us: how long a partial batch may wait to fill.
        limiter: bounds the threads of pre/post-processing across all executors.
        pre_post: run pre/post-processing (off: zero frames in, no detections out).
    """

    kind = "gpu"

    def __init__(
        self,
        name: str,
        *,
        model: str,
        loadable: Loadable,
        engine: GpuEngine,
        scheduler: Scheduler[Request],
        capacity: int,
        max_batch: int,
        max_queue_delay_us: float,
        limiter: anyio.CapacityLimiter,
        pre_post: bool = True,
        slots: int = 2,
    ) -> None:
        if not 1 <= max_batch <= engine.max_batch:
            raise ValueError(f"max_batch must be 1..{engine.max_batch}, got {max_batch}")
        super().__init__(
            name,
            core=None,
            models=frozenset([model]),
            capacity=capacity,
            service_us=engine.curve_us[1],
        )
        self.max_batch = max_batch
        self.max_queue_delay_us = max_queue_delay_us
        self.batch_service_us = {b: t for b, t in engine.curve_us.items() if b <= max_batch}
        self.loadable = loadable
        self.engine = engine
        self.scheduler = scheduler
        self.limiter = limiter
        self.pre_post = pre_post
        self.decoder = decoder_for(loadable.decoder)
        self._slots = slots
        self._engine_free_ns = 0  # when the batch on the engine is expected to leave it
        self._engine_idle = anyio.Event()  # set when it does
        self._engine_idle.set()
        self._pre_ns = 0.0  # pre-processing time of a batch (EWMA)
        inp = loadable.inputs[0]
        self._blank = quantize_hwc4(
            np.zeros((*loadable.image_size, inp.c), np.uint8), loadable.input_scale
        )

    def close(self) -> None:
        """Nothing to release: the emulated engine holds host memory only."""

    async def warm_up(self) -> float:
        try:
            _, timing = await anyio.to_thread.run_sync(self.engine.run, [self._blank])
        except Exception as exc:  # the engine's errors share no base class
            self.warm, self.warm_error = "failed", str(exc)
            raise DeviceFailed(f"{self.name}: warm-up batch failed: {exc}") from exc
        self.warm = "ok"
        return timing.actual_us

    async def run(self, on_outcome: OnOutcome) -> None:
        """Serve batches until cancelled."""
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(self._slots):
                    tg.start_soon(self._loop, on_outcome)
        finally:
            self.close()

    async def _loop(self, on_outcome: OnOutcome) -> None:
        while True:
            lead_ns = self._engine_free_ns - self._pre_ns - time.monotonic_ns()
            if lead_ns > 0 and not self._engine_idle.is_set():  # just in time (module docstring)
                with anyio.move_on_after(lead_ns / 1e9):
                    await self._engine_idle.wait()
            batch = self.scheduler.next_batch(
                self.name, max_batch=self.max_batch, max_queue_delay_us=self.max_queue_delay_us
            )
            for stale in batch.expired:
                expired = DeadlineExceeded("deadline passed while queued")
                await on_outcome(Outcome(stale.id, self.name, error=expired))
            if batch.jobs:
                try:
                    outcomes, device_us = await self._execute(batch.jobs)
                except Exception as exc:  # a bug must cost these requests an INTERNAL, no more
                    log.exception("batch_failed", device=self.name)
                    bug = InternalError(repr(exc))
                    outcomes = [Outcome(j.id, self.name, error=bug) for j in batch.jobs]
                    device_us = None
                self.scheduler.finished_batch(self.name, batch.jobs, device_us)
                for outcome in outcomes:
                    await on_outcome(outcome)
            elif batch.wait_until_ns is not None:  # a partial batch is filling: a new job or
                delay = max(batch.wait_until_ns - time.monotonic_ns(), 0) / 1e9  # its time
                with anyio.move_on_after(delay):
                    await self.wait_for_work()
            else:
                await self.wait_for_work()

    async def _execute(self, jobs: Sequence[Job[Request]]) -> tuple[list[Outcome], float | None]:
        t0 = time.monotonic_ns()
        prepared: list[tuple[npt.NDArray[np.int8], Letterbox | None]]
        if self.pre_post:
            prepared = list(await anyio.to_thread.run_sync(self._pre, jobs, limiter=self.limiter))
        else:
            prepared = [(self._blank, None) for _ in jobs]
        t1 = time.monotonic_ns()
        self._pre_ns += 0.2 * ((t1 - t0) - self._pre_ns)
        frames = [frame for frame, _ in prepared]
        idle = anyio.Event()
        self._engine_idle = idle
        self._engine_free_ns = t1 + round(self.scheduler.service_us(self.name, len(jobs)) * 1e3)
        try:
            # The engine takes one batch at a time by itself; its wait is not a pre/post thread's.
            heads, timing = await anyio.to_thread.run_sync(self.engine.run, frames)
        except Exception as exc:  # noqa: BLE001 (any engine error fails this batch, not the loop)
            error = self.failed(DeviceFailed(f"{self.name}: batch of {len(jobs)} failed: {exc}"))
            return [Outcome(j.id, self.name, error=error) for j in jobs], None
        finally:
            idle.set()
        t2 = time.monotonic_ns()
        if self.pre_post:
            dets = await anyio.to_thread.run_sync(
                self._post, jobs, heads, [g for _, g in prepared], limiter=self.limiter
            )
        else:
            dets = [np.zeros((0, 6), np.float32) for _ in jobs]
        t3 = time.monotonic_ns()
        self.succeeded()
        self.stats.busy_ns += timing.end_ns - timing.start_ns
        outcomes = [
            Outcome(
                job.id,
                self.name,
                detections=d,
                queue_us=(t0 - job.payload.received_ns) / 1e3,
                pre_us=(t1 - t0) / 1e3,
                device_us=timing.actual_us,
                post_us=(t3 - t2) / 1e3,
                start_ns=timing.start_ns,
                end_ns=timing.end_ns,
            )
            for job, d in zip(jobs, dets, strict=True)
        ]
        return outcomes, timing.actual_us

    def _pre(self, jobs: Sequence[Job[Request]]) -> list[tuple[npt.NDArray[np.int8], Letterbox]]:
        size = self.loadable.image_size
        out = []
        for job in jobs:
            rgb = to_rgb(job.payload.image, job.payload.pixel_format)  # type: ignore[arg-type]
            canvas, geometry = letterbox(rgb, (size[0], size[1]))
            out.append((quantize_hwc4(canvas, self.loadable.input_scale), geometry))
        return out

    def _post(
        self,
        jobs: Sequence[Job[Request]],
        heads: Sequence[Sequence[npt.NDArray[np.float32]]],
        geometries: Sequence[Any],
    ) -> list[npt.NDArray[np.float32]]:
        return [
            self.decoder.postprocess(
                frame_heads,
                self.loadable,
                geometry,
                conf=job.payload.conf,
                iou=job.payload.iou,
                max_det=job.payload.max_det,
            )
            for job, frame_heads, geometry in zip(jobs, heads, geometries, strict=True)
        ]
