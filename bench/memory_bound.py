"""The daemon's memory under large frames from many connections (docs/reliability.md "Bounded
memory"), against the code before the frame budget and this code, in one run.

    git worktree add /tmp/before <a commit before the frame budget>    # the baseline's code
    python bench/memory_bound.py --before /tmp/before [--connections 40]

The daemon: two emulated DLA cores in timing mode at 0.2 s a frame (what is admitted stays).
``--frame 4096``: the default limits (4096 x 4096 images, 64 MiB messages; this code: a 512 MiB
frame budget), each of ``--connections`` DEALERs sends one 4096 x 4096 x 3 frame (48 MiB);
``--frame 1080``: limits set to 1920 x 1080 (``max_message_bytes`` 8 MiB), 1080p frames (6.2 MB).
``--max-connections N`` adds a run of this code with ``[frontend] max_connections = N``.
All frames are one buffer on the client side. The daemon's RSS is sampled every 20 ms until every
frame is answered or 20 s, and once more 2 s after.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import zmq
from orin_config import (  # bench/, beside this script
    DEMO_LOADABLES,
    emulated_dlas,
    rss_mib,
    running_daemon,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "clients")]
from dlad import protocol  # noqa: E402

CONFIG = (
    """
[frontend]
endpoints = ["{endpoint}"]
{limits}[pre_post]
enabled = false
[metrics]
enabled = false
"""
    + emulated_dlas(200_000.0)
    + '[models.demo]\ndevices = ["dla0", "dla1"]\n'
    + DEMO_LOADABLES
)


LIMITS_1080 = "max_image_width = 1920\nmax_image_height = 1080\nmax_message_bytes = 8388608\n"


def one(
    tree: Path | None, connections: int, frame: int, log: Path, cap: int | None = None
) -> tuple[float, float, float, Counter[str]]:
    """(RSS before, peak RSS, RSS 2 s after, reply statuses)."""
    shape = (4096, 4096, 3) if frame == 4096 else (1080, 1920, 3)
    frames = protocol.encode(protocol.InferRequest(1, "demo", np.zeros(shape, np.uint8)))
    limits = "" if frame == 4096 else LIMITS_1080
    if cap is not None:
        limits += f"max_connections = {cap}\n"
    config = CONFIG.replace("{limits}", limits)
    with running_daemon(config, log, tree=tree) as (proc, endpoint):
        start = peak = rss_mib(proc.pid)
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(0.02):
                peak = max(peak, rss_mib(proc.pid))

        sampler = threading.Thread(target=sample)
        sampler.start()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        socks = []
        for _ in range(connections):
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            s.connect(endpoint)
            socks.append(s)
        for s in socks:
            s.send_multipart(frames, copy=False)
        statuses: Counter[str] = Counter()
        deadline = time.monotonic() + 20
        waiting = set(range(connections))
        while waiting and time.monotonic() < deadline:
            for i in list(waiting):
                if socks[i].poll(10):
                    statuses[protocol.decode_reply(socks[i].recv_multipart()).status.name] += 1
                    waiting.discard(i)
        statuses["unanswered in 20 s"] = len(waiting)
        done.set()
        sampler.join()
        time.sleep(2)
        after = rss_mib(proc.pid)
        for s in socks:
            s.close(0)
        ctx.term()
    return start, peak, after, statuses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="a checkout of the baseline")
    p.add_argument("--connections", type=int, default=40)
    p.add_argument("--frame", type=int, choices=(4096, 1080), default=4096)
    p.add_argument("--max-connections", type=int, default=None,
                   help="also run this code with [frontend] max_connections = N")  # fmt: skip
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "memory")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{args.connections} connections x one frame of {args.frame}\n")
    print("| code | RSS before MiB | peak RSS MiB | RSS 2 s after MiB | replies |")
    print("|---|---|---|---|---|")
    runs: list[tuple[str, Path | None, int | None]] = [
        ("before", args.before, None),
        ("now", None, None),
    ]
    if args.max_connections is not None:
        runs.append((f"now, max_connections {args.max_connections}", None, args.max_connections))
    for code, tree, cap in runs:
        log = args.out / f"{code.split(',')[0]}_{args.frame}_{cap}.log"
        start, peak, after, statuses = one(tree, args.connections, args.frame, log, cap)
        replies = ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()) if v)
        print(f"| {code} | {start:.0f} | {peak:.0f} | {after:.0f} | {replies} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
