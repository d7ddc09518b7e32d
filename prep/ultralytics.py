"""Import Ultralytics YOLOv5 v7.0 checkpoints into :class:`prep.model.YOLOv5`, without Ultralytics.

A real Ultralytics ``.pt`` is ``torch.save`` of a dict (``epoch``, ``best_fitness``, ``model``,
``ema``, ``updates``, ``optimizer``, ``opt``, ``git``, ``date``) whose ``model``/``ema`` entries are
*pickled module objects* (``models.yolo.DetectionModel``, usually ``.half()``). Unpickling those
normally imports the Ultralytics source (AGPL, needs torchvision), and a ``.pt`` is code: a pickle
can call any importable function. :func:`load_ultralytics_state_dict` therefore never imports
Ultralytics and never runs code from the file:

1. It first tries ``torch.load(weights_only=True)``, which loads plain state dicts
   (``{name: tensor}``, or ``{'model': {name: tensor}, ...}``) with torch's own hardened unpickler.
2. Otherwise it unpickles with a restricted unpickler. Every global the file names is looked up in
   an explicit allowlist (tensor/parameter rebuild functions, ``OrderedDict``, ``set``, the
   ``torch.nn`` module classes YOLOv5 uses, numpy array reconstruction, ...). Classes from
   Ultralytics' own packages (``models.*``, ``utils.*``, ``ultralytics.*``) become inert stand-ins
   that only record their pickled state (for an ``nn.Module``: ``_parameters``, ``_buffers``,
   ``_modules``). Anything else (``os.system``, ``builtins.eval``, ``subprocess.Popen`` ...) is
   refused with a :class:`CheckpointError` that names the global, before it is ever called.
   Allowlisted *functions* are wrapped in sealed callables so a crafted pickle cannot rewrite their
   attributes (pickle's BUILD opcode on a global), and modules recovered from the file are only
   read, never called.
3. The recovered module tree is walked exactly as ``nn.Module.state_dict()`` would (parameters,
   then persistent buffers, then children), tensors become float32, and the result is checked
   against :class:`prep.model.YOLOv5` of the inferred variant and class count.

Layer-name mapping (Ultralytics v7.0 state-dict key -> ours):

====================================================  ============================================
Ultralytics key pattern                               our key
====================================================  ============================================
``model.{i}.conv.weight`` / ``.bn.*`` (Conv, 0-24)    identical
``model.{i}.cv{1,2,3}.{conv,bn}.*`` (C3, SPPF)        identical
``model.{i}.m.{j}.cv{1,2}.{conv,bn}.*`` (Bottleneck)  identical
``model.24.m.{0,1,2}.{weight,bias}`` (Detect convs)   identical
``model.24.anchors`` (grid units, ``[3, 3, 2]``)      identical (persistent buffer, grid units)
``*.bn.num_batches_tracked``                          identical (filled with 0 where absent)
(no Ultralytics counterpart)                          ``*.addop`` (Bottleneck), ``*.concat`` (C3,
                                                      SPPF): parameter-free modules, no keys
====================================================  ============================================

The mapping is the identity by construction: ``prep.model`` builds the same module tree as
Ultralytics v7.0 (same ``nn.Sequential`` index per layer, same attribute names ``conv``/``bn``/
``cv1``/``cv2``/``cv3``/``m``, same Detect buffer), and ``state_dict`` keys are just the attribute
paths to parameters and persistent buffers. Our only extra modules, ``addop`` (residual add) and
``concat`` (channel concat, which exist so QAT can attach quantizers to their inputs), own no
parameters or buffers in float mode, so they add no keys. Anything they gain later (QAT quantizer
state) is ours-only and :func:`export_ultralytics_state_dict` drops it.
"""

from __future__ import annotations

import _compat_pickle
import functools
import os
import pickle  # noqa: TID251  restricted unpickler: the allowlist is the security boundary
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType, SimpleNamespace
from typing import IO, TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from prep.model import YOLOv5

