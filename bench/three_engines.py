"""Three engines behind one model on the emulated Orin (docs/BENCHMARKS.md §6), in one run.

    python bench/three_engines.py [--out runs/three_engines] [--contention 1.0] [--skew 0.5]
        [--time-scale 1]

Every daemon is the emulated Orin in timing mode at YOLOv5s-672 costs (a DLA core 3.82 ms a
frame; the GPU's published INT8 batch curve, 1.82 ms at batch 1 … 9.19 ms at 8, batches up to 8;
the shared DRAM at ``--contention``), pre/post-processing off so that the engines, not this
machine's CPU cores, are the bottleneck. ``dlad-bench`` drives each one through the SDK.

1. **Saturated throughput** of {dla0, dla1}, {gpu} and {dla0, dla1, gpu} (closed loop, as many
   in flight as the engines' queues and slots hold, so that none is refused), each against its
   contention-aware ideal: every engine busy all the time, the GPU at batch 8, each slowed by
   the others as ``dlad.devices.dram.saturated_rates`` says.
2. **The pool against a static split** under 24 cameras averaging 30 fps, Zipf-skewed
   (``--skew``: camera i at a rate in proportion to 1/(i+1)^skew; 0.5: 85 fps down to 17 fps):
   goodput (frames answered within their camera's frame period) with the pool (policies
   ``latency`` and ``throughput``, any engine per frame) and with every camera pinned to one
   engine at its first frame: in proportion to the engines' speeds (policy ``static``, an
   informed hand split by camera count), and dealt round robin (``static-even``: ``[scheduler]
   pins`` cam0 → dla0, cam1 → dla1, cam2 → gpu, ...; a DeepStream deployment with one branch per
   engine and the sources shared out evenly).
3. **The latency policy at 20% load** (Poisson, 20% of the three engines' ideal): p50/p99
   against the ``throughput`` policy (DLA cores first).

Prints markdown tables and writes each dlad-bench CSV/JSON under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

from orin_config import demo_model, emulated_dlas, running_daemon  # bench/, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dlad.devices.dram import saturated_rates  # noqa: E402
from dlad.devices.emulated_gpu import ORIN_GPU_YOLOV5S_MS  # noqa: E402

DLA_US, GPU_BATCH = 3820.0, 8
HELD = {"dla0": 8 + 2, "dla1": 8 + 2, "gpu": 24 + 2 * GPU_BATCH}
"""Jobs each engine holds: its queue_depth below, plus its slots' jobs in flight."""
GPU_US = {b: ms * 1e3 for b, ms in ORIN_GPU_YOLOV5S_MS.items()}
CONFIG = """
[daemon]
default_deadline_ms = 1000.0
[frontend]
endpoints = ["{endpoint}"]
sndhwm = 2000
[pre_post]
enabled = false
[scheduler]
policy = "{policy}"
{pins}[soc]
dram_contention = {contention}
{dlas}[devices.gpu]
kind = "gpu"
queue_depth = 24
max_batch = {gpu_batch}
mode = "timing"
latency_us = {gpu_us}
{model}"""
COMMON = ["--input", "random:640x480", "--warmup-s", "1.5", "--window-s", "2",
          "--stability-pct", "5", "--max-trials", "6", "--quiet"]  # fmt: skip


def config(
    devices: list[str], policy: str, *, contention: float, scale: float, dla_us: float = DLA_US
) -> str:
    """The emulated Orin above serving ``devices`` under ``policy`` (``static-even``: policy
    static with :func:`even_pins`); ``dla_us``: a DLA core's time a frame, the GPU's scaled with
    it as the emulated GPU scales another model's."""
    return CONFIG.format(
        endpoint="{endpoint}",
        policy=policy.removesuffix("-even"),
        pins=even_pins(devices) if policy.endswith("-even") else "",
        contention=contention,
        dlas=emulated_dlas(dla_us * scale),
        gpu_batch=GPU_BATCH,
        gpu_us=GPU_US[1] * dla_us / DLA_US * scale,
        model=demo_model(devices),
    )


def bench(endpoint: str, out: Path, name: str, *args: str) -> dict[str, str]:
    cmd = [
        sys.executable, "-m", "dlad_bench", "--endpoint", endpoint, *COMMON, *args,
        "--csv", str(out / f"{name}.csv"), "--json", str(out / f"{name}.json"),
    ]  # fmt: skip
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)
    with (out / f"{name}.csv").open(newline="") as f:
        return list(csv.DictReader(f))[-1]


def run(out: Path, name: str, devices: list[str], policy: str, args: argparse.Namespace,
        *bench_args: str, dla_us: float = DLA_US) -> dict[str, str]:  # fmt: skip
    text = config(devices, policy, contention=args.contention, scale=args.time_scale, dla_us=dla_us)
    with running_daemon(text, out / f"{name}.daemon.log") as (_, endpoint):
        return bench(endpoint, out, name, *bench_args)


