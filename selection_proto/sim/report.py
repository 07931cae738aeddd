"""What `simulate` shows: the table on stdout, the JSON document (`--json`), and one self-contained
HTML page (`--report`: inline SVG, nothing fetched) with each setting's TTFT distribution and
each engine's requests in flight and KV use over time. Pure: text in, text out."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from typing import Any

from .engine import FleetConfig
from .fleet import BASELINES, ORACLE, SettingRun

__all__ = ["document", "html_report", "summary", "table", "yardsticks"]

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def yardsticks(runs: Sequence[SettingRun]) -> list[tuple[str, SettingRun]]:
    """The runs each run's mean TTFT is read against, with their column names: the oracle's
    (`--compare oracle`), and Dynamo's: the first run of its cost in process
    (`router_policy=dynamo`, the default), else the first `--service` run."""
    found = []
    oracle = next((run for run in runs if run.name == ORACLE), None)
    if oracle is not None:
        found.append(("mean/oracle", oracle))
    in_process = [run for run in runs if run.name not in (*BASELINES, ORACLE) and "service" not in run.settings]
    dynamo = next((run for run in in_process if run.settings.get("router_policy", "dynamo") == "dynamo"),
                  next((run for run in runs if "service" in run.settings), None))
    if dynamo is not None and oracle is not None:
        found.append(("mean/dynamo", dynamo))
    return found


def _ratio(run: SettingRun, yardstick: SettingRun) -> str:
    return f"{run.ttft['mean'] / yardstick.ttft['mean']:.2f}x" if yardstick.ttft["mean"] > 0 else "-"


def table(runs: Sequence[SettingRun]) -> str:
    """With an oracle among the runs, each run's mean TTFT also as a multiple of the oracle's and
    of Dynamo's (`yardsticks`); `--pd` runs have their own columns (`_pd_table`)."""
    if any(run.tpot is not None for run in runs):
        return _pd_table(runs)
    against = yardsticks(runs)
    counted = any(run.replicas is not None for run in runs)  # `--replicas`: a column says how many, and shared
    head = ("setting", *(("replicas",) if counted else ()), "ttft mean", "p50", "p90", "p99", "wait mean", "hit rate",
            "busy max", "requests", "failed", *(name for name, _ in against))
    rows = [head] + [(
        run.name, *((replica_count(run),) if counted else ()),
        *(f"{run.ttft[k]:.3f}" for k in ("mean", "p50", "p90", "p99")), f"{run.queue_wait['mean']:.3f}",
        f"{run.hit_rate:.3f}", f"{run.busy_max_mean:.1f}", str(run.requests), str(run.failed),
        *(_ratio(run, yardstick) for _, yardstick in against)) for run in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row))
             for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]]) + "\n" + _tenant_table(runs)


def replica_count(run: SettingRun) -> str:
    """How many services routed the run, and whether they shared bookings: `-` for a baseline."""
    if run.replicas is not None:
        return (f"{run.replicas['replicas']} {'shared' if run.replicas['shared'] else 'alone'}"
                + (" strict" if run.replicas.get("admission") == "strict" else ""))
    return "-" if run.name in BASELINES or run.name == ORACLE else "1"


_PD_HEAD = ("setting", "remote", "ttft mean", "p50", "p99", "tpot mean ms", "p99 ms", "wait mean", "hit rate",
            "requests", "failed")


def _pd_cells(run: SettingRun) -> tuple[str, ...]:
    """A planned run's row: TTFT in seconds, the time per output token in milliseconds."""
    tpot = run.tpot or {"mean": 0.0, "p99": 0.0}
    return (run.name, f"{run.remote_share or 0.0:.2f}", *(f"{run.ttft[k]:.3f}" for k in ("mean", "p50", "p99")),
            *(f"{tpot[k] * 1000:.1f}" for k in ("mean", "p99")), f"{run.queue_wait['mean']:.3f}",
            f"{run.hit_rate:.3f}", str(run.requests), str(run.failed))


def _pd_table(runs: Sequence[SettingRun]) -> str:
    """`--pd`: each fleet and decider, with the share of remote plans and the time per output token."""
    rows = [_PD_HEAD, *(_pd_cells(run) for run in runs)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_PD_HEAD))]
    lines = ["  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row))
             for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]]) + "\n" + _tenant_table(runs)


