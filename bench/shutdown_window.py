"""Requests lost while the daemon shuts down (docs/reliability.md "Shutdown"), in one run.

    git worktree add /tmp/before <a commit before the drain>    # the baseline's code
    python bench/shutdown_window.py --before /tmp/before [--rate 2000] [--runs 5]

For the code of ``--before`` and this code, ``--runs`` times: a daemon (two emulated DLA cores in
timing mode, 2 ms a frame), one client sending 64x64 INFERs open loop at ``--rate``; after 0.5 s
the daemon gets SIGTERM; the client goes on sending until 0.3 s after the process has exited,
then waits 1 s for replies. A request is **lost** if it got no reply although it was sent more
than 50 ms before the daemon stopped reading (so it reached the socket while it was open:
loopback delivers in microseconds). When it stopped reading is taken from its log: this code
logs ``closing`` after its last read; the older code logs ``stopped`` right after closing the
socket, reads nothing after its drain, and is charged from that line. Requests sent later went
to a closed port; nobody read them.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import zmq
from orin_config import DEMO_LOADABLES, emulated_dlas, running_daemon  # bench/, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "clients")]
from dlad import protocol  # noqa: E402

CONFIG = (
    """
[frontend]
endpoints = ["{endpoint}"]
[metrics]
enabled = false
"""
    + emulated_dlas(2000.0)
    + '[models.demo]\ndevices = ["dla0", "dla1"]\n'
    + DEMO_LOADABLES
)
MARGIN_S = 0.05


def last_read(log_path: Path) -> float:
    """When the daemon last read its socket (epoch seconds), from its log."""
    stamps = {}
    for line in log_path.read_text().splitlines():
        for event in ("closing", "stopped"):
            if f"] {event} " in line or line.rstrip().endswith(f"] {event}"):
                stamp = line.split()[0].replace("Z", "+00:00")
                stamps[event] = datetime.fromisoformat(stamp).timestamp()
    return stamps.get("closing", stamps["stopped"])


def one_run(tree: Path | None, rate: float, log_path: Path) -> tuple[int, int, int]:
    """(sent, answered, lost) of one shutdown."""
    image = np.zeros((64, 64, 3), np.uint8)
    sent_at: dict[int, float] = {}
    answered: set[int] = set()
    with running_daemon(CONFIG, log_path, tree=tree) as (proc, endpoint):
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(endpoint)
        exited: list[float] = []

        def watch() -> None:
            while proc.poll() is None:
                time.sleep(0.001)
            exited.append(time.monotonic())

        threading.Thread(target=watch, daemon=True).start()
        t0 = time.monotonic()
        i = 0
        signalled = False
        while not exited or time.monotonic() < exited[0] + 0.3:
            due = t0 + i / rate
            if time.monotonic() >= due:
                sock.send_multipart(protocol.encode(protocol.InferRequest(i, "demo", image)))
                sent_at[i] = time.time()  # the daemon's log has wall-clock times
                i += 1
            while sock.poll(0):
                answered.add(int(protocol.decode_reply(sock.recv_multipart()).id or 0))
            if not signalled and time.monotonic() > t0 + 0.5:
                proc.terminate()
                signalled = True
        while sock.poll(1000):
            answered.add(int(protocol.decode_reply(sock.recv_multipart()).id or 0))
        sock.close(0)
        ctx.term()
    closed = last_read(log_path)
    lost = sum(1 for r, t in sent_at.items() if r not in answered and t < closed - MARGIN_S)
    return len(sent_at), len(answered), lost


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="a checkout of the baseline")
    p.add_argument("--rate", type=float, default=2000.0)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "shutdown")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"open loop at {args.rate:g}/s; lost = unanswered, sent > {MARGIN_S * 1e3:g} ms "
          "before the daemon last read\n")  # fmt: skip
    print("| code | run | sent | answered | lost |")
    print("|---|---|---|---|---|")
    totals: dict[str, int] = {}
    for name, tree in (("before", args.before), ("now", None)):
        for run in range(args.runs):
            sent, answered, lost = one_run(tree, args.rate, args.out / f"{name}{run}.log")
            totals[name] = totals.get(name, 0) + lost
            print(f"| {name} | {run} | {sent} | {answered} | {lost} |", flush=True)
    print(f"\nlost in {args.runs} shutdowns: before {totals['before']}, now {totals['now']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
