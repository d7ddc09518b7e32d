"""dlad-bench's results: a printed table, a CSV (one row per level) and a JSON document.

Both files have a fixed schema, tested: the CSV's columns are :data:`CSV_COLUMNS` in that order,
whatever the daemon's devices (the per-device share is one ``device_share`` column of
``name=fraction`` pairs); the JSON is ``{"schema": "dlad-bench/4", "meta": {...}, "levels":
[...]}`` where each level has the keys :data:`JSON_LEVEL_KEYS`. Times are milliseconds, rates
requests per second; a value that does not apply (no OK reply, closed-loop offered rate) is
empty in the CSV and ``null`` in the JSON.
"""

from __future__ import annotations

import base64
import csv
import html
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from rich.console import Console
from rich.table import Table

from dlad_bench.measure import STATUS_NAMES, LevelResult, as_dict

__all__ = [
    "CSV_COLUMNS", "JSON_LEVEL_KEYS", "SCHEMA", "print_table", "write_csv", "write_html",
    "write_json",
]  # fmt: skip

SCHEMA: Final = "dlad-bench/4"
"""2: ``device_batch`` (each device's mean batch size) added. 3: ``intended_latency_ms``
(latency from each request's due time), ``slo_ms`` and ``slo_goodput_rps`` added."""
LATENCY_KEYS: Final = ("p50", "p90", "p95", "p99", "p99_9", "max", "mean")
DAEMON_KEYS: Final = ("queue", "pre", "device", "post", "total", "queue_p99", "total_p99")
CSV_COLUMNS: Final[tuple[str, ...]] = (
    "mode", "level", "offered_rps", "sent_rps", "throughput_rps", "goodput_rps", "requests",
    *(f"status_{s}" for s in STATUS_NAMES), "shed_fraction",
    *(f"latency_{k}_ms" for k in LATENCY_KEYS), "client_overhead_ms",
    *(f"daemon_{k}_ms" for k in DAEMON_KEYS), "device_share", "device_batch",
    "late_sends", "late_fraction", "max_late_ms", "windows", "stable", "measured_s",
    *(f"intended_latency_{k}_ms" for k in LATENCY_KEYS), "slo_ms", "slo_goodput_rps",
)  # fmt: skip
JSON_LEVEL_KEYS: Final[tuple[str, ...]] = (
    "mode", "level", "offered_rps", "sent_rps", "throughput_rps", "goodput_rps", "requests",
    "status_counts", "shed_fraction", "latency_ms", "client_overhead_ms", "daemon_ms",
    "device_share", "device_batch", "late_sends", "late_fraction", "max_late_ms", "windows",
    "stable", "measured_s", "window_stats", "intended_latency_ms", "slo_ms", "slo_goodput_rps",
)  # fmt: skip


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _devices(r: LevelResult) -> str:
    """``dla0 30% gpu 70% b5.2``: each device's share of the OK replies, and its mean batch
    where it batched."""
    parts = []
    for d, share in r.device_share.items():
        batch = r.device_batch.get(d, 1.0)
        parts.append(f"{d} {100 * share:.0f}%" + (f" b{batch:.1f}" if batch > 1.0 else ""))
    return " ".join(parts)


def csv_row(r: LevelResult) -> dict[str, Any]:
    """One level as a CSV row (keys: :data:`CSV_COLUMNS`)."""
    row: dict[str, Any] = {
        "mode": r.mode, "level": r.level, "offered_rps": r.offered_rps, "sent_rps": r.sent_rps,
        "throughput_rps": r.throughput_rps, "goodput_rps": r.goodput_rps,
        "requests": r.requests, "shed_fraction": r.shed_fraction,
        "client_overhead_ms": r.client_overhead_ms,
        "device_share": " ".join(f"{d}={s:.4f}" for d, s in r.device_share.items()),
        "device_batch": " ".join(f"{d}={b:.3f}" for d, b in r.device_batch.items()),
        "late_sends": r.late_sends, "late_fraction": r.late_fraction,
        "max_late_ms": r.max_late_ms, "windows": r.windows, "stable": r.stable,
        "measured_s": r.measured_s,
    }  # fmt: skip
    row |= {f"status_{s}": r.status_counts.get(s, 0) for s in STATUS_NAMES}
    row |= {f"latency_{k}_ms": r.latency_ms[k] for k in LATENCY_KEYS}
    row |= {f"daemon_{k}_ms": r.daemon_ms[k] for k in DAEMON_KEYS}
    row |= {f"intended_latency_{k}_ms": r.intended_latency_ms.get(k, math.nan)
            for k in LATENCY_KEYS}  # fmt: skip
    row |= {"slo_ms": r.slo_ms, "slo_goodput_rps": r.slo_goodput_rps}
    out = {}
    for col in CSV_COLUMNS:
        v = row[col]
        if isinstance(v, float):
            v = "" if not math.isfinite(v) else round(v, 4)
        out[col] = v
    return out


