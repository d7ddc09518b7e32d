"""dlad-bench against a real daemon (two emulated DLA cores in timing mode): each load mode sends
the schedule it should (checked on the records of what was actually sent), camera frames carry
their stream and deadline, the stability logic ends levels, the CSV/JSON schemas are stable, the
plots are written and open, and an unreachable daemon is a clear error with exit status 1.

Every assertion here holds on a machine of any speed and load: they check what was sent, in
what order and how many, never how fast (how punctually sends leave and what rates come out is
``bench/capacity_study.py``'s job, BENCHMARKS §5)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from PIL import Image

from dlad.daemon import Daemon
from dlad_bench import plots
from dlad_bench.cli import main, parse_range
from dlad_bench.inputs import load_frames
from dlad_bench.report import CSV_COLUMNS, JSON_LEVEL_KEYS, write_csv, write_json
from dlad_bench.runner import Level, Load, Settings, run_level
from dlad_bench.schedule import arrival_times
from dlad_client import AsyncClient
from tests.clients.test_bench_schedule import exponential_ks, ks_critical
from tests.dlad.test_daemon import running
from tests.dlad.test_metrics import serving

pytestmark = pytest.mark.timeout(90)

FRAMES = load_frames("random:64x48")
QUICK = Settings(warmup_s=0.3, window_s=0.5, stability_pct=30.0, max_trials=6)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    """2 ms per task per core: about 1000 requests/s of capacity."""
    with serving(tmp_path, latency=2000.0) as d:
        yield d


def run(endpoint: str, load: Load, settings: Settings = QUICK) -> Level:
    async def go() -> Level:
        async with AsyncClient(endpoint, max_in_flight=10_000) as client:
            return await run_level(client, load, settings, FRAMES)

    return anyio.run(go)


def test_closed_loop_keeps_exactly_n_in_flight(daemon: Daemon) -> None:
    level = run(daemon.bound[0], Load("concurrency", 3))
    done = [r for r in level.records if not math.isnan(r.done)]
    assert all(math.isnan(r.scheduled) for r in level.records)
    probes = sorted({r.sent for r in level.records})
    in_flight = [sum(1 for r in level.records if r.sent <= t < r.done) for t in probes]
    assert max(in_flight) == 3  # never more than N ...
    # ... and a new request goes out only when one came back: the k-th send (k >= N, counted
    # from 0) follows at least k - N + 1 replies.
    sends = sorted(r.sent for r in level.records)
    dones = sorted(r.done for r in done)
    for k, t in enumerate(sends[3:], start=3):
        assert np.searchsorted(dones, t, side="right") >= k - 3 + 1
    r = level.result
    assert r.status_counts["OK"] == r.requests > 0
    assert set(r.device_share) == {"dla0", "dla1"}
    assert r.device_batch == {"dla0": 1.0, "dla1": 1.0}  # a DLA core runs one frame at a time
    assert math.isnan(r.offered_rps)


def test_open_loop_poisson_sends_the_schedule(daemon: Daemon) -> None:
    rate = 150.0
    settings = Settings(warmup_s=0.5, window_s=1.0, stability_pct=50.0, max_trials=3, seed=11)
    level = run(daemon.bound[0], Load("rate", rate, "poisson"), settings)
    sent = sorted(level.records, key=lambda r: r.scheduled)
    due = np.array([r.scheduled for r in sent])
    horizon = settings.warmup_s + settings.max_trials * settings.window_s + 1.0
    expected = arrival_times(rate, horizon, arrivals="poisson", seed=11)
    np.testing.assert_array_equal(due, expected[: due.size])  # the precomputed schedule
    # the schedule's gaps are exponential at the rate; every request left on or after its time
    assert exponential_ks(np.diff(due), rate) < ks_critical(due.size - 1)
    assert all(r.sent >= r.scheduled for r in sent)
    r = level.result
    assert r.offered_rps == rate
    assert 0 < r.requests <= len(sent)  # the measured windows' requests (after warm-up)
    assert sum(r.status_counts.values()) == r.requests  # every one has an outcome


def _messages(level: Level, batch: int) -> list[list[Any]]:
    """The level's records cut into its messages (each message's records are appended
    together), checked to be one message each: sent together, answered together."""
    recs = level.records
    assert len(recs) % batch == 0
    groups = [recs[i : i + batch] for i in range(0, len(recs), batch)]
    for g in groups:
        assert len({r.sent for r in g}) == 1
        done = {r.done for r in g}
        assert len(done) == 1 or all(math.isnan(d) for d in done)
    return groups


def test_closed_loop_batches_send_one_message_of_b_frames(daemon: Daemon) -> None:
    received = daemon.frontend.counters.received
    level = run(daemon.bound[0], Load("concurrency", 2), dataclasses.replace(QUICK, batch=4))
    messages = _messages(level, 4)
    # the daemon got one message per four frames (and a CANCEL for each still in flight at the
    # end), not four INFERs
    got = daemon.frontend.counters.received - received
    assert len(messages) <= got <= len(messages) + 2
    probes = sorted({r.sent for r in level.records})
    in_flight = [sum(1 for r in level.records if r.sent <= t < r.done) for t in probes]
    assert max(in_flight) == 8  # two messages of four
    r = level.result
    assert r.status_counts["OK"] == r.requests > 0
    assert r.requests % 4 == 0  # frames counted, a message's four in the same window
    assert set(r.device_share) == {"dla0", "dla1"}  # a message's frames spread over the cores


def test_open_loop_batches_offer_frames(daemon: Daemon) -> None:
    settings = Settings(warmup_s=0.3, window_s=0.5, stability_pct=50.0, max_trials=3, batch=3)
    level = run(daemon.bound[0], Load("rate", 50.0, "constant"), settings)
    messages = _messages(level, 3)
    due = np.sort([g[0].scheduled for g in messages])
    np.testing.assert_allclose(np.diff(due), 1 / 50.0, rtol=1e-9)  # 50 messages a second
    assert all(r.scheduled == g[0].scheduled for g in messages for r in g)
    r = level.result
    assert r.offered_rps == 150.0  # frames a second
    assert r.requests % 3 == 0
    assert sum(r.status_counts.values()) == r.requests


def test_camera_streams_do_not_batch(daemon: Daemon) -> None:
    with pytest.raises(ValueError, match="one frame a message"):
        run(daemon.bound[0], Load("streams", 2), dataclasses.replace(QUICK, batch=2))


def test_open_loop_constant_rate(daemon: Daemon) -> None:
    settings = Settings(warmup_s=0.3, window_s=0.5, stability_pct=50.0, max_trials=3)
    level = run(daemon.bound[0], Load("rate", 200.0, "constant"), settings)
    due = np.sort([r.scheduled for r in level.records])
    np.testing.assert_allclose(np.diff(due), 1 / 200.0, rtol=1e-9)  # one every 5 ms
    assert all(r.sent >= r.scheduled for r in level.records)
    sends = sorted(level.records, key=lambda r: r.sent)  # sent in schedule order
    assert [r.scheduled for r in sends] == sorted(r.scheduled for r in sends)


def test_camera_streams_carry_stream_and_deadline_and_get_shed(tmp_path: Path) -> None:
    # 20 ms per task on two cores = 100 frames/s of capacity; 4 cameras at 50 fps offer 200
    with serving(tmp_path, latency=20_000.0) as d:
        settings = Settings(warmup_s=0.3, window_s=0.6, stability_pct=60.0, max_trials=3)
        level = run(d.bound[0], Load("streams", 4, fps=50.0), settings)
    recs = level.records
    assert {r.stream for r in recs} == {0, 1, 2, 3}
    assert {r.deadline_ms for r in recs} == {20.0}  # one frame period
    for s in range(4):
        due = np.array(sorted(r.scheduled for r in recs if r.stream == s))
        np.testing.assert_allclose(np.diff(due), 1 / 50.0, atol=1e-9)
    r = level.result
    assert r.offered_rps == 200.0
    # Two cores at 20 ms a frame serve at most 100 frames/s, however loaded the machine: the
    # rest of what 4 cameras at 50 fps send is shed. A newer frame of a stream supersedes a
    # queued one (CANCELLED); stale frames miss their deadline (DEADLINE_EXCEEDED).
    assert r.throughput_rps <= 100.0 * 1.1
    shed = Counter(x.status for x in recs if x.status not in ("", "OK"))
    assert shed["CANCELLED"] + shed["DEADLINE_EXCEEDED"] > 0
    assert r.shed_fraction > 0
    assert r.goodput_rps <= r.throughput_rps


def test_levels_stop_when_stable_or_after_max_trials(daemon: Daemon) -> None:
    # Any two windows agree within 10^6 %: stable as soon as the rule allows (3 windows).
    steady = run(
        daemon.bound[0],
        Load("concurrency", 2),
        Settings(warmup_s=0.3, window_s=0.4, stability_pct=1e6, max_trials=8),
    )
    assert steady.result.stable
    assert steady.result.windows == 3
    never = run(
        daemon.bound[0],
        Load("concurrency", 2),
        Settings(warmup_s=0.1, window_s=0.2, stability_pct=1e-6, max_trials=4),
    )
    assert not never.result.stable
    assert never.result.windows == 4


def test_count_windows(daemon: Daemon) -> None:
    settings = Settings(warmup_s=0.2, window_count=50, stability_pct=50.0, max_trials=3)
    level = run(daemon.bound[0], Load("concurrency", 2), settings)
    assert all(w.completed >= 49 for w in level.result.window_stats)


# ------------------------------------------------------------------------------ outputs

EXPECTED_CSV = [
    "mode", "level", "offered_rps", "sent_rps", "throughput_rps", "goodput_rps", "requests",
    "status_OK", "status_BAD_REQUEST", "status_NOT_FOUND", "status_OVERLOADED",
    "status_DEADLINE_EXCEEDED", "status_CANCELLED", "status_SHUTTING_DOWN",
    "status_DEVICE_FAILED", "status_INTERNAL", "status_CLIENT_TIMEOUT", "shed_fraction",
    "latency_p50_ms", "latency_p90_ms", "latency_p95_ms", "latency_p99_ms", "latency_p99_9_ms",
    "latency_max_ms", "latency_mean_ms", "client_overhead_ms", "daemon_queue_ms",
    "daemon_pre_ms", "daemon_device_ms", "daemon_post_ms", "daemon_total_ms",
    "daemon_queue_p99_ms", "daemon_total_p99_ms", "device_share", "device_batch", "late_sends",
    "late_fraction", "max_late_ms", "windows", "stable", "measured_s",
    "intended_latency_p50_ms", "intended_latency_p90_ms", "intended_latency_p95_ms",
    "intended_latency_p99_ms", "intended_latency_p99_9_ms", "intended_latency_max_ms",
    "intended_latency_mean_ms", "slo_ms", "slo_goodput_rps",
]  # fmt: skip
EXPECTED_JSON = [
    "mode", "level", "offered_rps", "sent_rps", "throughput_rps", "goodput_rps", "requests",
    "status_counts", "shed_fraction", "latency_ms", "client_overhead_ms", "daemon_ms",
    "device_share", "device_batch", "late_sends", "late_fraction", "max_late_ms", "windows",
    "stable", "measured_s", "window_stats", "intended_latency_ms", "slo_ms", "slo_goodput_rps",
]  # fmt: skip


def test_csv_json_schemas_and_plots(daemon: Daemon, tmp_path: Path) -> None:
    levels = [run(daemon.bound[0], Load("rate", rate, "poisson")) for rate in (100.0, 300.0)]
    results = [lv.result for lv in levels]
    assert list(CSV_COLUMNS) == EXPECTED_CSV  # a schema change must change this test
    assert list(JSON_LEVEL_KEYS) == EXPECTED_JSON
    write_csv(tmp_path / "r.csv", results)
    with (tmp_path / "r.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == EXPECTED_CSV
    assert [float(row["level"]) for row in rows] == [100.0, 300.0]
    assert all(float(row["throughput_rps"]) > 0 for row in rows)
    assert rows[0]["device_share"].split()[0].startswith("dla0=")
    write_json(tmp_path / "r.json", results, {"k": 1})
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["schema"] == "dlad-bench/4"
    assert doc["meta"] == {"k": 1}
    for level in doc["levels"]:
        assert list(level) == EXPECTED_JSON
        assert set(level["latency_ms"]) == {"p50", "p90", "p95", "p99", "p99_9", "max", "mean"}
        assert set(level["daemon_ms"]) == {
            "queue", "pre", "device", "post", "total", "queue_p99", "total_p99"}  # fmt: skip
        assert level["latency_ms"]["p99"] >= level["latency_ms"]["p50"] > 0
        # A timing-mode core never finishes a task before its modelled 2 ms (it sleeps out
        # the rest); how much longer it takes depends on the machine's load, so no upper bound.
        assert level["daemon_ms"]["device"] >= 2.0 * (1 - 1e-6)
        assert set(level["window_stats"][0]) == {
            "index", "start_s", "end_s", "completed", "throughput_rps", "latency_ms"}  # fmt: skip
    written = [
        plots.plot_cdf([(lv.load.label, lv.records) for lv in levels], tmp_path / "cdf.png"),
        plots.plot_load(results, tmp_path / "load.png", capacity_rps=1000.0),
        plots.plot_timeline(levels[-1].records, tmp_path / "timeline.png", span_ms=40.0),
    ]
    for path in written:
        with Image.open(path) as img:
            assert img.format == "PNG"
            assert img.size[0] > 300
            img.verify()
        assert path.stat().st_size < 200_000
    # The window holds exactly the device runs that overlap it. Which devices ran in a given
    # 40 ms depends on the machine's load; over the whole level both cores served.
    records = levels[-1].records
    inside, start = plots.timeline_window(records, 40.0)
    ran = [(r.device or "?", r.start_ns, r.end_ns) for r in records
           if r.start_ns is not None and r.end_ns is not None]  # fmt: skip
    end = start + 40_000_000
    assert inside
    assert sorted(inside) == sorted((d, a, b) for d, a, b in ran if b > start and a < end)
    assert all(b >= a for _, a, b in inside)
    whole, _ = plots.timeline_window(records, 1e9)
    assert {d for d, _, _ in whole} == {"dla0", "dla1"}


def test_cli_end_to_end(daemon: Daemon, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "--endpoint", daemon.bound[0], "--concurrency", "1:3:2", "--input", "random:32x32",
        "--warmup-s", "0.2", "--window-s", "0.3", "--stability-pct", "50", "--max-trials", "4",
        "--csv", str(tmp_path / "o.csv"), "--json", str(tmp_path / "o.json"),
        "--plots", str(tmp_path / "plots"), "--quiet",
    ]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "dlad-bench" in out
    assert "concurrency 3" in out
    doc: dict[str, Any] = json.loads((tmp_path / "o.json").read_text())
    assert [lv["level"] for lv in doc["levels"]] == [1.0, 3.0]
    assert doc["meta"]["devices"] == ["dla0", "dla1"]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "latency_cdf.png", "load.png", "timeline.png"]  # fmt: skip


def test_unreachable_daemon_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    code = main(["--endpoint", endpoint, "--rate", "10", "--connect-timeout-s", "0.3", "--quiet"])
    assert code == 1
    assert "no daemon answered" in capsys.readouterr().err


def test_an_endpoint_without_a_port_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--endpoint", "tcp://127.0.0.1", "--rate", "10", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dlad-bench: endpoint 'tcp://127.0.0.1' has no port")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "args",
    [
        ["--rate", "0"],
        ["--concurrency", "1.5"],
        ["--rate", "5:1"],
        ["--streams", "4", "--fps", "0"],
        ["--rate", "10", "--input", "random:0x10"],
        ["--rate", "10", "--input", "/nonexistent/dir"],
        ["--rate", "10", "--stability-windows", "5", "--max-trials", "3"],
        ["--rate", "10", "--concurrency", "2"],
        ["--rate", "10", "--batch", "0"],
        ["--rate", "10", "--batch", "17"],
        ["--streams", "2", "--batch", "2"],
    ],
)
def test_bad_arguments_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert "dlad-bench: error:" in capsys.readouterr().err


def test_parse_range() -> None:
    assert parse_range("8") == [8.0]
    assert parse_range("1:16:5") == [1.0, 6.0, 11.0, 16.0]
    assert parse_range("100:300:100") == [100.0, 200.0, 300.0]
    assert parse_range("2:4") == [2.0, 3.0, 4.0]
    assert parse_range("0.5:1.0:0.25") == [0.5, 0.75, 1.0]


# ------------------------------------------------------------------ dlad-bench says what happened
def _bench_args(endpoint: str, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--endpoint", endpoint, "--input", "random:32x32", "--warmup-s", "0.1", "--window-s",
        "0.3", "--stability-pct", "50", "--max-trials", "3", "--timeout-s", "2",
        "--connect-timeout-s", "2", "--json", str(tmp_path / "o.json"), "--quiet", *extra,
    ]  # fmt: skip


def test_failure_statuses_get_their_own_columns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DEVICE_FAILED is not load shedding: it has its own column, not a hidden 0 in "shed"."""
    with running(tmp_path, latency=500.0, depth=64, error_rate=0.3) as (_, endpoint):
        assert main(_bench_args(endpoint, tmp_path, "--concurrency", "2")) == 0
    out = capsys.readouterr().out
    assert "DEVICE_FAILED" in out.partition("what failed (% of requests)")[2]
    (level,) = json.loads((tmp_path / "o.json").read_text())["levels"]
    assert level["status_counts"]["DEVICE_FAILED"] > 0
    assert level["shed_fraction"] == 0.0  # nothing was shed: the failures are elsewhere


