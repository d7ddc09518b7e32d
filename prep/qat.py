"""Quantization-aware training with NVIDIA ModelOpt, following the cuDLA YOLOv5 sample's recipe.

Recipe (docs/reference/cudla.md §1):

1. BatchNorm is folded into the convolutions *before* quantizers go in (QAT trains fused convs).
2. Q/DQ on the inputs of every Conv, of the SPPF MaxPool and of the residual Adds; weights
   per-output-channel with ``max`` calibration; activations per-tensor with a histogram
   calibrator and the MSE-optimal range.
3. Quantizers are *shared* where TensorRT needs equal scales: all tensors joined by a Concat
   (inputs and output), the MaxPool chain of SPPF, and both operands of a residual Add. The
   groups are found on a ``torch.fx`` trace of the float model, so the rule holds for any graph
   built from these modules, not for hand-listed layer names.
4. Optionally (``all_layers``) Q/DQ on every SiLU and Concat input as well (the sample's option 2).
5. The heads' outputs get quantizers too (``quantize_heads``), so the translator can give the
   graph outputs scales for INT8 ``CHW32`` heads.
6. Fine-tuning by feature distillation against the frozen float model (MSE between the quantized
   and float outputs of selected layers and of the heads), Adam, small learning rates: the
   sample's ``finetune``; a detection-loss term can be mixed in.
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import fx, nn

from prep.model import Add, Concat, YOLOv5

if TYPE_CHECKING:
    from prep.families.dfl import RawHeads

    Detector = YOLOv5 | RawHeads

ProgressFn = Callable[[int, int, dict[str, float]], None]


@dataclass(frozen=True)
class QATConfig:
    """Settings of the QAT stage (all recorded in the stage manifest)."""

    calib_batches: int = 16
    calib_method: str = "mse"  # histogram -> amax: "mse", "entropy" or "percentile"
    all_layers: bool = False
    quantize_heads: bool = True
    """Calibrate Q/DQ on the heads' outputs, so the translator gives s8/s16/s32 scales and
    INT8 ``CHW32`` heads can be built."""
    train_head_quant: bool = False
    """Keep the head-output quantizers on during fine-tuning and fake-quant evaluation. Off by
    default: the QAT model then stands for FP16 heads (the sample's deployment), and what INT8
    heads cost is measured separately (the head-precision table); they are on for export."""
    epochs: int = 2
    iters_per_epoch: int = 100
    batch_size: int = 16
    lr: float = 1e-5
    detection_loss_weight: float = 0.0
    seed: int = 0
    device: str = "auto"


# ------------------------------------------------------------------------------ quantized modules
_registered = False


def _register_quant_modules() -> None:
    """Teach ModelOpt our Add, Concat and (for ``all_layers``) SiLU modules; idempotent."""
    global _registered  # noqa: PLW0603 (ModelOpt's registry is process-global)
    if _registered:
        return
    from modelopt.torch.quantization.nn import QuantModuleRegistry, TensorQuantizer
    from modelopt.torch.quantization.nn.modules.quant_module import QuantModule
    from modelopt.torch.quantization.tensor_quant import QUANT_DESC_8BIT_PER_TENSOR

    class QuantAdd(QuantModule):  # type: ignore[misc]  # ModelOpt is untyped
        """One quantizer for both addends (their scales must be equal for an INT8 Add)."""

        def _setup(self) -> None:
            self._register_temp_attribute(
                "input_quantizer", TensorQuantizer(QUANT_DESC_8BIT_PER_TENSOR)
            )

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.input_quantizer(a) + self.input_quantizer(b)

    class QuantConcat(QuantModule):  # type: ignore[misc]  # ModelOpt is untyped
        def _setup(self) -> None:
            self._register_temp_attribute(
                "input_quantizer", TensorQuantizer(QUANT_DESC_8BIT_PER_TENSOR)
            )

        def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([self.input_quantizer(x) for x in xs], self.d)

    class QuantSiLU(QuantModule):  # type: ignore[misc]  # ModelOpt is untyped
        """SiLU with Q/DQ on its input and on the sigmoid output (the sample's option 2)."""

        def _setup(self) -> None:
            self._register_temp_attribute(
                "input_quantizer", TensorQuantizer(QUANT_DESC_8BIT_PER_TENSOR)
            )
            self._register_temp_attribute(
                "sigmoid_quantizer", TensorQuantizer(QUANT_DESC_8BIT_PER_TENSOR)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.input_quantizer(x)
            return x * self.sigmoid_quantizer(torch.sigmoid(x))

    QuantModuleRegistry.register({Add: "prep.Add"})(QuantAdd)
    QuantModuleRegistry.register({Concat: "prep.Concat"})(QuantConcat)
    QuantModuleRegistry.register({nn.SiLU: "nn.SiLU"})(QuantSiLU)
    _registered = True


def _use_torch_fake_quant() -> None:
    """Make ModelOpt use its pure-torch fake-quant kernels on CUDA too.

    On first GPU use ModelOpt JIT-compiles a CUDA extension (minutes, and it needs nvcc and
    ninja on the machine); its pure-torch path computes the same int8 fake quantization and is
    what runs on the CPU anyway. Pre-setting the cached extension to None selects that path.
    """
    from modelopt.torch.quantization import extensions

    if not hasattr(extensions.get_cuda_ext, "extension"):
        extensions.get_cuda_ext.extension = None


def quant_config(cfg: QATConfig, model: nn.Module) -> dict[str, Any]:
    """The ModelOpt quantization config of the recipe for the fused ``model`` (calibration is
    run by :func:`calibrate`)."""
    act = {"num_bits": 8, "axis": None, "calibrator": "histogram"}
    entries: list[dict[str, Any]] = [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0}},
        {"quantizer_name": "*input_quantizer", "cfg": act},
        # the layers the model's forward never runs (the DFL conv, YOLO26's other head)
        *({"quantizer_name": f"{name}.*", "enable": False} for name in _unused(model)),
    ]
    if not cfg.all_layers:
        entries += [
            {"quantizer_name": f"{name}.input_quantizer", "enable": False}
            for name, m in model.named_modules()
            if isinstance(m, Concat | nn.SiLU)
        ]
    else:
        entries.append({"quantizer_name": "*sigmoid_quantizer", "cfg": act})
    if cfg.quantize_heads:
        entries += [
            {"quantizer_name": f"{name}.output_quantizer", "cfg": act}
            for name in _head_convs(model)
        ]
    return {"quant_cfg": entries, "algorithm": None}


def _head_convs(model: nn.Module) -> list[str]:
    names: list[str] = getattr(model, "head_convs")()  # noqa: B009  (every family's model has it)
    return names


def _unused(model: nn.Module) -> list[str]:
    """Modules with parameters of their own that a forward of ``model`` does not run."""
    ran: set[str] = set()
    handles = [
        m.register_forward_pre_hook(lambda *_, n=name: ran.add(n))
        for name, m in model.named_modules()
    ]
    try:
        with torch.no_grad():
            model(torch.zeros(1, 3, 64, 64))
    finally:
        for h in handles:
            h.remove()
    return [
        name
        for name, m in model.named_modules()
        if name not in ran and any(True for _ in m.parameters(recurse=False))
    ]


# ------------------------------------------------------------------------------ sharing rules
class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # attention computes with its input's shape, which a symbolic trace cannot
        from prep.families.dla_attention import DlaAttention

        leaf = isinstance(m, Add | Concat | DlaAttention)
        return leaf or super().is_leaf_module(m, module_qualified_name)


_SPLITS = frozenset({"split", "chunk"})


def scale_groups(model: nn.Module) -> list[list[str]]:
    """Module names whose input quantizers must share one scale, found on an fx trace.

    Tensors joined by a Concat (inputs and output; a ``Concat`` module or ``torch.cat``), a
    MaxPool's input and output, the two operands of an Add, and a tensor with the parts a
    ``split`` / ``chunk`` cuts it into form groups (union-find); every module that quantizes its
    input and consumes a tensor of a group belongs to that group. Only groups of two or more are
    returned.
    """
    graph = _Tracer().trace(model)
    modules = dict(model.named_modules())
    parent: dict[fx.Node, fx.Node] = {}

    def find(n: fx.Node) -> fx.Node:
        while parent.get(n, n) is not n:
            n = parent[n]
        return n

    def union(a: fx.Node, b: fx.Node) -> None:
        ra, rb = find(a), find(b)
        if ra is not rb:
            parent[ra] = rb

    def tensor_args(node: fx.Node) -> list[fx.Node]:
        out: list[fx.Node] = []
        for arg in node.args:
            if isinstance(arg, fx.Node):
                out.append(arg)
            elif isinstance(arg, list | tuple):
                out.extend(a for a in arg if isinstance(a, fx.Node))
        return out

    for node in graph.nodes:
        ins = tensor_args(node)
        joined = (node.op == "call_function" and node.target is torch.cat) or (
            node.op == "call_method" and node.target in _SPLITS
        )
        part = (
            node.op == "call_function"
            and node.target is operator.getitem
            and ins
            and ins[0].op == "call_method"
            and ins[0].target in _SPLITS
        )
        if joined or part:
            for x in ins[:1] if part else ins:
                union(x, node)
        if node.op != "call_module":
            continue
        mod = modules[str(node.target)]
        if isinstance(mod, Concat | nn.MaxPool2d):
            for x in ins:
                union(x, node)
        elif isinstance(mod, Add):
            union(ins[0], ins[1])

    roots = {find(n) for n in parent}
    groups: dict[fx.Node, list[str]] = {}
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        mod = modules[str(node.target)]
        readers = [f"{node.target}.{n}" for n in getattr(mod, "input_readers", ())]
        if readers:  # a block traced as a leaf: its layers that read its input share a scale
            sites = [(tensor_args(node)[0], readers)]
        elif isinstance(mod, nn.Conv2d | nn.MaxPool2d | Add | Concat):
            sites = [(x, [str(node.target)]) for x in tensor_args(node) if find(x) in roots]
        else:
            continue
        for x, names in sites:
            members = groups.setdefault(find(x), [])
            members += [n for n in names if n not in members]
    return [g for g in groups.values() if len(g) > 1]


def share_quantizers(qmodel: nn.Module, groups: Iterable[Sequence[str]]) -> int:
    """Make every module of a group use the first member's input quantizer; returns #shared."""
    modules = dict(qmodel.named_modules())
    shared = 0
    for group in groups:
        # Disabled quantizers (e.g. Concat inputs outside ``all_layers``) stay out of the group.
        enabled = [n for n in group if not modules[n].input_quantizer._disabled]
        if len(enabled) < 2:
            continue
        major = modules[enabled[0]].input_quantizer
        for name in enabled[1:]:
            if modules[name].input_quantizer is not major:
                modules[name].input_quantizer = major
                shared += 1
    return shared


# ---------------------------------------------------------------------------- quantize + calibrate
def warm_up_batchnorm(model: nn.Module, batches: Iterable[torch.Tensor]) -> None:
    """Run batches in train mode without gradients so BN running stats are real.

    Needed before fusing an *untrained* model: with default running stats (mean 0, var 1) the
    fused model's activations explode, calibration collapses and QAT turns to NaN.
    """
    was_training = model.training
    model.train()
    with torch.no_grad():
        for x in batches:
            model(x)
    model.train(was_training)


def quantize(model: Detector, cfg: QATConfig) -> tuple[Detector, list[list[str]]]:
    """Put the model in its deployable form (``fuse``: BN folded, and for a DFL family the
    layers of ``prep.families.dfl.RawHeads.fuse``), insert quantizers and apply the sharing
    rules. Calibrate afterwards.

    Returns the quantized model (a deep copy; ``model`` is left as it was) and the sharing groups.
    """
    import modelopt.torch.quantization as mtq

    _register_quant_modules()
    _use_torch_fake_quant()
    fused = copy.deepcopy(model).eval().fuse()
    groups = scale_groups(fused)
    qmodel = mtq.quantize(fused, quant_config(cfg, fused))
    share_quantizers(qmodel, groups)
    return qmodel, groups


def _quantizers(model: nn.Module) -> list[Any]:
    from modelopt.torch.quantization.nn import TensorQuantizer

    return [m for m in model.modules() if isinstance(m, TensorQuantizer)]


@torch.no_grad()
def calibrate(qmodel: nn.Module, batches: Iterable[torch.Tensor], method: str = "mse") -> int:
    """Collect statistics with quantization off, then load amax (weights: max, activations:
    histogram + ``method``). Returns the number of calibrated quantizers.

    Raises:
        RuntimeError: a quantizer saw no data (e.g. an empty batch iterable).
    """
    quantizers = [q for q in _quantizers(qmodel) if not q._disabled]
    for q in quantizers:
        q.disable_quant()
        q.enable_calib()
    qmodel.eval()
    seen = 0
    device = torch.device("cpu")
    for x in batches:
        qmodel(x)
        seen += 1
        device = x.device
    if seen == 0:
        raise RuntimeError("calibration needs at least one batch")
    for q in quantizers:
        if type(q._calibrator).__name__ == "HistogramCalibrator":
            if method == "mse":
                # ModelOpt 0.47's own "mse" passes num_bits where fake_tensor_quant now takes
                # a bias, so every candidate scores 0 and it returns its first bin: compute it here.
                amax = histogram_mse_amax(q._calibrator._calib_hist, q._calibrator._calib_bin_edges)
                q.amax = torch.tensor(amax, dtype=torch.float32, device=device)
            else:
                q.load_calib_amax(method)
        else:
            q.load_calib_amax()
        q.enable_quant()
        q.disable_calib()
    return len(quantizers)


def _host_array(values: Any) -> np.ndarray:
    # The calibrator keeps its histogram as a tensor on the model's device (CUDA on a GPU run).
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=np.float64)