def write_csv(path: Path, results: Sequence[LevelResult]) -> None:
    """Write one row per level (header: :data:`CSV_COLUMNS`). Raises OSError."""
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for r in results:
            writer.writerow(csv_row(r))


def json_level(r: LevelResult) -> dict[str, Any]:
    """One level as a JSON object (keys: :data:`JSON_LEVEL_KEYS`; NaN becomes null)."""
    level = {
        "mode": r.mode, "level": r.level, "offered_rps": _num(r.offered_rps),
        "sent_rps": r.sent_rps, "throughput_rps": r.throughput_rps,
        "goodput_rps": r.goodput_rps, "requests": r.requests,
        "status_counts": dict(r.status_counts), "shed_fraction": _num(r.shed_fraction),
        "latency_ms": {k: _num(r.latency_ms[k]) for k in LATENCY_KEYS},
        "client_overhead_ms": _num(r.client_overhead_ms),
        "daemon_ms": {k: _num(r.daemon_ms[k]) for k in DAEMON_KEYS},
        "device_share": dict(r.device_share), "device_batch": dict(r.device_batch),
        "late_sends": r.late_sends,
        "late_fraction": r.late_fraction, "max_late_ms": r.max_late_ms, "windows": r.windows,
        "stable": r.stable, "measured_s": r.measured_s,
        "window_stats": [
            {k: _num(v) for k, v in as_dict(w).items()} for w in r.window_stats
        ],
        "intended_latency_ms": {
            k: _num(r.intended_latency_ms.get(k, math.nan)) for k in LATENCY_KEYS
        },
        "slo_ms": _num(r.slo_ms), "slo_goodput_rps": _num(r.slo_goodput_rps),
    }  # fmt: skip
    return {k: level[k] for k in JSON_LEVEL_KEYS}


def write_json(
    path: Path,
    results: Sequence[LevelResult],
    meta: Mapping[str, Any],
    repeats: Sequence[Mapping[str, Any]] | None = None,
) -> None:
    """Write ``{"schema", "meta", "levels"}``, and ``"repeats"`` (each level's trials, from
    ``dlad_bench.repeats.json_repeats``) when the levels were repeated. Raises OSError."""
    doc: dict[str, Any] = {"schema": SCHEMA, "meta": dict(meta),
                           "levels": [json_level(r) for r in results]}  # fmt: skip
    if repeats is not None:
        doc["repeats"] = list(repeats)
    path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def _f(x: float, digits: int = 1) -> str:
    return "-" if not math.isfinite(x) else f"{x:.{digits}f}"


def _table(title: str, columns: Sequence[str]) -> Table:
    table = Table(title=title, header_style="bold", box=None, pad_edge=False, title_justify="left")
    for col in columns:
        table.add_column(col, justify="left" if col in ("load", "devices") else "right")
    return table


def print_table(results: Sequence[LevelResult], console: Console) -> None:
    """The results as tables that fit 100 columns: the rates (offered, sent, ok, good, shed,
    late); the client's latency percentiles with the daemon's split of the mean (queue / pre /
    device / post) and the client-side rest; where the requests ran (device shares and
    batches); and, where any failed, a column per failure status any level saw."""
    failures = sorted({k for r in results for k, n in r.status_counts.items() if n and k != "OK"})
    slo = any(math.isfinite(r.slo_ms) for r in results)
    rates = _table("dlad-bench: rates (requests/s)",
                   ["load", "offered/s", "sent/s", "ok/s", "good/s", *(["slo/s"] if slo else []),
                    "shed %", "late %", "stable"])  # fmt: skip
    latency = _table("latency (ms)", ["load", "p50", "p90", "p99", "p99.9", "max", "p99 due",
                                      "queue", "pre", "device", "post", "client"])  # fmt: skip
    placed = _table("where they ran", ["load", "devices"])
    # A DEVICE_FAILED or CLIENT_TIMEOUT is not load shedding and must not hide in "shed".
    failed = _table("what failed (% of requests)", ["load", *failures])
    for r in results:
        lat, dm, load = r.latency_ms, r.daemon_ms, f"{r.mode} {r.level:g}"
        rates.add_row(load, _f(r.offered_rps), _f(r.sent_rps), _f(r.throughput_rps),
                      _f(r.goodput_rps), *([_f(r.slo_goodput_rps)] if slo else []),
                      _f(100 * r.shed_fraction), _f(100 * r.late_fraction),
                      "yes" if r.stable else "no")  # fmt: skip
        latency.add_row(load, *(_f(lat[k], 2) for k in ("p50", "p90", "p99", "p99_9", "max")),
                        _f(r.intended_latency_ms.get("p99", math.nan), 2),
                        *(_f(dm[k], 2) for k in ("queue", "pre", "device", "post")),
                        _f(r.client_overhead_ms, 2))  # fmt: skip
        shares = [_f(100 * r.status_counts.get(k, 0) / r.requests if r.requests else math.nan)
                  for k in failures]  # fmt: skip
        placed.add_row(load, _devices(r))
        failed.add_row(load, *shares)
    for table in (rates, latency, placed, *([failed] if failures else [])):
        console.print(table)
    console.print(
        "latencies on the client (OK replies), from the send; p99 due: from when the request "
        "was due (open loop: what a stalled generator would hide); queue/pre/device/post: the "
        "daemon's mean split of them; client: the rest (transport, client)"
    )


