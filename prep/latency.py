"""Per-layer latency model of one Orin DLA core running a PTQ ONNX graph (no Q/DQ, static shapes).

An estimate, not a measurement. ``prep.latency_graph`` decides what the DLA compiler would make of
the graph (fused SiLU/residual Add, in-place Concat, INT8<->FP16 ``Reformat`` steps); this module
prices each hardware step with the constants of :class:`DlaParams`, every one with its source or
reasoning in ``docs/latency.md``. Six are fitted to published totals (YOLOv5s 672x672,
:data:`CALIBRATION_US`, and three of NVIDIA's published DLA networks: ``bench/dla_published.py
--fit``); three more published networks check them.

* **Compute.** A conv's MACs are counted with its channels padded to the MAC array's atoms
  (grouped convs per pack of groups sharing an atom, depthwise convs with the channels as the
  atom), at the INT8 or the ~15x slower FP16 rate, times an efficiency that rises with the
  array passes each output takes; its SDP stage writes the output at its ALU rate, or its lookup
  table's for a Sigmoid, Tanh or SiLU, and the slower of the two wins. Stand-alone SDP, pooling
  and resize steps run at their engines' element rates.
* **Memory.** Activations live in CHW32 (int8) / CHW16 (fp16) surfaces. A buffer stays in the
  1 MiB SRAM when it fits beside every other on-chip buffer alive over its producer->last
  consumer span (greedy, shortest spans first); otherwise it goes to DRAM. Graph I/O and weights
  are in DRAM. SRAM and DRAM are separate ports: a step's memory time is the slower of the two.
* **Time of a step** = ``layer_overhead_us + max(compute, memory)``. Batch items run one after
  another, so time, MACs and bytes scale linearly with the batch (as the published 3.82 / 7.68 /
  15.17 ms at batch 1 / 2 / 4 do).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from prep.latency_graph import (
    SUPPORTED_OPS,
    LatencyModelError,
    LatencyPlan,
    Precision,
    Step,
    UnsupportedOpError,
    plan_graph,
)

if TYPE_CHECKING:
    import onnx

__all__ = [
    "CALIBRATION_US",
    "FIT_RANGES",
    "ORIN_DLA",
    "SUPPORTED_OPS",
    "Bound",
    "DlaParams",
    "LatencyEstimate",
    "LatencyModelError",
    "LatencyPlan",
    "LayerCost",
    "Precision",
    "UnsupportedOpError",
    "estimate",
    "estimate_plan",
    "fit_params",
    "plan_graph",
]

Bound = Literal["compute", "memory", "overhead", "fused", "in-place"]


@dataclass(frozen=True)
class DlaParams:
    """Every assumption of the model; ``docs/latency.md`` gives the source of each."""

    clock_hz: float = 1.331e9
    """DLA clock of the published YOLOv5 runs (DRIVE Orin / AGX Orin, 1331 MHz)."""
    int8_macs_per_cycle: float = 8192.0
    """Dense INT8 MACs per cycle: 2 DLAs x 8192 x 2 ops x 1.6 GHz (MAXN) x 2 (sparse) = 105 TOPS."""
    fp16_macs_per_cycle: float = 8192.0 / 15.0
    """Dense FP16 MACs per cycle: the seed article gives INT8 ~15x FP16 dense on Orin's DLA."""
    int8_atom_c: int = 64
    """Input channels consumed per MAC-array pass in INT8; C is padded up to a multiple."""
    int8_atom_k: int = 32
    """Output channels (kernels) per pass in INT8; K is padded up to a multiple."""
    fp16_atom_c: int = 32
    """Input-channel atom in FP16 (same 64-byte atom, 2-byte elements)."""
    fp16_atom_k: int = 16
    """Output-channel atom in FP16."""
    image_channels: int = 4
    """Convs reading <= this many channels use channel extension (kernel x C packed into atoms)."""
    int8_conv_efficiency: float = 0.966
    """Ceiling of the achieved fraction of the padded INT8 MAC rate (:meth:`conv_efficiency`):
    fitted with the three below to YOLOv5s, ResNet-34, ResNet-50 and SSD-MobileNetV1."""
    fp16_conv_efficiency: float = 0.5023
    """The same ceiling in FP16: fitted to YOLOv5s with FP16 heads (:func:`fit_params`)."""
    conv_reduction_knee: float = 1.9
    """r0 of the conv efficiency's factor ``R / (R + r0)`` (R: array passes an output): fitted."""
    lut_elems_per_cycle: float = 11.9784
    """Elements per cycle of the SDP's lookup table (Sigmoid, Tanh, a fused SiLU): fitted."""
    sdp_elems_per_cycle: float = 16.0
    """Elements per cycle of the SDP's ALUs (ReLU, clip, element-wise, reformat; fused outputs)."""
    pdp_elems_per_cycle: float = 8.0
    """Elements per cycle of a stand-alone pooling pass (max of input and output elements)."""
    resize_elems_per_cycle: float = 16.0
    """Output elements per cycle of a nearest-neighbour Resize (a data-movement pass)."""
    surface_atom_bytes: int = 32
    """Channel packing of DLA surfaces: 32 int8 (CHW32) or 16 fp16 (CHW16) channels per atom."""
    sram_bytes: int = 1 << 20
    """On-chip SRAM per DLA available to intermediate tensors (1 MiB on Orin)."""
    sram_bytes_per_cycle: float = 128.0
    """SRAM read+write bandwidth per DLA cycle."""
    dram_bytes_per_s: float = 0.3 * 204.8e9
    """One DLA's achievable share of Orin AGX's 204.8 GB/s LPDDR5 (others: GPU, CPU, DLA1)."""
    layer_overhead_us: float = 5.45
    """Fixed cost of every hardware layer (programming it, pipeline fill and drain): fitted."""

    def macs_per_cycle(self, precision: Precision) -> float:
        return self.int8_macs_per_cycle if precision == "int8" else self.fp16_macs_per_cycle

    def conv_efficiency(self, precision: Precision, reduction: float = math.inf) -> float:
        """Achieved fraction of the padded MAC rate of a conv whose every output takes
        ``reduction`` passes of the MAC array (input-channel atoms x kernel taps): the
        precision's ceiling x ``R / (R + r0)``, r0 = ``conv_reduction_knee``. It rises with R
        towards the ceiling (a 1x1 conv over one channel atom, R = 1, gets 1 / (1 + r0) of it)."""
        ceiling = self.int8_conv_efficiency if precision == "int8" else self.fp16_conv_efficiency
        if math.isinf(reduction):
            return ceiling
        return ceiling * reduction / (reduction + self.conv_reduction_knee)

    def atoms(self, precision: Precision) -> tuple[int, int]:
        if precision == "int8":
            return self.int8_atom_c, self.int8_atom_k
        return self.fp16_atom_c, self.fp16_atom_k


