"""dlad-bench's precomputed schedules: rates and inter-arrival distributions, checked
statistically (Kolmogorov-Smirnov against the intended distribution, and against a wrong one to
show the check has power), and the stability rule that ends a level."""

from __future__ import annotations

import math
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pytest

from dlad_bench.measure import Measurement, WindowStats, is_stable
from dlad_bench.schedule import arrival_times, camera_fps, camera_times

pytestmark = pytest.mark.timeout(30)


def ks_distance(samples: npt.NDArray[np.float64], cdf: npt.NDArray[np.float64]) -> float:
    """Kolmogorov-Smirnov D of sorted ``samples`` against the model CDF at those samples."""
    n = samples.size
    i = np.arange(1, n + 1)
    return float(max(np.max(i / n - cdf), np.max(cdf - (i - 1) / n)))


def ks_critical(n: int, alpha: float = 1e-3) -> float:
    """The asymptotic KS critical value: D above it rejects at level ``alpha``."""
    return math.sqrt(-math.log(alpha / 2) / 2) / math.sqrt(n)


def exponential_ks(gaps: npt.NDArray[np.float64], rate: float) -> float:
    x = np.sort(gaps)
    return ks_distance(x, 1.0 - np.exp(-rate * x))


def test_constant_arrivals_are_evenly_spaced() -> None:
    times = arrival_times(250.0, 2.0, arrivals="constant")
    assert times.size == 500
    np.testing.assert_allclose(np.diff(times), 1 / 250.0)
    assert times[0] == 0.0
    assert times[-1] < 2.0


def test_poisson_rate_and_exponential_gaps() -> None:
    rate, duration = 400.0, 20.0
    times = arrival_times(rate, duration, arrivals="poisson", seed=7)
    n = times.size
    expected = rate * duration
    assert abs(n - expected) < 4 * math.sqrt(expected)  # Poisson count: sd = sqrt(mean)
    assert np.all(np.diff(times) >= 0)
    assert times[0] >= 0
    assert times[-1] < duration
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert exponential_ks(gaps, rate) < ks_critical(n)
    # the same check rejects constant gaps and a wrong rate: it has power
    const = np.diff(arrival_times(rate, duration, arrivals="constant"))
    assert exponential_ks(const, rate) > ks_critical(const.size)
    assert exponential_ks(gaps, 1.3 * rate) > ks_critical(n)
    # a different seed gives a different, equally valid schedule; the same seed the same one
    assert not np.array_equal(times, arrival_times(rate, duration, seed=8)[:n])
    np.testing.assert_array_equal(times, arrival_times(rate, duration, seed=7))


@pytest.mark.parametrize("burstiness", [0.5, 2.0])
def test_gamma_gaps_have_the_rate_and_the_burstiness(burstiness: float) -> None:
    stats = pytest.importorskip("scipy.stats")
    rate, duration = 300.0, 30.0
    times = arrival_times(rate, duration, arrivals="gamma", burstiness=burstiness, seed=3)
    gaps = np.diff(np.concatenate([[0.0], times]))
    n = gaps.size
    shape = 1 / burstiness**2
    model = stats.gamma(shape, scale=1 / (rate * shape))
    x = np.sort(gaps)
    assert ks_distance(x, model.cdf(x)) < ks_critical(n)
    assert exponential_ks(gaps, rate) > ks_critical(n)  # not Poisson
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(burstiness, rel=0.1)


def test_camera_streams_are_periodic_with_their_own_phase() -> None:
    times, ids = camera_times(16, 30.0, 2.0, seed=1)
    assert times.size == ids.size == 16 * 60
    assert np.all(np.diff(times) >= 0)
    phases = []
    for s in range(16):
        mine = times[ids == s]
        assert mine.size == 60
        np.testing.assert_allclose(np.diff(mine), 1 / 30.0, atol=1e-9)
        phases.append(mine[0])
    assert len(set(phases)) == 16  # not synchronised
    assert all(0 <= p < 1 / 30.0 for p in phases)


