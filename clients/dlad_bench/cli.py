"""``dlad-bench``: load-test a running dlad daemon (see the package docstring for the modes).

Exit status: 0 done; 1 the daemon did not answer, refused the run, or stopped answering during
it (the levels measured until then are still reported and written); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import math
import platform
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import anyio
from rich.console import Console
from rich.live import Live
from rich.text import Text

from dlad.errors import DladError
from dlad_bench import plots
from dlad_bench.inputs import Frame, load_frames
from dlad_bench.judge import EXIT_THRESHOLD, RateSearch, failures, parse_threshold
from dlad_bench.measure import CLIENT_TIMEOUT, LevelResult, Measurement
from dlad_bench.repeats import json_repeats, print_repeats, representative, spread
from dlad_bench.report import print_table, write_csv, write_html, write_json
from dlad_bench.runner import Level, Load, Settings, run_level
from dlad_bench.schedule import ARRIVALS
from dlad_client import AsyncClient, ClientTimeout, CurveKeys, DaemonStatus

__all__ = ["main", "parse_range"]


def parse_range(text: str, *, integer: bool = False) -> list[float]:
    """``"8"`` → ``[8]``; ``"start:end:step"`` → start, start+step, … ≤ end (``step`` defaults to
    1). Raises ValueError on anything else, a step ≤ 0, end < start or a value ≤ 0."""
    parts = text.split(":")
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"{text!r}: expected N or START:END[:STEP]") from None
    if len(nums) == 1:
        values = nums
    elif len(nums) in (2, 3):
        start, end = nums[0], nums[1]
        step = nums[2] if len(nums) == 3 else 1.0
        if not (step > 0 and end >= start):
            raise ValueError(f"{text!r}: need STEP > 0 and END >= START")
        count = math.floor((end - start) / step + 1e-9) + 1
        values = [start + i * step for i in range(count)]
    else:
        raise ValueError(f"{text!r}: expected N or START:END[:STEP]")
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"{text!r}: every value must be > 0")
    if integer and not all(v.is_integer() for v in values):
        raise ValueError(f"{text!r}: values must be integers")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dlad-bench",
        description="Load-test a running dlad: closed-loop concurrency, open-loop request rate "
        "(constant, Poisson, gamma) or camera streams; windows with a stability criterion; "
        "results as a table, CSV, JSON and plots.",
    )
    p.add_argument(
        "--endpoint",
        action="append",
        default=None,
        help="daemon endpoint, repeatable (default tcp://127.0.0.1:5555)",
    )
    p.add_argument("--model", default="demo")
    p.add_argument("--curve-server-key", metavar="FILE",
                   help="the daemon's public key file, for [auth] mode = curve")  # fmt: skip
    p.add_argument("--curve-key", metavar="FILE",
                   help="this client's secret key file (its public key allowed there)")  # fmt: skip
    p.add_argument("--shm-slots", type=int, default=0, metavar="N",
                   help="send frames through N shared-memory slots (a daemon on this host: "
                        "docs/protocol.md); frames past them go in the message")  # fmt: skip
    p.add_argument("--batch", type=int, default=1, metavar="B",
                   help="frames a message (INFER_BATCH, as perf_analyzer's -b): the level counts "
                        "messages, every rate and count in the results frames; not with "
                        "--streams (default 1)")  # fmt: skip
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", metavar="N|A:B:S", help="closed loop: requests in flight")
    mode.add_argument("--rate", metavar="R|A:B:S", help="open loop: mean requests per second")
    mode.add_argument("--streams", metavar="S|A:B:S", help="open loop: cameras at --fps each")
    p.add_argument(
        "--arrivals",
        choices=ARRIVALS,
        default="poisson",
        help="--rate's inter-arrival gaps (default poisson)",
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma arrivals: coefficient of variation of the gaps (1 = Poisson)",
    )
    p.add_argument("--fps", type=float, default=30.0, help="--streams: frames per second each")
    p.add_argument(
        "--fps-skew", type=float, default=0.0, metavar="Z",
        help="--streams: camera i at a rate in proportion to 1/(i+1)^Z, mean --fps "
        "(default 0: all at --fps); each frame's deadline is its camera's period",
    )  # fmt: skip
    p.add_argument(
        "--input",
        default="demo",
        help="frames: demo (bundled images), random:WxH, or a directory of images",
    )
    p.add_argument(
        "--deadline-ms",
        type=int,
        default=None,
        help="deadline of each request (streams: one frame period)",
    )
    p.add_argument("--slo-ms", type=float, default=None, metavar="MS",
                   help="a latency objective: goodput counts OK replies within MS of their due "
                        "time (the slo/s column, slo_goodput_rps)")  # fmt: skip
    p.add_argument("--search-p99-ms", type=float, default=None, metavar="MS",
                   help="with --rate LO:HI: search (by bisection) the highest rate whose p99 "
                        "from the due time stays within MS with <= 1%% not OK")  # fmt: skip
    p.add_argument("--search-steps", type=int, default=6, help="bisections of the search (6)")
    p.add_argument("--fail-if", action="append", default=[], metavar="COND",
                   help="exit 3 if any level meets COND, e.g. 'p99>40ms', 'goodput<0.95', "
                        "'slo<99%%' (repeatable; metrics in dlad_bench/judge.py)")  # fmt: skip
    p.add_argument("--timeout-s", type=float, default=10.0, help="client timeout per request")
    p.add_argument(
        "--connect-timeout-s",
        type=float,
        default=3.0,
        help="how long to wait for the daemon's first answer",
    )
    p.add_argument("--warmup-s", type=float, default=2.0)
    win = p.add_mutually_exclusive_group()
    win.add_argument("--window-s", type=float, default=2.0, help="measurement window (s)")
    win.add_argument(
        "--window-count",
        type=int,
        default=None,
        help="close windows after this many completed requests instead",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="measure each level for this long (windows of --window-s, no early stop on "
        "stability) instead of until stable",
    )
    p.add_argument("--stability-pct", type=float, default=10.0)
    p.add_argument("--stability-windows", type=int, default=3)
    p.add_argument("--max-trials", type=int, default=10, help="most windows per level")
    p.add_argument(
        "--late-tolerance-ms",
        type=float,
        default=2.0,
        help="an open-loop send later than this behind schedule counts as late",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run each level N times (seeds seed..seed+N-1): mean, 95%% CI and CV "
                        "of throughput and p99 over the trials; the tables, CSV, plots and "
                        "thresholds show each level's median-throughput trial")  # fmt: skip
    p.add_argument("--csv", type=Path, default=None, help="write the results table as CSV")
    p.add_argument("--json", type=Path, default=None, help="write the results as JSON")
    p.add_argument("--plots", type=Path, default=None, help="write PNG plots into this folder")
    p.add_argument("--html", type=Path, default=None,
                   help="write one self-contained HTML report (tables, plots inline)")  # fmt: skip
    p.add_argument("--timeline-ms", type=float, default=100.0, help="timeline plot's window")
    p.add_argument(
        "--timeline-level",
        type=int,
        default=-1,
        help="which level (index, default the last) the timeline shows",
    )
    p.add_argument(
        "--capacity-rps",
        type=float,
        default=None,
        help="draw this engine capacity on the load plot",
    )
    p.add_argument("--quiet", action="store_true", help="no progress display")
    return p


class _Progress:
    """One status line per window: a live line on a terminal, plain lines otherwise."""

    def __init__(self, console: Console, quiet: bool, total: int) -> None:
        self.console = console
        self.quiet = quiet
        self.total = total
        self.index = 0
        self.live: Live | None = None
        if not quiet and console.is_terminal:
            self.live = Live(Text(""), console=console, transient=True, auto_refresh=False)
            self.live.start()

    def level(self, index: int, load: Load) -> None:
        self.index = index
        self._show(f"level {index + 1}/{self.total} {load.label}: warming up")

    def window(self, load: Load, m: Measurement) -> None:
        w = m.windows[-1]
        self._show(
            f"level {self.index + 1}/{self.total} {load.label}: window {len(m.windows)}"
            f"/{m.max_trials}  {w.throughput:.1f} OK/s  mean {w.latency_ms:.2f} ms"
            f"{'  stable' if m.stable else ''}"
        )

    def _show(self, text: str) -> None:
        if self.live is not None:
            self.live.update(Text(text), refresh=True)
        elif not self.quiet:
            self.console.print(text, highlight=False)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


async def _bench(
    args: argparse.Namespace, loads: list[Load], settings: Settings, frames: list[Frame]
) -> int:
    err = Console(stderr=True)
    out = Console() if sys.stdout.isatty() else Console(width=200)  # a file gets whole rows
    endpoints = args.endpoint or ["tcp://127.0.0.1:5555"]
    levels: list[Level] = []
    repeats: list[tuple[str, list[LevelResult]]] = []  # every trial of each level
    curve = None
    if args.curve_server_key or args.curve_key:
        if not (args.curve_server_key and args.curve_key):
            print("dlad-bench: --curve-server-key and --curve-key go together", file=sys.stderr)
            return 2
        try:
            curve = CurveKeys.from_files(args.curve_server_key, args.curve_key)
        except ValueError as exc:
            print(f"dlad-bench: {exc}", file=sys.stderr)
            return 2
    shm = {}
    if args.shm_slots:
        slot = max(f.nbytes for f in frames)
        shm = {"shm_slot_bytes": max(slot, 4096), "shm_slots": args.shm_slots}
    try:
        client = AsyncClient(
            endpoints, timeout_s=settings.timeout_s, max_in_flight=100_000, curve=curve, **shm
        )
    except ValueError as exc:  # e.g. shared memory with a daemon on another host
        print(f"dlad-bench: {exc}", file=sys.stderr)
        return 2
    async with client as c:
        try:
            status: DaemonStatus = await c.status(timeout_s=args.connect_timeout_s)
        except ClientTimeout:
            print(
                f"dlad-bench: no daemon answered at {', '.join(endpoints)} within "
                f"{args.connect_timeout_s:g} s (is dlad running? see --endpoint)",
                file=sys.stderr,
            )
            return 1
        except DladError as exc:
            print(f"dlad-bench: the daemon refused STATUS: {exc}", file=sys.stderr)
            return 1
        if args.model not in {m["name"] for m in status["models"]}:
            names = ", ".join(m["name"] for m in status["models"]) or "none"
            print(
                f"dlad-bench: the daemon serves no model {args.model!r} ({names})", file=sys.stderr
            )
            return 1
        search = args.search
        progress = _Progress(err, args.quiet, search.total if search else len(loads))
        gone = ""
        warnings: list[str] = []  # the console's, for the HTML report too
        try:
            for i, load in enumerate(_loads(loads, search, args)):
                progress.level(i, load)
                trials: list[Level] = []
                for t in range(args.repeat):
                    trial = dataclasses.replace(settings, seed=settings.seed + t)
                    trials.append(
                        await run_level(c, load, trial, frames, on_window=progress.window)
                    )
                    gone = await _daemon_gone(c, trials[-1].result, args.connect_timeout_s)
                    if gone:
                        break
                level = trials[representative([lv.result for lv in trials])]
                levels.append(level)
                repeats.append((load.label, [lv.result for lv in trials]))
                r = level.result
                if search is not None:
                    search.record(load.level, r)
                if gone:
                    break
                if r.late_fraction > 0.01:
                    warnings.append(
                        f"{load.label}: {100 * r.late_fraction:.1f}% of requests left more "
                        f"than {settings.late_tolerance_ms:g} ms behind schedule (worst "
                        f"{r.max_late_ms:.1f} ms); achieved {r.sent_rps:.1f}/s of "
                        f"{r.offered_rps:.1f}/s offered: the generator fell behind its "
                        "schedule (is the client short of CPU?)"
                    )
                    err.print(f"[yellow]warning[/]: {warnings[-1]}", highlight=False)
        finally:
            progress.close()
    results = [lv.result for lv in levels]
    print_table(results, out)
    if args.batch > 1:
        out.print(f"batches: {args.batch} frames a message (INFER_BATCH); each level counts "
                  "messages, every rate, count and latency above is of frames")  # fmt: skip
    if client.shm is not None:
        out.print(f"shared memory: {args.shm_slots} slots; {client.shm.inline} frames went in "
                  "the message (every slot was the daemon's)")  # fmt: skip
    if args.repeat > 1:
        print_repeats(repeats, out)
    if search is not None:
        out.print(f"search: {search.summary()}")
    if gone:
        err.print(
            f"[red]dlad-bench: the daemon stopped answering during {levels[-1].load.label}[/]: "
            f"{gone}; {len(loads) - len(levels)} level(s) not run. The table above covers the "
            "levels run until then."
        )
    meta = {
        "endpoints": endpoints,
        "shm_slots": args.shm_slots,
        "batch": args.batch,
        "shm_inline": None if client.shm is None else client.shm.inline,
        "daemon": status["name"],
        "daemon_version": status["version"],
        "devices": [d["name"] for d in status["devices"]],
        "model": args.model,
        "input": args.input,
        "frame_shapes": sorted({tuple(f.shape) for f in frames}),
        "argv": sys.argv[1:],
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "settings": {k: getattr(settings, k) for k in settings.__dataclass_fields__},
    }  # fmt: skip
    if args.csv is not None:
        write_csv(args.csv, results)
    if args.json is not None:
        spreads = [json_repeats(label, t) for label, t in repeats] if args.repeat > 1 else None
        write_json(args.json, results, meta, spreads)
    failed = failures(args.thresholds, [(lv.load.label, lv.result) for lv in levels])
    if args.plots is not None or args.html is not None:
        with tempfile.TemporaryDirectory() as tmp:
            folder = args.plots if args.plots is not None else Path(tmp)
            pngs = _plots(args, levels, folder)
            if args.html is not None:
                notes = [f"search: {search.summary()}"] if search is not None else []
                notes += _repeat_notes(repeats) if args.repeat > 1 else []
                notes += [f"failed {line}" for line in failed]
                notes += [f"the daemon stopped answering: {gone}"] if gone else []
                judged = bool(args.thresholds) or search is not None or bool(gone)
                passed = not failed and not gone and (search is None or search.passing is not None)
                verdict = ("PASS" if passed else "FAIL") if judged else None
                write_html(args.html, results, meta, pngs, notes, verdict=verdict,
                           warnings=warnings)  # fmt: skip
    if gone:
        return 1
    for line in failed:
        err.print(f"[red]dlad-bench: failed[/] {line}")
    if search is not None and search.passing is None:  # the search has no answer: it failed
        err.print(f"[red]dlad-bench: failed[/] the search: {search.summary()}")
        return EXIT_THRESHOLD
    return EXIT_THRESHOLD if failed else 0


def _repeat_notes(repeats: list[tuple[str, list[LevelResult]]]) -> list[str]:
    """One line per level for the HTML report: its trials' throughput and p99 spread."""
    lines = []
    for label, trials in repeats:
        rate = spread([t.throughput_rps for t in trials])
        p99 = spread([t.latency_ms["p99"] for t in trials])
        lines.append(
            f"{label}: over {len(trials)} trials ok/s {rate.mean:.1f} "
            f"[{rate.ci95[0]:.1f}, {rate.ci95[1]:.1f}] (CV {100 * rate.cv:.1f}%), p99 "
            f"{p99.mean:.2f} [{p99.ci95[0]:.2f}, {p99.ci95[1]:.2f}] ms (CV {100 * p99.cv:.1f}%)"
        )
    return lines


