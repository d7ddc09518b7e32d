"""Build the executors of a plan's Python engines: the config → device translation in one place.

For each placement on a DLA device: its fault settings become the emulated core's
:class:`~dlad.devices.emulated.FaultConfig` and its cuDLA loadable is looked up. For a placement
on the gpu device: its engine, by ``engine``: the emulated Orin GPU (from the model's loadable,
with its batch curve), the torch program (``TorchGpu``, a CUDA GPU) or the TensorRT engine
(``TensorRtGpu``, a Jetson), the last two imported only when configured and measuring their own
batch curve at start, with the GPU service (if pre/post-processing runs on CUDA) for its
batches. The daemon hands each to the native plane with its queue bound, batch size, first
service-time estimates and tier (a DLA core 0, the GPU 1). The emulated engines share one
:class:`~dlad.devices.dram.SharedDram` (``[soc] dram_contention``), so running at once slows them
as the Orin's shared DRAM does.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import TYPE_CHECKING

from dlad.config import Placement, Plan, _resolve
from dlad.devices.base import DlaError
from dlad.devices.dram import SharedDram
from dlad.devices.emulated import FaultConfig
from dlad.devices.emulated_gpu import EmulatedGpu
from dlad.devices.factory import cudla_loadable_for
from dlad.devices.int8_engine import Int8EngineError
from dlad.executors.base import Executor
from dlad.executors.dla import DlaExecutor
from dlad.executors.gpu import GpuEngine, GpuExecutor

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
    *,
    pre_post: bool,
    gpu: GpuService | None,
    only: Collection[str] | None = None,
    dram: SharedDram | None = None,
) -> dict[str, Executor]:
    """One executor per placement (a DLA core's or the GPU's; ``only``: of those devices), by
    device name; ``gpu``: their pre/post-processing runs on it where it can; ``dram``: the
    emulated DRAM their emulated engines share (a daemon's, which its plane shares too; by
    default one of ``[soc] dram_contention`` for these executors alone).

    Raises ExecutorBuildError naming the device whose core or loadable fails (the executors
    built before it are closed first).
    """
    built: dict[str, Executor] = {}
    if dram is None:
        dram = SharedDram(plan.config.soc.dram_contention)  # what the emulated engines share
    # The DLA slots' threads pre/post-process this many frames at once between them.
    lanes = threading.BoundedSemaphore(max(plan.config.pre_post.threads, 1))
    try:
        for placement in plan.placements:
            if only is not None and placement.device not in only:
                continue
            dev = plan.config.device(placement.device)
            if dev.kind == "gpu":
                gpu_executor = _gpu_executor(plan, placement, pre_post, dram=dram, gpu=gpu)
                built[gpu_executor.name] = gpu_executor
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
                    capacity=dev.queue_depth,
                    mode=dev.mode,
                    latency_us=placement.latency_us,
                    threads=dev.threads,
                    faults=faults,
                    task_timeout_ms=dev.task_timeout_ms,
                    pre_post=pre_post,
                    gpu=gpu,
                    backend=dev.backend,
                    cudla_loadable=cudla_loadable_for(plan, placement),
                    dram=dram,
                    lanes=lanes,
                )
            except DlaError as exc:  # the core cannot open or load (e.g. no exact INT8 kernel)
                raise ExecutorBuildError(
                    f"cannot open or load {placement.path}: {exc}", key=f"devices.{dev.name}"
                ) from None
            built[executor.name] = executor
    except BaseException:
        for done in built.values():
            done.close()
        raise
    return built


def _gpu_executor(
    plan: Plan,
    placement: Placement,
    pre_post: bool,
    *,
    dram: SharedDram,
    gpu: GpuService | None,
) -> GpuExecutor:
    dev = plan.config.device(placement.device)
    max_batch = dev.batch_limit
    kind = dev.engine or "emulated"
    engine: GpuEngine
    try:
        if kind == "emulated":
            engine = EmulatedGpu(
                placement.loadable,
                mode=dev.mode,
                max_batch=max_batch,
                batch1_us=dev.latency_us,
                threads=dev.threads,
                dram=dram,
            )
        else:
            artifact = _artifact(plan, placement, kind)
            if kind == "torch":
                from dlad.devices.torch_gpu import TorchGpu  # noqa: PLC0415 (torch: lazy)

                engine = TorchGpu(placement.loadable, artifact, max_batch=max_batch)
            else:
                from dlad.devices.tensorrt_gpu import TensorRtGpu  # noqa: PLC0415 (lazy)
                from dlad.gpu.layout import GpuLayouts  # noqa: PLC0415

                # With the GPU's pre/post kernels, its layout kernels around the engine keep
                # batches on the device (one CUDA graph per batch size, for the plane).
                engine = TensorRtGpu(
                    placement.loadable, artifact, max_batch=max_batch,
                    device_index=0 if gpu is None else int(gpu.ctx.device),
                    layouts=None if gpu is None else GpuLayouts(gpu.ctx),
                )  # fmt: skip
    except (Int8EngineError, ValueError) as exc:  # TorchGpuError, TensorRtGpuError too
        raise ExecutorBuildError(
            f"cannot build the {kind} GPU engine for model {placement.model!r}: {exc}",
            key=f"devices.{dev.name}",
        ) from None
    try:
        return GpuExecutor(
            dev.name,
            model=placement.model,
            loadable=placement.loadable,
            engine=engine,
            capacity=dev.queue_depth,
            max_batch=max_batch,
            max_queue_delay_us=dev.max_queue_delay_us,
            pre_post=pre_post,
            gpu=gpu,  # its pre/post kernels, where the engine keeps batches on that GPU
        )
    except BaseException:
        engine.close()  # the executor owns it only once built
        raise


def _artifact(plan: Plan, placement: Placement, kind: str) -> str:
    """The absolute path of the model's ``torch`` or ``tensorrt`` GPU artifact (the config
    checked that it is set)."""
    text = getattr(plan.config.model(placement.model).loadables, kind)
    return str(_resolve(str(text), plan.base_dir))
