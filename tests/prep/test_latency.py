"""DLA latency model: published YOLOv5s figures, MAC counts, fusion, memory, errors and the CLI.

The YOLOv5s 672x672 graph is exported once per session (random weights: only the structure
matters to the model).
"""

from __future__ import annotations

import argparse
import io
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

from prep import profile_cmd
from prep.latency import (
    CALIBRATION_US,
    ORIN_DLA,
    LatencyEstimate,
    LatencyModelError,
    LatencyPlan,
    LayerCost,
    UnsupportedOpError,
    estimate,
    estimate_plan,
    fit_params,
    plan_graph,
)

HEADS = ("/model.24/m.0/Conv", "/model.24/m.1/Conv", "/model.24/m.2/Conv")
LAST_C3 = ("/model.23/cv3/conv/Conv", "/model.23/cv3/act/Sigmoid", "/model.23/cv3/act/Mul")
# Published YOLOv5s 672x672, one DLA at 1.33 GHz (docs/reference/cudla.md §6, seed article table 1).
PUBLISHED_INT8_HEADS_MS = (2.4, 1000 / 410)
PUBLISHED_FP16_HEADS_MS = (3.82, 1000 / 255)
PUBLISHED_BATCH_MS = {1: 3.82, 2: 7.68, 4: 15.17}


