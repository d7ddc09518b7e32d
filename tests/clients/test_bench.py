"""dlad-bench against a real daemon (two emulated DLA cores in timing mode): each load mode sends
the schedule it should (checked on the records of what was actually sent), camera frames carry
their stream and deadline, the stability logic ends levels, the CSV/JSON schemas are stable, the
plots are written and open, and an unreachable daemon is a clear error with exit status 1."""

from __future__ import annotations

import csv
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
    probes = np.linspace(0.5, max(r.done for r in done) - 0.1, 200)
    in_flight = [sum(1 for r in level.records if r.sent <= t < r.done) for t in probes]
    assert max(in_flight) == 3  # never more than N ...
    assert np.median(in_flight) == 3  # ... and N nearly always
    r = level.result
    assert r.status_counts["OK"] == r.requests > 0
    assert set(r.device_share) == {"dla0", "dla1"}
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
    # what actually left the client: at the rate, with exponential gaps
    times = np.array([r.sent for r in sent])
    gaps = np.diff(times)
    assert times.size / (times[-1] - times[0]) == pytest.approx(rate, rel=0.15)
    assert exponential_ks(gaps, rate) < ks_critical(gaps.size)
    assert np.median(times - due) < 2e-3  # sends leave on time
    r = level.result
    assert r.sent_rps == pytest.approx(rate, rel=0.25)
    assert r.throughput_rps == pytest.approx(r.sent_rps, rel=0.25)  # under capacity: all OK
    assert r.offered_rps == rate


def test_open_loop_constant_rate(daemon: Daemon) -> None:
    settings = Settings(warmup_s=0.3, window_s=0.5, stability_pct=50.0, max_trials=3)
    level = run(daemon.bound[0], Load("rate", 200.0, "constant"), settings)
    times = np.sort([r.sent for r in level.records])
    gaps = np.diff(times)
    assert np.median(gaps) == pytest.approx(1 / 200.0, rel=0.1)
    assert np.percentile(gaps, 90) < 2.5 / 200.0  # no clumping beyond scheduling jitter


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
    assert r.throughput_rps < 120.0  # the devices' capacity, not the offered load
    shed = Counter(x.status for x in recs if x.status not in ("", "OK"))
    # a newer frame of a stream supersedes a queued one; stale frames miss their deadline
    assert shed["CANCELLED"] + shed["DEADLINE_EXCEEDED"] > 0
    assert r.shed_fraction > 0.2
    assert r.goodput_rps <= r.throughput_rps


def test_levels_stop_when_stable_or_after_max_trials(daemon: Daemon) -> None:
    steady = run(
        daemon.bound[0],
        Load("concurrency", 2),
        Settings(warmup_s=0.3, window_s=0.4, stability_pct=40.0, max_trials=8),
    )
    assert steady.result.stable
    assert 3 <= steady.result.windows < 8
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
    "daemon_queue_p99_ms", "daemon_total_p99_ms", "device_share", "late_sends",
    "late_fraction", "max_late_ms", "windows", "stable", "measured_s",
]  # fmt: skip
EXPECTED_JSON = [
    "mode", "level", "offered_rps", "sent_rps", "throughput_rps", "goodput_rps", "requests",
    "status_counts", "shed_fraction", "latency_ms", "client_overhead_ms", "daemon_ms",
    "device_share", "late_sends", "late_fraction", "max_late_ms", "windows", "stable",
    "measured_s", "window_stats",
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
    assert doc["schema"] == "dlad-bench/1"
    assert doc["meta"] == {"k": 1}
    for level in doc["levels"]:
        assert list(level) == EXPECTED_JSON
        assert set(level["latency_ms"]) == {"p50", "p90", "p95", "p99", "p99_9", "max", "mean"}
        assert set(level["daemon_ms"]) == {
            "queue", "pre", "device", "post", "total", "queue_p99", "total_p99"}  # fmt: skip
        assert level["latency_ms"]["p99"] >= level["latency_ms"]["p50"] > 0
        assert level["daemon_ms"]["device"] == pytest.approx(2.0, rel=0.5)  # the 2 ms model
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
    inside, _ = plots.timeline_window(levels[-1].records, 40.0)
    assert {d for d, _, _ in inside} == {"dla0", "dla1"}
    assert all(b >= a for _, a, b in inside)


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