def test_skewed_cameras_keep_the_mean_rate_and_their_own_periods() -> None:
    rates = camera_fps(24, 30.0, 1.0)
    assert rates.mean() == pytest.approx(30.0)
    assert np.all(np.diff(rates) < 0)  # camera 0 the busiest
    assert rates[0] / rates[23] == pytest.approx(24.0)  # Zipf: 1 / (s + 1)
    np.testing.assert_array_equal(camera_fps(5, 30.0, 0.0), np.full(5, 30.0))
    times, ids = camera_times(24, 30.0, 4.0, seed=2, skew=1.0)
    assert np.all(np.diff(times) >= 0)
    for s in (0, 5, 23):
        mine = times[ids == s]
        np.testing.assert_allclose(np.diff(mine), 1 / rates[s], atol=1e-9)
        assert 0 <= mine[0] < 1 / rates[s]
    assert times.size == pytest.approx(24 * 30 * 4, rel=0.02)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: camera_fps(3, 30.0, -0.5), "skew"),
        (lambda: arrival_times(0.0, 1.0), "rate"),
        (lambda: arrival_times(10.0, -1.0), "duration_s"),
        (lambda: arrival_times(10.0, 1.0, arrivals="gamma", burstiness=0.0), "burstiness"),
        (lambda: arrival_times(10.0, 1.0, arrivals=cast("Any", "weibull")), "arrivals"),
        (lambda: camera_times(0, 30.0, 1.0), "streams"),
        (lambda: camera_times(2, math.inf, 1.0), "rate"),
    ],
)
def test_bad_schedules_are_refused(call: object, message: str) -> None:
    assert callable(call)
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------------------------ stability


def _w(i: int, throughput: float, latency: float, completed: int = 100) -> WindowStats:
    return WindowStats(i, float(i), float(i + 1), completed, throughput, latency)


def test_stable_needs_the_last_windows_within_the_percentage_on_both() -> None:
    assert not is_stable([_w(0, 100, 10), _w(1, 100, 10)], 10)  # too few
    assert is_stable([_w(0, 100, 10), _w(1, 105, 10.5), _w(2, 96, 9.6)], 10)
    assert not is_stable([_w(0, 100, 10), _w(1, 100, 10), _w(2, 125, 10)], 10)  # throughput
    assert not is_stable([_w(0, 100, 10), _w(1, 100, 13), _w(2, 100, 10)], 10)  # latency
    assert is_stable([_w(0, 500, 90), _w(1, 100, 10), _w(2, 100, 10), _w(3, 101, 10)], 10)
    assert not is_stable([_w(0, 0, math.nan, 0)] * 3, 10)  # nothing answered
    assert is_stable([_w(0, 100, 10), _w(1, 100, 13), _w(2, 100, 10)], 20)


def test_measurement_stops_when_stable_or_out_of_trials() -> None:
    m = Measurement(pct=10, windows=3, max_trials=10)
    series = [(300, 50), (150, 20), (100, 10), (102, 10.2), (99, 9.9), (100, 10)]
    stops = []
    for i, (t, lat) in enumerate(series):
        stops.append(m.add(_w(i, t, lat)))
        if stops[-1]:
            break
    assert stops == [False, False, False, False, True]  # stable at the fifth window
    assert m.stable
    assert m.measured == (2.0, 5.0)  # the last three windows
    unstable = Measurement(pct=1, windows=3, max_trials=4)
    results = [unstable.add(_w(i, 100 + 10 * (i % 2), 10)) for i in range(4)]
    assert results == [False, False, False, True]
    assert not unstable.stable
    with pytest.raises(ValueError, match="stability_windows"):
        Measurement(windows=5, max_trials=3)


