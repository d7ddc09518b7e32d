"""The emulated Orin's shared DRAM (dlad/devices/dram.py): calibration, the rate model, waits,
and the engines that use it. Time is a virtual clock stepped by the tests, except where a
thread must block (those synchronise on state and end by stop or abort, never by a duration)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlad.config import ConfigError, parse_config
from dlad.devices.base import Task
from dlad.devices.dram import (
    ORIN_DRAM_K,
    EngineKind,
    SharedDram,
    Transfer,
    saturated_rates,
    slowdown,
)
from dlad.devices.emulated import ABORTED_STATUS, EmulatedDlaCore
from dlad.devices.emulated_gpu import EmulatedGpu
from dlad.loadable import read_loadable
from dlad.models import DEMO

pytestmark = pytest.mark.timeout(60)

# The forum measurement the model is calibrated to (AGX Orin, MAXN, pure conv2d, qps).
GPU_ALONE, DLA_ALONE, GPU_WITH_DLAS, DLA_WITH_ALL = 405.3, 132.7, 229.2, 113.1


class Clock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def saturate(
    engines: dict[str, tuple[EngineKind, float]], contention: float, seconds: float
) -> dict[str, float]:
    """Every engine busy back to back for ``seconds`` of virtual time, through SharedDram's own
    API (begin / end_ns / finish): the completions per second of each."""
    clock = Clock()
    dram = SharedDram(contention, clock=clock)
    running = {name: dram.begin(kind, us * 1e3) for name, (kind, us) in engines.items()}
    done = dict.fromkeys(engines, 0)
    horizon = int(seconds * 1e9)
    while True:
        name = min(running, key=lambda n: (dram.end_ns(running[n]), n))
        end = dram.end_ns(running[name])
        if end > horizon:
            return {n: c / seconds for n, c in done.items()}
        clock.ns = end
        dram.finish(running[name])
        done[name] += 1
        kind, us = engines[name]
        running[name] = dram.begin(kind, us * 1e3)


ORIN_FORUM: dict[str, tuple[EngineKind, float]] = {
    "gpu": ("gpu", 1e6 / GPU_ALONE),
    "dla0": ("dla", 1e6 / DLA_ALONE),
    "dla1": ("dla", 1e6 / DLA_ALONE),
}


def test_three_engines_at_once_reproduce_the_forum_measurement() -> None:
    rates = saturate(ORIN_FORUM, 1.0, seconds=60)
    assert rates["gpu"] == pytest.approx(GPU_WITH_DLAS, rel=0.01)
    assert rates["dla0"] == pytest.approx(DLA_WITH_ALL, rel=0.01)
    assert rates["dla1"] == pytest.approx(DLA_WITH_ALL, rel=0.01)
    assert sum(rates.values()) == pytest.approx(GPU_WITH_DLAS + 2 * DLA_WITH_ALL, rel=0.01)
    # ... and the closed form the benchmarks use as the ideal agrees with the simulation.
    ideal = saturated_rates(ORIN_FORUM, 1.0)
    for name, rate in rates.items():
        assert rate == pytest.approx(ideal[name], rel=0.01)


def test_each_engine_alone_runs_at_its_own_rate() -> None:
    for name, engine in ORIN_FORUM.items():
        alone = saturate({name: engine}, 1.0, seconds=30)[name]
        assert alone == pytest.approx(1e6 / engine[1], rel=0.01)


def test_no_contention_is_mlperf_resnet50() -> None:
    """NVIDIA's MLPerf ResNet-50 on AGX Orin: GPU 4,500/s, one DLA 600/s, all three configured
    at 6,100/s (measured 6,424): at contention 0 the pool is the isolated sum, 5,700/s."""
    resnet: dict[str, tuple[EngineKind, float]] = {
        "gpu": ("gpu", 1e6 / 4500),
        "dla0": ("dla", 1e6 / 600),
        "dla1": ("dla", 1e6 / 600),
    }
    rates = saturate(resnet, 0.0, seconds=2)
    assert sum(rates.values()) == pytest.approx(5700, rel=0.01)
    assert sum(rates.values()) <= 6100


def test_coefficients_split_the_dla_slowdown_by_aggressor_traffic() -> None:
    k = ORIN_DRAM_K
    assert 1 + 2 * k["gpu", "dla"] == pytest.approx(GPU_ALONE / GPU_WITH_DLAS)
    assert 1 + k["dla", "gpu"] + k["dla", "dla"] == pytest.approx(DLA_ALONE / DLA_WITH_ALL)
    assert k["dla", "gpu"] / k["dla", "dla"] == pytest.approx(GPU_ALONE / DLA_ALONE)
    assert slowdown("gpu", ["gpu"], 1.0) == 1.0  # one GPU per Orin: no pair listed


def test_a_task_slows_only_while_another_runs() -> None:
    clock = Clock()
    dram = SharedDram(1.0, clock=clock)
    dla = dram.begin("dla", 10e6)  # 10 ms alone
    assert dram.end_ns(dla) == 10_000_000
    clock.ns = 5_000_000
    gpu = dram.begin("gpu", 100e6)  # runs past the DLA task's end
    k = ORIN_DRAM_K["dla", "gpu"]
    assert dram.end_ns(dla) == pytest.approx(5e6 + 5e6 * (1 + k), abs=1)
    clock.ns = 7_000_000
    dram.finish(gpu)  # the GPU stops: the DLA task is back at full speed for what is left
    left = 5e6 - 2e6 / (1 + k)
    assert dram.end_ns(dla) == pytest.approx(7e6 + left, abs=1)
    assert dram.running() == ["dla"]
    dram.finish(dla)
    dram.finish(dla)  # idempotent
    assert dram.done == {"dla": 1, "gpu": 1}
    assert dram.running() == []


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["dla", "gpu"]),
            st.integers(1, 20_000_000),  # work, ns
            st.integers(0, 20_000_000),  # start, ns
        ),
        min_size=1,
        max_size=8,
    ),
    st.sampled_from([0.0, 0.5, 1.0, 3.0]),
)
def test_every_task_takes_at_least_its_work(
    tasks: list[tuple[EngineKind, int, int]], contention: float
) -> None:
    """Any overlap of tasks: each ends no sooner than its work alone, exactly then without
    contention, and never later than at its worst-case slowdown."""
    clock = Clock()
    dram = SharedDram(contention, clock=clock)
    pending = sorted(enumerate(tasks), key=lambda t: (t[1][2], t[0]))
    running: dict[int, tuple[Transfer, int]] = {}
    worst = 1 + contention * max(ORIN_DRAM_K.values()) * (len(tasks) - 1)
    while pending or running:
        ends = sorted((dram.end_ns(t), i) for i, (t, _) in running.items())
        if pending and (not ends or pending[0][1][2] <= ends[0][0]):
            i, (kind, work, start) = pending.pop(0)
            clock.ns = max(clock.ns, start)
            running[i] = (dram.begin(kind, work), clock.ns)
            continue
        end, i = ends[0]
        clock.ns = max(clock.ns, end)
        transfer, began = running.pop(i)
        dram.finish(transfer)
        took, work = clock.ns - began, tasks[i][1]
        assert took >= work - 1
        assert took <= work * worst + 1
        if contention == 0:
            assert abs(took - work) <= 1


def test_bad_contention_is_refused() -> None:
    for bad in (-0.1, 10.5, float("nan")):
        with pytest.raises(ValueError, match="contention"):
            SharedDram(bad)
    with pytest.raises(ValueError, match="kind"):
        SharedDram().begin("cpu", 1.0)  # type: ignore[arg-type]


def test_config_soc_contention_is_checked() -> None:
    base = {
        "devices": {"dla0": {"kind": "dla", "core": 0}},
        "models": {"m": {"devices": ["dla0"], "loadables": {"core0": "x.emu"}}},
    }
    assert parse_config(base).soc.dram_contention == 1.0
    with pytest.raises(ConfigError, match=r"soc\.dram_contention"):
        parse_config({**base, "soc": {"dram_contention": -1}})
    with pytest.raises(ConfigError, match=r"scheduler\.policy"):
        parse_config({**base, "scheduler": {"policy": "fastest"}})


def test_wait_returns_when_stopped() -> None:
    dram = SharedDram(1.0)
    transfer = dram.begin("dla", 3600e9)  # an hour: only the stop can end this wait
    stop = threading.Event()
    result: list[str] = []
    waiter = threading.Thread(target=lambda: result.append(dram.wait(transfer, stop=stop.is_set)))
    waiter.start()
    stop.set()
    dram.wake()
    waiter.join(timeout=30)
    assert result == ["stopped"]
    dram.finish(transfer)


@pytest.fixture
def demo_core() -> Iterator[tuple[EmulatedDlaCore, SharedDram]]:
    dram = SharedDram(1.0)
    core = EmulatedDlaCore(0, mode="timing", latency_us=3600e6, dram=dram)  # an hour a task
    yield core, dram
    core.close(force=True)


def test_a_dla_task_shares_the_dram_and_a_forced_close_ends_it(
    demo_core: tuple[EmulatedDlaCore, SharedDram],
) -> None:
    core, dram = demo_core
    module = core.load(str(DEMO / "fp16_heads.dla0.emu"))
    inputs = [core.alloc_buffer(d) for d in module.inputs]
    outputs = [core.alloc_buffer(d) for d in module.outputs]
    fence = core.create_fence()
    started = threading.Event()
    original = dram.begin

    def begin(kind: EngineKind, work_ns: float) -> object:
        transfer = original(kind, work_ns)
        started.set()
        return transfer

    dram.begin = begin  # type: ignore[method-assign,assignment]
    handle = core.submit(Task(module, inputs, outputs, signal=((fence, 1),)))
    assert started.wait(timeout=30)
    assert dram.running() == ["dla"]
    core.close(force=True)  # the task waits out an hour of DRAM time: only the abort ends it
    assert handle.status == ABORTED_STATUS
    assert fence.reached(1)
    assert dram.running() == []
    assert dram.done["dla"] == 1


def test_an_emulated_gpu_batch_shares_the_dram() -> None:
    dram = SharedDram(1.0)
    loadable = read_loadable(DEMO / "fp16_heads.dla0.emu")
    gpu = EmulatedGpu(loadable, mode="timing", max_batch=2, batch1_us=10.0, dram=dram)
    frame = np.zeros((*loadable.image_size, 4), np.int8)
    heads, timing = gpu.run([frame, frame])
    assert len(heads) == 2
    assert timing.size == 2
    assert dram.done["gpu"] == 1
    assert dram.running() == []
