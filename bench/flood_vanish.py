"""Connections that flood the daemon and vanish (docs/reliability.md, "A flood that vanishes"),
against a baseline's code and this code, in one run.

    git worktree add /tmp/before <the baseline's commit>    # the baseline's code
    python bench/flood_vanish.py --before /tmp/before [--rounds 20] [--heartbeat-s 0.05]

Each round, ``--connections`` raw ZMTP peers (``tests/dlad/zmtp_peer.py``) send 1-byte junk with
PING commands among it as fast as the daemon takes it for ``--seconds``, never reading a reply,
then reset the connection. The daemon: one emulated core, ``[frontend] heartbeat_s`` as given
(libzmq's heartbeat timer is one of the two ways to its abort, a PING among the junk the other).
Reported per code: rounds lived through (and how it ended), the daemon's RSS before and after,
connections the daemon cut, and whether a STATUS is answered afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import threading
from pathlib import Path

import zmq
from orin_config import rss_mib, running_daemon  # bench/, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
from dlad import protocol  # noqa: E402
from tests.dlad.test_flood_and_vanish import CONFIG  # noqa: E402
from tests.dlad.zmtp_peer import flood_and_vanish  # noqa: E402


def flood(port: int, seconds: float) -> None:
    with contextlib.suppress(OSError):  # the daemon died under an earlier flood: the round says
        flood_and_vanish("127.0.0.1", port, seconds)


def one(tree: Path | None, args: argparse.Namespace, log: Path) -> str:
    config = CONFIG.replace("heartbeat_s = 0.05", f"heartbeat_s = {args.heartbeat_s}")
    with running_daemon(config, log, tree=tree) as (proc, _):
        port = int(re.findall(r"tcp://127\.0\.0\.1:(\d+)", log.read_text())[-1])
        start, lived = rss_mib(proc.pid), 0
        for _ in range(args.rounds):
            floods = [threading.Thread(target=flood, args=(port, args.seconds))
                      for _ in range(args.connections)]  # fmt: skip
            for t in floods:
                t.start()
            for t in floods:
                t.join()
            if proc.poll() is not None:
                break
            lived += 1
        if proc.poll() is not None:
            abort = re.search(r"Assertion failed: [^\n]*", log.read_text())
            how = f"exit {proc.returncode}" + (f" ({abort.group(0)})" if abort else "")
            return f"{lived} of {args.rounds}, {how} | {start:.0f} | - | - | no |"
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(protocol.encode(protocol.StatusRequest(1)))
        answered = sock.poll(30_000) and protocol.decode_reply(sock.recv_multipart()).id == 1
        sock.close(0)
        ctx.term()
        after = rss_mib(proc.pid)
    cuts = sum(int(n) for n in re.findall(r"connections_cut=(\d+)", log.read_text()))
    status = "yes" if answered else "no"
    return f"{lived} of {args.rounds} | {start:.0f} | {after:.0f} | {cuts} | {status} |"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="a checkout of the baseline")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--seconds", type=float, default=0.3, help="each connection's flood")
    p.add_argument("--heartbeat-s", type=float, default=0.05)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "flood_vanish")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{args.rounds} rounds x {args.connections} connections x {args.seconds} s, "
          f"heartbeat_s {args.heartbeat_s}\n")  # fmt: skip
    print("| code | rounds lived | RSS before MiB | RSS after MiB | connections cut | STATUS |")
    print("|---|---|---|---|---|---|")
    for code, tree in (("before", args.before), ("now", None)):
        row = one(tree, args, args.out / f"{code}_{args.heartbeat_s}.log")
        print(f"| {code} | {row}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