def test_summary_counts_late_sends_goodput_shed_and_shares() -> None:
    from dlad_bench.measure import Record, summarize

    records = []
    for i in range(200):  # 200 requests due every 10 ms over 2 s
        due = i * 0.01
        late = 0.005 if i % 50 == 0 else 0.0005  # 4 of them leave 5 ms late
        status = "OVERLOADED" if i % 10 == 0 else "OK"
        latency = 0.040 if i % 4 == 1 else 0.010  # some OK answers miss a 33 ms deadline
        r = Record(due, due + late, deadline_ms=33.0)
        r.done = r.sent + latency
        r.status = status
        r.device = f"dla{i % 2}" if status == "OK" else None
        r.total_us = 8000.0 if status == "OK" else 0.0
        records.append(r)
    m = Measurement(pct=50, windows=1, max_trials=1)
    m.add(WindowStats(0, 0.0, 2.0, 0, 1.0, 1.0))
    s = summarize(
        records, mode="rate", level=100.0, offered_rps=100.0, measurement=m,
        late_tolerance_ms=2.0,
    )  # fmt: skip
    done = [r for r in records if r.done < 2.0]
    assert s.requests == len(done)
    assert s.late_sends == 4
    assert s.late_fraction == pytest.approx(4 / 200)
    assert s.max_late_ms == pytest.approx(5.0)
    ok = [r for r in done if r.status == "OK"]
    assert s.status_counts["OK"] == len(ok)
    assert s.status_counts["OVERLOADED"] == len(done) - len(ok)
    assert s.shed_fraction == pytest.approx((len(done) - len(ok)) / len(done))
    good = [r for r in ok if r.latency_ms <= 33.0]
    assert s.goodput_rps == pytest.approx(len(good) / 2.0)
    assert s.throughput_rps == pytest.approx(len(ok) / 2.0)
    shares = {d: sum(1 for r in ok if r.device == d) / len(ok) for d in ("dla0", "dla1")}
    assert s.device_share == pytest.approx(shares)
    assert shares["dla0"] < shares["dla1"]  # dla0 lost the refused (even) requests
    assert s.latency_ms["max"] == pytest.approx(40.0)
    assert s.client_overhead_ms == pytest.approx(np.mean([r.latency_ms - 8.0 for r in ok]))


def test_summary_infers_batch_sizes_from_shared_device_times() -> None:
    from dlad_bench.measure import Record, summarize

    records = []
    for i in range(24):
        r = Record(i * 0.01, i * 0.01, deadline_ms=33.0)
        r.done, r.status, r.total_us = r.sent + 0.005, "OK", 4000.0
        if i < 16:  # the GPU ran them in batches of 4, 4, 8: shared start and end stamps
            r.device = "gpu"
            batch = 0 if i < 4 else 1 if i < 8 else 2
            r.start_ns, r.end_ns = 1_000_000 * batch, 1_000_000 * batch + 900_000
        else:  # DLA replies, one run each (and two without device times)
            r.device = "dla0"
            if i < 22:
                r.start_ns, r.end_ns = 10_000_000 + i, 10_000_100 + i
        records.append(r)
    m = Measurement(pct=50, windows=1, max_trials=1)
    m.add(WindowStats(0, 0.0, 2.0, 0, 1.0, 1.0))
    s = summarize(
        records, mode="rate", level=100.0, offered_rps=100.0, measurement=m,
        late_tolerance_ms=2.0,
    )  # fmt: skip
    assert s.device_batch == {"dla0": 1.0, "gpu": pytest.approx(16 / 3)}