@pytest.fixture(scope="session")
def yolov5s_672(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from prep.export import export_onnx
    from prep.model import YOLOv5

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("latency") / "yolov5s_672.onnx"
    export_onnx(YOLOv5("s", 80).eval().fuse(), path, 672)
    return path


@pytest.fixture(scope="session")
def plans(yolov5s_672: Path) -> dict[str, LatencyPlan]:
    model = onnx.load(str(yolov5s_672))
    return {
        "int8": plan_graph(model, heads="int8"),
        "fp16": plan_graph(model, heads="fp16"),
        "fp16+c3": plan_graph(model, heads="fp16", fp16_nodes=LAST_C3),
    }


def layer(est: LatencyEstimate, name: str) -> LayerCost:
    return next(x for x in est.layers if x.name == name)


# ------------------------------------------------------------------------ published figures
def test_totals_within_15_percent_of_published(plans: dict[str, LatencyPlan]) -> None:
    int8 = estimate_plan(plans["int8"]).total_ms
    fp16 = estimate_plan(plans["fp16"]).total_ms
    for published in PUBLISHED_INT8_HEADS_MS:
        assert abs(int8 / published - 1) < 0.15, (int8, published)
    for published in PUBLISHED_FP16_HEADS_MS:
        assert abs(fp16 / published - 1) < 0.15, (fp16, published)


def test_head_precision_ordering(plans: dict[str, LatencyPlan]) -> None:
    """INT8 heads < FP16 heads < FP16 heads + last C3 block (cuDLA-samples: 4.0 -> 4.46 ms)."""
    t = {k: estimate_plan(p).total_us for k, p in plans.items()}
    assert t["int8"] < t["fp16"] < t["fp16+c3"]
    assert t["fp16+c3"] / t["fp16"] > 1.03  # a visible step, as the published 4.0 -> 4.46
    fp16 = estimate_plan(plans["fp16"])
    assert all(layer(fp16, h).precision == "fp16" for h in HEADS)
    assert layer(fp16, LAST_C3[0]).precision == "int8"


def test_yolov5n_320_is_smaller_but_not_free(
    plans: dict[str, LatencyPlan], tmp_path_factory: pytest.TempPathFactory
) -> None:
    from prep.export import export_onnx
    from prep.model import YOLOv5

    path = tmp_path_factory.mktemp("latency") / "yolov5n_320.onnx"
    export_onnx(YOLOv5("n", 80).eval().fuse(), path, 320)
    small = estimate(path, heads="int8")
    big = estimate_plan(plans["int8"])
    layers = sum(x.bound not in ("fused", "in-place") for x in small.layers)
    assert layers * ORIN_DLA.layer_overhead_us < small.total_us < big.total_us / 3


def test_fit_reproduces_the_default_efficiencies(plans: dict[str, LatencyPlan]) -> None:
    """The defaults are what ``fit_params`` gives on the published points, not hand-set."""
    cases = [
        (plans["int8"], CALIBRATION_US["int8_heads"]),
        (plans["fp16"], CALIBRATION_US["fp16_heads"]),
    ]
    fitted = fit_params(cases)
    assert fitted.int8_conv_efficiency == pytest.approx(ORIN_DLA.int8_conv_efficiency, abs=2e-3)
    assert fitted.fp16_conv_efficiency == pytest.approx(ORIN_DLA.fp16_conv_efficiency, abs=2e-3)
    for plan, target in cases:
        assert estimate_plan(plan, params=fitted).total_us == pytest.approx(target, rel=1e-3)
    with pytest.raises(LatencyModelError, match="case 0"):
        fit_params(cases[::-1])


def test_batch_scales_linearly(plans: dict[str, LatencyPlan]) -> None:
    one = estimate_plan(plans["fp16"], batch=1)
    for batch, published in PUBLISHED_BATCH_MS.items():
        est = estimate_plan(plans["fp16"], batch=batch)
        assert est.total_us == pytest.approx(batch * one.total_us, rel=1e-9)
        assert sum(x.macs for x in est.layers) == batch * sum(x.macs for x in one.layers)
        # The published ratios are linear within 1 %.
        assert est.total_us / one.total_us == pytest.approx(published / 3.82, rel=0.01)
    with pytest.raises(LatencyModelError, match="batch"):
        estimate_plan(plans["fp16"], batch=0)


def test_conv_macs_match_hand_formulas(plans: dict[str, LatencyPlan]) -> None:
    est = estimate_plan(plans["fp16"])

    def out_size(size: int, k: int, s: int, p: int) -> int:
        return (size + 2 * p - k) // s + 1

    s0 = out_size(672, 6, 2, 2)  # 6x6/2 stem
    hand = {
        "/model.0/conv/Conv": s0 * s0 * 32 * 3 * 6 * 6,
        "/model.1/conv/Conv": out_size(s0, 3, 2, 1) ** 2 * 64 * 32 * 9,
        "/model.7/conv/Conv": 21 * 21 * 512 * 256 * 9,
        "/model.9/cv2/conv/Conv": 21 * 21 * 512 * 1024,
        "/model.24/m.0/Conv": 84 * 84 * 255 * 128,
        "/model.24/m.2/Conv": 21 * 21 * 255 * 512,
    }
    for name, macs in hand.items():
        assert layer(est, name).macs == macs, name


def test_total_conv_macs_match_torch(plans: dict[str, LatencyPlan]) -> None:
    """Independent count: forward hooks on every nn.Conv2d of the same network."""
    from prep.model import YOLOv5

    model = YOLOv5("s", 80).eval().fuse()
    total = 0

    def hook(mod: torch.nn.Module, _: Any, out: torch.Tensor) -> None:
        nonlocal total
        assert isinstance(mod, torch.nn.Conv2d)
        k = mod.kernel_size[0] * mod.kernel_size[1]
        total += out[0].numel() * (mod.in_channels // mod.groups) * k

    handles = [
        m.register_forward_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Conv2d)
    ]
    with torch.inference_mode():
        model(torch.zeros(1, 3, 672, 672))
    for h in handles:
        h.remove()
    est = estimate_plan(plans["int8"])
    assert sum(x.macs for x in est.layers if x.op == "Conv") == total


def test_output_formats_and_input_layout(plans: dict[str, LatencyPlan]) -> None:
    """FP16 CHW16 heads write 2 bytes over 256 channels, INT8 CHW32 1 byte; input is HWC4."""
    fp16, int8 = estimate_plan(plans["fp16"]), estimate_plan(plans["int8"])
    for name, hw in zip(HEADS, (84, 42, 21), strict=True):
        assert layer(fp16, name).bytes_out == 256 * hw * hw * 2
        assert layer(int8, name).bytes_out == 256 * hw * hw * 1
    assert layer(int8, "/model.0/conv/Conv").bytes_in == 672 * 672 * 4
    # FP16 heads read FP16 inputs: one Reformat per head input, none with INT8 heads.
    assert sum(x.op == "Reformat" for x in fp16.layers) == 3
    assert not any(x.op == "Reformat" for x in int8.layers)


def test_sram_keeps_traffic_off_dram(plans: dict[str, LatencyPlan]) -> None:
    def run(sram: int) -> tuple[float, int]:
        est = estimate_plan(plans["int8"], params=replace(ORIN_DLA, sram_bytes=sram))
        return est.total_us, sum(x.dram_bytes for x in est.layers)

    (base, base_dram), (none, none_dram), (big, big_dram) = run(1 << 20), run(0), run(64 << 20)
    assert none > base > big
    assert none_dram > 1.2 * base_dram
    assert base_dram > 2 * big_dram
    # Even unlimited SRAM leaves the graph I/O and the weights on DRAM.
    assert big_dram >= 672 * 672 * 4 + sum(
        x.weight_bytes for x in estimate_plan(plans["int8"]).layers
    )


def test_silu_and_residual_add_are_fused(plans: dict[str, LatencyPlan]) -> None:
    est = estimate_plan(plans["int8"])
    sig = layer(est, "/model.0/act/Sigmoid")
    assert (sig.bound, sig.fused_into, sig.time_us) == ("fused", "/model.0/conv/Conv", 0.0)
    adds = [x for x in est.layers if x.op == "Add"]
    assert adds
    assert all(x.bound == "fused" for x in adds)
    concat = [x for x in est.layers if x.op == "Concat"]
    assert concat
    assert all(x.bound == "in-place" for x in concat)
    # the conv hosting a residual Add reads the shortcut as well as its input
    host = layer(est, str(adds[0].fused_into))
    assert host.bytes_in > layer(est, "/model.2/m/m.0/cv1/conv/Conv").bytes_in


# ------------------------------------------------------------------------------ small graphs
def make_graph(
    nodes: list[onnx.NodeProto],
    weights: dict[str, np.ndarray],
    shape: tuple[int, ...],
    outputs: tuple[str, ...] = ("y",),
) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(v, name=k) for k, v in weights.items()]
    graph = helper.make_graph(
        nodes,
        "t",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in outputs],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def conv_graph(
    cin: int, cout: int, k: int, stride: int, size: int, *, tail: str = ""
) -> onnx.ModelProto:
    """x -> entry Conv -> Conv(+bias) [-> SiLU | -> Sigmoid] -> y."""
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((cin, cin, 1, 1)).astype(np.float32)
    w = rng.standard_normal((cout, cin, k, k)).astype(np.float32)
    b = np.zeros(cout, np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["a"], name="entry"),
        helper.make_node(
            "Conv", ["a", "w", "b"], ["c" if tail else "y"], name="conv",
            kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4,
        ),
    ]  # fmt: skip
    if tail == "silu":
        nodes += [
            helper.make_node("Sigmoid", ["c"], ["s"], name="sig"),
            helper.make_node("Mul", ["c", "s"], ["y"], name="mul"),
        ]
    elif tail == "sigmoid":
        nodes.append(helper.make_node("Sigmoid", ["c"], ["y"], name="sig"))
    return make_graph(nodes, {"w0": w0, "w": w, "b": b}, (1, cin, size, size))


