"""One model on two emulated DLA cores and the real H200 GPU at once, through the SDK
(docs/BENCHMARKS.md §7.3). Run on the device machine by ``bench/h200_pool.sh``.

    python3 bench/h200_pool.py [--out DIR] [--dla-us 3820] [--policy latency|throughput]

1. Exports the bundled demo model's torch program here (``prep.torch_export``; a ``.pt2`` is read
   by the torch that wrote it).
2. Starts one ``dlad`` per engine set, {dla0, dla1}, {gpu} and {dla0, dla1, gpu}: the DLA cores
   emulated in timing mode at ``--dla-us`` a frame (default: YOLOv5s-672's published 3.82 ms, so
   the DLAs are as much slower than this GPU as an Orin's are than its GPU), the GPU running the
   model for real (``engine = "torch"``, one CUDA graph per batch size up to 16), pre/post-
   processing on (letterbox and quantise on CPU threads for the GPU's batches, CUDA kernels for
   the DLA slots), the bundled images as input.
3. Drives each with ``dlad-bench`` closed loop with as many requests in flight as its engines'
   queues and slots hold (none refused), and prints throughput, p50/p99, each device's share and
   mean batch, and the pool against the sum of its parts.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from pathlib import Path

from orin_config import demo_model, emulated_dlas, running_daemon  # bench/, beside this script

ROOT = Path(__file__).resolve().parents[1]
HELD = {"dla0": 8 + 2, "dla1": 8 + 2, "gpu": 64 + 2 * 16}
"""Jobs each engine holds: its queue_depth below, plus its slots' jobs in flight."""
CONFIG = """
[daemon]
default_deadline_ms = 2000.0
[frontend]
endpoints = ["{endpoint}"]
sndhwm = 4000
rcvhwm = 4000
[pre_post]
threads = 8
[scheduler]
policy = "{policy}"
{dlas}[devices.gpu]
kind = "gpu"
engine = "torch"
queue_depth = 64
max_batch = 16
{model}torch = "{program}"
"""


def run_set(out: Path, name: str, devices: list[str], program: Path, args: argparse.Namespace):
    text = CONFIG.format(
        endpoint="{endpoint}", dlas=emulated_dlas(args.dla_us), program=program,
        policy=args.policy,
        model=demo_model(devices),
    )  # fmt: skip
    with running_daemon(text, out / f"{name}.daemon.log", start_timeout_s=120) as (_, endpoint):
        cmd = [
            sys.executable, "-m", "dlad_bench", "--endpoint", endpoint, "--input", "demo",
            "--concurrency", str(sum(HELD[d] for d in devices)),
            "--warmup-s", "2", "--window-s", "2",
            "--stability-pct", "5", "--max-trials", "6", "--quiet",
            "--csv", str(out / f"{name}.csv"), "--json", str(out / f"{name}.json"),
            "--plots", str(out / f"{name}_plots"), "--timeline-ms", "20",
        ]  # fmt: skip
        print("$", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True)
    with (out / f"{name}.csv").open(newline="") as f:
        return list(csv.DictReader(f))[-1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")) / "pool")
    p.add_argument("--dla-us", type=float, default=3820.0)
    p.add_argument("--policy", choices=["latency", "throughput"], default="latency",
                   help="[scheduler] policy of every daemon")  # fmt: skip
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from dlad.models import DEMO
    from prep.torch_export import export_torch

    program = export_torch(DEMO / "fp16_heads.dla0.emu", args.out / "demo.pt2", max_batch=16)
    rows = {}
    for devices in (["dla0", "dla1"], ["gpu"], ["dla0", "dla1", "gpu"]):
        name = "_".join(devices)
        rows[name] = run_set(args.out, name, devices, program, args)

    def f(row: dict[str, str], key: str) -> float:
        return float(row[key]) if row.get(key) else float("nan")

    print(f"\nemulated DLA {args.dla_us:g} us a frame\n")
    print("| engines | OK/s | p50 ms | p99 ms | device share | mean batch |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(
            f"| {{{name.replace('_', ', ')}}} | {f(row, 'throughput_rps'):.1f} "
            f"| {f(row, 'latency_p50_ms'):.2f} | {f(row, 'latency_p99_ms'):.2f} "
            f"| {row['device_share']} | {row['device_batch']} |"
        )
    parts = f(rows["dla0_dla1"], "throughput_rps") + f(rows["gpu"], "throughput_rps")
    pool = f(rows["dla0_dla1_gpu"], "throughput_rps")
    print(f"\npool / (DLA pair + GPU alone) = {pool:.1f} / {parts:.1f} = {pool / parts:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