def histogram_mse_amax(hist: Any, bin_edges: Any, num_bits: int = 8, start_bin: int = 128) -> float:
    """The clipping range ``amax`` that minimises the expected squared error of symmetric
    ``num_bits`` quantization (round to nearest, saturate) over a histogram of ``|x|``.

    Candidates are the bin centres from ``start_bin`` on (as TensorRT's and ModelOpt's MSE
    calibrators do); the error of every bin is taken at its centre.

    Raises:
        RuntimeError: the histogram is empty (the quantizer saw no data).
    """
    if hist is None or bin_edges is None:
        raise RuntimeError("histogram calibrator saw no data")
    counts, edges = _host_array(hist), _host_array(bin_edges)
    if counts.sum() == 0.0:
        raise RuntimeError("histogram calibrator saw no data")
    # Only occupied bins contribute to the error: evaluate on those.
    centers = (edges[1:] + edges[:-1]) / 2
    occupied = counts > 0
    c_occ, n_occ = centers[occupied], counts[occupied]
    qmax = 2 ** (num_bits - 1) - 1
    # Exhaustive over the candidates, in float32 and in blocks to bound memory: ~2k x 2k
    # evaluations, tens of milliseconds per quantizer.
    cand = centers[min(start_bin, len(centers) - 1) :].astype(np.float32)
    c32, n32 = c_occ.astype(np.float32), n_occ.astype(np.float32)
    errs = np.empty(len(cand), dtype=np.float64)
    for lo in range(0, len(cand), 256):
        step = (cand[lo : lo + 256] / qmax)[:, None]
        q = np.clip(np.rint(c32[None, :] / step), -qmax, qmax) * step
        errs[lo : lo + 256] = ((q - c32[None, :]) ** 2 * n32[None, :]).sum(1, dtype=np.float64)
    best = float(cand[int(np.argmin(errs))])
    return best