#: Top-level packages of the Ultralytics source whose classes become inert stand-ins.
ULTRALYTICS_PACKAGES: frozenset[str] = frozenset({"models", "utils", "ultralytics"})

_STRIDES: tuple[int, int, int] = (8, 16, 32)
_MAX_DEPTH = 64  # far deeper than any YOLO module tree; a guard against crafted recursion
_MAX_LISTED = 8  # keys listed in an error message before "... and N more"

PathOrFile = str | os.PathLike[str] | IO[bytes]


class CheckpointError(ValueError):
    """The file is not a loadable YOLOv5 v7.0 checkpoint, or it names a global we refuse."""


@dataclass(frozen=True)
class ImportedCheckpoint:
    """A YOLOv5 v7.0 checkpoint, validated against :class:`prep.model.YOLOv5`.

    Attributes:
        state_dict: our (= Ultralytics') key names; floating tensors float32, fresh copies;
            ``num_batches_tracked`` int64. Loads into ``YOLOv5(variant, num_classes)`` strictly.
        num_classes: class count, from the head's output channels.
        variant: ``n s m l x``, from the stem width and the depth of layer 2.
        anchors_px: ``[3, 3, 2]`` anchors (w, h) in input pixels (``model.24.anchors`` x stride).
        source: ``'ema'`` or ``'model'`` (which checkpoint entry was used; the EMA is preferred
            when present, as Ultralytics does) or ``'state_dict'`` (the file was a bare state dict).
        names: class names when the checkpoint carries them (``DetectionModel.names``), else None.
    """

    state_dict: dict[str, torch.Tensor]
    num_classes: int
    variant: str
    anchors_px: torch.Tensor
    source: str
    names: list[str] | None


# ----------------------------------------------------------------------------- restricted unpickler


class _StandIn:
    """Inert record of an object whose class lives in Ultralytics' source.

    It runs nothing: construction keeps the arguments, ``__setstate__`` keeps the state. It is not
    callable, so a pickle cannot use an instance as a function.
    """

    qualified_name: ClassVar[str] = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> _StandIn:
        obj = super().__new__(cls)
        obj.__dict__["_pickled_args"] = (args, kwargs)
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The arguments were recorded by __new__; object.__init__ would reject them.
        pass

    def __setstate__(self, state: Any) -> None:
        is_pair = isinstance(state, tuple) and len(state) == 2
        dict_state, slot_state = state if is_pair else (state, None)
        for part in (dict_state, slot_state):
            if isinstance(part, dict) and all(isinstance(k, str) for k in part):
                self.__dict__.update(part)
            elif part is not None:
                self.__dict__.setdefault("_pickled_state", []).append(part)

    def __repr__(self) -> str:
        return f"<stand-in for {self.qualified_name}>"


class _Sealed:
    """An allowlisted callable that unpickling cannot modify.

    pickle's BUILD opcode applies state to whatever is on the stack, including a global it just
    loaded; on a plain function that could rewrite ``__defaults__`` process-wide. A sealed wrapper
    has no ``__dict__`` and refuses attribute assignment, so BUILD on it fails.
    """

    __slots__ = ("_fn", "_name")
    _fn: Callable[..., Any]
    _name: str

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_name", name)

    def __setattr__(self, key: str, value: Any) -> None:
        raise CheckpointError(f"checkpoint tried to modify {self._name} (attribute {key!r})")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<sealed {self._name}>"


#: ``torch.nn`` module classes YOLOv5-family checkpoints contain. nn.Module defines
#: ``__setstate__``, so BUILD on the class object itself fails (unbound call) rather than
#: setting class attributes.
_NN_MODULES: dict[str, tuple[str, ...]] = {
    "container": ("Sequential", "ModuleList", "ModuleDict"),
    "conv": ("Conv2d", "ConvTranspose2d"),
    "batchnorm": ("BatchNorm2d",),
    "activation": ("SiLU", "ReLU", "LeakyReLU", "Hardswish", "Sigmoid"),
    "linear": ("Identity", "Linear"),
    "pooling": ("MaxPool2d", "AdaptiveAvgPool2d"),
    "upsampling": ("Upsample",),
    "dropout": ("Dropout",),
    "flatten": ("Flatten",),
}