ORIN_DLA = DlaParams()

#: The published times the two efficiencies are fitted to: YOLOv5s 672x672 on one DLA at 1.33 GHz,
#: DLA 3.14, INT8 ``DLA_HWC4`` input (seed article table 1: 410 FPS with INT8 ``CHW32`` heads,
#: 255 FPS with FP16 ``CHW16`` heads; cuDLA-samples' trtexec median for the latter: 3.82 ms).
CALIBRATION_US: dict[str, float] = {"int8_heads": 1e6 / 410, "fp16_heads": 1e6 / 255}


@dataclass(frozen=True)
class LayerCost:
    """One ONNX node (or an inserted ``Reformat``) with its modelled cost for the whole batch.

    ``time_us = overhead_us + max(compute_us, memory_us)``; ``bound`` names the largest of the
    three, or is ``"fused"`` (zero cost, counted in ``fused_into``'s row) or ``"in-place"`` (a
    Concat its producers write into). ``bytes_in``/``bytes_out`` are activation bytes in the DLA's
    surface layout (channels padded to 32 int8 / 16 fp16), wherever they live; ``dram_bytes`` is
    the part of them, plus the weights, that goes over DRAM (the rest stays in SRAM).
    """

    name: str
    op: str
    precision: Precision
    macs: int
    bytes_in: int
    bytes_out: int
    weight_bytes: int
    compute_us: float
    memory_us: float
    overhead_us: float
    time_us: float
    bound: Bound
    fused_into: str | None = None
    dram_bytes: int = 0