def test_fused_silu_costs_little_and_unfused_costs_a_layer() -> None:
    plain = estimate(conv_graph(64, 64, 3, 1, 40), heads="int8")
    silu = estimate(conv_graph(64, 64, 3, 1, 40, tail="silu"), heads="int8")
    assert [layer(silu, n).bound for n in ("sig", "mul")] == ["fused", "fused"]
    assert silu.total_us - plain.total_us <= 0.01 * plain.total_us
    # The same Sigmoid in FP16 after an INT8 conv cannot fuse: a Reformat and a layer of its own.
    split = estimate(conv_graph(64, 64, 3, 1, 40, tail="sigmoid"), fp16_nodes=["sig"], heads="fp16")
    assert layer(split, "sig").bound != "fused"
    assert any(x.op == "Reformat" for x in split.layers)
    assert split.total_us - plain.total_us >= 2 * ORIN_DLA.layer_overhead_us


@settings(max_examples=40, deadline=None)
@given(
    cin=st.integers(1, 96),
    cout=st.integers(1, 96),
    k=st.sampled_from([1, 3, 5]),
    stride=st.sampled_from([1, 2]),
    size=st.integers(4, 40),
)
def test_conv_macs_property(cin: int, cout: int, k: int, stride: int, size: int) -> None:
    est = estimate(conv_graph(cin, cout, k, stride, size), heads="int8")
    conv = layer(est, "conv")
    out = (size + 2 * (k // 2) - k) // stride + 1
    assert conv.macs == out * out * cout * cin * k * k
    assert conv.time_us >= conv.overhead_us > 0
    assert conv.time_us == pytest.approx(
        conv.overhead_us + max(conv.compute_us, conv.memory_us), rel=1e-12
    )
    # Padding to the MAC atoms: channel counts 1..atom cost the same compute, never less.
    padded = estimate(conv_graph(cin, 32 * -(-cout // 32), k, stride, size), heads="int8")
    assert layer(padded, "conv").compute_us == pytest.approx(conv.compute_us, rel=1e-9)


def test_unsupported_op_is_reported_not_zero() -> None:
    w = np.ones((4, 4, 1, 1), np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Exp", ["c"], ["y"], name="the_exp"),
    ]
    model = make_graph(nodes, {"w": w}, (1, 4, 8, 8))
    with pytest.raises(UnsupportedOpError, match=r"the_exp \(Exp\)") as info:
        estimate(model)
    assert info.value.nodes == (("the_exp", "Exp"),)


def test_the_ops_of_the_dfl_families_are_priced() -> None:
    """Split and Slice copy each part (its share of the input read, the part written); Softmax
    is three SDP passes; Transpose and Reshape move the tensor at the resize rate."""
    w = np.ones((64, 64, 1, 1), np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Split", ["c"], ["a", "b"], name="split", axis=1),
        helper.make_node("Softmax", ["a"], ["s"], name="softmax", axis=3),
        helper.make_node("Transpose", ["s"], ["t"], name="transpose", perm=[0, 1, 3, 2]),
        helper.make_node("Add", ["t", "b"], ["y"], name="add"),
    ]
    est = estimate(make_graph(nodes, {"w": w}, (1, 64, 32, 32)))
    by = {layer.name: layer for layer in est.layers}
    assert by["split"].bytes_in == by["split"].bytes_out == 32 * 32 * 32  # int8 CHW32: one atom
    assert by["split:1"].bytes_out == 32 * 32 * 32
    p = ORIN_DLA
    sdp_us = 32 * 32 * 32 / p.sdp_elems_per_cycle / p.clock_hz * 1e6
    assert by["softmax"].compute_us == pytest.approx(3 * sdp_us)
    assert by["transpose"].compute_us == pytest.approx(sdp_us * p.sdp_elems_per_cycle
                                                       / p.resize_elems_per_cycle)  # fmt: skip


def test_bad_arguments() -> None:
    model = conv_graph(8, 8, 3, 1, 8)
    with pytest.raises(LatencyModelError, match="no node named 'nope'"):
        estimate(model, fp16_nodes=["nope"])
    with pytest.raises(LatencyModelError, match="heads"):
        estimate(model, heads="int4")  # type: ignore[arg-type]
    dynamic = make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="r")],
        {},
        ("N", 8, 8, 8),  # type: ignore[arg-type]
    )
    with pytest.raises(LatencyModelError, match="static shape"):
        estimate(dynamic)


def test_heads_flag_overrides_fp16_nodes_for_heads() -> None:
    model = conv_graph(8, 8, 3, 1, 8)  # the producer of "y" is the head
    est = estimate(model, fp16_nodes=["conv"], heads="int8")
    assert layer(est, "conv").precision == "int8"
    assert layer(estimate(model, heads="fp16"), "conv").precision == "fp16"


def test_translator_output_is_accepted(tmp_path: Path) -> None:
    from prep.translate import translate
    from tests.prep.onnx_graphs import conv_net, conv_net_weights

    result = translate(conv_net(conv_net_weights(np.random.default_rng(3))))
    est = estimate(result.model, fp16_nodes=result.fp16_nodes, heads="fp16")
    names = {x.name for x in est.layers}
    assert set(result.fp16_nodes) <= names
    assert est.total_us > 0


# ------------------------------------------------------------------------------------- CLI
def run_cli(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="prep")
    profile_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    out = io.StringIO()
    code = profile_cmd.run(parser.parse_args(["profile", *argv]), out)
    return code, out.getvalue()


def test_cli_prints_table_total_and_json(yolov5s_672: Path, tmp_path: Path) -> None:
    config = tmp_path / "pc.json"
    config.write_text(json.dumps({"int8_tensor_scales": {}, "fp16_nodes": list(LAST_C3)}))
    out_json = tmp_path / "est.json"
    code, text = run_cli(
        ["--onnx", str(yolov5s_672), "--precision-config", str(config), "--json", str(out_json)]
    )
    assert code == 0
    total = re.search(r"^total: ([0-9.]+) us \(([0-9.]+) ms\)", text, re.M)
    assert total is not None
    expected = estimate(yolov5s_672, fp16_nodes=LAST_C3).total_us
    assert float(total.group(1)) == pytest.approx(expected, abs=0.06)
    rows = [line.split() for line in text.splitlines() if line.startswith("/model.")]
    conv0 = next(r for r in rows if r[0] == "/model.0/conv/Conv")
    assert conv0[1:3] == ["Conv", "int8"]
    assert float(conv0[3]) == pytest.approx(390.2, abs=0.1)
    assert any(r[0] == LAST_C3[0] and r[2] == "fp16" for r in rows)
    assert re.search(r"^Conv\s+60\s", text, re.M)  # the per-op summary
    doc = json.loads(out_json.read_text())
    assert doc["total_us"] == pytest.approx(expected)
    table = text.split("\ntotal:")[0].splitlines()
    printed = [line for line in table if line.startswith(("/model.", "Reformat "))]
    assert len(printed) == sum(x["bound"] != "fused" for x in doc["layers"])
    assert sum(x["bound"] == "fused" for x in doc["layers"]) == 57 * 2 + 7  # SiLUs, Adds


def test_cli_param_override(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    onnx.save(conv_graph(64, 64, 3, 1, 32), str(model))

    def total(argv: list[str]) -> float:
        code, text = run_cli(["--onnx", str(model), *argv])
        assert code == 0
        found = re.search(r"^total: ([0-9.]+) us", text, re.M)
        assert found is not None
        return float(found.group(1))

    base = total([])
    slower = replace(ORIN_DLA, clock_hz=ORIN_DLA.clock_hz / 2, layer_overhead_us=5)
    expected = estimate(model, params=slower).total_us
    halved = total(["--param", f"clock_hz={slower.clock_hz}", "--param", "layer_overhead_us=5"])
    assert halved == pytest.approx(expected, abs=0.06)
    assert halved > base


def test_cli_exit_codes(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    onnx.save(conv_graph(8, 8, 3, 1, 8), str(model))
    assert run_cli(["--onnx", str(model), "--heads", "int8", "--batch", "2"])[0] == 0
    assert run_cli(["--onnx", str(tmp_path / "missing.onnx")])[0] == 2
    assert run_cli(["--onnx", str(model), "--batch", "0"])[0] == 2
    for param in ("nope=1", "clock_hz", "clock_hz=fast", "sram_bytes=1.5", "clock_hz=-1"):
        assert run_cli(["--onnx", str(model), "--param", param])[0] == 2, param
    assert run_cli(["--onnx", str(model), "--fp16-node", "nope"])[0] == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert run_cli(["--onnx", str(model), "--precision-config", str(bad)])[0] == 2
    bad.write_text(json.dumps({"fp16_nodes": "conv"}))
    assert run_cli(["--onnx", str(model), "--precision-config", str(bad)])[0] == 2
    garbage = tmp_path / "g.onnx"
    garbage.write_bytes(b"not an onnx file")
    assert run_cli(["--onnx", str(garbage)])[0] == 2
    soft = tmp_path / "exp.onnx"
    nodes = [helper.make_node("Exp", ["x"], ["y"], name="exp")]
    onnx.save(make_graph(nodes, {}, (1, 4, 8, 8)), str(soft))
    assert run_cli(["--onnx", str(soft)])[0] == 1
    with pytest.raises(SystemExit) as info:
        run_cli(["--onnx", str(model), "--heads", "int4"])
    assert info.value.code == 2


def test_a_graph_of_two_images_is_a_task_of_two(tmp_path: Path) -> None:
    """The graph's own batch counts: ``--batch 3`` of a batch-2 graph is a task of 6 images."""
    w = np.ones((8, 8, 1, 1), np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="conv")]
    model = make_graph(nodes, {"w": w}, (2, 8, 16, 16))
    assert estimate(model).batch == 2
    assert estimate(model, batch=3).batch == 6
    path = tmp_path / "two.onnx"
    onnx.save(model, str(path))
    code, out = run_cli(["--onnx", str(path), "--batch", "3"])
    assert code == 0
    assert "for batch 6 on one DLA" in out


# ------------------------------------------------------- grouped convs, pooling, efficiency, LUT
def grouped_graph(
    c: int, k: int, groups: int, size: int, *, tail: str = "", pool: bool = False
) -> onnx.ModelProto:
    """x -> entry 1x1 Conv (c) -> grouped kxk Conv (c -> c) [-> Relu | SiLU] [-> MaxPool 3x3/2]."""
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal((c, c, 1, 1)).astype(np.float32)
    w = rng.standard_normal((c, c // groups, k, k)).astype(np.float32)
    out = "c" if tail or pool else "y"
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["a"], name="entry"),
        helper.make_node("Conv", ["a", "w"], [out], name="conv", group=groups,
                         kernel_shape=[k, k], pads=[k // 2] * 4),
    ]  # fmt: skip
    if tail == "relu":
        nodes.append(helper.make_node("Relu", ["c"], ["r" if pool else "y"], name="act"))
    elif tail == "silu":
        nodes += [
            helper.make_node("Sigmoid", ["c"], ["s"], name="sig"),
            helper.make_node("Mul", ["c", "s"], ["r" if pool else "y"], name="mul"),
        ]
    if pool:
        src = "r" if tail else "c"
        pool_node = helper.make_node(
            "MaxPool", [src], ["y"], name="pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4
        )
        nodes.append(pool_node)
    return make_graph(nodes, {"w0": w0, "w": w}, (1, c, size, size))


def mac_array_us(macs: float, reduction: float, p: Any = ORIN_DLA) -> float:
    """Time of ``macs`` padded INT8 MACs at the efficiency of ``reduction`` passes an output."""
    return macs / (p.int8_macs_per_cycle * p.conv_efficiency("int8", reduction)) / p.clock_hz * 1e6


def test_depthwise_conv_is_priced_near_its_work() -> None:
    """Channels are the atom of a depthwise conv: its array time is its MACs (channels padded
    to the atom) at the rate of nine passes an output, not 64 x 32 padding per channel."""
    c, size = 256, 40
    est = estimate(grouped_graph(c, 3, c, size), heads="int8")
    dw = layer(est, "conv")
    assert dw.macs == size * size * c * 9
    sdp_us = size * size * c / ORIN_DLA.sdp_elems_per_cycle / ORIN_DLA.clock_hz * 1e6
    assert dw.compute_us == pytest.approx(max(mac_array_us(dw.macs, 9), sdp_us), rel=1e-9)
    # Its array time is below the time the SDP takes to write its output: output-bound, as an
    # element-wise layer is. (Padding each channel to a 64 x 32 atom made it 2048x its MACs.)
    assert mac_array_us(dw.macs, 9) < sdp_us
    assert dw.compute_us == pytest.approx(sdp_us)
    dense = layer(estimate(grouped_graph(c, 3, 1, size), heads="int8"), "conv")
    assert dw.compute_us < dense.compute_us / 4  # the dense conv has 256x the MACs
    # A depthwise-separable block (MobileNet's): the depthwise half costs no more than the
    # pointwise half (both write as many outputs, and the SDP's rate bounds both here); it was
    # 97 % of the time when every channel was padded to whole atoms.
    w_pw = np.ones((c, c, 1, 1), np.float32)
    w_dw = np.ones((c, 1, 3, 3), np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "wd"], ["d"], name="dw", group=c, kernel_shape=[3, 3],
                         pads=[1] * 4),
        helper.make_node("Relu", ["d"], ["e"], name="r1"),
        helper.make_node("Conv", ["e", "wp"], ["f"], name="pw"),
        helper.make_node("Relu", ["f"], ["y"], name="r2"),
    ]  # fmt: skip
    block = estimate(make_graph(nodes, {"wd": w_dw, "wp": w_pw}, (1, c, 38, 38)), heads="int8")
    share = layer(block, "dw").compute_us / sum(x.compute_us for x in block.layers)
    assert share <= 0.5 + 1e-9, share


@pytest.mark.parametrize(("c", "groups"), [(128, 32), (256, 32), (64, 16), (512, 32)])
def test_grouped_conv_packs_groups_into_channel_atoms(c: int, groups: int) -> None:
    """Groups narrower than the 64-channel atom share one (block-diagonal weights); their kernels
    are padded together to the 32-kernel atom. Groups of >= 64 channels are padded each."""
    size = 20
    conv = layer(estimate(grouped_graph(c, 3, groups, size), heads="int8"), "conv")
    cin_g = c // groups
    if cin_g < 64:
        pack = min(groups, 64 // cin_g)
        padded = size * size * -(-groups // pack) * 64 * (-(-pack * cin_g // 32) * 32) * 9
    else:
        padded = size * size * groups * -(-cin_g // 64) * 64 * -(-cin_g // 32) * 32 * 9
    reduction = 9 if cin_g < 64 else -(-cin_g // 64) * 9
    sdp_us = size * size * c / ORIN_DLA.sdp_elems_per_cycle / ORIN_DLA.clock_hz * 1e6
    assert conv.compute_us == pytest.approx(max(mac_array_us(padded, reduction), sdp_us), rel=1e-9)
    assert conv.macs == size * size * c * cin_g * 9


def test_conv_efficiency_rises_with_the_passes_an_output_takes() -> None:
    p = ORIN_DLA
    ceiling, knee = p.int8_conv_efficiency, p.conv_reduction_knee
    assert 0 < ceiling <= 1
    assert knee > 0
    effs = [p.conv_efficiency("int8", r) for r in (1, 2, 4, 9, 36, 72, 10_000)]
    assert effs == sorted(effs)
    assert effs[0] == pytest.approx(ceiling / (1 + knee))
    assert effs[-1] == pytest.approx(ceiling, rel=1e-3)
    assert p.conv_efficiency("int8") == ceiling
    assert p.conv_efficiency("fp16", 9) == pytest.approx(p.fp16_conv_efficiency * 9 / (9 + knee))
    # In a graph: a 1x1 conv over one channel atom (R = 1) runs at 1 / (1 + r0) of the ceiling,
    # a 3x3 conv over two atoms (R = 18) at 18 / (18 + r0); both MAC-bound here.
    one = layer(estimate(conv_graph(64, 256, 1, 1, 64), heads="int8"), "conv")
    three = layer(estimate(conv_graph(128, 256, 3, 1, 64), heads="int8"), "conv")
    sdp_us = 64 * 64 * 256 / p.sdp_elems_per_cycle / p.clock_hz * 1e6
    assert mac_array_us(64 * 64 * 256 * 128 * 9, 18) > sdp_us
    assert three.compute_us == pytest.approx(mac_array_us(64 * 64 * 256 * 128 * 9, 18), rel=1e-9)
    assert one.compute_us == pytest.approx(
        max(mac_array_us(64 * 64 * 256 * 64, 1), sdp_us), rel=1e-9
    )
    wide = layer(estimate(conv_graph(512, 256, 1, 1, 64), heads="int8"), "conv")  # R = 8
    assert wide.compute_us == pytest.approx(mac_array_us(64 * 64 * 256 * 512, 8), rel=1e-9)
    per_mac = (wide.compute_us / wide.macs) / (three.compute_us / three.macs)
    assert per_mac == pytest.approx((8 + knee) / 8 * 18 / (18 + knee), rel=1e-9)


def test_a_pool_after_its_conv_runs_on_the_fly() -> None:
    """Conv -> ReLU -> MaxPool: the SDP streams into the pooling engine, so the conv writes the
    pooled tensor only (no full-size round trip) and the pool is no layer of its own."""
    c, size = 64, 96
    fused = estimate(grouped_graph(c, 3, 1, size, tail="relu", pool=True), heads="int8")
    pool = layer(fused, "pool")
    assert (pool.bound, pool.fused_into, pool.time_us) == ("fused", "conv", 0.0)
    conv = layer(fused, "conv")
    assert conv.bytes_out == c * (size // 2) ** 2  # int8 CHW32: the pooled output
    assert conv.macs == size * size * c * c * 9  # the conv's own output, before pooling
    plain = layer(estimate(grouped_graph(c, 3, 1, size, tail="relu"), heads="int8"), "conv")
    assert conv.compute_us == pytest.approx(plain.compute_us, rel=1e-9)
    assert (
        fused.total_us
        < estimate(grouped_graph(c, 3, 1, size, tail="relu"), heads="int8").total_us + 1e-9
    )


def test_silu_uses_the_lookup_table_rate() -> None:
    """A fused SiLU needs the SDP's lookup table, a ReLU its ALUs: an output-bound conv (few
    MACs, many outputs) takes the LUT's element rate with SiLU, the ALUs' with ReLU."""
    p = ORIN_DLA
    assert p.lut_elems_per_cycle < p.sdp_elems_per_cycle
    size, c = 64, 64
    relu = layer(estimate(grouped_graph(c, 1, c, size, tail="relu"), heads="int8"), "conv")
    silu = layer(estimate(grouped_graph(c, 1, c, size, tail="silu"), heads="int8"), "conv")
    elems = size * size * c
    assert relu.compute_us == pytest.approx(elems / p.sdp_elems_per_cycle / p.clock_hz * 1e6)
    assert silu.compute_us == pytest.approx(elems / p.lut_elems_per_cycle / p.clock_hz * 1e6)


def test_fit_params_fields_are_checked(plans: dict[str, LatencyPlan]) -> None:
    cases = [(plans["int8"], 2400.0), (plans["fp16"], 3800.0)]
    with pytest.raises(LatencyModelError, match="cannot fit"):
        fit_params(cases, fields=("clock_hz", "fp16_conv_efficiency"))
    with pytest.raises(LatencyModelError, match="no lut_elems_per_cycle"):
        fit_params([(plans["int8"], 10.0), cases[1]])  # faster than any LUT rate can make it