@functools.cache
def _allowed_globals() -> Mapping[str, Any]:
    """The allowlist (read-only): ``'module.name'`` in the pickle -> the object to use."""
    import collections
    import pathlib
    from codecs import encode

    import numpy as np
    import torch

    allowed: dict[str, Any] = {
        "collections.OrderedDict": collections.OrderedDict,
        "torch.Size": torch.Size,
        "torch.device": torch.device,
        "torch.Tensor": torch.Tensor,
        "torch.nn.parameter.Parameter": torch.nn.Parameter,
        # bytes under pickle protocol 2 are written as _codecs.encode(str, 'latin1').
        "_codecs.encode": _Sealed(encode, "_codecs.encode"),
        # numpy arrays and scalars (best_fitness in training checkpoints); numpy 1 and 2 names.
        "numpy.ndarray": np.ndarray,
        "numpy.dtype": np.dtype,
    }
    multiarray = _numpy_multiarray()
    for core in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[f"{core}._reconstruct"] = _Sealed(multiarray._reconstruct, f"{core}._reconstruct")
        allowed[f"{core}.scalar"] = _Sealed(multiarray.scalar, f"{core}.scalar")
    for builtin in (set, frozenset, slice, bytearray, complex):
        allowed[f"builtins.{builtin.__name__}"] = builtin
    # vars(), not dir()/getattr(): torch's module __getattr__ would import lazy submodules.
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            allowed[f"torch.{name}"] = value
    rebuilds = ("tensor", "tensor_v2", "tensor_v3", "parameter", "parameter_with_state")
    for fn_name in (f"_rebuild_{kind}" for kind in rebuilds):
        allowed[f"torch._utils.{fn_name}"] = _Sealed(getattr(torch._utils, fn_name), fn_name)
    allowed["torch._tensor._rebuild_from_type_v2"] = _Sealed(
        torch._tensor._rebuild_from_type_v2, "_rebuild_from_type_v2"
    )
    for submodule, class_names in _NN_MODULES.items():
        for cls_name in class_names:
            allowed[f"torch.nn.modules.{submodule}.{cls_name}"] = getattr(torch.nn, cls_name)
    # Paths in training options: kept as pure paths (no filesystem access), sealed constructors.
    for flavour, pure in (("Posix", pathlib.PurePosixPath), ("Windows", pathlib.PureWindowsPath)):
        for path_name in (f"pathlib.{flavour}Path", f"pathlib.Pure{flavour}Path"):
            allowed[path_name] = _Sealed(pure, path_name)
    # Some trainers pickle their argparse options; an inert record is all we need of them.
    allowed["argparse.Namespace"] = _stand_in_class("argparse", "Namespace")
    return MappingProxyType(allowed)


def _numpy_multiarray() -> Any:
    """numpy's multiarray module under its numpy 2 name, or its numpy 1 name."""
    import importlib

    try:
        return importlib.import_module("numpy._core.multiarray")
    except ImportError:  # numpy 1.x
        return importlib.import_module("numpy.core.multiarray")


def _stand_in_class(module: str, name: str) -> type[_StandIn]:
    """A fresh stand-in class that remembers which class the pickle named."""
    return type("StandIn", (_StandIn,), {"qualified_name": f"{module}.{name}"})


