"""Run a real daemon in-process on its own thread for a test."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

import anyio

from dlad.config import load_config
from dlad.daemon import Daemon


@contextmanager
def serve_in_thread(daemon: Daemon, *, start_timeout: float = 30.0) -> Iterator[str]:
    """Serve ``daemon`` on a thread of its own; yields its first bound endpoint once it is
    ready; stops and joins it on the way out, failing the test if ``serve`` raised."""
    started = threading.Event()
    errors: list[BaseException] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(daemon.serve)
            await daemon.ready.wait()
            started.set()

    def target() -> None:
        try:
            anyio.run(main)
        except BaseException as exc:  # noqa: BLE001 (re-raised by the test via `errors`)
            errors.append(exc)
            started.set()

    thread = threading.Thread(target=target)
    thread.start()
    assert started.wait(start_timeout)
    assert not errors, errors
    try:
        yield daemon.bound[0]
    finally:
        daemon.stop_threadsafe()
        thread.join(60)
        assert not thread.is_alive()
        assert not errors, errors


NUMERIC_DEMO: Final = """
[frontend]
endpoints = ["tcp://127.0.0.1:5555"]
[devices.dla0]
kind = "dla"
core = 0
[models.demo]
devices = ["dla0"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
"""
"""A config of one numeric-mode core (the real INT8 engine) serving the bundled demo model."""


@contextmanager
def serve_config(text: str, workdir: Path) -> Iterator[str]:
    """A daemon of the config ``text`` (written into ``workdir``) on a loopback port of its
    own, served on a thread; yields its endpoint."""
    cfg = workdir / "dlad.toml"
    cfg.write_text(text)
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    with serve_in_thread(daemon) as endpoint:
        yield endpoint