def test_a_daemon_that_dies_mid_run_is_reported_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with running(tmp_path, latency=2000.0) as (daemon, endpoint):
        real = run_level
        levels_run = 0

        async def then_stop(*args: Any, **kwargs: Any) -> Level:
            nonlocal levels_run
            level = await real(*args, **kwargs)
            levels_run += 1
            if levels_run == 1:  # the daemon goes away between the first level and the second
                daemon.stop_threadsafe()
                assert await anyio.to_thread.run_sync(daemon.stopped.wait, 30.0)
            return level

        monkeypatch.setattr("dlad_bench.cli.run_level", then_stop)
        code = main(_bench_args(endpoint, tmp_path, "--concurrency", "1:3:1"))
    assert code == 1
    captured = capsys.readouterr()
    assert "stopped answering during concurrency 2" in captured.err
    assert "1 level(s) not run" in captured.err
    doc = json.loads((tmp_path / "o.json").read_text())
    assert [lv["level"] for lv in doc["levels"]] == [1.0, 2.0]  # what was measured is kept
    assert doc["levels"][0]["status_counts"]["OK"] > 0


def test_duration_runs_each_level_for_that_long(daemon: Daemon, tmp_path: Path) -> None:
    # Stable after one window by these settings, yet --duration 0.9 s runs three of 0.3 s.
    args = _bench_args(daemon.bound[0], tmp_path, "--concurrency", "2", "--duration", "0.9")
    args[args.index("--stability-pct") + 1] = "1e6"
    assert main([*args, "--stability-windows", "1"]) == 0
    (level,) = json.loads((tmp_path / "o.json").read_text())["levels"]
    assert level["windows"] == 3
    assert level["measured_s"] >= 0.9 * (1 - 1e-6)  # results cover all three windows
    with pytest.raises(SystemExit):
        main([*args, "--duration", "0"])