@torch.no_grad()
def refresh_weight_amax(qmodel: nn.Module) -> int:
    """Set every per-channel weight quantizer's amax to the current ``max |w|`` of its channel.

    Fine-tuning moves the weights away from the values they were calibrated on, while TensorRT
    re-derives weight scales from the deployed weights as per-channel ``max|w|/127``; refreshing
    before export makes the exported Q/DQ scales exactly those (the translator checks this).
    Returns the number of quantizers updated.
    """
    n = 0
    for module in qmodel.modules():
        q = getattr(module, "weight_quantizer", None)
        weight = getattr(module, "weight", None)
        if q is None or weight is None or q._disabled:
            continue
        old = q.amax
        q.amax = weight.detach().abs().amax(dim=tuple(range(1, weight.ndim))).reshape(old.shape)
        n += 1
    return n


# ------------------------------------------------------------------------------ fine-tune
def finetune(
    qmodel: Detector,
    teacher: Detector,
    batches: Callable[[], torch.Tensor],
    cfg: QATConfig,
    *,
    detection_loss: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
    progress: ProgressFn | None = None,
) -> list[dict[str, float]]:
    """Feature-distillation QAT: MSE between quantized and float layer outputs and heads.

    ``teacher`` is the fused float model (kept frozen). Returns per-epoch mean losses.

    Raises:
        FloatingPointError: the loss became NaN or infinite (a broken calibration).
    """
    torch.manual_seed(cfg.seed)
    layers: list[int] = teacher.distill_layers()
    captured: dict[str, dict[int, torch.Tensor]] = {"s": {}, "t": {}}

    def hook(store: dict[int, torch.Tensor], idx: int) -> Callable[..., None]:
        def fn(_m: nn.Module, _i: Any, out: torch.Tensor) -> None:
            store[idx] = out

        return fn

    handles = [qmodel.model[i].register_forward_hook(hook(captured["s"], i)) for i in layers] + [
        teacher.model[i].register_forward_hook(hook(captured["t"], i)) for i in layers
    ]
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in qmodel.parameters() if p.requires_grad], lr=cfg.lr)
    history: list[dict[str, float]] = []
    total = cfg.epochs * cfg.iters_per_epoch
    step = 0
    try:
        for epoch in range(cfg.epochs):
            # The sample's schedule: a warm start, the peak in the middle, then decay.
            lr = cfg.lr * (0.1 if epoch == 0 and cfg.epochs > 2 else 1.0)
            if epoch >= max(cfg.epochs - 1, 1) and cfg.epochs > 1:
                lr = cfg.lr * 0.1
            for g in opt.param_groups:
                g["lr"] = lr
            qmodel.train()
            # BN is folded; train() only matters to the quantizers (none change behaviour).
            running = 0.0
            for _ in range(cfg.iters_per_epoch):
                x = batches()
                with torch.no_grad():
                    t_heads = teacher(x)
                s_heads = qmodel(x)
                loss = sum(
                    (nn.functional.mse_loss(captured["s"][i], captured["t"][i]) for i in layers),
                    x.new_zeros(()),
                )
                loss = loss + sum(
                    (nn.functional.mse_loss(s, t) for s, t in zip(s_heads, t_heads, strict=True)),
                    x.new_zeros(()),
                )
                if detection_loss is not None and cfg.detection_loss_weight > 0:
                    loss = loss + cfg.detection_loss_weight * detection_loss(s_heads)
                if not math.isfinite(float(loss.detach())):
                    raise FloatingPointError(
                        "QAT loss is not finite: calibration produced a broken range "
                        "(was BatchNorm warmed up before fusing an untrained model?)"
                    )
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                running += float(loss.detach())
                step += 1
                if progress is not None:
                    progress(step, total, {"epoch": epoch + 1, "distill": float(loss.detach())})
            history.append({"epoch": epoch + 1, "loss": running / cfg.iters_per_epoch, "lr": lr})
    finally:
        for h in handles:
            h.remove()
    qmodel.eval()
    return history