def _tenant_rows(runs: Sequence[SettingRun]) -> list[tuple[str, ...]]:
    return [(run.name, name, str(t["requests"]), str(t["failed"]),
             *(f"{t[what][k]:.3f}" for what in ("ttft", "queue_wait") for k in ("mean", "p99")))
            for run in runs for name, t in run.tenants.items()]


_TENANT_HEAD = ("setting", "tenant", "requests", "failed", "ttft mean", "ttft p99", "wait mean", "wait p99")


def _tenant_table(runs: Sequence[SettingRun]) -> str:
    """Per tenant, when the trace's lines name them (docs/FLOW_CONTROL.md)."""
    rows = _tenant_rows(runs)
    if not rows:
        return ""
    rows = [_TENANT_HEAD, *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_TENANT_HEAD))]
    lines = ["  ".join(cell.ljust(widths[i]) if i < 2 else cell.rjust(widths[i]) for i, cell in enumerate(row))
             for row in rows]
    return "\n" + "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]]) + "\n"


def document(runs: Sequence[SettingRun], config: FleetConfig, trace: str) -> dict[str, Any]:
    fleet = _fleet(config)
    if any(run.pd is not None for run in runs):
        fleet.update(_transfer(config))
    return {"trace": trace, "fleet": fleet, "settings": [run.to_json() for run in runs]}


def _transfer(config: FleetConfig) -> dict[str, Any]:
    return {"kv_bytes_per_token": config.kv_bytes_per_token, "link_bytes_per_sec": config.link_bytes_per_sec}


def _fleet(config: FleetConfig) -> dict[str, Any]:
    model = config.model
    return {"engines": config.engines, "kv_blocks": config.kv_blocks, "trace_block_size": config.trace_block_size,
            "load": config.load, "speedup": config.speedup, "event_delay_secs": config.event_delay_secs, "seed": config.seed,
            "engine_speeds": list(config.engine_speeds), "prefill_complete": config.prefill_complete,
            "engine_model": {name: getattr(model, name) for name in (
                "prefill_fixed_ms", "prefill_tokens_per_sec", "attention_ms", "decode_ms", "decode_full_ms",
                "max_batched_tokens", "max_running", "mocker")}}


def summary(runs: Sequence[SettingRun]) -> list[str]:
    """Each setting against the first, in words: mean and p99 TTFT and hit rate as ratios."""
    if len(runs) < 2 or runs[0].ttft["mean"] <= 0:
        return []
    first, lines = runs[0], []
    for run in runs[1:]:
        ratios = [f"{what} TTFT {run.ttft[k] / first.ttft[k]:.2f}x" for what, k in (("mean", "mean"), ("p99", "p99"))
                  if first.ttft[k] > 0]
        if run.tpot is not None and first.tpot is not None:
            ratios += [f"{what} TPOT {run.tpot[k] / first.tpot[k]:.2f}x" for what, k in (("mean", "mean"), ("p99", "p99"))
                       if first.tpot[k] > 0]
        if first.hit_rate > 0:
            ratios.append(f"hit rate {run.hit_rate / first.hit_rate:.2f}x")
        lines.append(f"{run.name}: {', '.join(ratios)} those of {first.name}")
    return lines


def _log_scale(x_min: float, x_max: float) -> Callable[[float], float]:
    """x -> [0, 1] on a log axis from x_min to x_max."""
    low, span = math.log10(x_min), math.log10(x_max) - math.log10(x_min)
    return lambda x: (math.log10(min(max(x, x_min), x_max)) - low) / span


def _polyline(points: Sequence[tuple[float, float]], box: tuple[float, float, float, float],
              x_max: float, y_max: float, color: str, width: float = 2.0,
              x_scale: Callable[[float], float] | None = None) -> str:
    left, top, w, h = box
    if not points or x_max <= 0 or y_max <= 0:
        return ""
    place = x_scale or (lambda x: min(x, x_max) / x_max)
    coords = " ".join(f"{left + w * place(x):.1f},{top + h - h * min(y, y_max) / y_max:.1f}"
                      for x, y in points)
    return f'<polyline fill="none" stroke="{color}" stroke-width="{width}" points="{coords}"/>'


