"""The native data plane's real DLA cores (cuDLA, on a Jetson).

:func:`open_plane_core` opens a placement's core as the DLA executor does
(:func:`dlad.devices.factory.open_core` with the backend ``cudla``, the task timeout set, each
slot's buffers allocated), makes the fence each slot's tasks signal (with GPU pre/post, the
slot's NvSciSync objects imported into CUDA by
:meth:`~dlad.gpu.service.GpuService.cudla_slot`, recipe A of ``docs/reference/cudla.md`` §4.7)
and hands the plane their handles and registered pointers
(:meth:`~dlad.devices.cudla.backend.CudlaDlaCore.plane_core`). The plane submits the tasks
and waits for their EOF fences itself (``dlad/native/cudla_engine.hpp``); the core object stays
the daemon's, which closes it after the plane.

This runs only where libcudla loads; on other machines it is tested against the fake cuDLA
library (``tests/dlad/cudla/fake_cudla.c``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dlad.devices.factory import cudla_loadable_for, open_core
from dlad.protocol import MAX_DET

if TYPE_CHECKING:
    from dlad.config import Placement, Plan
    from dlad.devices.cudla.backend import CudlaDlaCore
    from dlad.gpu.service import GpuService
    from dlad.native_plane import CudlaFunctions, PlaneCudla, PlaneGpu

__all__ = ["PlaneCore", "open_plane_core"]


@dataclass(frozen=True, slots=True)
class PlaneCore:
    """A cuDLA core opened for the plane: the core (the caller closes it after the plane),
    what the plane gets of it, its GPU pre/post (None: off), and the functions to call."""

    core: CudlaDlaCore
    spec: PlaneCudla
    gpu: PlaneGpu | None
    functions: CudlaFunctions


class PlaneCoreUnsupported(RuntimeError):
    """This core cannot be the plane's own engine (a cuDLA in deterministic-semaphore mode: the
    plane waits on the EOF fences cuDLA fills, and there dlad computes them); it serves as a
    Python engine instead."""


def open_plane_core(
    plan: Plan,
    placement: Placement,
    *,
    slots: int,
    gpu: GpuService | None,
) -> PlaneCore:
    """Open ``placement``'s DLA core through cuDLA for the native plane, with ``slots`` slots
    and, where ``gpu`` is given, GPU pre/post. Blocks (loading the module, allocating, warming
    the kernels).

    Raises PlaneCoreUnsupported (a core in deterministic-semaphore mode), DlaError (a library
    that does not load, a loadable that does not match the model's, any failed call), ValueError
    (no
    TensorRT loadable for this core, a model the GPU's candidate store cannot hold), CudaError
    or CudaInteropError; what was opened is closed again.
    """
    from dlad.devices.cudla.backend import CudlaDlaCore  # noqa: PLC0415 (ctypes binding)

    device = plan.config.device(placement.device)
    dla, module = open_core(
        "cudla", int(device.core or 0), str(placement.path), placement.loadable,
        cudla_loadable=cudla_loadable_for(plan, placement),
        cudla_options=None if gpu is None else gpu.cudla_options(),
    )  # fmt: skip
    assert isinstance(dla, CudlaDlaCore)  # the backend asked for
    try:
        dla.set_task_timeout(max(1, math.ceil(device.task_timeout_ms)))
        buffers = [
            (
                [dla.alloc_buffer(d) for d in module.inputs],
                [dla.alloc_buffer(d) for d in module.outputs],
            )
            for _ in range(slots)
        ]
        plane_gpu = None
        if gpu is None:
            fences = [dla.create_fence(f"dla{dla.core}-plane-{i}") for i in range(slots)]
        else:
            linked = [
                gpu.cudla_slot(dla, placement.loadable, inputs, outputs, MAX_DET)
                for inputs, outputs in buffers
            ]
            fences = [s.done for s in linked]  # the DLA-signalled fence the stream waits on
            plane_gpu = gpu.plane_gpu(placement.loadable, slots, cudla=linked)
        if dla.semaphores == "deterministic":
            raise PlaneCoreUnsupported(
                "this cuDLA offers deterministic semaphores only (older JetPack); the core "
                "serves as a Python engine, pre/post-processing on the CPU"
            )
        spec = dla.plane_core(
            [(i, o, fence) for (i, o), fence in zip(buffers, fences, strict=True)]
        )
        return PlaneCore(dla, spec, plane_gpu, dla.plane_functions())
    except BaseException:
        dla.close(force=True)
        raise
