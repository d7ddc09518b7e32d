"""Engine health under injected faults (docs/reliability.md "Quarantine and failover"), in one run.

    git worktree add /tmp/before <a commit before [health]>    # the baseline's code
    python bench/health_failover.py --before /tmp/before [--out runs/health] [--rate-fraction 0.6]

Two emulated DLA cores in timing mode (3.82 ms a frame, pre/post off), one model on both; dla0
faulty, dla1 sound. For each fault, the same Poisson load (``--rate-fraction`` of the pair's
capacity, deadline 100 ms) through ``dlad-bench`` against three daemons:

- **before**: the code of ``--before`` (a checkout from before ``[health]``):
  placement that learns nothing from failures, and each failure is the answer;
- **retry only**: this code, ``[health] quarantine_after = 0`` (failure-weighted placement and
  one retry on the other core, never a quarantine);
- **health**: the defaults (as retry only, plus quarantine after 5 failures in a row or one
  hang, probes from 1 s).

Faults: ``error_rate 0.3`` (a flaky core), ``hang_rate 0.3`` (tasks that never end, the task
timeout 100 ms), and a core that hangs every task after its warm-up. Goodput = frames answered OK
within their deadline, per second. Then **time to fence off a hung core**: a daemon whose dla0
hangs every task after warm-up; one request at a time, STATUS polled every 5 ms; the time from
the first request to dla0 ``quarantined``, against its task timeout.
"""

from __future__ import annotations

import argparse
import csv
import random
import subprocess
import sys
import time
from pathlib import Path

from orin_config import DEMO_LOADABLES, running_daemon  # bench/, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "clients")]
from dlad_client import Client, DladError  # noqa: E402

DLA_US, TIMEOUT_MS = 3820.0, 100.0
CONFIG = (
    """
[daemon]
default_deadline_ms = 1000.0
[frontend]
endpoints = ["{{endpoint}}"]
[pre_post]
enabled = false
[metrics]
enabled = false
{health}[devices.dla0]
kind = "dla"
core = 0
mode = "timing"
latency_us = {dla_us}
task_timeout_ms = {timeout}
[devices.dla0.faults]
error_rate = {error_rate}
hang_rate = {hang_rate}
seed = {seed}
[devices.dla1]
kind = "dla"
core = 1
mode = "timing"
latency_us = {dla_us}
task_timeout_ms = {timeout}
[models.demo]
devices = ["dla0", "dla1"]
"""
    + DEMO_LOADABLES
)
FAULTS = {  # name: (error_rate, hang_rate)
    "error_rate 0.3": (0.3, 0.0),
    "hang_rate 0.3": (0.0, 0.3),
    "hangs after warm-up": (0.0, 0.999),
}
MODES = {  # name: [health] table (None: the --before tree, which has none)
    "before": None,
    "retry only": "[health]\nquarantine_after = 0\n",
    "health": "[health]\n",
}


def warm_seed(rate: float) -> int:
    """A fault seed whose first draw (the warm-up task) passes."""
    return next(s for s in range(100_000) if random.Random(s).random() >= rate)


def config(mode: str, error_rate: float, hang_rate: float) -> str:
    return CONFIG.format(
        health=MODES[mode] or "", dla_us=DLA_US, timeout=TIMEOUT_MS, error_rate=error_rate,
        hang_rate=hang_rate, seed=warm_seed(error_rate + hang_rate),
    )  # fmt: skip


def bench(endpoint: str, out: Path, name: str, rate: float) -> dict[str, str]:
    cmd = [
        sys.executable, "-m", "dlad_bench", "--endpoint", endpoint, "--input", "random:640x480",
        "--rate", f"{rate:.1f}", "--arrivals", "poisson", "--deadline-ms", "100",
        "--warmup-s", "1", "--window-s", "3", "--stability-pct", "10", "--max-trials", "3",
        "--quiet", "--csv", str(out / f"{name}.csv"), "--json", str(out / f"{name}.json"),
    ]  # fmt: skip
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)
    with (out / f"{name}.csv").open(newline="") as f:
        return list(csv.DictReader(f))[-1]


def time_to_fence(out: Path) -> float:
    """Seconds from the first request to dla0 quarantined, on a core that hangs every task."""
    with running_daemon(config("health", 0.0, 0.999), out / "fence.daemon.log") as (_, ep):
        import numpy as np

        image = np.zeros((480, 640, 3), np.uint8)
        with Client(ep, timeout_s=10) as client:
            handle = client.submit(image)
            t0 = time.monotonic()
            while True:
                devices = {d["name"]: d for d in client.status()["devices"]}
                if devices["dla0"]["state"] == "quarantined":
                    fenced = time.monotonic() - t0
                    break
                if time.monotonic() - t0 > 10:
                    raise SystemExit("dla0 was not fenced off within 10 s")
                time.sleep(0.005)
            try:
                handle.result()
            except DladError as exc:
                print("first request:", type(exc).__name__, exc)
    return fenced


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "health")
    p.add_argument("--rate-fraction", type=float, default=0.6)
    p.add_argument("--before", type=Path, required=True, help="a checkout of the baseline")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rate = args.rate_fraction * 2 * 1e6 / DLA_US
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for fault, (error_rate, hang_rate) in FAULTS.items():
        for mode in MODES:
            name = f"{fault}_{mode}".replace(" ", "_")
            text = config(mode, error_rate, hang_rate)
            tree = args.before if mode == "before" else None
            log_path = args.out / f"{name}.daemon.log"
            with running_daemon(text, log_path, tree=tree) as (_, endpoint):
                rows[fault, mode] = bench(endpoint, args.out, name, rate)
    fenced = time_to_fence(args.out)

    def f(row: dict[str, str], key: str) -> float:
        return float(row[key]) if row.get(key) else float("nan")

    print(f"\nPoisson {rate:.0f}/s ({args.rate_fraction:g} of two cores), deadline 100 ms\n")
    print("| dla0's fault | daemon | goodput/s | OK % | shares | goodput / before |")
    print("|---|---|---|---|---|---|")
    for fault in FAULTS:
        base = f(rows[fault, "before"], "goodput_rps")
        for mode in MODES:
            row = rows[fault, mode]
            ok = 100 * f(row, "throughput_rps") / f(row, "offered_rps")
            print(f"| {fault} | {mode} | {f(row, 'goodput_rps'):.1f} | {ok:.1f} "
                  f"| {row['device_share']} | {f(row, 'goodput_rps') / base:.3f} |")  # fmt: skip
    print(f"\ntime to fence off a hung core: {1e3 * fenced:.0f} ms "
          f"(task timeout {TIMEOUT_MS:g} ms)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
