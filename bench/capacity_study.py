"""Capacity study of the emulated Orin with dlad-bench (docs/BENCHMARKS.md §5), in one run.

    python bench/capacity_study.py [--out runs/capacity] [--img docs/img] [--latency-us 3820]

Starts one ``dlad`` process (two emulated DLA cores in timing mode at the published YOLOv5s-672
FP16-heads service time, 3.82 ms per frame per core; pre/post-processing off, so the engines,
not this machine's two CPU cores, are the bottleneck), then runs ``dlad-bench`` against it:

1. a closed-loop concurrency sweep, 2 … 18 in flight;
2. an open-loop Poisson rate sweep from 0.25x to 2x the engines' summed capacity;
3. camera streams: 8, 16 and 24 cameras at 30 fps (one-frame-period deadlines);

and writes the CSV/JSON of each under ``--out``, four plots under ``--img`` (throughput and p99
vs load for sweeps 1 and 2, the latency CDFs of sweep 2, and a 60 ms device timeline of its 2x
level, a saturated window), and prints a markdown summary: for each level throughput, p99 and
shed fraction, and how close the saturated throughput comes to the sum of the engines'
capacities (ideal: 2 / service time; also against the device time the replies report).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """
[daemon]
default_deadline_ms = 1000.0
[frontend]
endpoints = ["{endpoint}"]
sndhwm = 1000
[metrics]
enabled = true
port = {metrics_port}
[pre_post]
enabled = false
[devices.dla0]
kind = "dla"
core = 0
queue_depth = 8
mode = "timing"
latency_us = {latency}
[devices.dla1]
kind = "dla"
core = 1
queue_depth = 8
mode = "timing"
latency_us = {latency}
[models.demo]
devices = ["dla0", "dla1"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
core1 = "bundled:demo/fp16_heads.dla1.emu"
"""
COMMON = ["--input", "random:640x480", "--warmup-s", "1", "--window-s", "1.5",
          "--stability-pct", "10", "--max-trials", "6", "--quiet"]  # fmt: skip


def bench(endpoint: str, out: Path, name: str, *args: str) -> list[dict[str, str]]:
    plots = out / f"{name}_plots"
    cmd = [
        sys.executable, "-m", "dlad_bench", "--endpoint", endpoint, *COMMON, *args,
        "--csv", str(out / f"{name}.csv"), "--json", str(out / f"{name}.json"),
        "--plots", str(plots),
    ]  # fmt: skip
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)
    with (out / f"{name}.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def fnum(row: dict[str, str], key: str) -> float:
    return float(row[key]) if row[key] else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "capacity")
    p.add_argument("--img", type=Path, default=ROOT / "docs" / "img")
    p.add_argument("--latency-us", type=float, default=3820.0)
    p.add_argument("--metrics-port", type=int, default=19464)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.img.mkdir(parents=True, exist_ok=True)
    capacity = 2 * 1e6 / args.latency_us
    tmp = Path(tempfile.mkdtemp(prefix="dlad-capacity-"))
    endpoint = f"ipc://{tmp}/dlad.sock"
    cfg = tmp / "dlad.toml"
    cfg.write_text(
        CONFIG.format(endpoint=endpoint, latency=args.latency_us, metrics_port=args.metrics_port)
    )
    log = (args.out / "daemon.log").open("w")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "dlad.cli", "--config", str(cfg)], stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 30
        while "listening" not in (args.out / "daemon.log").read_text():
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("dlad did not start; see daemon.log")
            time.sleep(0.1)
        load_avg = os.getloadavg()[0]
        t0 = time.monotonic()
        conc = bench(endpoint, args.out, "concurrency", "--concurrency", "2:18:4")
        step = round(capacity / 4)  # 0.25x ... 2x capacity in 8 levels
        rates = f"{step}:{8 * step}:{step}"
        pois = bench(
            endpoint, args.out, "poisson", "--rate", rates, "--arrivals", "poisson",
            "--timeline-ms", "60", "--capacity-rps", f"{capacity:.1f}",
        )  # fmt: skip
        cams = bench(endpoint, args.out, "streams", "--streams", "8:24:8", "--fps", "30")
        wall = time.monotonic() - t0
    finally:
        daemon.terminate()
        daemon.wait(30)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    for src, dst in [
        ("concurrency_plots/load.png", "capacity_concurrency.png"),
        ("poisson_plots/load.png", "capacity_poisson.png"),
        ("poisson_plots/latency_cdf.png", "capacity_poisson_cdf.png"),
        ("poisson_plots/timeline.png", "capacity_timeline.png"),
    ]:
        shutil.copyfile(args.out / src, args.img / dst)

    def table(rows: list[dict[str, str]], level: str) -> None:
        print(f"| {level} | offered/s | OK/s | good/s | p50 ms | p99 ms | shed | late sends |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            offered = fnum(r, "offered_rps")
            print(
                f"| {float(r['level']):g} | {'-' if math.isnan(offered) else f'{offered:.0f}'} "
                f"| {fnum(r, 'throughput_rps'):.1f} | {fnum(r, 'goodput_rps'):.1f} "
                f"| {fnum(r, 'latency_p50_ms'):.2f} | {fnum(r, 'latency_p99_ms'):.2f} "
                f"| {100 * fnum(r, 'shed_fraction'):.1f}% | {100 * fnum(r, 'late_fraction'):.1f}% |"
            )

    print(f"\nload average before: {load_avg:.2f}; {wall:.0f} s of benchmarking\n")
    print("concurrency sweep:")
    table(conc, "in flight")
    print("\nPoisson sweep:")
    table(pois, "rate")
    print("\ncamera streams at 30 fps:")
    table(cams, "streams")
    best = max(fnum(r, "throughput_rps") for r in conc + pois)
    device_ms = [fnum(r, "daemon_device_ms") for r in pois if fnum(r, "daemon_device_ms") > 0]
    measured_capacity = 2 * 1e3 / (sum(device_ms) / len(device_ms))
    print(
        f"\nsaturated throughput {best:.1f}/s = {best / capacity:.3f} of the engines' summed "
        f"capacity 2 / {args.latency_us / 1e3:.2f} ms = {capacity:.1f}/s, and "
        f"{best / measured_capacity:.3f} of 2 / the replies' mean device time "
        f"({2e3 / measured_capacity:.3f} ms) = {measured_capacity:.1f}/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
