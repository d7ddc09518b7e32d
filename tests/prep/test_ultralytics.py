"""Ultralytics YOLOv5 v7.0 checkpoint import: round trips, real-shaped pickles, refusal, errors."""

from __future__ import annotations

import builtins
import contextlib
import copy
import functools
import io
import os
import pathlib
import pickletools
import subprocess
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from prep import model as ours
from prep.model import ANCHORS, YOLOv5
from prep.ultralytics import (
    CheckpointError,
    _allowed_globals,
    _infer_variant,
    export_ultralytics_state_dict,
    load_into_model,
    load_ultralytics_state_dict,
)

FAKE_MODULES = ("models", "models.yolo", "models.common", "utils", "utils.general")


def _randomised(variant: str, nc: int, seed: int, anchor_scale: float = 1.0) -> YOLOv5:
    """A float model with non-trivial BatchNorm statistics, so every tensor matters."""
    torch.manual_seed(seed)
    anchors = torch.tensor(ANCHORS, dtype=torch.float32) * anchor_scale
    model = YOLOv5(variant, nc, anchors=anchors.tolist())
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                assert module.running_mean is not None
                assert module.running_var is not None
                assert module.num_batches_tracked is not None
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.1)
                module.running_mean.normal_(0.0, 0.1)
                module.running_var.uniform_(0.5, 2.0)
                module.num_batches_tracked.fill_(321)
    return model.eval()


def _save(obj: Any, *, legacy: bool = False) -> io.BytesIO:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        # The legacy format tries to store each module class's source; the throwaway classes
        # below have none, which torch reports as a warning.
        warnings.simplefilter("ignore", UserWarning)
        torch.save(obj, buf, _use_new_zipfile_serialization=not legacy)
    buf.seek(0)
    return buf


