"""One model on two emulated DLA cores and the real H200 GPU at once, through the SDK
(docs/BENCHMARKS.md §7.3). Run on the device machine by ``bench/h200_pool.sh``.

    python3 bench/h200_pool.py [--out DIR] [--dla-us 3820] [--policy latency|throughput]
        [--clients 4] [--repeat N] [--profile]

1. Exports the bundled demo model's torch program here (``prep.torch_export``; a ``.pt2`` is read
   by the torch that wrote it).
2. Starts one ``dlad`` per engine set, {dla0, dla1}, {gpu} and {dla0, dla1, gpu}: the DLA cores
   emulated in timing mode at ``--dla-us`` a frame (default: YOLOv5s-672's published 3.82 ms, so
   the DLAs are as much slower than this GPU as an Orin's are than its GPU), the GPU running the
   model for real (``engine = "torch"``, one CUDA graph per batch size up to 16), pre/post-
   processing on (letterbox and quantise on CPU threads for the GPU's batches, CUDA kernels for
   the DLA slots), the bundled images as input.
3. Drives each with ``--clients`` dlad-bench processes (default 4: one Python client tops out
   near 5,000 requests/s, below what the GPU serves) closed loop, with as many requests in flight
   in all as its engines' queues and slots hold (none refused), three fixed 2 s windows each, and
   prints throughput (summed), p50/p99 (the clients' highest), each device's share and mean
   batch, and the pool against the GPU alone and against the sum of its parts; with
   ``--repeat N``, N trials of the GPU alone and the pool, alternating, each trial's ratios and
   their median.
4. Says where the host's time went in each run: the cores each thread of the daemon and of the
   client kept busy (CPU seconds over the run's wall time, threads of one name summed) and the
   whole machine's busy cores, so a figure bound by the host says by which thread.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from daemon_throughput import (  # bench/, beside this script
    Threads,
    read_threads,
    start_profile,
    top_functions,
)
from orin_config import demo_model, emulated_dlas, running_daemon

ROOT = Path(__file__).resolve().parents[1]
HELD = {"dla0": 8 + 2, "dla1": 8 + 2, "gpu": 64 + 2 * 16}
"""Jobs each engine holds: its queue_depth below, plus its slots' jobs in flight."""
CONFIG = """
[daemon]
default_deadline_ms = 2000.0
[frontend]
endpoints = ["{endpoint}"]
sndhwm = 4000
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


def run_set(
    out: Path, name: str, devices: list[str], program: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """One daemon on ``devices``, driven by ``args.clients`` dlad-bench processes at once (one
    Python client tops out near 5,000 requests/s: one process would measure itself), each with
    its share of the requests in flight and the same fixed windows; returns the sum of their OK/s,
    their highest p50 and p99, and the devices' shares and mean batches weighted by OK/s."""
    text = CONFIG.format(
        endpoint="{endpoint}", dlas=emulated_dlas(args.dla_us), program=program,
        policy=args.policy,
        model=demo_model(devices),
    )  # fmt: skip
    held = sum(HELD[d] for d in devices)
    with running_daemon(text, out / f"{name}.daemon.log", start_timeout_s=120) as (
        daemon,
        endpoint,
    ):
        cmds = []
        for i in range(args.clients):
            share = held // args.clients + (i < held % args.clients)
            cmds.append([
                sys.executable, "-m", "dlad_bench", "--endpoint", endpoint, "--input", "demo",
                "--concurrency", str(share), "--warmup-s", "3", "--window-s", "2",
                "--stability-pct", "100", "--stability-windows", "3", "--max-trials", "3",
                "--quiet", "--seed", str(i),
                "--csv", str(out / f"{name}.{i}.csv"), "--json", str(out / f"{name}.{i}.json"),
            ])  # fmt: skip
        print("$", f"{args.clients} x", " ".join(cmds[0][2:]), flush=True)
        busy_before, daemon_before, t0 = machine_busy_s(), read_threads(daemon.pid), time.time()
        clients = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL) for cmd in cmds]
        last = [watch(c) for c in clients]
        spy = None
        if args.profile:  # 4 s in (past the warm-up), the samples of the thread holding the GIL
            time.sleep(4)
            spy = start_profile(daemon.pid, out / f"{name}.gil.raw", 5, gil=True)
        if any(c.wait() != 0 for c in clients):
            raise SystemExit(f"dlad-bench failed: {[c.returncode for c in clients]}")
        wall = time.time() - t0
        readings: Threads = {}
        for i, read in enumerate(last):
            readings.update({(i, f"client {n}"): r for (_, n), r in read().items()})
        print(f"host, cores busy over the run's {wall:.1f} s: machine "
              f"{(machine_busy_s() - busy_before) / wall:.2f} of {os.cpu_count()}; "
              f"daemon {cores(daemon_before, read_threads(daemon.pid), wall)}; "
              f"clients {cores({}, readings, wall)}", flush=True)  # fmt: skip
        if spy is not None and spy.wait() == 0 and (out / f"{name}.gil.raw").exists():
            print(f"daemon's GIL, 5 s:\n{top_functions(out / f'{name}.gil.raw', 12)}")
    rows = []
    for i in range(args.clients):
        with (out / f"{name}.{i}.csv").open(newline="") as f:
            rows.append(list(csv.DictReader(f))[-1])
    return combine(rows)