class _RestrictedUnpickler(pickle.Unpickler):
    """A pickle.Unpickler whose every global goes through the allowlist (see module docstring).

    torch.load subclasses this (to map ``torch.*Storage`` names to its storage types) and sets
    ``persistent_load`` on the instance to read tensor storages, so both keep working.
    """

    def __init__(self, file: IO[bytes], **kwargs: Any) -> None:
        super().__init__(file, **kwargs)
        self._allowed = _allowed_globals()
        self._stand_ins: dict[str, type[_StandIn]] = {}

    def find_class(self, module: str, name: str) -> Any:
        # Protocol 2 (torch.save's default) writes Python 2 names (``__builtin__.set``); map them
        # back as pickle's own find_class does, so the allowlist and messages use Python 3 names.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        qualified = f"{module}.{name}"
        if qualified in self._allowed:
            return self._allowed[qualified]
        if module.split(".", 1)[0] in ULTRALYTICS_PACKAGES:
            if qualified not in self._stand_ins:
                self._stand_ins[qualified] = _stand_in_class(module, name)
            return self._stand_ins[qualified]
        raise CheckpointError(
            f"refusing to load global {qualified!r} from the checkpoint: it is neither a tensor/"
            "container type on the allowlist nor a class from the Ultralytics source "
            f"({', '.join(sorted(ULTRALYTICS_PACKAGES))}). A .pt file can run code; this one "
            "is not a plain YOLOv5 checkpoint"
        )


def _restricted_load(file: IO[bytes], **kwargs: Any) -> Any:
    return _RestrictedUnpickler(file, **kwargs).load()


#: What torch.load needs of a ``pickle_module``: ``Unpickler``, ``load`` (legacy format headers)
#: and a ``__name__`` (it checks for dill).
_RESTRICTED_PICKLE = SimpleNamespace(
    __name__="prep.ultralytics.restricted_pickle",
    Unpickler=_RestrictedUnpickler,
    load=_restricted_load,
)


def _torch_load(path_or_file: PathOrFile) -> Any:
    """torch.load with weights_only first, then with the restricted unpickler."""
    import torch

    is_file = not isinstance(path_or_file, str | os.PathLike)
    where = repr(getattr(path_or_file, "name", "<file object>") if is_file else str(path_or_file))
    try:
        start = path_or_file.tell() if is_file else 0  # type: ignore[union-attr]
    except (OSError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint file object must be seekable: {exc}") from exc
    try:
        return torch.load(path_or_file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        pass  # module objects (or other globals torch does not allow): try our allowlist
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint {where}: {exc}") from exc
    if is_file:
        path_or_file.seek(start)  # type: ignore[union-attr]
    try:
        return torch.load(
            path_or_file, map_location="cpu", weights_only=False, pickle_module=_RESTRICTED_PICKLE
        )
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot unpickle checkpoint {where}: {exc}") from exc


# ------------------------------------------------------------------------------ module tree walking


def _is_module_like(obj: Any) -> bool:
    import torch

    return isinstance(obj, _StandIn | torch.nn.Module)


def _flatten_module(root: Any) -> dict[str, Any]:
    """Parameters and persistent buffers of a recovered module tree, named as state_dict names them.

    Reads the pickled ``__dict__`` only (``_parameters``, ``_buffers``,
    ``_non_persistent_buffers_set``, ``_modules``); nothing from the file is called.
    """
    out: dict[str, Any] = {}

    def mapping(state: dict[str, Any], attr: str, where: str) -> Mapping[str, Any]:
        value = state.get(attr, {})
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise CheckpointError(f"module {where or '<root>'}: {attr} is not a name mapping")
        return value

    def walk(module: Any, prefix: str, ancestors: tuple[int, ...]) -> None:
        where = prefix.rstrip(".")
        if id(module) in ancestors or len(ancestors) > _MAX_DEPTH:
            raise CheckpointError(f"module tree is cyclic or too deep at {where!r}")
        state = vars(module)
        non_persistent = state.get("_non_persistent_buffers_set", set())
        if not isinstance(non_persistent, set | frozenset):
            raise CheckpointError(f"module {where or '<root>'}: bad _non_persistent_buffers_set")
        for name, tensor in mapping(state, "_parameters", where).items():
            if tensor is not None:
                out[prefix + name] = tensor
        for name, tensor in mapping(state, "_buffers", where).items():
            if tensor is not None and name not in non_persistent:
                out[prefix + name] = tensor
        for name, child in mapping(state, "_modules", where).items():
            if child is None:
                continue
            if not _is_module_like(child):
                raise CheckpointError(f"{prefix + name} is a {type(child).__name__}, not a module")
            walk(child, f"{prefix}{name}.", (*ancestors, id(module)))

    walk(root, "", ())
    return out


def _select(obj: Any) -> tuple[dict[str, Any], str, Any]:
    """(raw state dict, source, the module object or None) of what torch.load returned."""
    import torch

    def is_state_dict(value: Any) -> bool:
        return (
            isinstance(value, Mapping)
            and len(value) > 0
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
        )

    if is_state_dict(obj):
        return dict(obj), "state_dict", None
    if _is_module_like(obj):
        return _flatten_module(obj), "model", obj
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"checkpoint holds a {type(obj).__name__}, not a dict or a model")
    for source in ("ema", "model"):  # the EMA first, as Ultralytics' attempt_load does
        entry = obj.get(source)
        if entry is None:
            continue
        if is_state_dict(entry):
            return dict(entry), source, None
        if _is_module_like(entry):
            return _flatten_module(entry), source, entry
        raise CheckpointError(
            f"checkpoint entry {source!r} is a {type(entry).__name__}, not a model or state dict"
        )
    raise CheckpointError(
        "checkpoint is neither a state dict nor a dict with a 'model' or 'ema' entry "
        f"(keys: {_listed(sorted(map(str, obj)))})"
    )


# --------------------------------------------------------------------------------------- validation


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_LISTED])
    more = len(keys) - _MAX_LISTED
    return f"{shown}, ... and {more} more" if more > 0 else shown


