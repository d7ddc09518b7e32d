"""The platform probe: cuDLA's version, the DLA count and each DLA's version, or why not.

``dlad status`` prints it; nothing here raises: a missing library or a failing call becomes the
probe's ``reason``.
"""

from __future__ import annotations

from ctypes import byref, c_uint64, c_void_p
from dataclasses import asdict, dataclass, field
from typing import Any

from dlad.devices.base import DlaError
from dlad.devices.cudla.abi import (
    CudlaMode,
    DevAttribute,
    DevAttributeType,
    Libraries,
    load_libraries,
)
from dlad.devices.cudla.nvsci import check_cudla

__all__ = ["PlatformProbe", "format_version", "probe"]


def format_version(value: int) -> str:
    """``cudlaGetVersion``'s ``1000000 * major + 1000 * minor + patch`` as ``major.minor.patch``."""
    return f"{value // 1_000_000}.{value // 1000 % 1000}.{value % 1000}"


@dataclass(frozen=True)
class PlatformProbe:
    """What the probe found. ``available`` is False with a ``reason`` when cuDLA cannot be used;
    values a release cannot report (an optional symbol it lacks) are None."""

    available: bool
    reason: str | None = None
    libraries: dict[str, str] = field(default_factory=dict)
    cudla_version: str | None = None
    device_count: int | None = None
    dla_versions: dict[int, int] = field(default_factory=dict)
    missing_symbols: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out = asdict(self)
        out["dla_versions"] = {str(k): v for k, v in self.dla_versions.items()}
        out["missing_symbols"] = list(self.missing_symbols)
        return out

    def summary(self) -> str:
        """One line for people."""
        if not self.available:
            return f"cuDLA: not available: {self.reason}"
        versions = ", ".join(f"DLA{i} {v:#x}" for i, v in self.dla_versions.items())
        return (f"cuDLA {self.cudla_version or 'version unknown'}, "
                f"{self.device_count if self.device_count is not None else '?'} DLA cores"
                + (f" ({versions})" if versions else ""))  # fmt: skip


def probe(libs: Libraries | None = None) -> PlatformProbe:
    """Probe cuDLA here: load the libraries (or use ``libs``), read the version and device count
    where the release has those calls, and open each core in standalone mode to read its
    ``CUDLA_DEVICE_VERSION``. Never raises."""
    try:
        libs = libs if libs is not None else load_libraries()
    except DlaError as exc:
        return PlatformProbe(False, exc.detail)
    version = count = None
    versions: dict[int, int] = {}
    try:
        if libs.has("cudlaGetVersion"):
            raw = c_uint64()
            check_cudla(libs.cudlaGetVersion(byref(raw)), "cudlaGetVersion")
            version = format_version(int(raw.value))
        if libs.has("cudlaDeviceGetCount"):
            n = c_uint64()
            check_cudla(libs.cudlaDeviceGetCount(byref(n)), "cudlaDeviceGetCount")
            count = int(n.value)
        for core in range(count if count is not None else 2):
            dev = c_void_p()
            check_cudla(
                libs.cudlaCreateDevice(core, byref(dev), CudlaMode.STANDALONE), "cudlaCreateDevice"
            )
            try:
                attr = DevAttribute()
                check_cudla(
                    libs.cudlaDeviceGetAttribute(dev, DevAttributeType.DEVICE_VERSION, byref(attr)),
                    "cudlaDeviceGetAttribute",
                )
                versions[core] = int(attr.deviceVersion)
            finally:
                libs.cudlaDestroyDevice(dev)
    except DlaError as exc:
        return PlatformProbe(
            False, str(exc), dict(libs.paths), version, count, versions, tuple(sorted(libs.missing))
        )
    return PlatformProbe(
        True, None, dict(libs.paths), version, count, versions, tuple(sorted(libs.missing))
    )