def combine(rows: list[dict[str, str]]) -> dict[str, Any]:
    """The clients' last rows as one: OK/s summed, the highest p50 and p99, each device's share
    and mean batch weighted by the clients' OK/s."""
    ok = [float(r["throughput_rps"]) for r in rows]
    share: Counter[str] = Counter()  # frames/s each device served
    batch: Counter[str] = Counter()  # frames/s x mean batch
    for r, w in zip(rows, ok, strict=True):
        shares = dict(item.split("=") for item in r["device_share"].split())
        for item in r["device_batch"].split():
            dev, _, b = item.partition("=")
            share[dev] += w * float(shares.get(dev, 0))
            batch[dev] += w * float(shares.get(dev, 0)) * float(b)
    total = sum(ok) or 1.0
    return {
        "ok": sum(ok),
        "p50": max(float(r["latency_p50_ms"]) for r in rows),
        "p99": max(float(r["latency_p99_ms"]) for r in rows),
        "share": " ".join(f"{d}={v / total:.3f}" for d, v in sorted(share.items())),
        "batch": " ".join(f"{d}={v / share[d]:.2f}" for d, v in sorted(batch.items()) if share[d]),
    }


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (``/proc/stat``: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def watch(proc: subprocess.Popen[bytes]):
    """Read ``proc``'s threads every 0.2 s while it runs; returns a function that gives the last
    reading (a process's threads cannot be read once it has exited)."""
    last: list[Threads] = [{}]

    def loop() -> None:
        while proc.poll() is None:
            try:
                last[0] = read_threads(proc.pid)
            except OSError:  # it exited between the poll and the read
                return
            time.sleep(0.2)

    threading.Thread(target=loop, daemon=True).start()
    return lambda: last[0]


def cores(before: Threads, after: Threads, wall: float) -> str:
    """Cores each thread name kept busy between two readings, busiest first (above 0.02)."""
    busy: Counter[str] = Counter()
    for key, r in after.items():
        was = before.get(key)
        busy[key[1]] += r.cpu - (was.cpu if was else 0.0)
    total = sum(busy.values()) / wall
    top = ", ".join(f"{n} {c / wall:.2f}" for n, c in busy.most_common() if c / wall >= 0.02)
    return f"{total:.2f} ({top})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")) / "pool")
    p.add_argument("--dla-us", type=float, default=3820.0)
    p.add_argument("--policy", choices=["latency", "throughput"], default="latency",
                   help="[scheduler] policy of every daemon")  # fmt: skip
    p.add_argument("--clients", type=int, default=4, help="dlad-bench processes (4)")
    p.add_argument("--repeat", type=int, default=1, help="trials of the GPU alone and the pool")
    p.add_argument("--profile", action="store_true",
                   help="sample the daemon's GIL holder with py-spy in each run")  # fmt: skip
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from dlad.models import DEMO
    from prep.torch_export import export_torch

    program = export_torch(DEMO / "fp16_heads.dla0.emu", args.out / "demo.pt2", max_batch=16)
    sets = {"dla0_dla1": ["dla0", "dla1"], "gpu": ["gpu"], "dla0_dla1_gpu": ["dla0", "dla1", "gpu"]}
    # the pair once; the GPU alone and the pool alternately, --repeat times (the host's noise
    # moves both alike within a trial, so each trial's ratio is the figure)
    order = ["dla0_dla1"] + ["gpu", "dla0_dla1_gpu"] * args.repeat
    rows: list[tuple[str, dict[str, Any]]] = []
    for n, name in enumerate(order):
        rows.append((name, run_set(args.out, f"{name}.{n}", sets[name], program, args)))

    print(f"\nemulated DLA {args.dla_us:g} us a frame, {args.policy} policy, "
          f"{args.clients} client processes\n")  # fmt: skip
    print("| engines | OK/s | p50 ms | p99 ms | device share | mean batch |")
    print("|---|---|---|---|---|---|")
    for name, row in rows:
        print(f"| {{{name.replace('_', ', ')}}} | {row['ok']:.1f} | {row['p50']:.2f} "
              f"| {row['p99']:.2f} | {row['share']} | {row['batch']} |")  # fmt: skip
    pair = rows[0][1]["ok"]
    alone = [r["ok"] for name, r in rows if name == "gpu"]
    pools = [r["ok"] for name, r in rows if name == "dla0_dla1_gpu"]
    per_gpu = [p / g for p, g in zip(pools, alone, strict=True)]
    per_sum = [p / (pair + g) for p, g in zip(pools, alone, strict=True)]
    print(f"\npool / GPU alone, each trial: {', '.join(f'{r:.3f}' for r in per_gpu)}; "
          f"median {statistics.median(per_gpu):.3f}")  # fmt: skip
    print(f"pool / (DLA pair + GPU alone), each trial: {', '.join(f'{r:.3f}' for r in per_sum)};"
          f" median {statistics.median(per_sum):.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