_HTML_COLUMNS: Final = (
    ("load", None, 0), ("offered/s", "offered_rps", 1), ("sent/s", "sent_rps", 1),
    ("ok/s", "throughput_rps", 1), ("good/s", "goodput_rps", 1), ("slo/s", "slo_goodput_rps", 1),
    ("shed %", "shed_fraction", -1), ("p50 ms", "latency_p50_ms", 2),
    ("p99 ms", "latency_p99_ms", 2), ("p99 from due, ms", "intended_latency_p99_ms", 2),
    ("max ms", "latency_max_ms", 2), ("devices", "device_share", 0), ("stable", "stable", 0),
)  # fmt: skip
"""(heading, CSV column, decimals: -1 a fraction shown as a percentage with one)."""


def _cell(value: object, digits: int) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or digits == 0:
        if isinstance(value, str) and "=" in value:  # device shares: "dla0=0.3312 ..."
            return " ".join(f"{d} {100 * float(s):.0f}%" for d, s in
                            (part.split("=") for part in value.split()))  # fmt: skip
        return "yes" if value is True else "no" if value is False else str(value)
    return f"{100 * value:.1f}" if digits < 0 else f"{value:,.{digits}f}"


def write_html(
    path: Path,
    results: Sequence[LevelResult],
    meta: Mapping[str, Any],
    plots: Sequence[Path] = (),
    notes: Sequence[str] = (),
    *,
    verdict: str | None = None,
    warnings: Sequence[str] = (),
) -> None:
    """One self-contained HTML report (readable offline: the plots are inline PNGs, nothing is
    fetched), the answer first: ``verdict`` (PASS or FAIL, where thresholds or a search judged
    the run) and ``notes`` (the search's answer, what failed), then the console's
    ``warnings``, one row per level (numbers rounded), what was run, and the plots. Raises
    OSError."""
    esc = html.escape
    head = "".join(f"<th>{esc(name)}</th>" for name, _, _ in _HTML_COLUMNS)
    rows = []
    for r in results:
        row = csv_row(r)
        cells = [f"{r.mode} {r.level:g}"] + [
            _cell("" if row[key] == "" else row[key], digits)
            for _, key, digits in _HTML_COLUMNS[1:] if key
        ]  # fmt: skip
        rows.append("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>")
    about = "".join(
        f"<tr><th>{esc(str(k))}</th><td>{esc(json.dumps(v, default=str))}</td></tr>"
        for k, v in meta.items() if k != "settings"
    )  # fmt: skip
    images = "".join(
        f'<figure><img alt="{esc(p.stem)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"><figcaption>{esc(p.stem)}</figcaption>'
        "</figure>"
        for p in plots
    )
    answer = ""
    if verdict is not None:
        colour = "#1a7f37" if verdict == "PASS" else "#cf222e"
        answer = f"<p class='verdict' style='color:{colour}'><b>{esc(verdict)}</b></p>"
    lines = "".join(f"<li>{esc(n)}</li>" for n in notes)
    warned = "".join(f"<li>{esc(w)}</li>" for w in warnings)
    doc = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>dlad-bench</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}img{max-width:100%}"
        ".verdict{font-size:1.6em}.warnings{color:#9a6700}"
        "</style></head><body><h1>dlad-bench</h1>"
        f"<h2>Answer</h2>{answer}{f'<ul>{lines}</ul>' if lines else ''}"
        f"{'' if answer or lines else '<p>no threshold or search was asked for</p>'}"
        f"{f'<h2>Warnings</h2><ul class=warnings>{warned}</ul>' if warned else ''}"
        f"<h2>Levels</h2><table><tr>{head}</tr>{''.join(rows)}</table>"
        f"<h2>What was run</h2><table>{about}</table><h2>Plots</h2>{images or '<p>none</p>'}"
        f"<p>schema {SCHEMA}; the same figures as the CSV and JSON outputs, unrounded.</p>"
        "</body></html>\n"
    )
    path.write_text(doc, encoding="utf-8")
