"""Python bytecodes the daemon's event loop runs per request, by function: a count, not a time.

    python bench/loop_opcodes.py [--requests 300] [--in-flight 4] [--shm] [--batch N]
        [--pre-post none|cpu|cuda] [--before DIR] [--top 25]

The event loop's thread is bound by the interpreter: ``perf`` on cpu2 puts two thirds of its
samples in libpython, a fifth in the kernel's context switches and 2 % in libzmq
(``bench/daemon_throughput.py --perf``, BENCHMARKS §9.11). On these VMs its CPU per request moves
by more between runs than a small change saves, so such a change cannot be measured by time. The
bytecodes the loop executes per request can: they are the same in every run of the same code.
(They are not the whole cost: a quarter fewer took 5-11 % off the loop's CPU on the H200 host.)

dlad runs as ``bench/daemon_throughput.py`` runs it (two emulated cores in timing mode;
pre/post off unless ``--pre-post`` says otherwise) under a tracer that counts every bytecode the
main thread executes (``sys.settrace`` with opcode events; from Python 3.12 ``sys.monitoring``'s
instruction events, since 3.12's settrace drops opcode events; the engines' threads are not
counted; counts differ between Python versions, so compare within one),
from SIGUSR1, once the client's first replies are in, to SIGUSR2. Traced, the loop is some
twenty times slower, so it is the bottleneck: keep ``--in-flight`` low so that, as at dlad's
real load, a wake-up finds about one message. Requests per count: the replies the loop sent
meanwhile. ``--before DIR`` counts a checkout of other code (``git worktree add DIR <commit>``)
the same way, one after the other.
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from daemon_throughput import CONFIG, FRAME, tree_env, wait_ready

from dlad_client import Client

TRACER = r"""
import collections, json, runpy, signal, sys, threading
out = sys.argv.pop(1)
counts, calls = collections.Counter(), collections.Counter()
main = threading.get_ident()
if sys.version_info >= (3, 12):  # sys.monitoring (3.12's settrace drops opcode events)
    mon, TOOL = sys.monitoring, sys.monitoring.PROFILER_ID
    mon.use_tool_id(TOOL, "loop_opcodes")
    def instruction(code, offset):
        if threading.get_ident() == main:
            counts[code] += 1
    def entered(code, offset):  # each call, and each resumption of a coroutine
        if threading.get_ident() == main:
            calls[code] += 1
    mon.register_callback(TOOL, mon.events.INSTRUCTION, instruction)
    mon.register_callback(TOOL, mon.events.PY_START, entered)
    mon.register_callback(TOOL, mon.events.PY_RESUME, entered)
    every = mon.events.INSTRUCTION | mon.events.PY_START | mon.events.PY_RESUME
    def trace(on):
        mon.set_events(TOOL, every if on else 0)
else:  # settrace, on this (the main) thread only
    def local(frame, event, arg):
        if event == "opcode":
            counts[frame.f_code] += 1
        return local
    def tracer(frame, event, arg):  # each call, and each resumption of a coroutine
        calls[frame.f_code] += 1
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        return local
    def trace(on):
        sys.settrace(tracer if on else None)
def start(*_):
    counts.clear(); calls.clear(); trace(True)
def stop(*_):
    trace(False)
    rows = collections.defaultdict(lambda: [0, 0])  # by file and function, not line
    for c, n in counts.items():
        row = rows[f"{c.co_filename}:{c.co_qualname}"]
        row[0] += n
        row[1] += calls[c]
    with open(out, "w") as f:
        json.dump(rows, f)
