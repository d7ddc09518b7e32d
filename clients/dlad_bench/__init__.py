"""dlad-bench: the load-testing harness for dlad, after Triton's perf_analyzer.

It talks to a running daemon through the SDK (:mod:`dlad_client`) and the wire protocol only,
never through the daemon's internals, so it measures what any client would see::

    dlad-bench --concurrency 1:16:3                   closed loop, a concurrency sweep
    dlad-bench --rate 50:250:50 --arrivals poisson    open loop at a mean rate (constant/gamma too)
    dlad-bench --streams 16 --fps 30                  16 cameras, one-frame-period deadlines
    dlad-bench --streams 24 --fps 30 --fps-skew 0.5   24 cameras, Zipf-skewed rates, mean 30
        [--input demo | random:640x480 | DIR] [--csv r.csv] [--json r.json] [--plots DIR]
        [--html report.html]                          one self-contained report, plots inline

Each level runs a warm-up, then measurement windows until the last 3 agree within
``--stability-pct`` on throughput and latency (or ``--max-trials`` windows; ``--duration S``
instead measures each level for S seconds), and reports throughput, goodput, client latency
percentiles, the daemon's queue/pre/device/post split from the replies' timings, a column per
failure status, each device's share and mean batch size (replies that share their device
start and end ran as one batch; the timeline plot labels each batch), and late sends of the
generator. Latency is reported from each request's send and, in open loop, from when it was
due (``due_p99``, ``intended_latency_ms``: a generator that fell behind cannot hide the
queueing it skipped, wrk2's correction of coordinated omission). ``--slo-ms MS`` counts the OK
replies within MS of their due time (``slo/s``); ``--fail-if COND`` (``'p99>40ms'``,
``'goodput<0.95'``, ``'slo<99%'``, :mod:`~dlad_bench.judge`) exits 3 when a level meets it, for
CI. ``--rate LO:HI --search-p99-ms MS`` searches, by bisection, the highest rate whose p99 from
the due time stays within MS with at most 1 % not OK (perf_analyzer's latency-threshold search)
and reports every level it measured; a search that no rate passes exits 3 too. A daemon that
stops answering mid-run ends the sweep with exit status 1 after reporting the levels measured;
a usage error exits 2.
``docs/BENCHMARKS.md`` §5 has a capacity study made with it (``bench/capacity_study.py``), §6
the three engines behind one model (``bench/three_engines.py``).

Modules: :mod:`~dlad_bench.schedule` (open-loop send times), :mod:`~dlad_bench.inputs`
(frames), :mod:`~dlad_bench.runner` (one level against a daemon), :mod:`~dlad_bench.measure`
(windows, stability, results), :mod:`~dlad_bench.judge` (``--fail-if``),
:mod:`~dlad_bench.report` (table, CSV, JSON),
:mod:`~dlad_bench.plots` (PNG), :mod:`~dlad_bench.fuzz` (malformed messages),
:mod:`~dlad_bench.cli` (the command).
"""

from dlad_bench.measure import LevelResult, Measurement, Record, is_stable
from dlad_bench.runner import Level, Load, Settings, run_level
from dlad_bench.schedule import arrival_times, camera_times

__all__ = [
    "Level", "LevelResult", "Load", "Measurement", "Record", "Settings", "arrival_times",
    "camera_times", "is_stable", "run_level",
]  # fmt: skip
