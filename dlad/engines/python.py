"""Python-backed engines of the native data plane (``dlad/native/python_engine.hpp``).

What only Python does runs here, on the plane's engine threads, each call holding the
interpreter for its own work only: a DLA core whose frames need Python (numeric INT8 emulation
on onnxruntime, fault injection, numpy pre/post-processing, or a core in deterministic-semaphore
mode), with numpy pre/post-processing or its GPU chain (:class:`DlaFrames`); and the GPU's
batches (:class:`GpuBatches`) on its engine (the emulated Orin GPU, torch, TensorRT) with numpy
pre/post-processing, or with the whole batch on the GPU where the executor has the CUDA path.
Each wraps the executor that the config built (``dlad.executors.factory``: the core, its
buffers, faults and DRAM; the GPU's engine) and runs that executor's own per-frame code, so no
rule of a frame's path exists twice.

The plane hands each call a batch of ``(job, pixels, (height, width, format, colour, conf,
iou, max_det))`` (``format``: a code of :data:`dlad.protocol.PIXEL_FORMATS`) and answers each
job from the result: the frame's detections and pre/post times, or its failure (the device's, a
hang, or a fault of the daemon's) in words without the device's name, which the plane adds.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from dlad.errors import DeviceFailed
from dlad.executors.base import Outcome, Request
from dlad.executors.dla import DlaExecutor, Slot
from dlad.executors.gpu import GpuExecutor
from dlad.protocol import PIXEL_FORMATS, frame_shape

__all__ = ["DlaFrames", "GpuBatches"]

Batch = list[tuple[int, memoryview | None, tuple[Any, ...]]]
Result = tuple[int, str, Any, int | None, int | None]

_OK: Final = 0
_DEVICE: Final = 1
_HUNG: Final = 3
_INTERNAL: Final = 4


_NO_PIXELS: Final = "the frame's pixels are not where the engine can read them"


def request(pixels: memoryview | None, shape: tuple[Any, ...], model: str) -> Request | None:
    """The executor's request for one frame of a batch (its settings as the plane resolved
    them: the model's where the INFER set none); None where the plane held no pixels for it (a
    frame in a segment that is not mapped here)."""
    height, width, code, colour, conf, iou, max_det = shape
    if pixels is None:
        return None
    fmt = PIXEL_FORMATS[code]
    image = np.frombuffer(pixels, np.uint8).reshape(frame_shape(fmt, height, width))
    return Request(
        image=image,
        pixel_format=fmt,
        colour=colour,
        conf=conf,
        iou=iou,
        max_det=max_det,
        received_ns=time.monotonic_ns(),
        model=model,
    )


def result(out: Outcome, name: str) -> Result:
    """The plane's result tuple for an executor's outcome."""
    pre, post = round(out.pre_us), round(out.post_us)
    if out.error is None:
        return _OK, "", out.detections, pre, post
    words = str(getattr(out.error, "message", out.error)).removeprefix(f"{name}: ")
    if not isinstance(out.error, DeviceFailed):
        return _INTERNAL, words, None, None, None
    return (_HUNG if out.hung else _DEVICE), words, None, None, None


class DlaFrames:
    """A DLA core's frames for a Python engine of the plane: one job a call, on a free slot of
    the executor's (the engine runs as many threads as the executor has slots)."""

    def __init__(self, executor: DlaExecutor) -> None:
        self.executor = executor
        self.model = next(iter(executor.models))
        self._free: queue.SimpleQueue[Slot] = queue.SimpleQueue()
        for slot in executor.slots:
            self._free.put(slot)

    @property
    def slots(self) -> int:
        return len(self.executor.slots)

    def __call__(self, batch: Batch) -> tuple[int, int, Sequence[Result]]:
        ((job, pixels, shape),) = batch
        work = request(pixels, shape, self.model)
        if work is None:
            return 0, 0, [(_INTERNAL, _NO_PIXELS, None, None, None)]
        slot = self._free.get()  # one is free: the plane runs a job a thread
        try:
            out = self.executor.run_frame(job, work, slot)
        finally:
            self._free.put(slot)
        return out.start_ns, out.end_ns, [result(out, self.executor.name)]


class GpuBatches:
    """The GPU's batches for a Python engine of the plane, the executor's engine running each on
    a free slot of the executor's (the engine runs as many threads as the executor has slots)."""

    def __init__(self, executor: GpuExecutor) -> None:
        self.executor = executor
        self.model = next(iter(executor.models))
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(executor.slots):
            self._free.put(slot)

    def __call__(self, batch: Batch) -> tuple[int, int, Sequence[Result]]:
        ids: list[int] = []
        works: list[Request] = []
        for job, pixels, shape in batch:
            work = request(pixels, shape, self.model)
            if work is not None:
                works.append(work)
                ids.append(job)
        outcomes = {o.job_id: o for o in self._run(ids, works)} if works else {}
        missing: Result = (_INTERNAL, _NO_PIXELS, None, None, None)
        name = self.executor.name
        results = [result(outcomes[j], name) if j in outcomes else missing for j, _, _ in batch]
        ran = [o for o in outcomes.values() if o.end_ns]
        start = min((o.start_ns for o in ran), default=0)
        end = max((o.end_ns for o in ran), default=0)
        return start, end, results

    def _run(self, ids: Sequence[int], works: Sequence[Request]) -> Sequence[Outcome]:
        slot = self._free.get()  # one is free: the plane runs a batch a thread
        try:
            return self.executor.run_batch(ids, works, slot)
        finally:
            self._free.put(slot)
