"""TOML pieces the benchmarks' daemons share: the emulated Orin's two DLA cores in timing mode,
and the demo model served by a list of devices (``bench/three_engines.py``,
``bench/h200_pool.py``)."""

from __future__ import annotations

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
