"""Medians, min-max and same-run ratios, rendered as one Markdown table (readable as text)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

REFERENCE = "pgjobs"
RATIO_AGAINST = ("redis", "amqp")


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    fmt: str
    ratio: bool  # whether pgjobs/other is meaningful for this figure
    versus: str | None = None  # the other brokers' figure it is compared with (default: same)
    mine: str | None = None  # pgjobs's figure compared with it (default: same)


FIGURES = (
    Figure("publish_single", "publish, `task.delay()` (tasks/s)", "{:,.0f}", True),
    Figure("publish_single_nondurable",
           "publish, `task.delay()`, `durable_publish=False` (tasks/s)", "{:,.0f}", True,
           versus="publish_single"),
    Figure("publish_single_unconfirmed",
           "publish, `task.delay()`, `confirm_publish=False`, `durable_publish=False` (tasks/s)",
           "{:,.0f}", True, versus="publish_single"),
    Figure("publish_single_confirmed",
           "publish, `task.delay()`, RabbitMQ with `confirm_publish=True` (tasks/s; ratio: "
           "pgjobs's default)", "{:,.0f}", True, mine="publish_single"),
    Figure("publish_batch", "publish, batch path (tasks/s)", "{:,.0f}", True),
    Figure("drain_threads", "drain, threads c=8 (tasks/s)", "{:,.0f}", True),
    Figure("drain_prefork", "drain, prefork c=2 (tasks/s)", "{:,.0f}", True),
    Figure("latency_p50_ms", "idle latency p50 (ms)", "{:,.1f}", True),
    Figure("latency_p95_ms", "idle latency p95 (ms)", "{:,.1f}", True),
    Figure("latency_publish_p50_ms", "  of which the `delay()` call, p50 (ms)", "{:,.1f}", True),
    Figure("idle_statements_per_min", "idle worker: statements/min", "{:,.1f}", False),
    Figure("idle_xacts_per_min", "idle database: transactions/min (+autovacuum)", "{:,.1f}", False),
    Figure("idle_connections", "idle worker: connections held", "{:,.0f}", False),
)


def summarize(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def _values(runs: list[dict[str, Any]], key: str) -> list[float]:
    return [r["figures"][key] for r in runs if key in r["figures"]]


def ratios(results: dict[str, dict[str, Any]], key: str, other: str,
           versus: str | None = None, own: str | None = None) -> list[float]:
    """pgjobs/other per run index, only where both measured the figure in that run."""
    mine = results.get(REFERENCE, {}).get("runs", [])
    theirs = results.get(other, {}).get("runs", [])
    out = []
    for a, b in zip(mine, theirs, strict=False):  # a broker may have fewer runs
        va, vb = a["figures"].get(own or key), b["figures"].get(versus or key)
        if va is not None and vb:
            out.append(va / vb)
    return out


def build(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The machine-readable summary: per broker per figure, plus same-run ratios."""
    summary: dict[str, Any] = {"brokers": {}, "ratios": {}}
    for name, res in results.items():
        runs = res.get("runs", [])
        summary["brokers"][name] = {
            f.key: summarize(_values(runs, f.key)) for f in FIGURES if _values(runs, f.key)
        }
    for other in RATIO_AGAINST:
        if REFERENCE in results and other in results:
            summary["ratios"][f"{REFERENCE}/{other}"] = {
                f.key: summarize(ratios(results, f.key, other, f.versus, f.mine))
                for f in FIGURES
                if f.ratio and ratios(results, f.key, other, f.versus, f.mine)
            }
    return summary


def cell(s: dict[str, float] | None, fmt: str, runs: int) -> str:
    """``median (min..max)``; ``[k/runs]`` when only k runs produced the figure."""
    if not s:
        return "-"
    text = fmt.format(s["median"])
    if s["n"] > 1:
        text += f" ({fmt.format(s['min'])}..{fmt.format(s['max'])})"
    return text + (f" [{s['n']}/{runs}]" if s["n"] < runs else "")


def markdown(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    summary = build(results)
    names = list(results)
    ratio_cols = [o for o in RATIO_AGAINST if REFERENCE in results and o in results]
    header = ["figure", *names, *(f"{REFERENCE}/{o}" for o in ratio_cols)]
    rows: list[list[str]] = []
    for f in FIGURES:
        row = [f.label]
        for name in names:
            res = results[name]
            if res["status"] != "ok":
                row.append("skipped")
                continue
            s = summary["brokers"][name].get(f.key)
            row.append(cell(s, f.fmt, len(res["runs"])))
        for o in ratio_cols:
            s = summary["ratios"].get(f"{REFERENCE}/{o}", {}).get(f.key)
            row.append(cell(s, "{:.2f}x", meta["runs"]) if f.ratio else "")
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = [cells[0].ljust(widths[0])]
        padded += [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "| " + " | ".join(padded) + " |"

    dashes = ["-" * (widths[0] + 2)] + ["-" * (w + 1) + ":" for w in widths[1:]]
    sep = "|" + "|".join(dashes) + "|"
    out = [line(header), sep, *(line(r) for r in rows), ""]
    out.append(
        f"N={meta['n']} tasks, {meta['runs']} run(s); cells: median (min..max) over runs, "
        "[k/runs] when only k runs produced the figure (see Notes); "
        "ratios are computed within each run, then summarized. "
        "Throughput ratios > 1 favour pgjobs; latency ratios < 1 favour pgjobs."
    )
    notes = _notes(results)
    if notes:
        out += ["", "Notes:", *(f"- {n}" for n in notes)]
    out += [
        "",
        f"Host: {meta.get('host', '?')}; load average before/after: "
        f"{meta.get('load_before', '?')} / {meta.get('load_after', '?')}; "
        f"took {meta.get('elapsed_s', 0):.0f}s.",
    ]
    return "\n".join(out) + "\n"


def _notes(results: dict[str, dict[str, Any]]) -> list[str]:
    notes: list[str] = []
    for name, res in results.items():
        if res["status"] != "ok":
            notes.append(f"{name}: skipped: {res['reason']}")
            continue
        runs = res["runs"]
        transport = res.get("transport")
        methods = sorted({r["info"]["idle_method"] for r in runs if "idle_method" in r["info"]})
        paths = sorted({r["info"]["batch_path"] for r in runs if "batch_path" in r["info"]})
        bits = [f"`{res['url']}`"]
        if transport:
            bits.append(f"transport {transport}")
        if paths:
            bits.append(f"batch path: {', '.join(paths)}")
        if methods:
            bits.append(f"idle statements via {', '.join(methods)}")
        notes.append(f"{name}: " + "; ".join(bits))
        for i, r in enumerate(runs, 1):
            for err in r["errors"]:
                notes.append(f"{name} run {i}: failed: {err.splitlines()[0]}")
    return notes