def test_a_stalled_generator_cannot_hide_queueing_from_the_due_time_latency() -> None:
    """Coordinated omission: a generator that stalls 100 ms sends its overdue requests late;
    measured from the send they look fast, measured from when they were due they are not."""
    from dlad_bench.measure import Record, summarize

    records = []
    for i in range(100):  # due every 10 ms; requests 40-49 leave only at 0.5 s (the stall)
        due = i * 0.01
        sent = 0.5 if 40 <= i < 50 else due
        r = Record(due, sent, deadline_ms=1000.0)
        r.done, r.status = sent + 0.001, "OK"
        records.append(r)
    m = Measurement(pct=50, windows=1, max_trials=1)
    m.add(WindowStats(0, 0.0, 2.0, 0, 1.0, 1.0))
    s = summarize(
        records, mode="rate", level=100.0, offered_rps=100.0, measurement=m,
        late_tolerance_ms=2.0, slo_ms=20.0,
    )  # fmt: skip
    assert s.latency_ms["p99"] == pytest.approx(1.0)  # from the send: nothing to see
    assert s.intended_latency_ms["max"] == pytest.approx(101.0)  # request 40: due at 0.4 s
    assert s.intended_latency_ms["p99"] > 80.0
    # The objective counts from the due time: requests 40-48 missed 20 ms, 49 (11 ms) made it.
    assert s.slo_goodput_rps == pytest.approx(91 / 2.0)
    assert s.goodput_rps == pytest.approx(100 / 2.0)  # within their 1 s deadline, all of them


def test_thresholds_parse_and_judge_each_level() -> None:
    from dlad_bench.judge import failures, parse_threshold
    from dlad_bench.measure import Record, summarize

    r = Record(0.0, 0.0, deadline_ms=10.0)
    r.done, r.status = 0.005, "OK"
    m = Measurement(pct=50, windows=1, max_trials=1)
    m.add(WindowStats(0, 0.0, 1.0, 0, 1.0, 1.0))
    level = summarize([r], mode="rate", level=1.0, offered_rps=1.0, measurement=m,
                      late_tolerance_ms=2.0)  # fmt: skip
    passing = [parse_threshold(t) for t in ("p99>40ms", "goodput<0.95", "shed>1%",
                                            "throughput<0.5/s", "due_p99 >= 6ms")]  # fmt: skip
    assert failures(passing, [("rate 1", level)]) == []
    failing = [parse_threshold("p50>4ms"), parse_threshold("slo<0.5")]  # no SLO: no value
    assert failures(failing, [("rate 1", level)]) == [
        "rate 1: p50>4ms (measured 5)", "rate 1: slo<0.5 (measured nan)"]  # fmt: skip
    for bad in ("p99>", "p99 ~ 4", "latency>4ms", "goodput<95ms", "p99>40%"):
        with pytest.raises(ValueError, match="--fail-if"):
            parse_threshold(bad)


def test_the_rate_search_bisects_between_a_passing_and_a_failing_rate() -> None:
    from dlad_bench.judge import RateSearch
    from dlad_bench.measure import LevelResult

    def level(p99: float) -> LevelResult:
        """A level whose one OK reply took ``p99`` ms."""
        from dlad_bench.measure import Record, summarize

        rec = Record(0.0, 0.0, deadline_ms=1e6)
        rec.done, rec.status = p99 / 1e3, "OK"
        m = Measurement(pct=50, windows=1, max_trials=1)
        m.add(WindowStats(0, 0.0, 10.0, 0, 1.0, 1.0))
        return summarize([rec], mode="rate", level=1.0, offered_rps=1.0, measurement=m,
                         late_tolerance_ms=2.0)  # fmt: skip

    knee = 73.0  # the latency passes 40 ms at 73/s: p99 = rate / 2 ms below it, 1 s above
    search = RateSearch(10.0, 200.0, 40.0, steps=8)
    tried = []
    while (rate := search.next()) is not None:
        tried.append(rate)
        search.record(rate, level(rate / 2 if rate < knee else 1000.0))
    assert tried[:2] == [10.0, 200.0]
    assert len(tried) == 10
    assert search.passing is not None
    assert search.failing is not None
    assert search.passing < knee <= search.failing
    assert search.failing - search.passing == pytest.approx(190 / 2**8)
    assert "72." in search.summary() or "73." in search.summary()
    done = RateSearch(10.0, 200.0, 1e9, steps=8)  # everything passes: the top of the range
    while (rate := done.next()) is not None:
        done.record(rate, level(1.0))
    assert (done.passing, done.tried) == (200.0, [(10.0, True), (200.0, True)])