def _variant_table() -> dict[tuple[int, int], str]:
    """(stem out-channels, bottlenecks in layer 2) -> variant, from prep.model's own rules."""
    from prep.model import VARIANTS, _channels, _repeats

    return {(_channels(64, v.width), _repeats(3, v.depth)): v.name for v in VARIANTS.values()}


def _infer_variant(raw: Mapping[str, Any]) -> str:
    import torch

    stem = raw.get("model.0.conv.weight")
    if not isinstance(stem, torch.Tensor) or stem.dim() != 4:
        hint = (
            " (a Focus stem: YOLOv5 before v6.0 is not supported)"
            if "model.0.conv.conv.weight" in raw
            else ""
        )
        raise CheckpointError(f"no 4-d model.0.conv.weight: not a YOLOv5 v7.0 detector{hint}")
    width = int(stem.shape[0])
    depth = len({k.split(".")[3] for k in raw if k.startswith("model.2.m.")})
    table = _variant_table()
    if (width, depth) not in table:
        known = ", ".join(f"{v}: stem {w}, {d} bottleneck(s)" for (w, d), v in table.items())
        raise CheckpointError(
            f"stem width {width} with {depth} bottleneck(s) in model.2 is no YOLOv5 variant "
            f"({known})"
        )
    return table[(width, depth)]


def _anchors_and_classes(raw: Mapping[str, Any]) -> tuple[torch.Tensor, int]:
    import torch

    grid = raw.get("model.24.anchors")
    if not isinstance(grid, torch.Tensor):
        raise CheckpointError(
            "no model.24.anchors buffer: not a P3-P5 YOLOv5 v7.0 detector (P6 models, "
            "segmentation and anchor-free heads are not supported)"
        )
    if grid.dim() != 3 or grid.shape[0] != len(_STRIDES) or grid.shape[2] != 2:
        raise CheckpointError(f"model.24.anchors has shape {list(grid.shape)}, expected [3, na, 2]")
    grid = grid.detach().to(torch.float32)
    if not bool(torch.isfinite(grid).all()) or not bool((grid > 0).all()):
        raise CheckpointError("model.24.anchors holds non-positive or non-finite values")
    anchors_px = grid * torch.tensor(_STRIDES, dtype=torch.float32).view(-1, 1, 1)
    head = raw.get("model.24.m.0.weight")
    if not isinstance(head, torch.Tensor) or head.dim() != 4:
        raise CheckpointError("no 4-d model.24.m.0.weight: the Detect head is missing")
    na = int(grid.shape[1])
    per_anchor, rest = divmod(int(head.shape[0]), na)
    if rest or per_anchor < 6:
        raise CheckpointError(
            f"model.24.m.0.weight has {head.shape[0]} output channels, not {na} anchors x "
            "(5 + classes) with at least one class"
        )
    return anchors_px, per_anchor - 5


