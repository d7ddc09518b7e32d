"""Fuzz a running dlad: mutated multipart messages from separate processes, a well-behaved
client beside them (docs/reliability.md, "Fuzzing the frontend").

    python bench/fuzz_frontend.py [--messages 1000000] [--procs 1] [--seed 1] [--out F.json]
                                  [--tree DIR [--sanitizers]]

Starts one daemon (the emulated Orin's three engines in timing mode, ``max_message_bytes`` 1
MiB so that oversize mutations stay cheap), then ``--procs`` processes each send their share of
``dlad_bench.fuzz.messages`` from one DEALER (64 in flight), while this process's SDK client
sends a real 640x480 INFER and a STATUS ten times a second and checks every answer. The daemon's
RSS is sampled every half second. Exits 1 unless the daemon is alive at the end, answered every
fuzz message exactly once (each reply decodable), and answered every well-behaved request (OK,
or a typed refusal such as OVERLOADED when the fuzzer's valid INFERs fill the queues).

``--tree DIR``: the daemon of that checkout. ``--sanitizers``: its C++ core was built with
AddressSanitizer and UndefinedBehaviorSanitizer (``CFLAGS`` and ``LDFLAGS``
``-fsanitize=address,undefined -fno-sanitize-recover=all``, then ``python setup.py build_ext
--inplace`` there); the daemon runs with their runtimes preloaded, any report fatal, so a
finding ends it and the campaign fails with the report in the daemon's log.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from orin_config import (  # bench/, beside this script
    demo_model,
    emulated_dlas,
    rss_mib,
    running_daemon,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "clients")]
from dlad_bench.fuzz import CampaignResult, campaign  # noqa: E402
from dlad_client import Client, DladError  # noqa: E402

MAX_MESSAGE_BYTES = 2**20
CONFIG = """
[frontend]
endpoints = ["{endpoint}"]
cheap_requests_per_s = 1000000.0  # the decoder's refusals, not the junk rate limit, are tested
max_message_bytes = {max_bytes}
max_image_width = 640
max_image_height = 480
[metrics]
enabled = false
{dlas}[devices.gpu]
kind = "gpu"
mode = "timing"
latency_us = 1820.0
{model}"""


def sanitizer_env() -> dict[str, str]:
    """What a Python process needs to load a core built with ASan and UBSan: their runtimes
    first, leaks not counted (the interpreter keeps its objects at exit), every report fatal."""
    libs = []
    for name in ("libasan.so", "libubsan.so"):
        found = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True,
                               text=True, check=True).stdout.strip()  # fmt: skip
        libs.append(os.path.realpath(found))
    return {"LD_PRELOAD": ":".join(libs),
            "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1",
            "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}  # fmt: skip


def fuzz(args: tuple[str, int, int]) -> CampaignResult:
    endpoint, count, seed = args
    return campaign(endpoint, count, seed=seed, max_message_bytes=MAX_MESSAGE_BYTES)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--messages", type=int, default=1_000_000)
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path)
    p.add_argument("--tree", type=Path, help="the daemon of this checkout")
    p.add_argument("--sanitizers", action="store_true", help="its core has ASan and UBSan")
    args = p.parse_args()
    env = sanitizer_env() if args.sanitizers else None
    text = CONFIG.format(
        endpoint="{endpoint}", max_bytes=MAX_MESSAGE_BYTES, dlas=emulated_dlas(3820.0),
        model=demo_model(["dla0", "dla1", "gpu"]),
    )  # fmt: skip
    log_path = Path(tempfile.mkdtemp(prefix="dlad-fuzz-")) / "daemon.log"
    with running_daemon(text, log_path, tree=args.tree, env=env) as (daemon, endpoint):
        summary = campaign_against(daemon, endpoint, args)
    summary["exit_code"] = daemon.returncode
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    polite = summary["well_behaved"]
    ok = summary["daemon_alive"] and summary["unanswered"] == 0 == summary["undecodable"]
    ok = ok and summary["messages"] == args.messages
    ok = ok and polite["unanswered"] == 0 and polite["ok"] > 0
    return 0 if ok else 1


def campaign_against(
    daemon: subprocess.Popen[bytes], endpoint: str, args: argparse.Namespace
) -> dict[str, Any]:
    """The campaign of ``main``'s docstring against a started daemon; its summary."""
    rss = [rss_mib(daemon.pid)]
    done = threading.Event()
    polite: dict[str, int] = {"sent": 0, "ok": 0, "refused": 0, "unanswered": 0}
    errors: list[str] = []
    latencies: list[float] = []

    def sample() -> None:
        while not done.wait(0.5):
            if daemon.poll() is None:
                rss.append(rss_mib(daemon.pid))

    def well_behaved() -> None:
        image = np.random.default_rng(0).integers(0, 256, (480, 640, 3), np.uint8)
        with Client(endpoint, timeout_s=30) as client:
            while not done.is_set():
                for call in ("detect", "status"):
                    polite["sent"] += 1
                    t0 = time.perf_counter()
                    try:
                        client.detect(image, model="demo") if call == "detect" else client.status()
                    except DladError as exc:  # answered, with a typed refusal
                        polite["refused"] += 1
                        errors.append(f"{type(exc).__name__}: {exc}")
                    except TimeoutError as exc:
                        polite["unanswered"] += 1
                        errors.append(f"{type(exc).__name__}: {exc}")
                    else:
                        polite["ok"] += 1
                        if call == "detect":
                            latencies.append(time.perf_counter() - t0)
                done.wait(0.1)

    threads = [threading.Thread(target=f, daemon=True) for f in (sample, well_behaved)]
    for t in threads:
        t.start()
    shares = [(endpoint, args.messages // args.procs + (i < args.messages % args.procs),
               args.seed + i) for i in range(args.procs)]  # fmt: skip
    t0 = time.monotonic()
    with multiprocessing.get_context("spawn").Pool(args.procs) as pool:
        results = pool.map(fuzz, shares)
    wall = time.monotonic() - t0
    done.set()
    for t in threads:
        t.join(60)
    alive = daemon.poll() is None
    if alive:
        try:
            with Client(endpoint, timeout_s=10) as client:
                alive = bool(client.status()["ready"])
        except (DladError, TimeoutError):
            alive = False
    sent = sum(r.sent for r in results)
    replies = sum(r.replies for r in results)
    undecodable = sum(r.undecodable for r in results)
    statuses: dict[str, int] = {}
    for r in results:
        for name, n in r.statuses.items():
            statuses[name] = statuses.get(name, 0) + n
    p99 = float(np.percentile(latencies, 99) * 1e3) if latencies else float("nan")
    summary = {
        "messages": sent, "replies": replies, "unanswered": sent - replies,
        "undecodable": undecodable, "statuses": statuses, "wall_s": round(wall, 1),
        "messages_per_s": round(sent / wall), "daemon_alive": alive, "rss_mib": {
            "start": round(rss[0], 1), "peak": round(max(rss), 1),
            "end": round(rss[-1], 1),
            "after_first_10pct": round(rss[max(1, len(rss) // 10)], 1) if len(rss) > 1
            else None,
        },
        "well_behaved": {**polite, "errors": sorted(set(errors))[:5],
                         "infer_ok_p99_ms": round(p99, 2)},
        "procs": args.procs, "seed": args.seed, "cpus": os.cpu_count(),
    }  # fmt: skip
    return summary


if __name__ == "__main__":
    sys.exit(main())
