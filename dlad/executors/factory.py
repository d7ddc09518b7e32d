"""Build every executor of a plan: the config → device translation in one place.

For each placement on a DLA device: its fault settings become the emulated core's
:class:`~dlad.devices.emulated.FaultConfig`, its cuDLA loadable is looked up, the GPU service (if
pre/post-processing runs on CUDA) is wired into its slots, and the executor is registered with the
scheduler with its queue bound and first service-time estimate. The gpu device runs
pre/post-processing only in this release (``dlad.config`` refuses a model placed on it), so it
gets no executor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

from dlad.config import Plan
from dlad.devices.base import DlaError
from dlad.devices.emulated import FaultConfig
from dlad.devices.factory import cudla_loadable_for
from dlad.executors.base import Executor, Request
from dlad.executors.dla import DlaExecutor
from dlad.scheduler import Scheduler

if TYPE_CHECKING:
    from dlad.gpu.service import GpuService

__all__ = ["ExecutorBuildError", "build_executors"]


class ExecutorBuildError(RuntimeError):
    """An executor could not be built: its core does not open or its loadable does not load.
    ``key`` is the config table to look at (``devices.dla0``)."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def build_executors(
    plan: Plan,
    scheduler: Scheduler[Request],
    *,
    limiter: anyio.CapacityLimiter,
    pre_post: bool,
    gpu: GpuService | None,
) -> dict[str, Executor]:
    """One executor per DLA placement, registered with ``scheduler``, by device name.

    Raises ExecutorBuildError naming the device whose core or loadable fails (the executors
    built before it are closed first).
    """
    built: dict[str, Executor] = {}
    try:
        for placement in plan.placements:
            dev = plan.config.device(placement.device)
            if dev.kind != "dla":
                continue
            faults = None
            if dev.faults.active:
                faults = FaultConfig(
                    error_rate=dev.faults.error_rate,
                    hang_rate=dev.faults.hang_rate,
                    seed=dev.faults.seed,
                )
            try:
                executor = DlaExecutor(
                    dev.name,
                    int(dev.core or 0),
                    model=placement.model,
                    loadable_path=str(placement.path),
                    loadable=placement.loadable,
                    scheduler=scheduler,
                    capacity=dev.queue_depth,
                    mode=dev.mode,
                    latency_us=placement.latency_us,
                    threads=dev.threads,
                    faults=faults,
                    task_timeout_ms=dev.task_timeout_ms,
                    limiter=limiter,
                    pre_post=pre_post,
                    gpu=gpu,
                    backend=dev.backend,
                    cudla_loadable=cudla_loadable_for(plan, placement),
                )
            except DlaError as exc:  # the core cannot open or load (e.g. no exact INT8 kernel)
                raise ExecutorBuildError(
                    f"cannot open or load {placement.path}: {exc}", key=f"devices.{dev.name}"
                ) from None
            scheduler.add_device(
                executor.name,
                executor.models,
                capacity=executor.capacity,
                service_us=executor.service_us,
            )
            built[executor.name] = executor
    except BaseException:
        for done in built.values():
            done.close()
        raise
    return built