def _outputs(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(model.eval()(x))


# ------------------------------------------------------------------------ (i) state-dict round trip


@pytest.mark.parametrize("variant", ["n", "s"])
def test_round_trip_state_dict(variant: str, tmp_path: Path) -> None:
    model = _randomised(variant, nc=11, seed=1, anchor_scale=1.3)
    exported = export_ultralytics_state_dict(model)
    assert set(exported) == set(model.state_dict())  # addop/concat add no keys
    path = tmp_path / "sd.pt"
    torch.save(exported, path)

    ckpt = load_ultralytics_state_dict(path)

    assert (ckpt.variant, ckpt.num_classes, ckpt.source, ckpt.names) == (
        variant,
        11,
        "state_dict",
        None,
    )
    assert set(ckpt.state_dict) == set(exported)
    for key, tensor in exported.items():
        assert torch.equal(ckpt.state_dict[key], tensor), key
    torch.testing.assert_close(ckpt.anchors_px, model.anchors_px, rtol=1e-6, atol=1e-5)
    loaded = load_into_model(ckpt)  # strict load inside
    x = torch.rand(1, 3, 64, 64)
    for a, b in zip(_outputs(loaded, x), _outputs(model, x), strict=True):
        assert torch.equal(a, b)


def test_model_and_ema_entries_holding_state_dicts() -> None:
    model = export_ultralytics_state_dict(_randomised("n", nc=3, seed=2))
    ema = export_ultralytics_state_dict(_randomised("n", nc=3, seed=3))

    only_model = load_ultralytics_state_dict(_save({"model": model, "ema": None, "epoch": 5}))
    both = load_ultralytics_state_dict(_save({"model": model, "ema": ema}))

    assert only_model.source == "model"
    assert torch.equal(
        only_model.state_dict["model.4.cv1.conv.weight"], model["model.4.cv1.conv.weight"]
    )
    assert both.source == "ema"  # Ultralytics evaluates the EMA when a checkpoint has one
    assert torch.equal(both.state_dict["model.4.cv1.conv.weight"], ema["model.4.cv1.conv.weight"])


def test_export_drops_ours_only_state_and_refuses_fused_model() -> None:
    model = _randomised("n", nc=2, seed=4)
    # What QAT would add: state on our parameter-free addop module.
    model.get_submodule("model.2.m.0.addop").register_buffer("amax", torch.ones(1))
    assert "model.2.m.0.addop.amax" in model.state_dict()
    exported = export_ultralytics_state_dict(model)
    assert "model.2.m.0.addop.amax" not in exported
    load_ultralytics_state_dict(_save(exported))  # still a clean Ultralytics state dict

    with pytest.raises(ValueError, match=r"model\.0\.bn\.weight"):
        export_ultralytics_state_dict(model.fuse())


@functools.cache
def _template_n() -> dict[str, torch.Tensor]:
    return export_ultralytics_state_dict(_randomised("n", nc=1, seed=12))


@settings(max_examples=15, deadline=None)
@given(
    nc=st.integers(1, 90),
    scales=st.lists(st.floats(0.25, 4.0), min_size=9, max_size=9),
)
def test_classes_and_anchors_recovered(nc: int, scales: list[float]) -> None:
    # The n backbone with a head for nc classes and scaled anchors (no model built per example).
    anchors = torch.tensor(ANCHORS, dtype=torch.float32) * torch.tensor(scales).view(3, 3, 1)
    state = dict(_template_n())
    state["model.24.anchors"] = anchors / torch.tensor([8.0, 16.0, 32.0]).view(3, 1, 1)
    for level, channels in enumerate((64, 128, 256)):
        state[f"model.24.m.{level}.weight"] = torch.randn(3 * (nc + 5), channels, 1, 1)
        state[f"model.24.m.{level}.bias"] = torch.randn(3 * (nc + 5))
    ckpt = load_ultralytics_state_dict(_save(state))
    assert ckpt.num_classes == nc
    assert ckpt.variant == "n"
    torch.testing.assert_close(ckpt.anchors_px, anchors, rtol=1e-6, atol=1e-5)
    assert torch.equal(ckpt.state_dict["model.24.m.2.bias"], state["model.24.m.2.bias"])


# ------------------------------------------------------------------- (ii) real-shaped pickled model


@contextlib.contextmanager
def _fake_ultralytics() -> Iterator[types.SimpleNamespace]:
    """Throwaway ``models.yolo`` / ``models.common`` / ``utils.general`` modules with the class
    names Ultralytics v7.0 pickles, present only while the checkpoint is written."""
    assert not any(name in sys.modules for name in FAKE_MODULES)
    layout = {
        "models.yolo": ("DetectionModel", "Detect"),
        "models.common": ("Conv", "C3", "Bottleneck", "SPPF", "Concat"),
        "utils.general": ("Profile",),
    }
    classes: dict[str, type] = {}
    modules = {name: types.ModuleType(name) for name in FAKE_MODULES}
    for module_name, names in layout.items():
        for name in names:
            base: type = object if name == "Profile" else nn.Module
            cls = type(name, (base,), {"__module__": module_name, "__qualname__": name})
            setattr(modules[module_name], name, cls)
            classes[name] = cls
    sys.modules.update(modules)
    try:
        yield types.SimpleNamespace(**classes)
    finally:
        for name in FAKE_MODULES:
            del sys.modules[name]


def _as_ultralytics(model: YOLOv5, u: types.SimpleNamespace) -> Any:
    """The same weights in Ultralytics v7.0's object layout and attribute names."""
    model = copy.deepcopy(model)
    silu = nn.SiLU()  # v7.0's Conv.default_act: one instance shared by every Conv

    def convert(m: nn.Module) -> Any:
        if isinstance(m, ours.Conv):
            u_m = u.Conv()
            u_m.conv, u_m.bn, u_m.act = m.conv, m.bn, silu
        elif isinstance(m, ours.Bottleneck):
            u_m = u.Bottleneck()
            u_m.cv1, u_m.cv2, u_m.add = convert(m.cv1), convert(m.cv2), m.add
        elif isinstance(m, ours.C3):
            u_m = u.C3()
            u_m.cv1, u_m.cv2, u_m.cv3 = convert(m.cv1), convert(m.cv2), convert(m.cv3)
            u_m.m = nn.Sequential(*(convert(b) for b in m.m))
        elif isinstance(m, ours.SPPF):
            u_m = u.SPPF()
            u_m.cv1, u_m.cv2, u_m.m = convert(m.cv1), convert(m.cv2), m.m
        elif isinstance(m, ours.Concat):
            u_m = u.Concat()
            u_m.d = 1
        elif isinstance(m, ours.Detect):
            u_m = u.Detect()
            u_m.nc, u_m.no, u_m.nl, u_m.na = m.nc, m.no, m.nl, m.na
            u_m.grid = [torch.empty(0)] * 3
            u_m.anchor_grid = [torch.empty(0)] * 3
            u_m.m = m.m
            u_m.inplace = True
            u_m.register_buffer("anchors", m.anchors.clone())
            u_m.stride = torch.tensor([8.0, 16.0, 32.0])
        else:
            assert isinstance(m, nn.Upsample)
            return nn.Upsample(None, 2.0, "nearest")
        return u_m

    layers = []
    for i, layer in enumerate(model.model):
        u_layer = convert(layer)
        u_layer.i, u_layer.f = i, -1
        u_layer.type = f"models.common.{type(layer).__name__}"
        u_layer.np = sum(p.numel() for p in layer.parameters())
        layers.append(u_layer)
    root = u.DetectionModel()
    root.yaml = {"nc": model.num_classes, "depth_multiple": 0.33, "width_multiple": 0.25}
    root.model = nn.Sequential(*layers)
    root.save = [4, 6, 10, 14, 17, 20, 23]
    root.names = {i: f"class{i}" for i in range(model.num_classes)}  # v7.0: a dict
    root.stride = torch.tensor([8.0, 16.0, 32.0])
    root.inplace = True
    root.nc = model.num_classes
    root.hyp = {"lr0": 0.01, "box": 0.05}
    root.class_weights = torch.rand(model.num_classes)
    # Not in v7.0, but it must be skipped as state_dict() skips it.
    root.register_buffer("scratch", torch.ones(2), persistent=False)
    return root


def _ultralytics_checkpoint(
    model: YOLOv5, ema: YOLOv5 | None = None, *, legacy: bool = False, extra: Any = None
) -> io.BytesIO:
    with _fake_ultralytics() as u:
        ckpt = {
            "epoch": -1,
            "best_fitness": np.array([0.61]),
            "model": _as_ultralytics(model, u).half(),
            "ema": None if ema is None else _as_ultralytics(ema, u).half(),
            "updates": None,
            "optimizer": None,
            "opt": {
                "weights": "yolov5n.pt",
                "imgsz": 640,
                "save_dir": pathlib.Path("runs/train/exp"),  # PosixPath: mapped to a pure path
                "profile": u.Profile(),  # some utils.* object
                "extra": extra,
            },
            "git": {"remote": "https://github.com/ultralytics/yolov5", "commit": "915bbf2"},
            "date": "2022-11-22T12:00:00",
        }
        buf = _save(ckpt, legacy=legacy)
    assert not any(name in sys.modules for name in FAKE_MODULES)
    return buf


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_real_shaped_ultralytics_checkpoint(legacy: bool) -> None:
    model = _randomised("n", nc=7, seed=5, anchor_scale=0.9)
    buf = _ultralytics_checkpoint(model, legacy=legacy)

    ckpt = load_ultralytics_state_dict(buf, num_classes=7)

    assert (ckpt.variant, ckpt.num_classes, ckpt.source) == ("n", 7, "model")
    assert ckpt.names == [f"class{i}" for i in range(7)]
    reference = model.state_dict()
    assert set(ckpt.state_dict) == set(reference)
    for key, tensor in reference.items():
        got = ckpt.state_dict[key]
        assert got.dtype == tensor.dtype, key
        # The checkpoint was .half(): exactly the fp16 rounding of our float weights.
        expected = tensor.half().float() if tensor.is_floating_point() else tensor
        assert torch.equal(got, expected), key
    # anchors are fp16 in grid units in the file; x stride is exact.
    torch.testing.assert_close(ckpt.anchors_px, model.anchors_px, rtol=1e-3, atol=0.0)

    imported = load_into_model(ckpt)
    rounded = _randomised("n", nc=7, seed=5, anchor_scale=0.9)
    rounded.load_state_dict(
        {k: v.half().float() if v.is_floating_point() else v for k, v in reference.items()}
    )
    x = torch.rand(2, 3, 96, 64)
    got_out, float_out, rounded_out = (
        _outputs(imported, x),
        _outputs(model, x),
        _outputs(rounded, x),
    )
    for got, want_rounded, want_float in zip(got_out, rounded_out, float_out, strict=True):
        assert torch.equal(got, want_rounded)  # same weights, same arithmetic
        # fp16 weights (relative error <= 2^-11 ~ 4.9e-4 each) through ~60 convolutions: the
        # errors mostly cancel (about 2.5e-4 of the output range observed); allow 4 fp16 ulps.
        scale = want_float.abs().max()
        torch.testing.assert_close(got, want_float, rtol=0.0, atol=2e-3 * float(scale))
        assert not torch.equal(got, want_float)  # the rounding is really there


def test_real_shaped_checkpoint_prefers_ema() -> None:
    model = _randomised("n", nc=4, seed=6)
    ema = _randomised("n", nc=4, seed=7)
    ckpt = load_ultralytics_state_dict(_ultralytics_checkpoint(model, ema))
    assert ckpt.source == "ema"
    key = "model.13.m.0.cv2.conv.weight"
    assert torch.equal(ckpt.state_dict[key], ema.state_dict()[key].half().float())


def test_checkpoint_without_num_batches_tracked_is_filled() -> None:
    exported = export_ultralytics_state_dict(_randomised("n", nc=2, seed=8))
    trimmed = {k: v for k, v in exported.items() if not k.endswith("num_batches_tracked")}
    ckpt = load_ultralytics_state_dict(_save(trimmed))
    assert int(ckpt.state_dict["model.0.bn.num_batches_tracked"]) == 0
    load_into_model(ckpt)


# -------------------------------------------------------------------------- (iii) malicious pickles


class _Evil:
    """Unpickling this calls ``fn(*args)``, as a hostile checkpoint would."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.fn, self.args


def _payloads(marker: Path) -> dict[str, _Evil]:
    touch = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    return {
        "posix.system": _Evil(os.system, f"touch {marker}"),
        "builtins.eval": _Evil(builtins.eval, touch),
        "builtins.exec": _Evil(builtins.exec, touch),
        "subprocess.check_call": _Evil(subprocess.check_call, ["touch", str(marker)]),
    }


@pytest.mark.parametrize(
    "name", ["posix.system", "builtins.eval", "builtins.exec", "subprocess.check_call"]
)
@pytest.mark.parametrize("where", ["top", "beside_model", "inside_model"])
def test_malicious_globals_are_refused_unexecuted(name: str, where: str, tmp_path: Path) -> None:
    if name == "posix.system" and os.name != "posix":
        pytest.skip("os.system pickles as nt.system elsewhere")
    marker = tmp_path / "pwned"
    evil = _payloads(marker)[name]
    model = _randomised("n", nc=2, seed=9)
    if where == "top":
        buf = _save({"model": evil})
    elif where == "beside_model":
        buf = _ultralytics_checkpoint(model, extra=evil)
    else:
        with _fake_ultralytics() as u:
            obj = _as_ultralytics(model, u)
            obj.model[24].hook = evil
            buf = _save({"model": obj, "ema": None})

    with pytest.raises(CheckpointError, match=f"refusing to load global '{name}'"):
        load_ultralytics_state_dict(buf)
    assert not marker.exists()


def _legacy_file_with_pickle(payload: bytes) -> io.BytesIO:
    """A legacy-format torch file whose object pickle is ``payload`` (headers from torch.save)."""
    data = _save(0, legacy=True).getvalue()
    pickles, start = [], 0
    while start < len(data):
        end = next(pos for op, _, pos in pickletools.genops(data[start:]) if op.name == "STOP")
        assert end is not None
        pickles.append(data[start : start + end + 1])
        start += end + 1
    assert len(pickles) == 5  # magic, protocol, sys info, object, storage keys
    return io.BytesIO(b"".join([*pickles[:3], payload, pickles[4]]))


def _build_on_global(qualified: str, attribute: str) -> bytes:
    """Protocol-2 opcodes: GLOBAL qualified; BUILD (None, {attribute: 1}); STOP."""
    module, name = qualified.rsplit(".", 1)
    key = attribute.encode()
    return (
        b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n"
        b"N}X" + len(key).to_bytes(4, "little") + key + b"K\x01s\x86b."
    )


def test_legacy_splice_helper_loads_a_benign_pickle() -> None:
    # The helper itself works: a GLOBAL + REDUCE of an allowlisted type unpickles.
    payload = b"\x80\x02c__builtin__\nset\n]K\x07a\x85R."
    assert torch.load(_legacy_file_with_pickle(payload), weights_only=True) == {7}


def test_no_allowlisted_global_can_be_modified_by_build() -> None:
    for qualified, obj in _allowed_globals().items():
        before = {k: getattr(obj, k, None) for k in ("__defaults__", "forward", "dlad_injected")}
        for attribute in ("__defaults__", "forward", "dlad_injected"):
            # Refused by our unpickler (not merely by torch's weights_only pre-check).
            with pytest.raises(
                CheckpointError, match=r"cannot unpickle checkpoint|tried to modify"
            ):
                load_ultralytics_state_dict(
                    _legacy_file_with_pickle(_build_on_global(qualified, attribute))
                )
        after = {k: getattr(obj, k, None) for k in before}
        assert after == before, qualified


# -------------------------------------------------------------------------------------- (iv) errors


@pytest.fixture(scope="module")
def exported_n() -> dict[str, torch.Tensor]:
    return export_ultralytics_state_dict(_randomised("n", nc=5, seed=10))


def _error(obj: Any, **kwargs: Any) -> str:
    with pytest.raises(CheckpointError) as info:
        load_ultralytics_state_dict(_save(obj), **kwargs)
    return str(info.value)


def test_wrong_class_count(exported_n: dict[str, torch.Tensor]) -> None:
    assert "5 classes, expected 80" in _error(exported_n, num_classes=80)
    head = dict(exported_n)
    head["model.24.m.0.weight"] = torch.randn(3 * 10 + 1, 64, 1, 1)
    assert "31 output channels" in _error(head)


def test_names_inconsistent_with_head() -> None:
    model = _randomised("n", nc=3, seed=11)
    with _fake_ultralytics() as u:
        obj = _as_ultralytics(model, u)
        obj.names = ["a", "b"]
        buf = _save({"model": obj})
    with pytest.raises(CheckpointError, match="names 2 classes but its head has 3"):
        load_ultralytics_state_dict(buf)


def test_missing_and_unexpected_keys_are_listed(exported_n: dict[str, torch.Tensor]) -> None:
    broken = dict(exported_n)
    del broken["model.23.cv3.bn.weight"]
    broken["model.24.proto.cv1.conv.weight"] = torch.randn(4, 4, 1, 1)
    message = _error(broken)
    assert "missing keys (1): model.23.cv3.bn.weight" in message
    assert "unexpected keys (1): model.24.proto.cv1.conv.weight" in message


def test_shape_mismatch_names_key_and_shapes(exported_n: dict[str, torch.Tensor]) -> None:
    broken = dict(exported_n)
    broken["model.10.conv.weight"] = torch.randn(64, 256, 1, 1)
    message = _error(broken)
    assert "model.10.conv.weight: checkpoint [64, 256, 1, 1], ours [128, 256, 1, 1]" in message


def test_other_malformed_checkpoints(exported_n: dict[str, torch.Tensor]) -> None:
    assert "not a dict or a model" in _error([1, 2, 3])
    assert "'model' or 'ema'" in _error({"epoch": 3, "weights": "x"})
    nan = dict(exported_n)
    nan["model.5.bn.running_var"] = torch.full_like(nan["model.5.bn.running_var"], float("nan"))
    assert "model.5.bn.running_var holds non-finite values" in _error(nan)
    no_anchors = {k: v for k, v in exported_n.items() if k != "model.24.anchors"}
    assert "no model.24.anchors" in _error(no_anchors)
    focus = {"model.0.conv.conv.weight": torch.randn(16, 12, 3, 3)}
    assert "Focus" in _error(focus)
    deeper = dict(exported_n)
    deeper["model.2.m.1.cv1.conv.weight"] = torch.randn(16, 16, 1, 1)
    assert "stem width 16 with 2 bottleneck(s)" in _error(deeper)
    fused = _randomised("n", nc=5, seed=13).fuse().state_dict()
    assert "the model was fused" in _error(fused)
    with pytest.raises(CheckpointError, match=r"cannot (read|unpickle) checkpoint '<file object>'"):
        load_ultralytics_state_dict(io.BytesIO(b"not a torch file at all"))


# ---------------------------------------------------------------------------- (v) variant inference


def _meta_state(variant: str, nc: int = 80) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return YOLOv5(variant, nc).state_dict()


@pytest.mark.parametrize(
    ("variant", "width", "depth"),
    [("n", 16, 1), ("s", 32, 1), ("m", 48, 2), ("l", 64, 3), ("x", 80, 4)],
)
def test_variant_table(variant: str, width: int, depth: int) -> None:
    state = _meta_state(variant)
    assert state["model.0.conv.weight"].shape[0] == width
    assert _infer_variant(state) == variant


@pytest.mark.parametrize("variant", ["n", "s", "m"])
def test_variant_inferred_from_random_tensors(variant: str) -> None:
    gen = torch.Generator().manual_seed(12)
    random_state = {
        k: torch.randint(0, 9, v.shape, generator=gen)
        if not v.is_floating_point()
        else torch.rand(v.shape, generator=gen) + 0.5
        for k, v in _meta_state(variant, nc=9).items()
    }
    ckpt = load_ultralytics_state_dict(_save({"model": random_state}))
    assert (ckpt.variant, ckpt.num_classes) == (variant, 9)
    assert torch.equal(ckpt.state_dict["model.0.conv.weight"], random_state["model.0.conv.weight"])
