"""The ctypes mirrors of the kernels' parameter structs have the C layout (gcc, no GPU), and the
GPU program compiles (nvcc, where the CUDA toolkit is installed; no GPU needed)."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dlad.families import cuda_kernels
from dlad.gpu.driver import KERNEL_SOURCE, NVRTC_OPTIONS, kernel_source
from dlad.gpu.layout import LayoutParams
from dlad.gpu.prepost import FrameParams, Geometry, PostParams, PreParams

MIRRORS: dict[str, type[ctypes.Structure]] = {
    "PreParams": PreParams,
    "PostParams": PostParams,
    "Geometry": Geometry,
    "FrameParams": FrameParams,
    "LayoutParams": LayoutParams,
}


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_struct_layouts_match_kernels_cu(tmp_path: Path) -> None:
    source = KERNEL_SOURCE.read_text(encoding="utf-8")
    defines = "\n".join(re.findall(r"^#define DLAD_\w+ .*$", source, re.MULTILINE))
    typedefs = "\n".join(re.findall(r"^typedef .*;$", source, re.MULTILINE))
    structs = {
        m.group(1): m.group(0) for m in re.finditer(r"struct (\w+) \{.*?\n\};", source, re.S)
    }
    assert set(MIRRORS) <= set(structs)
    # C++ (g++): a struct's name is a type, as in CUDA C++; all structs, in source order.
    header = f"#include <stdio.h>\n#include <stddef.h>\n{defines}\n{typedefs}"
    lines = [header, *structs.values()]
    lines.append("int main(void) {")
    for name, mirror in MIRRORS.items():
        lines.append(f'printf("{name} size %zu\\n", sizeof({name}));')
        for field, *_ in mirror._fields_:
            lines.append(f'printf("{name} {field} %zu\\n", offsetof({name}, {field}));')
    lines.append("return 0; }")
    c = tmp_path / "abi.cpp"
    c.write_text("\n".join(lines))
    exe = tmp_path / "abi"
    subprocess.run(["g++", "-o", str(exe), str(c)], check=True, capture_output=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    expected = []
    for name, mirror in MIRRORS.items():
        expected.append(f"{name} size {ctypes.sizeof(mirror)}")
        expected += [f"{name} {f} {getattr(mirror, f).offset}" for f, *_ in mirror._fields_]
    assert out[:-1] == expected


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
@pytest.mark.timeout(300)
def test_the_gpu_program_compiles_for_orin(tmp_path: Path) -> None:
    """The one CUDA program (kernels.cu and every model family's decode) compiles for Orin's
    GPU (sm_87) with NVRTC's options, and holds every kernel the driver looks up: a machine
    without a GPU but with the toolkit catches what would otherwise fail at daemon start."""
    source = tmp_path / "program.cu"
    source.write_text(kernel_source(), encoding="utf-8")
    cubin = tmp_path / "program.cubin"
    options = [o for o in NVRTC_OPTIONS if o != "-default-device"]  # NVRTC's own: nvcc's default
    subprocess.run(["nvcc", *options, "-arch=sm_87", "-cubin", "-o", str(cubin), str(source)],
                   check=True, capture_output=True)  # fmt: skip
    symbols = cubin.read_bytes()
    for kernel in ("post_select_sort", "post_mask", "post_scan", *cuda_kernels()):
        assert kernel.encode() + b"\0" in symbols, kernel