def test_a_failing_threshold_exits_3_and_says_which(
    daemon: Daemon, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dlad_bench.judge import EXIT_THRESHOLD

    args = _bench_args(daemon.bound[0], tmp_path, "--rate", "50", "--slo-ms", "1000")
    assert main([*args, "--fail-if", "p99>10000ms", "--fail-if", "slo<0.5"]) == 0
    assert main([*args, "--fail-if", "p50<1000ms"]) == EXIT_THRESHOLD  # true, so it fails
    assert "failed poisson 50/s: p50<1000ms (measured" in capsys.readouterr().err
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["levels"][0]["slo_ms"] == 1000.0
    assert doc["levels"][0]["slo_goodput_rps"] > 0
    with pytest.raises(
        SystemExit
    ) as info:  # a bad condition is a usage error, before anything runs
        main([*args, "--fail-if", "p99 ~ 4"])
    assert info.value.code == 2


def test_the_search_finds_the_knee_of_a_daemon_in_timing_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two cores at 20 ms a frame: 100 frames/s. Past that the queues overflow (OVERLOADED),
    so the highest rate that keeps p99 within 150 ms with <= 1% not OK lies below 100/s."""
    with serving(tmp_path, latency=20_000.0) as d:
        args = _bench_args(d.bound[0], tmp_path, "--rate", "20:200", "--search-p99-ms", "150",
                           "--search-steps", "4")  # fmt: skip
        assert main(args) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("search:"))
    found = float(line.split("OK: ")[1].split("/s")[0])
    assert 40.0 <= found <= 100.0, line
    levels = json.loads((tmp_path / "o.json").read_text())["levels"]
    assert [lv["level"] for lv in levels][:2] == [20.0, 200.0]  # the measured curve is kept
    assert len(levels) == 6


def test_a_search_that_no_rate_passes_fails(
    daemon: Daemon, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No daemon answers within a microsecond: the search has no answer, and says so in a
    line and in its exit status, as a failed --fail-if does."""
    from dlad_bench.judge import EXIT_THRESHOLD

    args = _bench_args(daemon.bound[0], tmp_path, "--rate", "20:40", "--search-p99-ms", "0.001")
    assert main(args) == EXIT_THRESHOLD
    err = capsys.readouterr().err
    assert "dlad-bench: failed the search: no rate tried keeps p99 within 0.001 ms" in err


def test_the_html_report_is_one_file_that_needs_nothing_else(
    daemon: Daemon, tmp_path: Path
) -> None:
    report = tmp_path / "r.html"
    args = _bench_args(daemon.bound[0], tmp_path, "--rate", "40:80:40", "--html", str(report))
    assert main([*args, "--fail-if", "throughput<100000"]) == 3
    text = report.read_text()
    assert text.startswith("<!DOCTYPE html>")
    assert text.count("data:image/png;base64,") == 3  # the plots, inline
    for external in ('src="http', "<script", "<link"):  # nothing fetched from anywhere
        assert external not in text
    assert text.count("<tr><td>rate ") == 2  # a row per level
    assert "failed poisson 40/s: throughput&lt;100000" in text  # what failed, said there too


def test_repeated_trials_report_each_levels_spread(
    daemon: Daemon, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _bench_args(daemon.bound[0], tmp_path, "--rate", "40:80:40", "--repeat", "3")
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "over 3 trials: mean [95% bootstrap CI], CV" in out
    doc = json.loads((tmp_path / "o.json").read_text())
    assert len(doc["levels"]) == 2  # one row per level: its median-throughput trial
    assert [r["load"] for r in doc["repeats"]] == ["poisson 40/s", "poisson 80/s"]
    for rep, level in zip(doc["repeats"], doc["levels"], strict=True):
        assert rep["trials"] == 3
        rates = rep["throughput_rps"]
        assert len(rates["values"]) == 3
        assert level["throughput_rps"] == rates["values"][rep["representative"]]
        assert sorted(rates["values"])[1] == level["throughput_rps"]
        lo, hi = rates["ci95"]
        assert min(rates["values"]) <= lo <= rates["mean"] <= hi <= max(rates["values"])
        assert rates["cv"] >= 0
        assert len(rep["p99_ms"]["values"]) == 3
    with pytest.raises(SystemExit) as info:
        main([*args[:-2], "--repeat", "0"])
    assert info.value.code == 2


def test_the_spread_of_known_values() -> None:
    from dlad_bench.repeats import spread

    s = spread([10.0, 12.0, 14.0])
    assert s.mean == 12.0
    assert s.cv == pytest.approx(2.0 / 12.0)  # sample std 2
    assert 10.0 <= s.ci95[0] < 12.0 < s.ci95[1] <= 14.0
    assert spread([10.0, 12.0, 14.0]).ci95 == s.ci95  # seeded: the same trials, the same CI
    one = spread([5.0])
    assert (one.mean, one.ci95) == (5.0, (5.0, 5.0))
    assert math.isnan(one.cv)
    none = spread([math.nan, math.nan])
    assert math.isnan(none.mean)
    assert none.as_dict()["mean"] is None  # JSON has no NaN
    # a run's trials whose all-minimum resamples averaged one rounding below the minimum
    odd = spread([33.196700913231005, 31.01165768968624, 40.99207327315311])
    assert min(odd.values) <= odd.ci95[0] <= odd.mean <= odd.ci95[1] <= max(odd.values)


def test_frames_can_go_through_shared_memory(daemon: Daemon, tmp_path: Path) -> None:
    args = _bench_args(daemon.bound[0], tmp_path, "--concurrency", "4", "--shm-slots", "8")
    assert main(args) == 0
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["meta"]["shm_slots"] == 8
    assert doc["meta"]["shm_inline"] == 0  # 4 in flight never take more than the 8 slots
    assert doc["levels"][0]["status_counts"]["OK"] > 0
    assert daemon.frontend.shm_frames >= doc["levels"][0]["status_counts"]["OK"]
    remote = _bench_args("tcp://10.1.2.3:5555", tmp_path, "--rate", "10", "--shm-slots", "8")
    assert main(remote) == 2  # a segment here means nothing to a daemon there


def test_batches_of_shared_memory_frames_from_the_cli(
    daemon: Daemon, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _bench_args(daemon.bound[0], tmp_path, "--concurrency", "2", "--batch", "4",
                       "--shm-slots", "16")  # fmt: skip
    frames_before = daemon.frontend.shm_frames
    assert main(args) == 0
    assert "4 frames a message" in capsys.readouterr().out  # the table says what it counts
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["meta"]["batch"] == 4
    assert doc["meta"]["shm_inline"] == 0  # 8 frames in flight never take more than 16 slots
    ok = doc["levels"][0]["status_counts"]["OK"]
    assert ok > 0
    assert ok % 4 == 0
    assert daemon.frontend.shm_frames - frames_before >= ok  # every frame of every batch in a slot