@dataclass(frozen=True)
class LatencyEstimate:
    """Modelled DLA time of one task of ``batch`` images; ``layers`` in execution order."""

    total_us: float
    layers: list[LayerCost]
    batch: int
    params: DlaParams

    @property
    def total_ms(self) -> float:
        return self.total_us / 1000.0

    def by_op(self) -> dict[str, dict[str, float]]:
        """Per op type: ``count``, ``macs``, ``time_us`` and ``share`` of the total, by time."""
        out: dict[str, dict[str, float]] = {}
        for layer in self.layers:
            row = out.setdefault(layer.op, {"count": 0, "macs": 0, "time_us": 0.0, "share": 0.0})
            row["count"] += 1
            row["macs"] += layer.macs
            row["time_us"] += layer.time_us
        for row in out.values():
            row["share"] = row["time_us"] / self.total_us if self.total_us > 0 else 0.0
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["time_us"]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_us": self.total_us,
            "batch": self.batch,
            "params": asdict(self.params),
            "by_op": self.by_op(),
            "layers": [asdict(layer) for layer in self.layers],
        }


# ------------------------------------------------------------------------------------- the cost
def _ceil(a: int, b: int) -> int:
    return -(-a // b) * b


def _padded_macs(step: Step, p: DlaParams) -> tuple[int, int]:
    """MACs the array spends once channels are padded up to its atoms, and the passes
    (channel atoms x kernel taps) each output takes."""
    hw, k, cin_g, kh, kw, group, cin = step.geometry
    atom_c, atom_k = p.atoms(step.precision)
    k_g = k // group
    if cin <= p.image_channels and group == 1:
        # Channel extension: kernel taps x 4 channels are packed together into atoms of C.
        reduction = _ceil(kh * kw * p.image_channels, atom_c)
        return hw * _ceil(k, atom_k) * reduction, reduction // atom_c
    if group > 1 and cin_g == 1:
        # Depthwise: channels are the atom. Each channel is its own kernel, so the array takes
        # an atom of channels (and their k_g kernels each) per pass, reducing over taps only.
        return hw * _ceil(cin, atom_c) * k_g * kh * kw, kh * kw
    if group > 1 and cin_g < atom_c:
        # Grouped, narrow groups: as many groups as fit share one channel atom (block-diagonal
        # weights: each kernel reads its own group's channels), their kernels padded together.
        pack = min(group, atom_c // cin_g)
        packs = -(-group // pack)
        return hw * packs * atom_c * _ceil(pack * k_g, atom_k) * kh * kw, kh * kw
    # Dense, or groups of at least one atom: every group padded to whole atoms.
    reduction = _ceil(cin_g, atom_c) // atom_c * kh * kw
    return hw * group * _ceil(k_g, atom_k) * reduction * atom_c, reduction


def _place(plan: LatencyPlan, steps: Sequence[Step], p: DlaParams) -> dict[str, bool]:
    """Buffer root -> kept in SRAM. Greedy over buffers, shortest producer->consumer span first."""
    span: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    dram: set[str] = set()
    for idx, step in enumerate(steps):
        for t in [*step.reads, *([step.write] if step.write else [])]:
            root = plan.buffer_of.get(t, t)
            lo_hi = span.setdefault(root, [idx, idx])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], idx), max(lo_hi[1], idx)
            size[root] = max(size.get(root, 0), plan.tensors[t].bytes(p.surface_atom_bytes))
            if plan.tensors[t].graph_io:
                dram.add(root)
    usage = [0] * len(steps)
    on_chip: dict[str, bool] = {}
    for root in sorted(span, key=lambda r: (span[r][1] - span[r][0], span[r][0])):
        lo, hi = span[root]
        fits = root not in dram and all(
            usage[s] + size[root] <= p.sram_bytes for s in range(lo, hi + 1)
        )
        on_chip[root] = fits
        if fits:
            for s in range(lo, hi + 1):
                usage[s] += size[root]
    return on_chip


class _StepCost(NamedTuple):
    compute_us: float
    memory_us: float
    bytes_in: int
    bytes_out: int
    dram_bytes: int


def _sdp_rate(step: Step, p: DlaParams) -> float:
    return p.lut_elems_per_cycle if step.lut else p.sdp_elems_per_cycle


def _cost(step: Step, plan: LatencyPlan, p: DlaParams, on_chip: Mapping[str, bool]) -> _StepCost:
    """Cost of one step for one batch item."""
    t = plan.tensors
    dram = sram = 0
    bytes_in = 0
    for name in step.reads:
        b = t[name].bytes(p.surface_atom_bytes)
        bytes_in += b
        if on_chip[plan.buffer_of.get(name, name)]:
            sram += b
        else:
            dram += b
    bytes_out = t[step.write].bytes(p.surface_atom_bytes) if step.write else 0
    if step.write and on_chip[plan.buffer_of.get(step.write, step.write)]:
        sram += bytes_out
    else:
        dram += bytes_out
    dram += step.weight_bytes
    memory_s = max(dram / p.dram_bytes_per_s, sram / (p.sram_bytes_per_cycle * p.clock_hz))
    out_elems = t[step.write].padded_elems(p.surface_atom_bytes) if step.write else 0
    in_elems = max((t[r].padded_elems(p.surface_atom_bytes) for r in step.reads), default=0)
    if step.engine == "conv":
        padded, reduction = _padded_macs(step, p)
        mac_cycles = padded / (
            p.macs_per_cycle(step.precision) * p.conv_efficiency(step.precision, reduction)
        )
        sdp_elems = (
            t[step.sdp_tensor].padded_elems(p.surface_atom_bytes) if step.sdp_tensor else out_elems
        )
        cycles = max(mac_cycles, sdp_elems / _sdp_rate(step, p))
    elif step.engine == "sdp":
        cycles = step.passes * max(in_elems, out_elems) / _sdp_rate(step, p)
    elif step.engine == "pdp":
        cycles = max(in_elems, out_elems) / p.pdp_elems_per_cycle
    elif step.engine == "resize":
        cycles = out_elems / p.resize_elems_per_cycle
    else:  # a Concat copying inputs it could not take in place: pure data movement
        cycles = 0.0
    return _StepCost(cycles / p.clock_hz * 1e6, memory_s * 1e6, bytes_in, bytes_out, dram)


def _steps(plan: LatencyPlan) -> list[Step]:
    return [row.step for row in plan.rows if row.step is not None]


def estimate_plan(
    plan: LatencyPlan, *, batch: int = 1, params: DlaParams = ORIN_DLA
) -> LatencyEstimate:
    """Cost an analysed graph; see :func:`estimate`.

    Raises:
        LatencyModelError: ``batch`` < 1, or ``params.surface_atom_bytes`` differs from the
            value ``plan`` was analysed with.
    """
    if batch < 1:
        raise LatencyModelError(f"batch must be >= 1, got {batch}")
    if params.surface_atom_bytes != plan.surface_atom_bytes:
        raise LatencyModelError(
            f"plan analysed with surface_atom_bytes={plan.surface_atom_bytes}, params have "
            f"{params.surface_atom_bytes}: re-run plan_graph with the same value"
        )
    n = plan.items * batch
    on_chip = _place(plan, _steps(plan), params)
    layers: list[LayerCost] = []
    for row in plan.rows:
        step = row.step
        if step is None:
            layers.append(
                LayerCost(row.name, row.op, row.precision, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0,
                          "in-place" if row.in_place else "fused", row.fused_into)
            )  # fmt: skip
            continue
        compute, memory, b_in, b_out, dram = _cost(step, plan, params, on_chip)
        overhead = params.layer_overhead_us
        busy = max(compute, memory)
        bound: Bound = (
            "overhead" if overhead >= busy else "compute" if compute >= memory else "memory"
        )
        layers.append(
            LayerCost(
                name=row.name,
                op=row.op,
                precision=row.precision,
                macs=step.macs * n,
                bytes_in=b_in * n,
                bytes_out=b_out * n,
                weight_bytes=step.weight_bytes * n,
                compute_us=compute * n,
                memory_us=memory * n,
                overhead_us=overhead * n,
                time_us=(overhead + busy) * n,
                bound=bound,
                dram_bytes=dram * n,
            )
        )
    total = math.fsum(layer.time_us for layer in layers)
    return LatencyEstimate(total_us=total, layers=layers, batch=n, params=params)


def estimate(
    model: onnx.ModelProto | str | Path,
    *,
    fp16_nodes: Iterable[str] = (),
    heads: Precision = "fp16",
    head_nodes: Sequence[str] | None = None,
    batch: int = 1,
    params: DlaParams = ORIN_DLA,
) -> LatencyEstimate:
    """Modelled time of ``model`` on one DLA core, per layer and in total.

    ``fp16_nodes`` run in FP16 (e.g. the translator's ``fp16_nodes``), every other node in INT8;
    ``heads`` sets the precision of ``head_nodes`` (default: the producers of the graph outputs),
    overriding ``fp16_nodes`` for them, and so the output format: ``"fp16"`` writes FP16 ``CHW16``,
    ``"int8"`` INT8 ``CHW32``. The input is INT8 ``DLA_HWC4``. ``batch`` multiplies the graph's own
    batch dimension (items run one after another).

    Raises:
        UnsupportedOpError: the graph holds an op outside :data:`SUPPORTED_OPS`.
        LatencyModelError: unknown node names, dynamic shapes, an unreadable file, ``batch`` < 1.
    """
    plan = plan_graph(
        model,
        fp16_nodes=fp16_nodes,
        heads=heads,
        head_nodes=head_nodes,
        surface_atom_bytes=params.surface_atom_bytes,
    )
    return estimate_plan(plan, batch=batch, params=params)


#: The fields :func:`fit_params` can fit, each with its search range; time falls as each rises.
FIT_RANGES: dict[str, tuple[float, float]] = {
    "int8_conv_efficiency": (1e-3, 1.0),
    "fp16_conv_efficiency": (1e-3, 1.0),
    "lut_elems_per_cycle": (0.5, 256.0),
    "sdp_elems_per_cycle": (0.5, 256.0),
}


def fit_params(
    cases: Sequence[tuple[LatencyPlan, float]],
    base: DlaParams = ORIN_DLA,
    fields: tuple[str, str] = ("lut_elems_per_cycle", "fp16_conv_efficiency"),
) -> DlaParams:
    """Fit two constants so two analysed graphs take their measured times
    (``[(all-INT8 plan, us), (plan with FP16 convs, us)]``, batch 1); all else from ``base``.

    Case 0 must hold no FP16 conv: it fixes ``fields[0]`` (by default the lookup-table rate,
    which YOLOv5s's fused SiLUs bind); case 1 then fixes ``fields[1]`` (the FP16 efficiency
    ceiling). Each is a bisection over the field's :data:`FIT_RANGES`, time falling as it rises.
    The other constants of ``ORIN_DLA`` come from the joint fit of ``bench/dla_published.py --fit``.

    Raises:
        LatencyModelError: not exactly two cases, a field :data:`FIT_RANGES` does not list, FP16
            convs in case 0 or none in case 1, or no value in range reproduces a measured time.
    """
    if len(cases) != 2:
        raise LatencyModelError(f"fit_params needs exactly two cases, got {len(cases)}")
    unknown = [f for f in fields if f not in FIT_RANGES]
    if unknown:
        raise LatencyModelError(f"cannot fit {unknown}; fields: {', '.join(FIT_RANGES)}")
    (plan0, target0), (plan1, target1) = cases

    def fp16_convs(plan: LatencyPlan) -> int:
        return sum(1 for s in _steps(plan) if s.engine == "conv" and s.precision == "fp16")

    if fp16_convs(plan0) or not fp16_convs(plan1):
        raise LatencyModelError("case 0 must be all-INT8 convs and case 1 must hold FP16 convs")

    def with_value(p: DlaParams, field_name: str, value: float) -> DlaParams:
        changes: dict[str, Any] = {field_name: value}  # every FIT_RANGES field is a float
        return replace(p, **changes)

    def solve(plan: LatencyPlan, target: float, field_name: str, p: DlaParams) -> DlaParams:
        def total(value: float) -> float:
            return estimate_plan(plan, params=with_value(p, field_name, value)).total_us

        lo, hi = FIT_RANGES[field_name]
        if not total(hi) <= target <= total(lo):
            raise LatencyModelError(
                f"no {field_name} in [{lo}, {hi}] gives {target:.0f} us (range "
                f"{total(hi):.0f}-{total(lo):.0f} us)"
            )
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if total(mid) > target else (lo, mid)
        return with_value(p, field_name, round((lo + hi) / 2, 4))

    fitted = solve(plan0, target0, fields[0], base)
    return solve(plan1, target1, fields[1], fitted)
