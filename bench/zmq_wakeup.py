"""What a ZeroMQ send costs the sending thread when ZeroMQ's I/O thread is asleep, against
sends back to back (the I/O thread awake), in the same run: a ROUTER sends a 3-frame reply
(identity, a 120-byte header, an empty payload; dlad's INFER reply with pre/post off) to a
DEALER every ``gap`` seconds. The figure is the sending thread's CPU per reply
(``time.thread_time``) and the whole process's (the I/O threads' wake-ups included).

    python bench/zmq_wakeup.py [--replies 2000] [--trials 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import zmq

GAPS = (0.0, 0.0002, 0.002)  # back to back; 5,000 replies/s; 500 replies/s (dlad's load)


def measure(replies: int, gap: float) -> tuple[float, float]:
    """(sending thread's CPU µs per reply, process CPU µs per reply) at one gap."""
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.linger = dealer.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"hello")
    ident, _ = router.recv_multipart()
    header = b"x" * 120
    got = threading.Semaphore(0)

    def drain() -> None:
        for _ in range(replies):
            dealer.recv_multipart()
            got.release()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    sender = 0
    proc0 = time.process_time_ns()
    for _ in range(replies):
        if gap:
            time.sleep(gap)
        t0 = time.thread_time_ns()
        router.send(ident, zmq.SNDMORE | zmq.NOBLOCK)
        router.send(header, zmq.SNDMORE | zmq.NOBLOCK)
        router.send(b"", zmq.NOBLOCK)
        sender += time.thread_time_ns() - t0
        if gap:
            got.acquire()  # delivered: every thread is idle again before the next
    reader.join(30)
    proc = time.process_time_ns() - proc0
    router.close()
    dealer.close()
    ctx.term()
    return sender / replies / 1e3, proc / replies / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replies", type=int, default=2000)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    rows: dict[float, list[tuple[float, float]]] = {g: [] for g in GAPS}
    for _ in range(args.trials):
        for gap in GAPS:
            rows[gap].append(measure(args.replies, gap))
    base = statistics.median(s for s, _ in rows[0.0])
    for gap, runs in rows.items():
        sender = statistics.median(s for s, _ in runs)
        proc = statistics.median(p for _, p in runs)
        print(
            f"gap {gap * 1e3:.1f} ms: sending thread {sender:.1f} µs CPU a reply "
            f"({sender / base:.1f}x back to back), process {proc:.1f} µs (reader included)"
        )


if __name__ == "__main__":
    main()
