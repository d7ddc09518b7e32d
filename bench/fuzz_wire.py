"""The daemon's request decoder (``dlad/native/wire.cpp``) under AddressSanitizer and
UndefinedBehaviorSanitizer, on structure-aware fuzzed messages (docs/reliability.md).

    python bench/fuzz_wire.py [--messages 1000000] [--seed 1] [--keep DIR]

Builds ``tests/dlad/wire_fuzz.cpp`` with the decoder, both sanitizers on and every finding fatal
(``-fno-sanitize-recover=all``), then streams it ``--messages`` messages: six in ten from
``dlad_bench.fuzz.messages`` (valid INFER, CANCEL, STATUS and INFER_BATCH requests mutated in
their msgpack structure, fields, image and frames; about one in eight left valid), three in ten
well-formed INFERs with random settings (half of them with one byte of the header changed or
the header cut short; three in ten naming a shared-memory segment, its own or another's, with
a forged token, and half of those with a token of the wrong length or type, none, or an offset
inside the segment's header), one in fifty a junk flood's one-byte message, the rest raw
random bytes; each header in a buffer of exactly its
size, with its frames, and shared memory on or off at random. The driver checks that what the
decoder takes keeps the protocol's promises, that each refusal names its field, and writes each
INFER's reply or its refusal's. Prints the
messages read and taken, and exits non-zero on a sanitizer report, a broken promise or a message
not read.
"""

from __future__ import annotations

import argparse
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "clients"))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402

from dlad import protocol  # noqa: E402
from dlad_bench.fuzz import messages  # noqa: E402

FLAGS = ["-std=c++17", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
         "-fno-omit-frame-pointer"]  # fmt: skip
MAX_MESSAGE_BYTES = 1 << 20  # the driver's limits (wire_fuzz.cpp)


