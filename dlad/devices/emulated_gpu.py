"""The emulated Orin GPU: the same logical model as the DLAs, run in batches, taking the time
NVIDIA's published batch curve says an Orin GPU takes.

A product backend beside the emulated DLA core (``dlad/devices/emulated.py``), not a test double:
it is the third engine of the emulated Orin. A batch

1. computes (``mode="numeric"``): each frame through the loadable's INT8 engine (the same
   integers as the DLA cores: ``dlad/devices/int8_engine.py``), heads unpacked to the logical
   ``[C, H, W]`` layout a GPU engine writes; ``mode="timing"``: no math, fixed, valid heads;
2. takes the modelled time of its size in total (it sleeps what the computation left, or takes
   the computation's own time if that is longer), one batch at a time, as one GPU engine does;
   with a :class:`~dlad.devices.dram.SharedDram`, that time stretches while DLA tasks run.

**The batch curve** (:data:`ORIN_GPU_YOLOV5S_MS`) is ``trtexec``'s median GPU compute time of
YOLOv5s at 672x672, INT8, on DRIVE Orin (NVIDIA's cuDLA-samples README;
``docs/reference/cudla.md`` §6.1), where one DLA takes 3.82 ms at batch 1. Another model is scaled
by its own modelled DLA time against that 3.82 ms (its loadable's ``latency_us``), or by the
device's ``latency_us`` (its batch-1 time) when the config sets one; sizes in between are
interpolated. ``docs/latency.md`` says what this assumes.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

from dlad.curves import interpolate
from dlad.devices.dram import SharedDram
from dlad.devices.gpu_frames import check_batch, frame_shape
from dlad.devices.int8_engine import Int8Engine, engine_for_loadable
from dlad.imaging.post import unpack_head
from dlad.loadable import DataType, Loadable

__all__ = [
    "ORIN_DLA_YOLOV5S_MS",
    "ORIN_GPU_YOLOV5S_MS",
    "EmulatedGpu",
    "GpuBatchTiming",
    "batch_curve_us",
]

ORIN_GPU_YOLOV5S_MS: Final[Mapping[int, float]] = {
    1: 1.82, 2: 2.91, 4: 4.99, 8: 9.19, 12: 13.27, 16: 16.87,
}  # fmt: skip
"""GPU INT8, YOLOv5s 672x672, batch size -> ms (DRIVE Orin, trtexec; cudla.md §6.1)."""
ORIN_DLA_YOLOV5S_MS: Final = 3.82
"""One DLA, INT8, YOLOv5s 672x672, batch 1 (same source): the scale's reference."""

Mode = Literal["numeric", "timing"]


def batch_curve_us(
    loadable: Loadable, *, batch1_us: float | None = None, max_batch: int = 16
) -> dict[int, float]:
    """The emulated GPU's service time (µs) at each batch size 1..``max_batch`` for
    ``loadable``'s model: the published curve, scaled so that batch 1 takes ``batch1_us`` (or,
    unset, by the model's modelled DLA time against YOLOv5s-672's 3.82 ms), interpolated
    linearly between published sizes and extrapolated per image beyond 16."""
    if batch1_us is not None:
        scale = batch1_us / (ORIN_GPU_YOLOV5S_MS[1] * 1e3)
    else:
        scale = loadable.latency_us / (ORIN_DLA_YOLOV5S_MS * 1e3)
    return {b: interpolate(ORIN_GPU_YOLOV5S_MS, b) * 1e3 * scale for b in range(1, max_batch + 1)}


@dataclass(frozen=True, slots=True)
class GpuBatchTiming:
    """One batch's times: ``modelled_us`` (the curve's), ``compute_us`` (this host's math; None
    in timing mode), ``actual_us`` (what it took: the larger, on the host's clock)."""

    size: int
    modelled_us: float
    compute_us: float | None
    actual_us: float
    start_ns: int
    end_ns: int