def _axes(box: tuple[float, float, float, float], x_label: str, y_label: str, x_max: float, y_max: float,
          x_min: float | None = None) -> str:
    """With `x_min`, the x axis is logarithmic from it to `x_max`."""
    left, top, w, h = box
    parts = [f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="#fafafa" stroke="#444"/>',
             f'<text x="{left + w / 2}" y="{top + h + 32}" text-anchor="middle">{html.escape(x_label)}</text>',
             f'<text x="{left - 44}" y="{top + h / 2}" text-anchor="middle" '
             f'transform="rotate(-90 {left - 44} {top + h / 2})">{html.escape(y_label)}</text>']
    for i in range(5):
        x = left + w * i / 4
        y = top + h - h * i / 4
        label = x_max * i / 4 if x_min is None else x_min * (x_max / x_min) ** (i / 4)
        parts.append(f'<text x="{x:.1f}" y="{top + h + 16}" text-anchor="middle" font-size="11">'
                     f'{label:.3g}</text>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11">{y_max * i / 4:.3g}</text>')
    return "".join(parts)


def _svg(width: int, height: int, body: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif" font-size="13">{body}</svg>')


def _cdf_chart(runs: Sequence[SettingRun], curves: list[list[tuple[float, float]]], medians: list[float],
               label: str) -> str:
    """Each run's distribution (`curves[i]`, points of (value, fraction)) on one chart."""
    box = (70.0, 20.0, 620.0, 300.0)
    x_max = max((max((x for x, _ in curve), default=0.0) for curve in curves), default=0.0) or 1.0
    # When a setting is far behind the others, a linear axis crushes the rest into its left edge.
    medians = [m for m in medians if m > 0]
    x_min = min(medians) / 4 if medians and x_max / min(medians) > 20 else None
    scale = _log_scale(x_min, x_max) if x_min is not None else None
    lines = [_polyline(curve, box, x_max, 1.0, COLORS[i % len(COLORS)], x_scale=scale)
             for i, curve in enumerate(curves)]
    legend = "".join(
        f'<rect x="{box[0] + box[2] + 20}" y="{30 + 20 * i}" width="14" height="4" fill="{COLORS[i % len(COLORS)]}"/>'
        f'<text x="{box[0] + box[2] + 40}" y="{36 + 20 * i}">{html.escape(run.name)}</text>'
        for i, run in enumerate(runs))
    x_label = label + (", log scale" if x_min is not None else "")
    return _svg(960, max(370, 50 + 20 * len(runs)), _axes(box, x_label, "fraction of requests", x_max, 1.0, x_min)
                + "".join(lines) + legend)


def html_report(runs: Sequence[SettingRun], config: FleetConfig, trace: str) -> str:
    """One page: the table, the TTFT CDF of every setting (and with --pd their time per output
    token), and per setting each engine's requests in flight and KV use over time."""
    cdf = _cdf_chart(runs, [run.ttft_cdf for run in runs], [run.ttft["p50"] for run in runs],
                     "time to first token (s)")
    planned = any(run.tpot is not None for run in runs)
    if planned:
        cdf += "<h2>Time per output token</h2>" + _cdf_chart(
            runs, [[(x * 1000, y) for x, y in run.tpot_cdf] for run in runs],
            [(run.tpot or {"p50": 0.0})["p50"] * 1000 for run in runs], "time per output token (ms)")
    sections = []
    for run in runs:
        series = run.series
        times: list[float] = series["times"]
        t_max = times[-1] if times else 1.0
        small = (70.0, 20.0, 360.0, 160.0)
        peak = max((max(v, default=0) for v in series["in_flight"]), default=0) or 1
        load = "".join(_polyline(list(zip(times, values, strict=True)), small, t_max, peak,
                                 COLORS[i % len(COLORS)], 1.2) for i, values in enumerate(series["in_flight"]))
        kv = "".join(_polyline(list(zip(times, values, strict=True)), small, t_max, 1.0,
                               COLORS[i % len(COLORS)], 1.2) for i, values in enumerate(series["kv_used"]))
        sections.append(
            f"<h3>{html.escape(run.name)}</h3><div class=row>"
            + _svg(470, 230, _axes(small, "time (s)", "requests in flight", t_max, peak) + load)
            + _svg(470, 230, _axes(small, "time (s)", "KV blocks used", t_max, 1.0) + kv) + "</div>")
    against = yardsticks(runs)
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in _pd_cells(run))
        + f"<td><code>{html.escape(_settings_text(run))}</code></td></tr>" for run in runs) if planned else "".join(
        f"<tr><td>{html.escape(run.name)}</td>"
        + "".join(f"<td>{run.ttft[k]:.3f}</td>" for k in ("mean", "p50", "p90", "p99"))
        + f"<td>{run.queue_wait['mean']:.3f}</td><td>{run.hit_rate:.3f}</td><td>{run.busy_max_mean:.1f}</td>"
        f"<td>{run.requests}</td><td>{run.failed}</td>"
        + "".join(f"<td>{_ratio(run, yardstick)}</td>" for _, yardstick in against)
        + f"<td><code>{html.escape(_settings_text(run))}</code></td></tr>"
        for run in runs)
    ratio_heads = "".join(f"<th>{html.escape(name)}</th>" for name, _ in against)
    tenant_rows = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>"
                          for row in _tenant_rows(runs))
    tenants = "" if not tenant_rows else ("<h2>Per tenant</h2><table><tr>" + "".join(
        f"<th>{h}</th>" for h in _TENANT_HEAD) + f"</tr>{tenant_rows}</table>")
    fleet_members = {**_fleet(config), **(_transfer(config) if planned else {})}
    fleet = html.escape(", ".join(f"{k}={v}" for k, v in fleet_members.items() if k != "engine_model"))
    head = ("<th>setting</th><th>remote</th><th>TTFT mean (s)</th><th>p50</th><th>p99</th><th>TPOT mean (ms)</th>"
            "<th>p99</th><th>wait mean</th><th>hit rate</th><th>requests</th><th>failed</th><th>settings</th>"
            if planned else
            "<th>setting</th><th>TTFT mean (s)</th><th>p50</th><th>p90</th><th>p99</th><th>wait mean</th>\n"
            f"<th>hit rate</th><th>busy max</th><th>requests</th><th>failed</th>{ratio_heads}<th>settings</th>")
    model = html.escape(", ".join(f"{k}={v}" for k, v in _fleet(config)["engine_model"].items()))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>selection-proto simulate: {html.escape(trace)}</title>