def even_pins(devices: list[str], streams: int = 24) -> str:
    """``[scheduler] pins`` dealing dlad-bench's cameras (``cam<i>``) round robin over
    ``devices``: the even hand split of a DeepStream deployment with one branch per engine."""
    table = ", ".join(f'cam{i} = "{devices[i % len(devices)]}"' for i in range(streams))
    return f"pins = {{ {table} }}\n"


def ideal(
    devices: list[str], contention: float, scale: float = 1.0, dla_us: float = DLA_US
) -> float:
    s = scale * dla_us / DLA_US  # another model's engines, scaled as config() scales them
    engines = {
        d: ("gpu", GPU_US[GPU_BATCH] / GPU_BATCH * s) if d == "gpu" else ("dla", DLA_US * s)
        for d in devices
    }
    return sum(saturated_rates(engines, contention).values())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "three_engines")
    p.add_argument("--contention", type=float, default=1.0)
    p.add_argument("--skew", type=float, default=0.5)
    p.add_argument(
        "--time-scale", type=float, default=1.0,
        help="every engine time x S, camera rates and the Poisson rate / S, deadlines x S "
        "(S > 1: the host's own per-request cost matters less; the ratios are scale-free)",
    )  # fmt: skip
    args = p.parse_args()
    scale = args.time_scale
    args.out.mkdir(parents=True, exist_ok=True)
    c = args.contention
    load_avg = os.getloadavg()[0]
    t0 = time.monotonic()

    print("\n## 1. saturated throughput (closed loop)\n")
    sets = [["dla0", "dla1"], ["gpu"], ["dla0", "dla1", "gpu"]]
    sat = {}
    for devices in sets:
        name = "sat_" + "_".join(devices)
        held = sum(HELD[d] for d in devices)
        sat[name] = (
            devices,
            run(args.out, name, devices, "latency", args, "--concurrency", f"{held}"),
        )

    fps = 30 / scale
    print(f"\n## 2. 24 cameras, mean {fps:g} fps, skew {args.skew:g}\n")
    streams = {}
    for policy in ("latency", "throughput", "static", "static-even"):
        streams[policy] = run(
            args.out, f"streams_{policy}", ["dla0", "dla1", "gpu"], policy, args,
            "--streams", "24", "--fps", f"{fps:g}", "--fps-skew", f"{args.skew:g}",
        )  # fmt: skip

    low = 0.2 * ideal(["dla0", "dla1", "gpu"], c, scale)
    print(f"\n## 3. Poisson at 20% of the pool's ideal ({low:.0f}/s)\n")
    light = {}
    for policy in ("latency", "throughput"):
        light[policy] = run(
            args.out, f"light_{policy}", ["dla0", "dla1", "gpu"], policy, args,
            "--rate", f"{low:.1f}", "--arrivals", "poisson", "--deadline-ms", f"{100 * scale:g}",
        )  # fmt: skip
    wall = time.monotonic() - t0

    def f(row: dict[str, str], key: str) -> float:
        return float(row[key]) if row.get(key) else float("nan")

    print(
        f"\nload average before: {load_avg:.2f}; {wall:.0f} s; dram_contention {c:g}; "
        f"time scale {scale:g}\n"
    )
    print("| engines | throughput/s | contention-aware ideal/s | ratio | p99 ms |")
    print("|---|---|---|---|---|")
    for devices, row in sat.values():
        want = ideal(devices, c, scale)
        got = f(row, "throughput_rps")
        print(
            f"| {{{', '.join(devices)}}} | {got:.1f} | {want:.1f} | {got / want:.3f} "
            f"| {f(row, 'latency_p99_ms'):.2f} |"
        )
    print("\n| policy | offered/s | OK/s | goodput/s | goodput/offered | p99 ms | shed |")
    print("|---|---|---|---|---|---|---|")
    for policy, row in streams.items():
        offered = f(row, "offered_rps")
        print(
            f"| {policy} | {offered:.0f} | {f(row, 'throughput_rps'):.1f} "
            f"| {f(row, 'goodput_rps'):.1f} | {f(row, 'goodput_rps') / offered:.3f} "
            f"| {f(row, 'latency_p99_ms'):.2f} | {100 * f(row, 'shed_fraction'):.1f}% |"
        )
    pool = f(streams["latency"], "goodput_rps")
    for split in ("static", "static-even"):
        print(f"\npool / {split} split goodput: {pool / f(streams[split], 'goodput_rps'):.3f}")
    print()
    print("| policy | rate/s | p50 ms | p99 ms |")
    print("|---|---|---|---|")
    for policy, row in light.items():
        print(
            f"| {policy} | {f(row, 'throughput_rps'):.1f} | {f(row, 'latency_p50_ms'):.2f} "
            f"| {f(row, 'latency_p99_ms'):.2f} |"
        )
    lat, thr = light["latency"], light["throughput"]
    p50, p99 = (f(lat, k) / f(thr, k) for k in ("latency_p50_ms", "latency_p99_ms"))
    print(f"\nlatency / throughput policy: p50 {p50:.3f}, p99 {p99:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
