"""What decoding one request costs the daemon, warm: the C++ request decoder alone (what the
plane's thread spends on an INFER, here with one call from Python around it) and
``dlad.protocol.decode_request`` of an INFER (the frame in the message, and a shared-memory
INFER's header alone: the control plane's cost) against msgpack's unpack of the same header, in
the same run, µs a call (process CPU).

    python bench/decode_cost.py [--calls 20000] [--trials 3] [--gaps-ms 0.2,2]

Warm means back to back, the interpreter's caches hot: in the daemon each request is decoded
after the loop wakes, in colder caches (BENCHMARKS §9.9). ``--gaps-ms`` measures that too: the
same calls, each after the thread slept that long (the calling thread's CPU for the call
alone, the sleep not counted), as the daemon's loop sleeps between frames at its load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from dlad import _native, protocol

LIMITS = protocol.Limits(
    max_message_bytes=64 << 20, max_width=4096, max_height=4096, max_image_pixels=4096 * 4096
)


_SLOT = memoryview(bytearray(2 << 20))


def _shm_resolver(ref: protocol.ShmRef, nbytes: int) -> memoryview:
    """A slot already mapped, as the daemon's ``SharedFrames.resolve`` returns one."""
    return _SLOT[:nbytes]


def _cost_us(fn: Callable[[], Any], calls: int) -> float:
    t = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t) / calls * 1e6


def _after_sleep_us(fn: Callable[[], Any], calls: int, gap_s: float) -> float:
    """The calling thread's CPU for ``fn`` alone, each call after sleeping ``gap_s``."""
    spent = 0
    for _ in range(calls):
        time.sleep(gap_s)
        t = time.thread_time_ns()
        fn()
        spent += time.thread_time_ns() - t
    return spent / calls / 1e3


def _gaps(text: str) -> list[float]:
    """``--gaps-ms``: comma-separated sleeps in ms, each above 0."""
    try:
        gaps = [float(g) for g in text.split(",") if g.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want ms like 0.2,2, got {text!r}") from None
    if not all(0 < g <= 1000 for g in gaps):
        raise argparse.ArgumentTypeError(f"each gap must be in (0, 1000] ms, got {text!r}")
    return gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--gaps-ms", type=_gaps, default=[],
                    help="also after sleeps of these ms, e.g. 0.2,2")  # fmt: skip
    args = ap.parse_args()
    gaps: list[float] = args.gaps_ms
    image = np.zeros((672, 672, 3), np.uint8)
    inline = protocol.encode(protocol.InferRequest(7, "demo", image, format="RGB"))
    header = bytes(inline[0])
    limits = protocol._native_limits(LIMITS)
    payloads = [len(inline[1])]
    cases: dict[str, Callable[[], Any]] = {
        "msgpack.unpackb of the INFER header": lambda: msgpack.unpackb(header),
        "the C++ decoder, INFER header": lambda: _native.decode_request(
            header, payloads, limits, False
        ),
        "decode_request, INFER, frame in the message": lambda: protocol.decode_request(
            inline, LIMITS
        ),
    }
    ref = protocol.ShmRef("dlad-bench-decode", 64, 2 << 20, bytes(16))
    in_shm = protocol.encode(protocol.InferRequest(7, "demo", image, format="RGB", shm=ref))
    cases["decode_request, INFER, frame in shared memory"] = lambda: protocol.decode_request(
        in_shm, LIMITS, _shm_resolver
    )
    runs = [(name, gap) for name in cases for gap in [0.0, *gaps]]
    rows: dict[tuple[str, float], list[float]] = {run: [] for run in runs}
    slept = max(200, args.calls // 50)  # fewer: each waits for its sleep
    for _ in range(args.trials):
        for name, gap in runs:  # alternated in every trial
            fn = cases[name]
            cost = _cost_us(fn, args.calls) if not gap else _after_sleep_us(fn, slept, gap / 1e3)
            rows[name, gap].append(cost)
    print(f"µs a call, median of {args.trials} trials [min, max] ({args.calls} calls back to "
          f"back; {slept} after each sleep):")  # fmt: skip
    for (name, gap), values in rows.items():
        values.sort()
        median = statistics.median(values)
        label, times = name, ""
        if gap:
            label = f"  the same, each after a {gap:g} ms sleep"
            times = f"  x{median / statistics.median(rows[name, 0.0]):.1f} back to back's"
        print(f"  {label:48s} {median:7.2f} [{values[0]:.2f}, {values[-1]:.2f}]{times}")


if __name__ == "__main__":
    main()