<style>body{{font-family:sans-serif;margin:24px;color:#222}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}} td:first-child,td:last-child{{text-align:left}}
.row{{display:flex;gap:12px}}</style></head><body>
<h1>Simulated fleet: {html.escape(trace)}</h1>
{"".join(f"<p class=summary>{html.escape(line)}</p>" for line in summary(runs))}
<p>Fleet: {fleet}.<br>Engine model: {model}.</p>
<table><tr>{head}</tr>{rows}</table>
{tenants}<h2>Time to first token</h2>{cdf}
<h2>Engines over time</h2>{"".join(sections)}
</body></html>
"""


def _settings_text(run: SettingRun) -> str:
    if run.pd is not None:
        fleet = (f"{run.pd['prefill_engines']} prefill + {run.pd['decode_engines']} decode engines, "
                 f"decider {run.pd['decider'] or 'isl_bounding'}") if run.pd["prefill_engines"] else "aggregated"
        return ", ".join([fleet, *(f"{k}={v}" for k, v in sorted(run.settings.items()) if k != "kv_events")])
    if run.replicas is not None:
        return ", ".join([f"{replica_count(run)} replicas behind round robin"
                          + (f", ledger delay {run.replicas['ledger_delay_secs']:g} s" if run.replicas["shared"] else ""),
                          *(f"{k}={v}" for k, v in sorted(run.settings.items()) if k != "kv_events")])
    if not run.settings:
        return "all-knowing (greedy on the true state)" if run.name == ORACLE else \
            "baseline" if run.name in BASELINES else "defaults"
    return ", ".join(f"{k}={v}" for k, v in sorted(run.settings.items()) if k != "kv_events")