signal.signal(signal.SIGUSR1, start)
signal.signal(signal.SIGUSR2, stop)
sys.argv[0] = "dlad"
runpy.run_module("dlad.cli", run_name="__main__")
"""

REPLY = "Frontend._send_frames"
"""The function that sends every reply: its calls are the requests answered."""


def count(
    tree: Path | None, requests: int, in_flight: int, *, shm: bool, batch: int, pre_post: str
) -> dict[str, tuple[int, int]]:
    """Run one traced daemon (``tree``'s code, or this checkout's); its counts by function:
    (bytecodes, calls)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg, out = Path(tmp) / "dlad.toml", Path(tmp) / "counts.json"
        endpoint = "tcp://127.0.0.1:5613"
        on = pre_post != "none"
        cfg.write_text(CONFIG.format(
            endpoint=endpoint, pre_post="true" if on else "false", latency=3820.0,
            backend=pre_post if on else "cpu",
            gpu='[devices.gpu]\nkind = "gpu"\n' if pre_post == "cuda" else "",
        ))  # fmt: skip
        env = tree_env(tree)
        proc = subprocess.Popen(
            [sys.executable, "-c", TRACER, str(out), "--config", str(cfg)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tree, env=env,
        )  # fmt: skip
        try:
            wait_ready(proc, "listening")
            drive(endpoint, proc, requests, in_flight, shm=shm, batch=batch)
            for _ in range(600):  # the counts are written from the loop, at its next bytecode
                if out.exists() and out.stat().st_size:
                    break
                subprocess.run(["sleep", "0.1"], check=True)
            rows = json.loads(out.read_text())
        finally:
            proc.terminate()
            proc.wait(30)
    return {name: (n, c) for name, (n, c) in rows.items()}


def drive(
    endpoint: str, proc: subprocess.Popen[str], requests: int, in_flight: int, *, shm: bool,
    batch: int,
) -> None:  # fmt: skip
    """Keep ``in_flight`` requests outstanding; count from the 50th reply to the
    ``requests``-th after it."""
    image = np.random.default_rng(0).integers(0, 255, FRAME, dtype=np.uint8)
    extra = {"shm_slot_bytes": image.nbytes} if shm else {}
    with Client(endpoint, timeout_s=120.0, max_in_flight=in_flight * batch, **extra) as c:

        def send() -> Any:
            return c.submit_batch([image] * batch) if batch > 1 else c.submit(image)

        pending = collections.deque(send() for _ in range(in_flight))
        for i in range(50 + requests):
            if i == 50:
                proc.send_signal(signal.SIGUSR1)
            pending.popleft().result()
            pending.append(send())
        proc.send_signal(signal.SIGUSR2)
        for handle in pending:
            handle.result()


def per_request(rows: dict[str, tuple[int, int]]) -> tuple[float, dict[str, float]]:
    """(replies, bytecodes per reply by function)."""
    replies = sum(c for name, (_, c) in rows.items() if name.endswith(f":{REPLY}"))
    if not replies:
        raise SystemExit(f"no replies counted ({len(rows)} functions traced): the tracer did not "
                         "see the event loop's Python")  # fmt: skip
    n = replies
    return replies, {name: ops / n for name, (ops, _) in rows.items()}


def _short(name: str) -> str:
    path, _, function = name.rpartition(":")
    parts = Path(path).parts
    where = "/".join(parts[parts.index("dlad") :]) if "dlad" in parts else Path(path).name
    return f"{where}:{function}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--shm", action="store_true", help="shared-memory frames")
    ap.add_argument("--batch", type=int, default=1, help="frames a message (INFER_BATCH)")
    ap.add_argument("--pre-post", choices=("none", "cpu", "cuda"), default="none",
                    help="pre/post-processing: off (the daemon's own path), the CPU's, or CUDA "
                         "kernels fenced to the cores (a GPU machine)")  # fmt: skip
    ap.add_argument("--before", type=Path, metavar="DIR", help="also count this checkout")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    if args.requests < 1 or args.in_flight < 1 or args.batch < 1:
        ap.error("--requests, --in-flight and --batch must be at least 1")
    runs = {"this code": None, **({"--before": args.before.resolve()} if args.before else {})}
    results = {}
    for label, tree in runs.items():
        replies, ops = per_request(count(tree, args.requests, args.in_flight, shm=args.shm,
                                         batch=args.batch, pre_post=args.pre_post))  # fmt: skip
        results[label] = ops
        print(f"{label}: {sum(ops.values()):,.0f} bytecodes a reply on the event loop "
              f"({replies:.0f} replies counted, {args.batch} frame(s) each)")  # fmt: skip
    now = results["this code"]
    was = results.get("--before", {})
    names = sorted(set(now) | set(was), key=lambda k: -max(now.get(k, 0), was.get(k, 0)))
    head = "  bytecodes a reply" + ("   before" if was else "") + "  function"
    print(head)
    for name in names[: args.top]:
        before = f"  {was.get(name, 0):8.0f}" if was else ""
        print(f"  {now.get(name, 0):17.0f}{before}  {_short(name)}")
    by_file: collections.Counter[str] = collections.Counter()
    by_file_was: collections.Counter[str] = collections.Counter()
    for name, ops in now.items():
        by_file[_short(name).rpartition(":")[0]] += ops
    for name, ops in was.items():
        by_file_was[_short(name).rpartition(":")[0]] += ops
    print("by file:")
    for file, ops in by_file.most_common(15):
        before = f" (before {by_file_was.get(file, 0):,.0f})" if was else ""
        print(f"  {ops:10,.0f}{before}  {file}")


if __name__ == "__main__":
    main()
