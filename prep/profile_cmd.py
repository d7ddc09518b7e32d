"""``prep profile``: the modelled per-layer DLA time of a PTQ ONNX graph (``prep.latency``).

    prep profile --onnx model_noqdq.onnx [--heads int8|fp16] [--fp16-node NAME ...]
                 [--precision-config model_precision_config.json] [--batch N]
                 [--param FIELD=VALUE ...] [--json out.json] [--all]

Prints one row per hardware layer (name, op, precision, MACs, bytes in/out/weights, time, bound),
the total, and a summary per op type. Nodes fused into a conv's SDP stage (SiLU, residual Add) are
counted in the conv's row and listed only with ``--all``.

Exit status: 0 printed; 1 the graph holds ops the DLA does not run; 2 bad arguments or input
(missing or unreadable file, bad precision config, unknown node name, batch < 1, bad --param).
``--param FIELD=VALUE`` overrides a ``prep.latency.DlaParams`` constant (recalibration on an Orin,
``docs/latency.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from prep.latency import DlaParams, LatencyEstimate


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``profile`` on an ``add_subparsers()`` object; returns the new parser."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "profile",
        help="modelled per-layer DLA latency of a PTQ ONNX graph (an estimate, not a measurement)",
        description="Per-layer DLA time model (prep.latency, docs/latency.md): one Orin DLA core "
        "at 1331 MHz, INT8 DLA_HWC4 input. An estimate calibrated on published figures.",
    )
    p.add_argument("--onnx", type=Path, required=True, help="PTQ ONNX graph (no Q/DQ)")
    p.add_argument(
        "--heads",
        choices=("int8", "fp16"),
        default="fp16",
        help="precision of the output convs: fp16 (CHW16 outputs) or int8 (CHW32); default fp16",
    )
    p.add_argument(
        "--fp16-node",
        action="append",
        default=[],
        metavar="NAME",
        help="run this node in FP16 (repeatable)",
    )
    p.add_argument(
        "--precision-config",
        type=Path,
        help="the translator's *_precision_config.json: its fp16_nodes run in FP16",
    )
    p.add_argument("--batch", type=int, default=1, help="images per task (default 1)")
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override one DlaParams constant (repeatable), e.g. --param clock_hz=1.6e9",
    )
    p.add_argument("--json", type=Path, help="also write the estimate as JSON here")
    p.add_argument("--all", action="store_true", help="also list fused nodes (zero cost)")
    return p


class _ArgError(Exception):
    pass


def _fp16_nodes(args: argparse.Namespace) -> list[str]:
    nodes = list(args.fp16_node)
    if args.precision_config is not None:
        try:
            config = json.loads(args.precision_config.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _ArgError(f"cannot read precision config {args.precision_config}: {e}") from e
        listed = config.get("fp16_nodes") if isinstance(config, dict) else None
        if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
            raise _ArgError(
                f"{args.precision_config}: expected an object with a list of strings "
                "under 'fp16_nodes' (the translator's precision config)"
            )
        nodes += listed
    return nodes


def _params(items: list[str]) -> DlaParams:
    from prep.latency import ORIN_DLA

    fields = {f.name: f.type for f in dataclasses.fields(ORIN_DLA)}
    changes: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or name not in fields:
            raise _ArgError(f"--param needs FIELD=VALUE with FIELD one of {', '.join(fields)}")
        try:
            value = float(raw)
        except ValueError as e:
            raise _ArgError(f"--param {name}: not a number: {raw!r}") from e
        if not math.isfinite(value) or value < 0:
            raise _ArgError(f"--param {name}: needs a finite value >= 0, got {raw!r}")
        if fields[name] in (int, "int"):
            if value != int(value):
                raise _ArgError(f"--param {name}: needs an integer, got {raw!r}")
            changes[name] = int(value)
        else:
            changes[name] = value
    return dataclasses.replace(ORIN_DLA, **changes)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``prep profile`` for parsed ``args``; returns the exit status (module docstring)."""
    from prep.latency import LatencyModelError, UnsupportedOpError, estimate

    out = out or sys.stdout
    try:
        if not args.onnx.is_file():
            raise _ArgError(f"no such file: {args.onnx}")
        if args.batch < 1:
            raise _ArgError(f"--batch must be >= 1, got {args.batch}")
        est = estimate(
            args.onnx,
            fp16_nodes=_fp16_nodes(args),
            heads=args.heads,
            batch=args.batch,
            params=_params(args.param),
        )
    except UnsupportedOpError as e:
        print(f"prep profile: {e}", file=sys.stderr)
        return 1
    except (_ArgError, LatencyModelError) as e:
        print(f"prep profile: {e}", file=sys.stderr)
        return 2
    print_table(est, out, show_fused=args.all)
    if args.json is not None:
        doc = {"onnx": str(args.onnx), "heads": args.heads, **est.to_dict()}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}", file=out)
    return 0


def print_table(est: LatencyEstimate, out: TextIO, *, show_fused: bool = False) -> None:
    """The per-layer table, the ``total:`` line and the per-op summary, as plain text."""
    rows = [layer for layer in est.layers if show_fused or layer.bound != "fused"]
    width = max([len("name"), *(len(layer.name) for layer in rows)])
    head = (
        f"{'name':<{width}}  {'op':<9} {'prec':<4} {'MACs(M)':>9} {'in(kB)':>8} "
        f"{'out(kB)':>8} {'w(kB)':>7} {'time(us)':>9}  bound"
    )
    print(head, file=out)
    print("-" * len(head), file=out)
    for layer in rows:
        bound = {
            "fused": f"fused into {layer.fused_into}",
            "in-place": "in place (producers write the channel slices)",
        }.get(layer.bound, layer.bound)
        print(
            f"{layer.name:<{width}}  {layer.op:<9} {layer.precision:<4} "
            f"{layer.macs / 1e6:>9.1f} {layer.bytes_in / 1e3:>8.0f} {layer.bytes_out / 1e3:>8.0f} "
            f"{layer.weight_bytes / 1e3:>7.1f} {layer.time_us:>9.1f}  {bound}",
            file=out,
        )
    hidden = len(est.layers) - len(rows)
    print("-" * len(head), file=out)
    p = est.params
    print(
        f"total: {est.total_us:.1f} us ({est.total_ms:.3f} ms) for batch {est.batch} on one DLA "
        f"at {p.clock_hz / 1e6:.0f} MHz (modelled, not measured)"
        + (f"; {hidden} fused node(s) not listed (--all)" if hidden else ""),
        file=out,
    )
    print("", file=out)
    print(f"{'op':<9} {'count':>5} {'MACs(M)':>9} {'time(us)':>9} {'share':>6}", file=out)
    for op, s in est.by_op().items():
        print(
            f"{op:<9} {int(s['count']):>5} {s['macs'] / 1e6:>9.1f} {s['time_us']:>9.1f} "
            f"{s['share']:>6.1%}",
            file=out,
        )
