"""``python -m dlad.devices.cudla.selftest`` (also ``dlad selftest``): exercise every cuDLA and
NvSci call dlad declares once per DLA core, on the real libraries, and report each step.

Per core: the platform probe, open the core in standalone mode, set the task timeout, load the
given TensorRT loadable, allocate and import every I/O buffer, create a DLA-signalled and a
CPU-signalled fence, submit one task that waits on the CPU fence and signals the DLA fence,
release the CPU fence, wait for the EOF fence, read ``cudlaGetLastError``, then close. The
report lists every step (ok / failed / skipped with the reason) and every declared function that
was never called. Exit status: 0 all steps passed, 1 a step failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from dlad.devices.base import CudlaStatus, DlaError, Task
from dlad.devices.cudla.abi import Libraries, load_libraries
from dlad.devices.cudla.probe import probe

__all__ = ["Report", "main", "run_selftest"]

WAIT_S = 30.0


@dataclass
class Report:
    """Steps as ``(name, outcome, detail)`` with outcome ``ok``, ``failed`` or ``skipped``, and
    the declared functions never called."""

    steps: list[tuple[str, str, str]] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)
    uncalled: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(outcome != "failed" for _, outcome, _ in self.steps)

    def step(self, name: str, fn: Callable[[], object]) -> Any:
        """Run ``fn`` as step ``name``; a DlaError or OSError fails the step (returns None)."""
        t0 = time.perf_counter()
        try:
            result = fn()
        except (DlaError, OSError, ValueError) as exc:
            self.steps.append((name, "failed", str(exc)))
            return None
        ms = (time.perf_counter() - t0) * 1e3
        detail = result if isinstance(result, str) else f"{ms:.2f} ms"
        self.steps.append((name, "ok", detail))
        return result if result is not None else True

    def text(self) -> str:
        lines = [f"{outcome.upper():7} {name}: {detail}" for name, outcome, detail in self.steps]
        if self.uncalled:
            lines.append("not exercised: " + ", ".join(self.uncalled))
        lines.append("PASSED" if self.passed else "FAILED")
        return "\n".join(lines)


def _counting(libs: Libraries, counts: dict[str, int]) -> Libraries:
    def wrap(name: str, fn: Any) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return fn(*args)

        return call

    functions = {name: wrap(name, fn) for name, fn in libs.functions.items()}
    return replace(libs, functions=functions)


def run_selftest(
    loadables: dict[int, str],
    *,
    libs: Libraries | None = None,
    semaphores: Literal["auto", "syncpoint", "deterministic"] = "auto",
) -> Report:
    """Run the self-test on the cores in ``loadables`` (core -> TensorRT loadable path; a core
    without one is probed and opened only). Never raises for a cuDLA failure: it is a step."""
    from dlad.devices.cudla.backend import CudlaDlaCore  # noqa: PLC0415 (cycle-free, lazy)

    report = Report()
    base = report.step("load libraries", lambda: libs or load_libraries())
    if base is None:
        return report
    counted = _counting(base, report.calls)
    found = probe(counted)
    report.steps.append(("probe", "ok" if found.available else "failed", found.summary()))
    cores = sorted(loadables) or list(range(found.device_count or 0))
    for core in cores:
        dla = report.step(
            f"dla{core}: open (standalone)",
            functools.partial(CudlaDlaCore, core, libs=counted, semaphores=semaphores),
        )
        if dla is None:
            continue
        try:
            _exercise(report, dla, core, loadables.get(core))
        finally:
            report.step(f"dla{core}: close", dla.close)
    report.uncalled = sorted(set(base.functions) - set(report.calls))
    return report


def _exercise(report: Report, dla: Any, core: int, loadable: str | None) -> None:
    step = report.step
    step(f"dla{core}: set task timeout", lambda: dla.set_task_timeout(5000))
    step(f"dla{core}: device version", lambda: f"{dla.device_version():#x}")
    if loadable is None:
        report.steps.append((f"dla{core}: task", "skipped", "no loadable given (--loadable)"))
        return
    module = step(f"dla{core}: load {loadable}", lambda: dla.load(loadable))
    if module is None:
        return
    ins = step(f"dla{core}: input buffers", lambda: [dla.alloc_buffer(d) for d in module.inputs])
    outs = step(f"dla{core}: output buffers", lambda: [dla.alloc_buffer(d) for d in module.outputs])
    done = step(f"dla{core}: DLA-signalled fence", dla.create_fence)
    gate = step(f"dla{core}: CPU-signalled fence", lambda: dla.create_fence(signaller="cpu"))
    if not (ins and outs and done and gate):
        return
    for buf in ins:
        buf.raw[:] = np.random.default_rng(core).integers(0, 256, buf.raw.size, np.uint8)
    handle = step(
        f"dla{core}: submit (waits on the CPU fence at 2)",
        lambda: dla.submit(Task(module, ins, outs, wait=[(gate, 2)], signal=[(done, 1)])),
    )
    if handle is None:
        return
    step(f"dla{core}: CPU signal 1, 2", lambda: [gate.signal(v) for v in (1, 2)])

    def finished() -> str:
        if not done.wait(1, WAIT_S):
            raise DlaError(CudlaStatus.DLA_ERR_ENGINE_TIMEOUT, "NvSciSyncFenceWait", "no EOF")
        if handle.status is not CudlaStatus.SUCCESS:
            raise DlaError(handle.status, "cudlaGetLastError", "the task failed")
        return f"{handle.timing.actual_us:.1f} us"

    step(f"dla{core}: EOF fence + cudlaGetLastError", finished)
    step(f"dla{core}: last error", lambda: dla.last_error().c_name)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="dlad selftest", description="Exercise every cuDLA / NvSci call dlad uses, once."
    )
    p.add_argument("--loadable", action="append", default=[], metavar="CORE=PATH",
                   help="TensorRT DLA standalone loadable for a core (repeatable)")  # fmt: skip
    p.add_argument("--semaphores", choices=("auto", "syncpoint", "deterministic"), default="auto")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    loadables: dict[int, str] = {}
    for item in args.loadable:
        core, sep, path = item.partition("=")
        if not sep or core not in ("0", "1") or not path:
            print(f"dlad selftest: --loadable needs CORE=PATH with core 0 or 1, got {item!r}",
                  file=sys.stderr)  # fmt: skip
            return 2
        loadables[int(core)] = path
    report = run_selftest(loadables, semaphores=args.semaphores)
    if args.json:
        out = {"passed": report.passed, "steps": report.steps, "calls": report.calls,
               "uncalled": report.uncalled}  # fmt: skip
        print(json.dumps(out, indent=2))
    else:
        print(report.text())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
