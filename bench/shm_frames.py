"""Frames through dlad over tcp, ipc and shared memory, in one run, at two frame sizes.

    python bench/shm_frames.py [--seconds 5] [--trials 3] [--in-flight 16] [--batches 1,4]
        [--event-loops uvloop,asyncio] [--data-planes python,native] [--sizes 672x672,1080]
        [--floor] [--native-floor]

One dlad process serves tcp loopback and an ipc socket, with two emulated DLA cores in timing
mode at 50 µs a frame (40,000 frames/s together: the devices are never the bottleneck) and
pre/post-processing off, so what is measured is the frame's way in: the transport and the
daemon's own path. For 672x672x3 (1.35 MB, YOLOv5s' input) and 1920x1080x3 (6.2 MB, a 1080p
camera frame) frames, the SDK's ``Client`` keeps ``--in-flight`` INFERs outstanding:

- ``tcp``, ``ipc``: the frame in the message, sent without a copy by the client (ZeroMQ copies
  it through the kernel, and the daemon's I/O thread reads it out);
- ``shm``: the frame written into a shared-memory slot (``shm_slot_bytes``; the client copies
  each frame into its slot once, as a camera loop that did not render in place would) and only
  a header sent, over the ipc endpoint;
- ``shm-in-place``: the same, the frame in a slot from ``Client.frame`` (a camera that renders
  into the slot: the client copies nothing; the frame's content is written once per slot, what
  a camera writes each time is the camera's cost, not the transport's);

and, for the ceiling of each frame size, a bare pyzmq ROUTER answering 1-byte acks over tcp
(``bench/daemon_throughput.py``'s). ``--batches``: the dlad runs are repeated for each batch
size, the client sending that many frames a message (INFER_BATCH, ``Client.submit_batch``;
1: one INFER a frame), over every transport alike. Reported per trial and as the median over
trials: frames/s, the daemon's CPU per frame (its process, without the emulated cores'
threads), and shm's frames/s as a ratio to dlad over tcp and to the bare tcp ceiling.
``--event-loops``: the daemon is run on each (``[daemon] event_loop``) in every trial, each
loop's ratios against tcp on the same loop. ``--floor``: ``daemon_throughput.py``'s floor server
too (a uvloop ROUTER, two engine threads at the same 50 µs, a valid reply, nothing else: the
least a Python daemon of dlad's shape costs), over tcp and with shared-memory frames, one frame
a message: how far the frame's way in can go in Python at all. ``--native-floor``: the same
server written in C (``daemon_throughput.py --native-floor``'s), how far it goes without Python
in the server.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon_throughput import (
    bare_ceiling,
    cpu_seconds,
    drive_sdk,
    engine_cpu_seconds,
    floor_server,
    require_native_floor,
    wait_ready,
)

SIZES = {"1.35 MB (672x672)": (672, 672, 3), "6.2 MB (1920x1080)": (1080, 1920, 3)}
CONFIG = """
[daemon]
default_deadline_ms = 60000.0
event_loop = "{loop}"
[frontend]
endpoints = ["tcp://127.0.0.1:{port}", "ipc://{ipc}"]
sndhwm = 1000
[metrics]
enabled = false
[pre_post]
enabled = false
[devices.dla0]
kind = "dla"
core = 0
queue_depth = 32
mode = "timing"
latency_us = 50.0
[devices.dla1]
kind = "dla"
core = 1
queue_depth = 32
mode = "timing"
latency_us = 50.0
[models.demo]
devices = ["dla0", "dla1"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
core1 = "bundled:demo/fp16_heads.dla1.emu"
"""


def drive(endpoint: str, shape: tuple[int, ...], seconds: float, in_flight: int, mode: str, *,
          batch: int = 1) -> tuple[float, int]:  # fmt: skip
    """Keep ``in_flight`` frames outstanding for ``seconds`` after 1 s of warm-up, ``batch``
    a message (``drive_sdk``); returns (frames/s, frames answered OK in the measured window)."""
    r = drive_sdk(endpoint, seconds, in_flight, mode.startswith("shm"), shape=shape,
                  in_place=mode == "shm-in-place", batch=batch)  # fmt: skip
    return r["rate"], int(r["ok"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--port", type=int, default=5597)
    ap.add_argument("--batches", default="1", help="frames a message, comma-separated")
    ap.add_argument(
        "--event-loops", default="uvloop",
        help="the daemon's [daemon] event_loop, comma-separated: each is run in every trial, "
             "its own ratios beside the others'",
    )  # fmt: skip
    ap.add_argument(
        "--sizes", default=",".join(SIZES),
        help="frame sizes to run, comma-separated, of: " + ", ".join(SIZES),
    )  # fmt: skip
    ap.add_argument(
        "--floor", action="store_true",
        help="also the floor server (daemon_throughput.py --floor's) over tcp and shared memory",
    )  # fmt: skip
    ap.add_argument(
        "--native-floor", action="store_true",
        help="also the floor server written in C (daemon_throughput.py --native-floor's)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.native_floor:
        require_native_floor(ap)
    floors = [n for n, on in (("floor", args.floor), ("native floor", args.native_floor)) if on]
    sizes = {label: SIZES[label] for label in _sizes(args.sizes)}
    batches = [int(b) for b in args.batches.split(",")]
    loops = args.event_loops.split(",")
    modes = [
        (t, b, loop)
        for loop in loops
        for b in batches
        for t in ("tcp", "ipc", "shm", "shm-in-place")
    ]
    named = len(loops) > 1  # the loop in each row's name
    print(f"load average before: {os.getloadavg()[0]:.2f} (cpus: {os.cpu_count()})")
    rows: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ipc = f"{tmp}/dlad.sock"
        endpoints = {"tcp": f"tcp://127.0.0.1:{args.port}", "ipc": f"ipc://{ipc}",
                     "shm": f"ipc://{ipc}", "shm-in-place": f"ipc://{ipc}"}  # fmt: skip
        for trial in range(args.trials):
            print(f"--- trial {trial + 1} of {args.trials}")
            for label, shape in sizes.items():
                bare, bare_cpu, _ = bare_ceiling(
                    "tcp://127.0.0.1:5596", args.seconds, args.in_flight, frame=shape
                )
                rows.setdefault((label, "bare tcp"), []).append((bare["rate"], bare_cpu))
                print(f"{label}: bare pyzmq over tcp {bare['rate']:.0f} frames/s, server CPU "
                      f"{bare_cpu * 1e3:.3f} ms/frame")  # fmt: skip
                for kind in floors:
                    for mode, (rate, own) in run_floor(shape, args, kind != "floor").items():
                        rows.setdefault((label, f"{kind} {mode}"), []).append((rate, own))
                        print(f"{label}: the {kind} server over {mode} {rate:.0f} frames/s, its "
                              f"CPU {own * 1e3:.3f} ms/frame")  # fmt: skip
                for loop in loops:
                    cfg = Path(tmp) / f"dlad-{loop}.toml"
                    cfg.write_text(CONFIG.format(port=args.port, ipc=ipc, loop=loop))
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "dlad.cli", "--config", str(cfg)],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    )  # fmt: skip
                    try:
                        wait_ready(proc, "listening")
                        for transport, batch, _ in (m for m in modes if m[2] == loop):
                            ep = endpoints[transport]
                            cpu0, eng0 = cpu_seconds(proc.pid), engine_cpu_seconds(proc.pid)
                            rate, n = drive(ep, shape, args.seconds, args.in_flight, transport,
                                            batch=batch)  # fmt: skip
                            own = cpu_seconds(proc.pid) - cpu0
                            own = (own - engine_cpu_seconds(proc.pid) + eng0) / max(n, 1)
                            name = _name(transport, batch, loop if named else None)
                            rows.setdefault((label, name), []).append((rate, own))
                            print(f"{label}: dlad over {name} {rate:.0f} frames/s, daemon CPU "
                                  f"{own * 1e3:.3f} ms/frame")  # fmt: skip
                    finally:
                        proc.terminate()
                        proc.wait(30)
    print(f"summary, median over {args.trials} trials [min, max]:")
    for label in sizes:
        names = [_name(t, b, loop if named else None) for t, b, loop in modes]
        floor = [f"{kind} {t}" for kind in floors for t in FLOOR_MODES]
        for name in ("bare tcp", *floor, *names):
            rates, cpus = (sorted(x) for x in zip(*rows[label, name], strict=True))
            print(f"  {label} {name:8s}: {statistics.median(rates):7.0f} frames/s "
                  f"[{rates[0]:.0f}, {rates[-1]:.0f}], CPU {statistics.median(cpus) * 1e3:.3f} "
                  f"ms/frame")  # fmt: skip
        for mode, batch, loop in modes:
            if not mode.startswith("shm"):
                continue
            tag = loop if named else None
            shm = [r for r, _ in rows[label, _name(mode, batch, tag)]]
            # against tcp at the same batch size, against tcp one frame a message (what a
            # client without either extension gets), both on the same loop, and against the
            # bare ceiling
            for base in dict.fromkeys((_name("tcp", batch, tag), _name("tcp", 1, tag),
                                       "bare tcp")):  # fmt: skip
                ratio = sorted(s / r for s, (r, _) in zip(shm, rows[label, base], strict=True))
                mid = statistics.median(ratio)
                print(f"  {label} {_name(mode, batch, tag)} / {base}: "
                      f"{mid:.2f} [{ratio[0]:.2f}, {ratio[-1]:.2f}]")  # fmt: skip
        for kind in floors:
            for name, base in ((f"{kind} {t}", f"{kind} tcp") for t in FLOOR_MODES[1:]):
                for against in (base, "bare tcp"):
                    pairs = zip(rows[label, name], rows[label, against], strict=True)
                    ratio = sorted(s / r for (s, _), (r, _) in pairs)
                    print(f"  {label} {name} / {against}: {statistics.median(ratio):.2f} "
                          f"[{ratio[0]:.2f}, {ratio[-1]:.2f}]")  # fmt: skip
    print(f"load average after: {os.getloadavg()[0]:.2f}")


FLOOR_MODES = ("tcp", "shm", "shm-in-place")


def run_floor(
    shape: tuple[int, ...], args: argparse.Namespace, native: bool = False
) -> dict[str, tuple[float, float]]:
    """The floor server (``native``: in C) at the dlad runs' 50 µs a frame, driven by the SDK
    one frame a message in each of FLOOR_MODES (shared memory over the same loopback tcp
    endpoint: the header's way in differs from ipc's by nothing measurable); {mode: (frames/s,
    its CPU s a frame without its engine threads)}."""
    endpoint = f"tcp://127.0.0.1:{args.port + 2}"
    got = {}
    with floor_server(endpoint, 50.0, native=native) as proc:
        for mode in FLOOR_MODES:
            cpu0, eng0 = cpu_seconds(proc.pid), engine_cpu_seconds(proc.pid)
            rate, n = drive(endpoint, shape, args.seconds, args.in_flight, mode)
            own = cpu_seconds(proc.pid) - cpu0 - engine_cpu_seconds(proc.pid) + eng0
            got[mode] = rate, own / max(n, 1)
    return got


def _sizes(value: str) -> list[str]:
    """The ``--sizes`` labels: each a key of SIZES, or a part of one that names only it (e.g.
    ``672x672``, ``1080``)."""
    labels = []
    for part in value.split(","):
        found = [label for label in SIZES if part.strip() in label]
        if len(found) != 1:
            raise SystemExit(f"--sizes: {part!r} names {len(found)} of: {', '.join(SIZES)}")
        labels.append(found[0])
    return labels


def _name(transport: str, batch: int, loop: str | None = None) -> str:
    name = transport if batch == 1 else f"{transport} x{batch}"
    return name if loop is None else f"{name} [{loop}]"


if __name__ == "__main__":
    main()