@functools.lru_cache(maxsize=16)
def _reference_state(
    variant: str, num_classes: int, num_anchors: int
) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]]:
    """Key -> (shape, dtype) of our model, read-only. Shapes depend on the anchor count, not the
    values, so this is cached; the model is built on the meta device (no memory, no init)."""
    import torch

    from prep.model import YOLOv5

    placeholder = [[(1.0, 1.0)] * num_anchors] * len(_STRIDES)
    with torch.device("meta"):
        reference = YOLOv5(variant, num_classes, anchors=placeholder)
    return MappingProxyType(
        {k: (tuple(v.shape), v.dtype) for k, v in reference.state_dict().items()}
    )


def conform_state(
    raw: Mapping[str, Any],
    reference: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    what: str = "YOLOv5 v7.0",
) -> dict[str, torch.Tensor]:
    """Fresh float32 (int64 for counters) copies of ``raw``, checked key by key against ours
    (``reference``: key → shape and dtype of the ``what`` model). Raises CheckpointError naming
    missing or unexpected keys, a shape or dtype mismatch, or non-finite weights."""
    import torch

    got = set(raw)
    missing = sorted(k for k in set(reference) - got if not k.endswith(".num_batches_tracked"))
    unexpected = sorted(got - set(reference))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys ({len(missing)}): {_listed(missing)}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {_listed(unexpected)}")
        if any(k.endswith(".conv.bias") for k in unexpected):
            parts.append(
                "convolution biases without BatchNorm: the model was fused; save it unfused"
            )
        raise CheckpointError(f"state dict does not match {what}: " + "; ".join(parts))
    out: dict[str, torch.Tensor] = {}
    for key, (shape, dtype) in reference.items():
        if key not in raw:  # a num_batches_tracked the checkpoint did not keep
            out[key] = torch.zeros(shape, dtype=dtype)
            continue
        tensor = raw[key]
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise CheckpointError(f"{key} is a {type(tensor).__name__}, not a dense tensor")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"shape mismatch for {key}: checkpoint {list(tensor.shape)}, ours {list(shape)}"
            )
        if dtype.is_floating_point:
            if not tensor.dtype.is_floating_point:
                raise CheckpointError(f"{key} has dtype {tensor.dtype}, expected floating point")
            if not bool(torch.isfinite(tensor).all()):
                raise CheckpointError(f"{key} holds non-finite values")
        elif tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            raise CheckpointError(f"{key} has dtype {tensor.dtype}, expected an integer counter")
        # detach + copy: no autograd state or pickled hooks survive, no storage shared with the file
        out[key] = tensor.detach().to(dtype=dtype, copy=True).contiguous()
    return out


def checkpoint_names(module: Any, num_classes: int) -> list[str] | None:
    """DetectionModel.names (a list, or an {index: name} dict since v7.0) as a list, or None."""
    if module is None:
        return None
    names = vars(module).get("names")
    if names is None:
        return None
    if isinstance(names, Mapping):
        if set(names) != set(range(len(names))):
            raise CheckpointError("class names dict is not indexed 0..n-1")
        names = [names[i] for i in range(len(names))]
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"class names are a {type(names).__name__}, not strings")
    if len(names) != num_classes:
        raise CheckpointError(
            f"checkpoint names {len(names)} classes but its head has {num_classes}"
        )
    return list(names)


# --------------------------------------------------------------------------------------- public API