def build(into: Path) -> Path:
    """The sanitized driver, built in ``into``. Raises RuntimeError where it does not build."""
    exe = into / "wire_fuzz"
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or clang++)")
    sources = [str(ROOT / "dlad/native/wire.cpp"), str(ROOT / "tests/dlad/wire_fuzz.cpp")]
    wire = f"-I{ROOT / 'clients/dlad_wire/native'}"  # the wire's rules, dlad-client's headers
    done = subprocess.run([cxx, *FLAGS, wire, *sources, "-o", str(exe)], capture_output=True,
                          text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the driver did not build:\n{done.stderr[-2000:]}")
    return exe


def _infer(rng: random.Random) -> list[bytes]:
    """A well-formed INFER with random settings (in the message, or in shared memory)."""
    fmt = rng.choice(protocol.PIXEL_FORMATS)
    even = 2 if fmt in ("NV12", "YUYV") else 1
    h, w = rng.randrange(1, 20) * even, rng.randrange(1, 20) * even
    image = np.zeros(protocol.frame_shape(fmt, h, w), np.uint8)
    colour: dict[str, Any] = {}
    if even == 2 and rng.random() < 0.5:
        colour = {"colorspace": rng.choice(protocol.COLORSPACES),
                  "color_range": rng.choice(protocol.COLOR_RANGES)}  # fmt: skip
    name = "".join(rng.choice("abcdefgh-_.0123") for _ in range(rng.randrange(1, 129)))
    request = protocol.InferRequest(
        rng.randrange(2**64), name, image, format=fmt, **colour,
        stream=rng.choice([None, name[:20]]), priority=rng.randrange(8),
        deadline_ms=rng.choice([None, 1, rng.randrange(1, protocol.MAX_DEADLINE_MS + 1)]),
        conf=rng.choice([None, 0.0, rng.random() * 0.999]),
        iou=rng.choice([None, 1.0, 1.0 - rng.random() * 0.999]),
        max_det=rng.choice([None, 1, rng.randrange(1, protocol.MAX_DET + 1)]),
    )  # fmt: skip
    if rng.random() < 0.3:  # a segment of its own or another's: the token, true or forged
        ref = protocol.ShmRef(rng.choice(["seg", name[:200].lstrip(".") or "s"]),
                              rng.randrange(64, 4096), 1 << 20, rng.randbytes(16))  # fmt: skip
        request = request.in_shared_memory(ref)
        frames = [bytes(f) for f in protocol.encode(request)]
        if rng.random() < 0.5:  # the hostile shapes of an shm map
            header = msgpack.unpackb(frames[0])
            shm = header["shm"]
            match rng.randrange(4):
                case 0:
                    shm["token"] = rng.randbytes(rng.choice([0, 1, 15, 17, 64]))
                case 1:
                    shm["token"] = rng.choice(["x" * 16, 16, None])
                case 2:
                    del shm["token"]
                case _:
                    shm["offset"] = rng.randrange(0, 80)
            frames[0] = msgpack.packb(header)
        return frames
    return [bytes(f) for f in protocol.encode(request)]


def records(n: int, seed: int) -> bytes:
    """``n`` driver records (see the module docstring)."""
    rng = random.Random(seed)
    fuzzed = messages(seed, max_message_bytes=MAX_MESSAGE_BYTES)
    out = bytearray()
    for _ in range(n):
        pick = rng.random()
        if pick < 0.02:  # a junk flood's one-byte messages
            header = bytes([rng.choice([0xC1, 0x00, 0x80, 0x90, 0xFF])])
            frames, payload = 1, 0
        elif pick < 0.1:
            header = rng.randbytes(rng.randrange(0, 96))
            frames, payload = rng.choice([1, 2, 3]), rng.randrange(0, 1 << 12)
        elif pick < 0.4:
            parts = _infer(rng)
            header = parts[0]
            if rng.random() < 0.5 and header:
                at = rng.randrange(len(header))
                header = (header[:at] if rng.random() < 0.3 else
                          header[:at] + bytes([rng.randrange(256)]) + header[at + 1 :])  # fmt: skip
            frames = len(parts)
            payload = len(parts[1]) if frames >= 2 else 0
        else:
            parts = next(fuzzed)
            header = parts[0]
            frames = len(parts)
            payload = len(parts[1]) if frames >= 2 else 0
        shm = rng.random() < 0.5
        out += struct.pack("<I", len(header)) + header
        out += struct.pack("<BQB", min(frames, 255), payload, shm)
    return bytes(out)


def run(exe: Path, n: int, seed: int, chunk: int = 50_000) -> tuple[int, int]:
    """Feed ``n`` messages in chunks (one driver run each); returns (read, taken). Raises
    RuntimeError with the driver's report on any failure."""
    read = taken = 0
    for start in range(0, n, chunk):
        count = min(chunk, n - start)
        env = {"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0",
               "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}  # fmt: skip
        done = subprocess.run([str(exe)], input=records(count, seed + start), env=env,
                              capture_output=True, check=False)  # fmt: skip
        report = done.stderr.decode(errors="replace")
        if done.returncode != 0 or report.strip():
            raise RuntimeError(f"messages {start}..{start + count} (seed {seed + start}): "
                               f"exit {done.returncode}\n{report[-4000:]}")  # fmt: skip
        got, took = (int(x) for x in done.stdout.split()[1::2])
        if got != count:
            raise RuntimeError(f"the driver read {got} of {count} messages")
        read, taken = read + got, taken + took
    return read, taken


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", type=Path, default=None, help="build the driver here and keep it")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        try:
            exe = build(where)
            read, taken = run(exe, args.messages, args.seed)
        except RuntimeError as exc:
            print(f"fuzz_wire: {exc}", file=sys.stderr)
            return 1
        took = time.monotonic() - t0
    print(f"{read} messages read under ASan + UBSan, {taken} taken as INFERs, no finding "
          f"({took:.0f} s, seed {args.seed})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