class EmulatedGpu:
    """One emulated GPU engine for one model (see the module docstring).

    Args:
        loadable: the model's emulated loadable (its INT8 graph, I/O descriptors, scales).
        mode: ``"numeric"`` or ``"timing"``.
        max_batch: the largest batch :meth:`run` takes (>= 1).
        batch1_us: the batch-1 service time to scale the curve to (None: from the loadable).
        threads: onnxruntime intra-op threads of the numeric engine.
        dram: the DRAM it shares with the emulated Orin's DLA cores (a batch takes longer while
            they run: ``dlad/devices/dram.py``), or None (alone). It must run on
            ``time.monotonic_ns``.

    Raises ValueError for a bad argument, and the INT8 engine's errors for a graph it cannot
    build. :meth:`run` is thread-safe: batches run one at a time.
    """

    def __init__(
        self,
        loadable: Loadable,
        *,
        mode: Mode = "numeric",
        max_batch: int = 8,
        batch1_us: float | None = None,
        threads: int = 1,
        dram: SharedDram | None = None,
    ) -> None:
        if mode not in ("numeric", "timing"):
            raise ValueError(f"mode must be 'numeric' or 'timing', got {mode!r}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if batch1_us is not None and not batch1_us > 0:
            raise ValueError(f"batch1_us must be > 0, got {batch1_us}")
        self.loadable = loadable
        self.mode: Mode = mode
        self.max_batch = max_batch
        self.curve_us = batch_curve_us(loadable, batch1_us=batch1_us, max_batch=max_batch)
        self._engine: Int8Engine | None = (
            engine_for_loadable(loadable, threads=threads) if mode == "numeric" else None
        )
        self._patterns = [_pattern_head(d) for d in loadable.outputs] if mode == "timing" else []
        self.dram = dram
        self._frame_shape = frame_shape(loadable)
        self._lock = threading.Lock()

    def run(
        self, frames: Sequence[npt.NDArray[np.int8]]
    ) -> tuple[list[list[npt.NDArray[np.float32]]], GpuBatchTiming]:
        """Run one batch of ``DLA_HWC4`` int8 frames (``quantize_hwc4``'s output); returns, per
        frame, its logical heads (float32 ``[C, H, W]`` each), and the batch's timing.

        Raises ValueError for an empty batch, one over ``max_batch`` or a frame that is not an
        int8 array of the loadable's ``DLA_HWC4`` input shape.
        """
        check_batch(frames, self.max_batch, self._frame_shape)
        modelled = self.curve_us[len(frames)]
        with self._lock:  # one engine: batches queue behind each other
            start = time.monotonic_ns()
            dram = self.dram
            # The curve's time is the batch's work alone; sharing the DRAM stretches it.
            transfer = None if dram is None else dram.begin("gpu", modelled * 1e3)
            try:
                if self._engine is not None:
                    heads = [self._heads(self._engine.run(f)) for f in frames]
                    compute_us: float | None = (time.monotonic_ns() - start) / 1e3
                else:
                    heads = [list(self._patterns) for _ in frames]
                    compute_us = None
                if dram is not None and transfer is not None:
                    dram.wait(transfer)
                else:
                    left = modelled * 1e3 - (time.monotonic_ns() - start)
                    if left > 0:
                        time.sleep(left / 1e9)
            finally:
                if dram is not None and transfer is not None:
                    dram.finish(transfer)
            end = time.monotonic_ns()
        timing = GpuBatchTiming(len(frames), modelled, compute_us, (end - start) / 1e3, start, end)
        return heads, timing

    def close(self) -> None:
        """Nothing to release (host memory only); for the engine protocol's owner."""

    def _heads(self, buffers: Sequence[npt.NDArray[Any]]) -> list[npt.NDArray[np.float32]]:
        return [
            unpack_head(b, d.c, d.h, d.w, d.scale if d.data_type == DataType.INT8 else None)
            for d, b in zip(self.loadable.outputs, buffers, strict=True)
        ]


def _pattern_head(desc: Any) -> npt.NDArray[np.float32]:
    """Timing mode's head for one output: deterministic per name, in the range of real logits
    (objectness mostly far below any threshold)."""
    rng = np.random.default_rng(zlib.crc32(desc.name.encode("utf-8")))
    head: npt.NDArray[np.float32] = rng.normal(-6.0, 2.0, (desc.c, desc.h, desc.w)).astype(
        np.float32
    )
    return head
