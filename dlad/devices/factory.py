"""Open the DLA core a device is configured for: ``backend = "emulated"``, ``"cudla"`` or
``"auto"`` (cudla where libcudla, libnvscibuf and libnvscisync load and the model has a TensorRT
loadable for the core; else emulated).

The emulated loadable (``.emu``) still gives the model's metadata (anchors, strides, scales,
image size); on the cudla backend the TensorRT loadable is what runs, and its I/O descriptors, as
cuDLA reports them, must be those of the ``.emu`` (the same network built for the same core).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import structlog

from dlad.devices.base import CudlaStatus, DlaCore, DlaError, Module
from dlad.devices.dram import SharedDram
from dlad.devices.emulated import EmulatedDlaCore, FaultConfig
from dlad.loadable import Loadable, TensorDescriptor

__all__ = ["cudla_loads", "open_core", "resolve_backend"]

_log = structlog.get_logger(__name__)
_SAME: tuple[str, ...] = ("name", "size", "n", "c", "h", "w", "data_type", "tensor_format")


def cudla_loads() -> str | None:
    """None where the cuDLA and NvSci libraries load here, else why not."""
    from dlad.devices.cudla.abi import CudlaLibraryError, load_libraries  # noqa: PLC0415

    try:
        load_libraries()
    except CudlaLibraryError as exc:
        return exc.detail
    return None


def resolve_backend(backend: str, cudla_loadable: str | None) -> Literal["emulated", "cudla"]:
    """The backend ``auto`` means here (``emulated`` and ``cudla`` mean themselves). Raises
    ValueError for an unknown backend."""
    if backend in ("emulated", "cudla"):
        return backend  # type: ignore[return-value]
    if backend != "auto":
        raise ValueError(f"a DLA backend is auto, emulated or cudla, got {backend!r}")
    if cudla_loadable is None:
        return "emulated"
    return "cudla" if cudla_loads() is None else "emulated"


def _check_same(
    cudla: tuple[TensorDescriptor, ...], emu: tuple[TensorDescriptor, ...], kind: str
) -> None:
    mine = [tuple(getattr(d, k) for k in _SAME) for d in cudla]
    want = [tuple(getattr(d, k) for k in _SAME) for d in emu]
    if mine != want:
        raise DlaError(
            CudlaStatus.ERROR_INVALID_MODULE, "cudlaModuleGetAttributes",
            f"the TensorRT loadable's {kind} {mine} differ from the .emu's {want}",
        )  # fmt: skip


def open_core(
    backend: str,
    core: int,
    loadable_path: str,
    loadable: Loadable,
    *,
    cudla_loadable: str | None = None,
    mode: Literal["numeric", "timing"] = "numeric",
    latency_us: float | None = None,
    threads: int = 1,
    faults: FaultConfig | None = None,
    dram: SharedDram | None = None,
    allocator: Callable[[int], npt.NDArray[np.uint8]] | None = None,
    cudla_options: dict[str, Any] | None = None,
) -> tuple[DlaCore, Module]:
    """Open DLA ``core`` on ``backend`` and load its loadable; returns the core and module.

    ``emulated``: :class:`EmulatedDlaCore` with ``mode``, ``latency_us``, ``threads``, ``faults``,
    ``dram`` and ``allocator``, loading ``loadable_path``. ``cudla``:
    :class:`~dlad.devices.cudla.backend.CudlaDlaCore` (``cudla_options`` are its keyword
    arguments) loading ``cudla_loadable`` with the INT8 scales of ``loadable``. Raises
    DlaError (a cudla core is closed again if its loadable does not match ``loadable``) and
    ValueError for an unknown backend or a cudla core without ``cudla_loadable``.
    """
    chosen = resolve_backend(backend, cudla_loadable)
    if chosen == "emulated":
        emu = EmulatedDlaCore(
            core, mode=mode, latency_us=latency_us, threads=threads, faults=faults, dram=dram,
            allocator=allocator,
        )  # fmt: skip
        try:
            return emu, emu.load(loadable_path)
        except BaseException:
            emu.close(force=True)
            raise
    if cudla_loadable is None:
        raise ValueError(f"DLA core {core}: backend cudla needs the model's TensorRT loadable")
    from dlad.devices.cudla.backend import CudlaDlaCore  # noqa: PLC0415 (lazy: ctypes binding)

    dla = CudlaDlaCore(core, **(cudla_options or {}))
    try:
        scales = {d.name: d.scale for d in (*loadable.inputs, *loadable.outputs) if d.scale}
        module = dla.load(cudla_loadable, scales=scales)
        _check_same(module.inputs, loadable.inputs, "inputs")
        _check_same(module.outputs, loadable.outputs, "outputs")
    except BaseException:
        dla.close(force=True)
        raise
    _log.info("cudla_core_opened", core=core, loadable=cudla_loadable, semaphores=dla.semaphores)
    return dla, module


def cudla_loadable_for(plan: Any, placement: Any) -> str | None:
    """The absolute path of the TensorRT loadable configured for ``placement``'s device core
    (``[models.<name>.loadables] cudla_coreN``), or None. ``plan`` is a
    :class:`dlad.config.Plan`, ``placement`` one of its placements."""
    from dlad.config import _resolve  # noqa: PLC0415 (config imports nothing of ours; its path rules)

    device = plan.config.device(placement.device)
    if device.core is None:
        return None
    text = plan.config.model(placement.model).loadables.cudla_for_core(device.core)
    return None if text is None else str(_resolve(text, plan.base_dir))
