"""dlad-bench's reports as a reader meets them: the console's tables fit 100 columns, the HTML
report gives the answer first, rounded, with the console's warnings."""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console

from dlad_bench.measure import LevelResult
from dlad_bench.report import print_table, write_html

STATUSES = ("OK", "OVERLOADED", "DEADLINE_EXCEEDED", "DEVICE_FAILED", "CLIENT_TIMEOUT")


def level(rate: float, slo: bool = True) -> LevelResult:
    latency = {"p50": 12.3456, "p90": 20.5, "p95": 25.0, "p99": 1234.5678, "p99_9": 2345.6,
               "max": 99999.99, "mean": 15.0}  # fmt: skip
    return LevelResult(
        mode="rate", level=rate, offered_rps=rate, sent_rps=rate * 0.999,
        throughput_rps=rate * 0.9, goodput_rps=rate * 0.85, requests=10_000,
        status_counts={s: 100 * (i + 1) for i, s in enumerate(STATUSES)},
        shed_fraction=0.0312345, latency_ms=latency, client_overhead_ms=0.4567,
        daemon_ms={"queue": 1.0, "pre": 2.0, "device": 3.8, "post": 0.5, "total": 7.3,
                   "queue_p99": 9.0, "total_p99": 20.0},
        device_share={"dla0": 0.33123, "dla1": 0.33, "gpu": 0.33877},
        device_batch={"dla0": 1.0, "dla1": 1.0, "gpu": 3.5}, late_sends=300,
        late_fraction=0.03, max_late_ms=12.0, windows=5, stable=False, measured_s=10.0,
        intended_latency_ms={"p99": 4567.891}, slo_ms=40.0 if slo else math.nan,
        slo_goodput_rps=rate * 0.8 if slo else math.nan,
    )  # fmt: skip


def test_the_tables_fit_100_columns_with_every_column_there() -> None:
    console = Console(width=100, record=True, force_terminal=False)
    print_table([level(1500.0), level(12000.0)], console)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 100
    for heading in ("offered/s", "slo/s", "p99.9", "p99 due", "device", "client", "devices",
                    "what failed (% of requests)", "OVERLOADED", "DEADLINE_EXCEEDED",
                    "DEVICE_FAILED", "CLIENT_TIMEOUT", "gpu 34% b3.5"):  # fmt: skip
        assert heading in text, heading
    for value in ("10800.0", "1234.57", "99999.99", "4567.89", "rate 12000"):  # whole, unwrapped
        assert value in text, value
    assert "…" not in text  # nothing cut short


def test_the_html_report_gives_the_answer_first(tmp_path: Path) -> None:
    report = tmp_path / "r.html"
    write_html(report, [level(1500.0)], {"model": "demo"}, notes=["search: 1,400/s passes"],
               verdict="FAIL", warnings=["rate 1500/s: 3.0% of requests left late"])  # fmt: skip
    text = report.read_text()
    order = [text.index(s) for s in ("<h2>Answer", "FAIL", "search: 1,400/s passes",
                                     "<h2>Warnings", "3.0% of requests left late",
                                     "<h2>Levels", "<h2>What was run")]  # fmt: skip
    assert order == sorted(order)
    assert "<td>1,350.0</td>" in text  # ok/s, rounded to a decimal with thousands separated
    assert "<td>1,234.57</td>" in text  # p99 ms
    assert "<td>3.1</td>" in text  # shed, as a percentage
    assert "dla0 33% dla1 33% gpu 34%" in text
    assert "1234.5678" not in text  # no unrounded figure in the table


def test_an_unjudged_run_says_so(tmp_path: Path) -> None:
    report = tmp_path / "r.html"
    write_html(report, [level(10.0, slo=False)], {})
    text = report.read_text()
    assert "no threshold or search was asked for" in text
    assert "Warnings" not in text
