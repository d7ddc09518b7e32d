"""What the benchmarks' daemons share: TOML pieces (the emulated Orin's two DLA cores in timing
mode, the demo model served by a list of devices), :func:`running_daemon`, a dlad process for the
length of a ``with`` (``bench/three_engines.py``, ``bench/h200_pool.py``,
``bench/fuzz_frontend.py``, ``bench/health_failover.py``), and :func:`rss_mib`, a process's
resident memory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def rss_mib(pid: int) -> float:
    """Process ``pid``'s resident memory (``VmRSS``), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


DEMO_LOADABLES = """[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
core1 = "bundled:demo/fp16_heads.dla1.emu"
"""


def emulated_dlas(latency_us: float, queue_depth: int = 8) -> str:
    """``[devices.dla0]`` and ``[devices.dla1]``: emulated cores in timing mode, ``latency_us``
    a frame."""
    return "".join(
        f'[devices.dla{core}]\nkind = "dla"\ncore = {core}\nqueue_depth = {queue_depth}\n'
        f'mode = "timing"\nlatency_us = {latency_us}\n'
        for core in (0, 1)
    )


def demo_model(devices: list[str]) -> str:
    """``[models.demo]`` served by ``devices``, with the bundled loadables."""
    listed = ", ".join(f'"{d}"' for d in devices)
    return f"[models.demo]\ndevices = [{listed}]\n" + DEMO_LOADABLES


@contextmanager
def running_daemon(
    config: str,
    log_path: Path,
    *,
    start_timeout_s: float = 60.0,
    tree: Path | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Run ``dlad`` on ``config`` (TOML text whose ``{endpoint}`` is filled with an ipc
    endpoint in a fresh directory), its output in ``log_path``; ``tree``: the dlad of that
    checkout instead of this one (a baseline, or a build with sanitizers); ``env``: more
    environment. Yields the process and the endpoint once it logs ``listening``; terminates it
    on the way out. Exits (SystemExit, with the log's tail) if it does not start."""
    tmp = Path(tempfile.mkdtemp(prefix="dlad-bench-"))
    endpoint = f"ipc://{tmp}/dlad.sock"
    (tmp / "dlad.toml").write_text(config.replace("{endpoint}", endpoint))
    with log_path.open("w") as log:
        more = {} if tree is None else {"PYTHONPATH": str(tree.resolve())}
        proc = subprocess.Popen(
            [sys.executable, "-m", "dlad.cli", "--config", str(tmp / "dlad.toml")],
            stdout=log, stderr=log, env={**os.environ, **more, **(env or {})}, cwd=tree,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + start_timeout_s
        while "listening" not in log_path.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                print(log_path.read_text()[-3000:])
                raise SystemExit(f"dlad did not start; see {log_path}")
            time.sleep(0.1)
        yield proc, endpoint
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)
