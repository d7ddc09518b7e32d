"""What decoding one request costs the daemon's loop, warm: ``dlad.protocol.decode_request``
of an INFER (the frame in the message, and a shared-memory INFER's header alone) against
msgpack's unpack of the same header, in the same run, µs a call (process CPU).

    python bench/decode_cost.py [--calls 20000] [--trials 3]

Warm means back to back, the interpreter's caches hot: in the daemon each request is decoded
after the loop wakes, in colder caches (BENCHMARKS §9.9).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from dlad import protocol

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    image = np.zeros((672, 672, 3), np.uint8)
    inline = protocol.encode(protocol.InferRequest(7, "demo", image, format="RGB"))
    header = bytes(inline[0])
    cases: dict[str, Callable[[], Any]] = {
        "msgpack.unpackb of the INFER header": lambda: msgpack.unpackb(header),
        "decode_request, INFER, frame in the message": lambda: protocol.decode_request(
            inline, LIMITS
        ),
    }
    ref = protocol.ShmRef("dlad-bench-decode", 0, 2 << 20)
    in_shm = protocol.encode(protocol.InferRequest(7, "demo", image, format="RGB", shm=ref))
    cases["decode_request, INFER, frame in shared memory"] = lambda: protocol.decode_request(
        in_shm, LIMITS, _shm_resolver
    )
    rows: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.trials):
        for name, fn in cases.items():  # alternated in every trial
            rows[name].append(_cost_us(fn, args.calls))
    print(f"µs a call, median of {args.trials} trials of {args.calls} [min, max]:")
    for name, values in rows.items():
        values.sort()
        print(f"  {name:48s} {statistics.median(values):7.2f} [{values[0]:.2f}, {values[-1]:.2f}]")


if __name__ == "__main__":
    main()
