"""Build and drive the fake cuDLA/NvSci library (``fake_cudla.c``) for the cudla backend's tests.

:func:`build_fake` compiles the C file with plain gcc into a directory; :class:`FakeLib` wraps
the fake's test controls (call log, live-object counts, error injection, options, the task
callback); :func:`fake_loadable` writes a loadable in the fake's own format from dlad tensor
descriptors (``"FAKECDLA"``, version, core, input and output counts, raw 168-byte
``cudlaModuleTensorDescriptor`` structs).
"""

from __future__ import annotations

import ctypes
import shutil
import struct
import subprocess
from collections.abc import Callable, Sequence
from ctypes import POINTER, c_char_p, c_int, c_int64, c_long, c_size_t, c_uint32, c_uint64, c_void_p
from pathlib import Path
from typing import Any

from dlad.devices.cudla.abi import Libraries, load_libraries
from dlad.devices.cudla.backend import descriptor_to_c
from dlad.loadable import TensorDescriptor

SOURCE = Path(__file__).with_name("fake_cudla.c")
KINDS = (
    "device", "module", "mem_reg", "sem_reg", "buf_module", "buf_attr_list", "buf_obj",
    "sync_module", "sync_attr_list", "sync_obj", "cpu_wait_ctx", "fence",
)  # fmt: skip
TASK_FN = ctypes.CFUNCTYPE(
    c_int,
    c_int,
    c_uint32,
    POINTER(c_void_p),
    POINTER(c_uint64),
    c_uint32,
    POINTER(c_void_p),
    POINTER(c_uint64),
)
FAULT_ERROR, FAULT_HANG = 1, 2


def gcc_problem() -> str | None:
    """Why the fake cannot be built here, or None."""
    if shutil.which("gcc") is None:
        return "gcc is not installed: the fake cuDLA library cannot be built"
    return None


def build_fake(out_dir: Path, *, old_release: bool = False) -> Path:
    """Compile the fake into ``out_dir`` and return the .so path (raises CalledProcessError
    with gcc's output on a compile error)."""
    name = "libfakecudla_old.so" if old_release else "libfakecudla.so"
    out = out_dir / name
    cmd = ["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror",
           "-fvisibility=hidden", "-pthread", "-o", str(out), str(SOURCE)]  # fmt: skip
    if old_release:
        cmd.insert(1, "-DFAKE_OLD_RELEASE")
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    return out


class FakeLib:
    """The fake's test controls, bound to one built .so."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        lib = self.lib
        lib.fake_live.argtypes, lib.fake_live.restype = [c_char_p], c_long
        lib.fake_log_count.argtypes, lib.fake_log_count.restype = [], c_size_t
        lib.fake_log_entry.argtypes, lib.fake_log_entry.restype = [c_size_t], c_char_p
        lib.fake_log_clear.argtypes, lib.fake_log_clear.restype = [], None
        lib.fake_set_option.argtypes, lib.fake_set_option.restype = [c_char_p, c_int64], c_int
        lib.fake_fail_next.argtypes, lib.fake_fail_next.restype = [c_char_p, c_int, c_int], None
        lib.fake_task_fault.argtypes = [c_uint64, c_int, c_int, c_int]
        lib.fake_task_fault.restype = None
        lib.fake_set_task_callback.argtypes, lib.fake_set_task_callback.restype = [c_void_p], None
        lib.fake_reset.argtypes, lib.fake_reset.restype = [], None
        self._callback: Any = None

    def libraries(self) -> Libraries:
        """The backend's view of the fake: all three libraries are this one file."""
        p = str(self.path)
        return load_libraries(cudla=p, nvscibuf=p, nvscisync=p)

    def reset(self) -> None:
        self.lib.fake_reset()
        self._callback = None

    def live(self) -> dict[str, int]:
        return {k: int(self.lib.fake_live(k.encode())) for k in KINDS}

    def calls(self) -> list[str]:
        n = self.lib.fake_log_count()
        return [(self.lib.fake_log_entry(i) or b"").decode() for i in range(n)]

    def call_names(self) -> list[str]:
        return [c.split(" ", 1)[0] for c in self.calls()]

    def clear_log(self) -> None:
        self.lib.fake_log_clear()

    def option(self, name: str, value: int) -> None:
        assert self.lib.fake_set_option(name.encode(), value), name

    def fail_next(self, call: str, status: int, count: int = 1) -> None:
        self.lib.fake_fail_next(call.encode(), status, count)

    def task_fault(self, core: int, kind: int, status: int = 0, count: int = 1) -> None:
        self.lib.fake_task_fault(core, kind, status, count)

    def set_callback(self, fn: Callable[..., int] | None) -> None:
        """``fn(core, inputs, outputs) -> status`` with ``memoryview`` s of the buffers,
        called on the fake's device thread instead of its default computation."""
        if fn is None:
            self._callback = None
            self.lib.fake_set_task_callback(None)
            return

        def trampoline(core: int, n_in: int, ins: Any, in_sizes: Any, n_out: int, outs: Any,
                       out_sizes: Any) -> int:  # fmt: skip
            def views(ptrs: Any, sizes: Any, n: int) -> list[memoryview]:
                return [
                    memoryview((ctypes.c_uint8 * sizes[i]).from_address(ptrs[i])).cast("B")
                    for i in range(n)
                ]

            return fn(core, views(ins, in_sizes, n_in), views(outs, out_sizes, n_out))

        self._callback = TASK_FN(trampoline)
        self.lib.fake_set_task_callback(ctypes.cast(self._callback, c_void_p))


def fake_loadable(
    inputs: Sequence[TensorDescriptor], outputs: Sequence[TensorDescriptor], core: int,
    *, version: int = 1,
) -> bytes:  # fmt: skip
    """A loadable in the fake's format that reports these descriptors."""
    head = b"FAKECDLA" + struct.pack("<4I", version, core, len(inputs), len(outputs))
    return head + b"".join(bytes(descriptor_to_c(d)) for d in (*inputs, *outputs))


def expected_default_output(inp: bytes, out_index: int, size: int) -> bytes:
    """The fake's default computation: ``out[b] = in[b % len(in)] + 31 * j + 7`` (mod 256)."""
    import numpy as np

    src = np.frombuffer(inp, np.uint8)
    idx = np.arange(size) % src.size
    return ((src[idx].astype(np.int64) + 31 * out_index + 7) % 256).astype(np.uint8).tobytes()


__all__ = [
    "FAULT_ERROR",
    "FAULT_HANG",
    "FakeLib",
    "build_fake",
    "c_size_t",
    "c_void_p",
    "expected_default_output",
    "fake_loadable",
    "gcc_problem",
]  # fmt: skip
