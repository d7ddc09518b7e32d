"""A DLA executor whose core cannot be fenced to the GPU pre/post-processes on the CPU instead."""

from __future__ import annotations

import time
from typing import Any

import anyio
import numpy as np

from dlad.devices.base import CudlaStatus, DlaError
from dlad.executors.base import Request
from dlad.executors.dla import DlaExecutor
from dlad.loadable import read_loadable
from dlad.models import DEMO
from dlad.scheduler import Scheduler


class _RefusingGpu:
    """Stands in for GpuService: plain host memory, and no slot for this core."""

    def __init__(self) -> None:
        self.asked = 0

    def host_array(self, nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, np.uint8)

    def cudla_options(self) -> dict[str, Any]:
        return {}

    def slot_for(self, *_: object, **__: object) -> Any:
        self.asked += 1
        raise DlaError(CudlaStatus.ERROR_UNSUPPORTED_OPERATION, "cudlaImportExternalSemaphore")


def test_executor_falls_back_to_cpu_pre_post() -> None:
    path = DEMO / "fp16_heads.dla0.emu"
    gpu = _RefusingGpu()
    worker = DlaExecutor(
        "dla0",
        0,
        model="demo",
        loadable_path=str(path),
        loadable=read_loadable(path, expect_core=0),
        scheduler=Scheduler(time.monotonic_ns),
        mode="timing",
        latency_us=100.0,
        threads=1,
        faults=None,
        task_timeout_ms=1000.0,
        limiter=anyio.CapacityLimiter(1),
        gpu=gpu,  # type: ignore[arg-type]
    )
    try:
        assert gpu.asked == 1  # the first slot asked, the executor gave up on the GPU
        assert worker.gpu is None
        assert all(slot.gpu is None for slot in worker.slots)
        work = Request(np.zeros((48, 64, 3), np.uint8), "RGB", 0.25, 0.45, 300, 0, "demo")
        geometry = worker._pre(work, worker.slots[0].inputs[0])
        assert (geometry.src_w, geometry.src_h) == (64, 48)
    finally:
        worker.close()