def read_checkpoint(path_or_file: PathOrFile) -> tuple[dict[str, Any], str, Any]:
    """The raw state dict of a checkpoint (names as ``state_dict`` gives them, tensors as
    stored), which entry it came from (``ema``, ``model`` or ``state_dict``) and the recovered
    module record (its pickled attributes, read-only; None for a bare state dict). Read as the
    module docstring says: nothing in the file runs. Raises CheckpointError."""
    return _select(_torch_load(path_or_file))


def load_ultralytics_state_dict(
    path_or_file: PathOrFile, *, num_classes: int | None = None
) -> ImportedCheckpoint:
    """Read a YOLOv5 v7.0 checkpoint (Ultralytics ``.pt`` or a state dict) without Ultralytics.

    Accepts a path or a seekable binary file holding, as written by ``torch.save``: a bare state
    dict; a dict whose ``'ema'``/``'model'`` entry is a state dict; or a real Ultralytics checkpoint
    with pickled module objects (see the module docstring for how those are unpickled safely).

    Args:
        path_or_file: the checkpoint.
        num_classes: if given, the class count the caller expects; a different one is an error.

    Returns:
        The validated checkpoint; its ``state_dict`` loads strictly into
        ``YOLOv5(variant, num_classes, anchors=anchors_px)`` (see :func:`load_into_model`).

    Raises:
        CheckpointError: unreadable file; a global outside the allowlist (named in the message);
            not a P3-P5 YOLOv5 v7.0 detector; unknown width/depth combination; missing or
            unexpected keys (listed); a shape mismatch (key and both shapes); non-finite weights;
            class names or ``num_classes`` inconsistent with the head.
    """
    import torch

    raw, source, module = _select(_torch_load(path_or_file))
    variant = _infer_variant(raw)
    anchors_px, nc = _anchors_and_classes(raw)
    if num_classes is not None and num_classes != nc:
        raise CheckpointError(f"checkpoint has {nc} classes, expected {num_classes}")
    stride = None if module is None else vars(module).get("stride")
    if isinstance(stride, torch.Tensor) and stride.tolist() != list(_STRIDES):
        raise CheckpointError(f"model strides are {stride.tolist()}, ours are {list(_STRIDES)}")
    names = checkpoint_names(module, nc)
    state = conform_state(raw, _reference_state(variant, nc, int(anchors_px.shape[1])))
    return ImportedCheckpoint(
        state_dict=state,
        num_classes=nc,
        variant=variant,
        anchors_px=anchors_px,
        source=source,
        names=names,
    )


def load_into_model(ckpt: ImportedCheckpoint) -> YOLOv5:
    """Our detector with the checkpoint's variant, class count, anchors and weights, in eval mode.

    Raises:
        RuntimeError: from ``load_state_dict(strict=True)`` if ``ckpt`` was not made by
            :func:`load_ultralytics_state_dict` and does not match.
    """
    from prep.model import YOLOv5

    model = YOLOv5(ckpt.variant, ckpt.num_classes, anchors=ckpt.anchors_px.tolist())
    model.load_state_dict(ckpt.state_dict, strict=True)
    return model.eval()


def export_ultralytics_state_dict(model: YOLOv5) -> dict[str, torch.Tensor]:
    """Our model's weights under Ultralytics v7.0 names (detached copies, dtype kept).

    The mapping is the identity (module docstring); keys that exist only on our side, such as QAT
    quantizer state on ``addop``/``concat``/convolutions, are dropped. The result loads into an
    Ultralytics ``DetectionModel`` of the same size and into :func:`load_ultralytics_state_dict`.

    Raises:
        ValueError: the model no longer has the Ultralytics layout (e.g. after :meth:`YOLOv5.fuse`
            folded the BatchNorms away).
    """
    reference = _reference_state(model.variant, model.num_classes, model.detect.na)
    ours = model.state_dict()
    missing = sorted(set(reference) - set(ours))
    if missing:
        raise ValueError(
            f"model has no Ultralytics layout (fused or modified?); missing: {_listed(missing)}"
        )
    return {key: ours[key].detach().clone() for key in reference}