def _loads(
    fixed: list[Load], search: RateSearch | None, args: argparse.Namespace
) -> Iterator[Load]:
    """The levels to run: the sweep as given, or the search's rates one after the other."""
    if search is None:
        yield from fixed
        return
    while (rate := search.next()) is not None:
        yield Load("rate", rate, args.arrivals, args.burstiness)


async def _daemon_gone(client: AsyncClient, r: LevelResult, timeout_s: float) -> str:
    """Why the daemon seems to have stopped answering during a level ("" if it still answers).

    Asked only when the level had requests that got no reply at all or no OK reply: then one
    STATUS must come back within ``timeout_s``."""
    unanswered = r.status_counts.get(CLIENT_TIMEOUT, 0)
    if r.requests and not unanswered and r.status_counts.get("OK", 0):
        return ""
    try:
        await client.status(timeout_s=timeout_s)
    except ClientTimeout:
        return (
            f"{unanswered} of {r.requests} measured requests got no reply, and STATUS got none "
            f"within {timeout_s:g} s"
        )
    except DladError:
        return ""  # it answers (with an error): alive
    return ""


def _plots(args: argparse.Namespace, levels: list[Level], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    chosen = levels[args.timeline_level]
    return [
        plots.plot_cdf([(lv.load.label, lv.records) for lv in levels], folder / "latency_cdf.png"),
        plots.plot_load([lv.result for lv in levels], folder / "load.png", args.capacity_rps),
        plots.plot_timeline(
            chosen.records,
            folder / "timeline.png",
            span_ms=args.timeline_ms,
            title=f"device timeline: {chosen.load.label}, {args.timeline_ms:g} ms",
        ),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dlad-bench`` with ``argv`` (default: the command line); returns the exit status."""
    p = _parser()
    args = p.parse_args(argv)
    try:
        if args.concurrency is not None:
            values = parse_range(args.concurrency, integer=True)
            loads = [Load("concurrency", v) for v in values]
        elif args.rate is not None:
            values = parse_range(args.rate)
            loads = [Load("rate", v, args.arrivals, args.burstiness) for v in values]
        else:
            values = parse_range(args.streams, integer=True)
            loads = [Load("streams", v, fps=args.fps, fps_skew=args.fps_skew) for v in values]
        if not (args.fps > 0 and args.burstiness > 0):
            raise ValueError("--fps and --burstiness must be > 0")
        if not args.fps_skew >= 0:
            raise ValueError("--fps-skew must be >= 0")
        settings = Settings(
            model=args.model,
            deadline_ms=args.deadline_ms,
            timeout_s=args.timeout_s,
            warmup_s=args.warmup_s,
            window_s=args.window_s,
            window_count=args.window_count,
            stability_pct=args.stability_pct,
            stability_windows=args.stability_windows,
            max_trials=args.max_trials,
            late_tolerance_ms=args.late_tolerance_ms,
            seed=args.seed,
            duration_s=args.duration,
            slo_ms=args.slo_ms,
            batch=args.batch,
        )
        settings.check()
        if args.streams is not None and args.batch > 1:
            raise ValueError("--batch: camera streams send one frame a message")
        if args.deadline_ms is not None and args.deadline_ms < 1:
            raise ValueError("--deadline-ms must be >= 1")
        if args.slo_ms is not None and not args.slo_ms > 0:
            raise ValueError("--slo-ms must be > 0")
        if args.repeat < 1:
            raise ValueError("--repeat must be >= 1")
        if args.shm_slots < 0:
            raise ValueError("--shm-slots must be >= 0")
        args.thresholds = [parse_threshold(t) for t in args.fail_if]
        args.search = None
        if args.search_p99_ms is not None:
            if args.rate is None:
                raise ValueError("--search-p99-ms searches a rate: give --rate LO:HI")
            args.search = RateSearch(min(values), max(values), args.search_p99_ms,
                                     steps=args.search_steps)  # fmt: skip
        if args.slo_ms is None and any(t.text.startswith("slo") for t in args.thresholds):
            raise ValueError("--fail-if on slo needs --slo-ms")
        frames = load_frames(args.input, seed=args.seed)  # bad input fails before connecting
    except (ValueError, FileNotFoundError) as exc:
        p.error(str(exc))
    return anyio.run(_bench, args, loads, settings, frames)


if __name__ == "__main__":
    sys.exit(main())