def batch_sampler(
    images: np.ndarray, batch_size: int, seed: int, device: str = "cpu"
) -> Callable[[], torch.Tensor]:
    """Random batches of letterboxed uint8 images as float tensors in [0, 1]."""
    rng = np.random.default_rng(seed)

    def draw() -> torch.Tensor:
        idx = np.sort(rng.choice(len(images), size=min(batch_size, len(images)), replace=False))
        t = torch.from_numpy(np.ascontiguousarray(images[idx])).to(device)
        return t.permute(0, 3, 1, 2).float().div_(255.0)

    return draw


def quantizer_summary(qmodel: nn.Module) -> dict[str, int]:
    """Counts of enabled quantizers, of activation-quantizer call sites and of distinct
    activation quantizers (fewer than the sites when sharing rules applied)."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    sites = [
        q
        for n, q in qmodel.named_modules(remove_duplicate=False)
        if isinstance(q, TensorQuantizer)
        and not q._disabled
        and n.endswith(("input_quantizer", "output_quantizer", "sigmoid_quantizer"))
    ]
    return {
        "enabled_quantizers": len([q for q in _quantizers(qmodel) if not q._disabled]),
        "activation_sites": len(sites),
        "distinct_activation_quantizers": len({id(q) for q in sites}),
    }


def set_head_output_quant(qmodel: nn.Module, enabled: bool) -> int:
    """Switch the heads' output quantizers on or off (their calibrated amax is kept)."""
    n = 0
    heads = tuple(f"{conv}.output_quantizer" for conv in _head_convs(qmodel))
    for name, module in qmodel.named_modules():
        if name in heads:
            if getattr(module, "amax", None) is None:
                continue
            if enabled:
                module.enable()
            else:
                module.disable()
            n += 1
    return n


