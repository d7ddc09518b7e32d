"""The ctypes ABI pinned to docs/reference/cudla.md §4.2-4.6: struct sizes and field offsets (LP64),
enum values, library lookup and the probing of symbols only newer releases export."""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import pytest

from dlad.devices.base import CudlaStatus, DlaError
from dlad.devices.cudla import abi
from dlad.devices.cudla.abi import CudlaLibraryError, load_libraries

LAYOUTS = {  # struct: (size, {field: offset}) from docs/reference/cudla.md §4.4 and §4.6
    abi.ModuleTensorDescriptor: (168, {
        "name": 0, "size": 88, "n": 96, "c": 104, "h": 112, "w": 120, "dataFormat": 128,
        "dataType": 129, "dataCategory": 130, "pixelFormat": 131, "pixelMapping": 132,
        "stride": 136,
    }),
    abi.ExternalMemoryHandleDesc: (16, {"extBufObject": 0, "size": 8}),
    abi.ExternalSemaphoreHandleDesc: (8, {"extSyncObject": 0}),
    abi.CudlaFence: (16, {"fence": 0, "type": 8}),
    abi.WaitEvents: (16, {"preFences": 0, "numEvents": 8}),
    abi.SignalEvents: (24, {"devPtrs": 0, "eofFences": 8, "numEvents": 16}),
    abi.CudlaTask: (48, {
        "moduleHandle": 0, "outputTensor": 8, "numOutputTensors": 16, "numInputTensors": 20,
        "inputTensor": 24, "waitEvents": 32, "signalEvents": 40,
    }),
    abi.ModuleAttribute: (8, {"numInputTensors": 0, "inputTensorDesc": 0}),
    abi.DevAttribute: (4, {"unifiedAddressingSupported": 0, "deviceVersion": 0}),
    abi.NvSciBufAttrKeyValuePair: (24, {"key": 0, "value": 8, "len": 16}),
    abi.NvSciSyncAttrKeyValuePair: (24, {"attrKey": 0, "value": 8, "len": 16}),
    abi.NvSciSyncFence: (48, {"payload": 0}),
}  # fmt: skip


@pytest.mark.skipif(ctypes.sizeof(ctypes.c_void_p) != 8, reason="the documented layouts are LP64")
@pytest.mark.parametrize("struct", list(LAYOUTS), ids=lambda s: s.__name__)
def test_struct_layouts(struct: type[ctypes.Structure]) -> None:
    size, offsets = LAYOUTS[struct]
    assert ctypes.sizeof(struct) == size
    for name, offset in offsets.items():
        assert getattr(struct, name).offset == offset, name


def test_task_puts_outputs_before_inputs() -> None:
    names = [f[0] for f in abi.CudlaTask._fields_]
    assert names.index("outputTensor") < names.index("inputTensor")


def test_enum_values() -> None:
    assert {e.name: int(e) for e in abi.CudlaMode} == {"CUDA_DLA": 0, "STANDALONE": 1}
    assert (int(abi.SyncAttrFlags.WAIT), int(abi.SyncAttrFlags.SIGNAL)) == (1, 2)
    assert [int(e) for e in abi.ModuleAttributeType] == [0, 1, 2, 3, 4, 5]
    assert (int(abi.FenceType.NVSCISYNC_FENCE), int(abi.FenceType.NVSCISYNC_FENCE_SOF)) == (1, 2)
    assert [int(e) for e in abi.SubmitFlags] == [1, 2, 4]
    assert [int(e) for e in abi.AccessPermission] == [0, 1, 2]
    assert [int(e) for e in abi.DevAttributeType] == [0, 1]
    assert [int(e) for e in abi.NvSciBufType] == [0, 1, 2, 3, 4, 5]
    keys = {e.name: int(e) for e in abi.NvSciBufAttrKey}
    expected = {
        "TYPES": 1,
        "NEED_CPU_ACCESS": 2,
        "REQUIRED_PERM": 3,
        "GPU_ID": 5,
        "RAW_BUFFER_SIZE": 0x10000,
        "RAW_BUFFER_ALIGN": 0x10001,
        "TENSOR_SIZE": 0x30007,
    }
    assert {k: keys[k] for k in expected} == expected
    assert (int(abi.NvSciBufAccessPerm.READ_ONLY), int(abi.NvSciBufAccessPerm.READ_WRITE)) == (1, 3)
    assert int(abi.NvSciSyncAttrKey.REQUIRE_DETERMINISTIC_FENCES) == 6
    assert int(abi.NvSciSyncAttrKey.NEED_CPU_ACCESS) == 1
    assert int(abi.NvSciSyncAttrKey.REQUIRED_PERM) == 2
    assert [int(e) for e in abi.NvSciSyncAccessPerm] == [1, 2, 3, 1 << 63]
    assert (int(abi.NvSciError.SUCCESS), int(abi.NvSciError.TIMEOUT)) == (0, 0x200)
    assert abi.NAME_MAX_LEN == 80
    assert abi.NUM_STRIDES == 8


def test_missing_library_names_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(CudlaLibraryError) as info:
        load_libraries(cudla=str(tmp_path / "libcudla.so.1"))
    assert info.value.status is CudlaStatus.ERROR_DRIVER_NOT_FOUND
    assert "libcudla" in str(info.value)
    monkeypatch.setenv("DLAD_CUDLA_LIB", str(tmp_path / "nowhere.so"))
    with pytest.raises(CudlaLibraryError, match="DLAD_CUDLA_LIB"):
        load_libraries()


def test_required_symbol_missing(fake_so: Path) -> None:
    libc = ctypes.util.find_library("c")
    assert libc is not None
    with pytest.raises(CudlaLibraryError, match="lacks cudlaCreateDevice"):
        load_libraries(cudla=libc, nvscibuf=str(fake_so), nvscisync=str(fake_so))


def test_optional_symbols_are_probed(fake_so: Path, fake_old_so: Path) -> None:
    new = load_libraries(str(fake_so), str(fake_so), str(fake_so))
    assert new.missing == frozenset()
    assert all(new.has(name) for name in abi.OPTIONAL_SYMBOLS)
    old = load_libraries(str(fake_old_so), str(fake_old_so), str(fake_old_so))
    assert old.missing == abi.OPTIONAL_SYMBOLS
    with pytest.raises(DlaError) as info:
        old.cudlaSetTaskTimeoutInMs  # noqa: B018
    assert info.value.status is CudlaStatus.ERROR_UNSUPPORTED_OPERATION
    assert info.value.call == "cudlaSetTaskTimeoutInMs"
    with pytest.raises(AttributeError):
        old.notAFunction  # noqa: B018