# ------------------------------------------------------------------------------ checkpoints
QAT_FORMAT = "dlad-prep-qat/2"
_QAT_FORMATS = (QAT_FORMAT, "dlad-prep-yolov5-qat/1")


def save_qat(path: Any, qmodel: Detector, cfg: QATConfig, extra: dict[str, Any]) -> None:
    """Save a quantized model: weights, every quantizer's amax and the recipe to rebuild it.

    ModelOpt's own ``mto.save`` cannot restore shared quantizers (it sees each shared module
    under one name only), so the model is rebuilt by re-running :func:`quantize` with the same
    settings and loading this state dict over it.
    """
    from dataclasses import asdict

    torch.save(
        {
            "format": QAT_FORMAT,
            "family": qmodel.family,
            "variant": qmodel.variant,
            "num_classes": qmodel.num_classes,
            "anchors_px": qmodel.anchors_px.tolist() if isinstance(qmodel, YOLOv5) else None,
            "qat_config": asdict(cfg),
            "state_dict": qmodel.state_dict(),
            "extra": extra,
        },
        path,
    )


def load_qat(path: Any) -> tuple[Detector, dict[str, Any]]:
    """Rebuild a model saved by :func:`save_qat`; returns it (eval mode) and its ``extra``.

    Raises:
        ValueError: the file is not a prep QAT checkpoint.
    """
    from modelopt.torch.quantization.nn import TensorQuantizer

    from prep.train import rebuild_model

    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or data.get("format") not in _QAT_FORMATS:
        raise ValueError(f"{path} is not a prep QAT checkpoint")
    model: Any = rebuild_model(data).eval()
    qmodel, _ = quantize(model, QATConfig(**data["qat_config"]))
    sd = data["state_dict"]
    for name, mod in qmodel.named_modules():
        if isinstance(mod, TensorQuantizer) and f"{name}._amax" in sd:
            mod.amax = sd[f"{name}._amax"].clone()
    qmodel.load_state_dict(sd, strict=True)
    cfg = QATConfig(**data["qat_config"])
    if cfg.quantize_heads:
        set_head_output_quant(qmodel, cfg.train_head_quant)
    return qmodel.eval(), dict(data["extra"])
