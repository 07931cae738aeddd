"""The fleet at a glance (docs/STATUS.md): what an operator looks at first, built once (`Fleet`) and
read by each viewer through its own filter (`View`) as one snapshot of bounded size whatever the
fleet: a summary (workers by state and lifecycle; per key the last minute's selections, refusals,
cached tokens achieved against achievable, the shadow policy, the engines' hit rate, the queue by
lane), the workers worst first (at most `MAX_WORKER_ROWS` of those the filter matches, their ranks
summed), one worker's ranks on demand (`detail`), and the newest decisions explained; and the
server-sent event that carries a snapshot to the live page (`status_page.PAGE`).

Reading only: nothing here changes state."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final, NamedTuple

from .._version import __version__
from .base import jsonio
from .base.errors import BadRequest
from .base.routes import STATUS_QUERY
from .base.settings import Settings
from .base.types import WorkerCatalogRecord
from .base.wire import parse_query, query_int
from .cache.engine_metrics import EngineMetrics
from .fleet.decisions import Decision
from .fleet.outcomes import REASONS
from .fleet.pool import RECENT_DECISIONS, Key, Pool
from .fleet.verdict import ORDER, SEVERITY, SEVERITY_ORDER
from .readouts import kv_routing
from .routing.cost import explain

__all__ = ["MAX_FILTER_CHARS", "MAX_KEY_ROWS", "MAX_LANES", "MAX_REASONS", "MAX_WORKER_ROWS", "RETRY_MS",
           "Fleet", "View", "event", "fleet", "snapshot", "view_of"]

RETRY_MS: Final = 2000  # an EventSource that lost its stream asks again after this long
MAX_WORKER_ROWS: Final = 100  # of the workers a filter matches, worst first
MAX_KEY_ROWS: Final = 50  # keys in the summary, those with most queued, then most selections, first
MAX_LANES: Final = 16  # lanes listed per key, highest tier first
MAX_REASONS: Final = 3  # a worker row's reasons; its detail has them all
MAX_FILTER_CHARS: Final = 256
LIFECYCLES: Final = ("schedulable", "incomplete", "unschedulable")


class View(NamedTuple):
    """One viewer's filter: workers whose text holds `text` (lower case; empty: all), and the
    worker whose ranks it asked to see."""

    text: str = ""
    detail: int | None = None


def view_of(query: str) -> View:
    """The filter of `?q=<text>&detail=<worker_id>`, or 400."""
    params = parse_query(query, STATUS_QUERY)
    text = params.get("q", "")
    if len(text) > MAX_FILTER_CHARS:
        raise BadRequest(f"Failed to deserialize query string: q: at most {MAX_FILTER_CHARS} characters")
    return View(text.strip().lower(), query_int(params, "detail", 64))


def _rate(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole > 0 else None


def _shadow(d: Decision, policy: str | None) -> dict[str, Any] | None:
    """What the shadow policy would have chosen (one of the two policies predicts every candidate's seconds)."""
    if d.shadow is None:
        return None
    c = d.shadow
    return {"policy": policy, "worker_id": c.rank[0], "dp_rank": c.rank[1], "cached_tokens": c.cached,
            "predicted_ttft_secs": round(c.wait + c.prefill, 6), "agrees": c.rank == d.chosen.rank}


def _decision(key: Key, d: Decision, settings: Settings, now: float) -> dict[str, Any]:
    chosen, runner = d.chosen, d.runner_up
    plan = {} if d.plan is None else {"plan": {  # a prefill/decode plan's: chosen is its decode worker
        "path": d.plan[0], "prefill": None if d.plan[1] is None else {"worker_id": d.plan[1][0],
                                                                       "dp_rank": d.plan[1][1]},
        "reason": d.plan[2]}}
    return {
        "age_secs": round(max(0.0, now - d.at), 3), "model_name": key[0], "tenant_id": key[1],
        "request_id": d.request_id, "isl_tokens": d.isl, "worker_id": chosen.rank[0], "dp_rank": chosen.rank[1],
        "cached_tokens": chosen.cached, "achievable_cached_tokens": d.achievable, "loss_reason": d.loss,
        "predicted_ttft_secs": round(chosen.wait + chosen.prefill, 6) if d.predicted or d.shadow else None,
        "candidate_count": d.candidates, "margin_unit": "seconds" if d.predicted else "blocks",
        "runner_up": None if runner is None else {"worker_id": runner.rank[0], "dp_rank": runner.rank[1],
                                                  "cached_tokens": runner.cached,
                                                  "margin": round(runner.logit - chosen.logit, 6),
                                                  "tied": runner.logit == chosen.logit},
        "candidates": [{"worker_id": c.worker_id, "dp_rank": c.dp_rank, "cached_tokens": c.cached_tokens,
                        "logit": round(c.logit, 6), "predicted_wait_secs": c.predicted_wait_secs}
                       for c in explain(list(d.cheapest), d.predicted)],
        **plan,
        "shadow": _shadow(d, settings.shadow_policy),
    }


def _ranks(record: WorkerCatalogRecord, pool: Pool | None) -> list[dict[str, Any]]:
    ranks = pool.workers.get(record.worker_id, ()) if pool is not None else ()
    rows = []
    for rank in ranks:
        assert pool is not None
        load = pool.tracker.loads[rank]
        rows.append({"dp_rank": rank[1], "active_requests": load.requests, "prefill_tokens": load.prefill_tokens,
                     "decode_blocks": load.decode_blocks(), "index_blocks": pool.index.device.size(rank)})
    return rows


class _Row(NamedTuple):
    order: tuple[int, int, int]
    text: str  # what a filter matches, lower case
    value: dict[str, Any]


def _worker(record: WorkerCatalogRecord, pools: Mapping[Key, Pool], settings: Settings,
            engines: EngineMetrics, now: float) -> _Row:
    pool = pools.get(record.key)
    ranks = pool.workers.get(record.worker_id, ()) if pool is not None else ()
    requests = prefill = decode = blocks = 0
    for rank in ranks:  # summed here, listed only in a detail: a fleet has many
        assert pool is not None
        load = pool.tracker.loads[rank]
        requests += load.requests
        prefill += load.prefill_tokens
        decode += load.decode_blocks()
        blocks += pool.index.device.size(rank)
    verdict = kv_routing(record, pools, settings, now)
    state = verdict["state"]
    severity = SEVERITY[state]
    reasons: list[str] = verdict["reasons"]
    value = {
        "worker_id": record.worker_id, "model_name": record.key[0], "tenant_id": record.key[1],
        "endpoint": record.request.endpoint, "lifecycle": record.lifecycle,
        "not_schedulable_reasons": list(record.not_schedulable_reasons),
        "kv_routing": {"state": state, "severity": severity, "reasons": reasons[:MAX_REASONS],
                       "more_reasons": max(0, len(reasons) - MAX_REASONS),
                       "last_event_age_secs": verdict.get("last_event_age_secs"),
                       "restarts": verdict.get("restarts", 0),
                       "predicted_cached_tokens": verdict["predicted_cached_tokens"],
                       "observed_cached_tokens": verdict["observed_cached_tokens"],
                       "observations": verdict["observations"]},
        "dp_size": len(ranks), "active_requests": requests, "prefill_tokens": prefill, "decode_blocks": decode,
        "index_blocks": blocks,
        "engine": engines.view(record.worker_id, now),
    }
    text = " ".join((str(record.worker_id), record.request.endpoint or "", f"{record.key[0]}/{record.key[1]}",
                     record.lifecycle, state, severity)).lower()
    return _Row((-SEVERITY_ORDER[severity], -ORDER[state], record.worker_id), text, value)


def _lanes(pool: Pool) -> list[dict[str, Any]]:
    return [{"priority": tier, "policy_class": name, "queued": queued, "queued_uncached_tokens": tokens,
             "fairness_ids": flows} for tier, name, queued, tokens, flows in pool.queue.lanes()[:MAX_LANES]]


def _outcomes(totals: Mapping[str, float], span: float) -> dict[str, Any]:
    """The last minute's counts of one key or of all, as rates and shares."""
    prompt, achieved, achievable = (totals.get(n, 0.0) for n in ("prompt_tokens", "achieved", "achievable"))
    scored = totals.get("shadow_scored", 0.0)
    return {
        "window_secs": round(span, 3),
        "selections_per_sec": round(totals.get("selections", 0.0) / span, 3),
        "refusals_per_sec": round(totals.get("refusals", 0.0) / span, 3),
        "errors_per_sec": round(totals.get("errors", 0.0) / span, 3),
        "prompt_tokens": int(prompt), "achieved_cached_tokens": int(achieved),
        "achievable_cached_tokens": int(achievable),
        "achieved_hit_rate": _rate(achieved, prompt), "achievable_hit_rate": _rate(achievable, prompt),
        "routing_efficiency": _rate(achieved, achievable),
        "lost_cached_tokens": {r: int(totals.get("lost:" + r, 0.0)) for r in REASONS},
        "shadow": None if not scored else {
            "scored": int(scored), "disagreement_rate": _rate(totals.get("shadow_disagreed", 0.0), scored),
            "mean_predicted_ttft_secs": {"acting": round(totals.get("ttft_acting", 0.0) / scored, 6),
                                         "shadow": round(totals.get("ttft_shadow", 0.0) / scored, 6)}},
    }


def _engine_rates(values: list[float]) -> dict[str, Any]:
    return {"engine_hit_rate": round(sum(values) / len(values), 4) if values else None,
            "engine_workers_reporting": len(values)}


class Fleet(NamedTuple):
    """What every viewer's snapshot is cut from, built once: the summary, every worker row worst
    first, the newest decisions, and what a detail is read from."""

    head: dict[str, Any]
    rows: list[_Row]
    records: Mapping[int, WorkerCatalogRecord]
    pools: Mapping[Key, Pool]


def fleet(records: Iterable[WorkerCatalogRecord], pools: Mapping[Key, Pool], settings: Settings,
          engines: EngineMetrics, ready: bool, serving: bool, now: float) -> Fleet:
    by_id = {r.worker_id: r for r in records}
    rows = sorted((_worker(r, pools, settings, engines, now) for r in by_id.values()), key=lambda row: row.order)
    lifecycles = dict.fromkeys(LIFECYCLES, 0)
    states = dict.fromkeys(ORDER, 0)
    severities = dict.fromkeys(SEVERITY_ORDER, 0)
    engine_rates: dict[Key, list[float]] = {}
    predicted = observed = 0
    for row in rows:
        w = row.value
        lifecycles[w["lifecycle"]] = lifecycles.get(w["lifecycle"], 0) + 1
        states[w["kv_routing"]["state"]] += 1
        severities[w["kv_routing"]["severity"]] += 1
        predicted += w["kv_routing"]["predicted_cached_tokens"]
        observed += w["kv_routing"]["observed_cached_tokens"]
        rate = (w["engine"] or {}).get("prefix_cache_hit_rate")
        if rate is not None:
            engine_rates.setdefault((w["model_name"], w["tenant_id"]), []).append(rate)
    keys = []
    everything: dict[str, float] = {}
    span = 0.0
    for key, pool in pools.items():
        if not pool.workers:
            continue
        totals, key_span = pool.outcomes.totals(now), pool.outcomes.span(now)
        span = max(span, key_span)
        for name, value in totals.items():
            everything[name] = everything.get(name, 0.0) + value
        keys.append({"model_name": key[0], "tenant_id": key[1], **_outcomes(totals, key_span),
                     **_engine_rates(engine_rates.get(key, [])),
                     "pending_count": len(pool.queue), "pending_isl_tokens": sum(e.prompt.isl for e in pool.queue),
                     "active_reservations": len(pool.tracker.bookings), "lanes": _lanes(pool)})
    keys.sort(key=lambda k: (-k["pending_count"], -k["selections_per_sec"], k["model_name"], k["tenant_id"]))
    # Newest first; of one instant, the later first (a sort keeps the order of equals).
    recent = sorted(((d, k) for k, p in pools.items() for d in reversed(p.recent)),
                    key=lambda dk: -dk[0].at)[:RECENT_DECISIONS]
    summary = {
        "workers": {"total": len(rows), "by_lifecycle": lifecycles, "by_state": states, "by_severity": severities},
        **_outcomes(everything, span or 1.0), **_engine_rates([x for v in engine_rates.values() for x in v]),
        "observed_cached_tokens": observed, "predicted_cached_tokens": predicted,
        "observed_hit_rate": _rate(observed, predicted),
        "pending_count": sum(k["pending_count"] for k in keys),
        "keys_total": len(keys),
    }
    head = {"version": __version__, "ready": ready, "serving": serving, "policy": settings.router_policy,
            "shadow_policy": settings.shadow_policy, "kv_events": settings.kv_events, "summary": summary,
            "keys": keys[:MAX_KEY_ROWS], "decisions": [_decision(k, d, settings, now) for d, k in recent]}
    return Fleet(head, rows, by_id, pools)


def _detail(f: Fleet, worker_id: int, settings: Settings, now: float) -> dict[str, Any] | None:
    """One worker with every rank and every reason, or None when it is not in the catalog."""
    record = f.records.get(worker_id)
    if record is None:
        return None
    pool = f.pools.get(record.key)
    ranks = _ranks(record, pool)
    if pool is not None:
        expected = settings.kv_events in ("subscribe", "push")
        for rank in ranks:
            r = (worker_id, rank["dp_rank"])
            state, reasons = pool.watch[r].state(pool.fresh[r], pool.block_size, expected,
                                                 settings.kv_verdict_window_secs, now)
            rank.update(state=state, severity=SEVERITY[state], reasons=reasons)
    verdict = kv_routing(record, f.pools, settings, now)
    return {"worker_id": worker_id, "reasons": verdict["reasons"], "ranks": ranks}


def snapshot(f: Fleet, view: View, settings: Settings, now: float) -> dict[str, Any]:
    """One viewer's snapshot: the summary, the worst `MAX_WORKER_ROWS` workers its filter matches,
    the worker it asked to see in detail."""
    text = view.text
    matched = [row.value for row in f.rows if text in row.text] if text else [row.value for row in f.rows]
    return {**f.head, "filter": {"q": text, "detail": view.detail}, "workers_matched": len(matched),
            "workers": matched[:MAX_WORKER_ROWS],
            "detail": None if view.detail is None else _detail(f, view.detail, settings, now)}


def event(value: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying `value` as JSON on one `data:` line (JSON has no raw newline)."""
    return b"retry: " + str(RETRY_MS).encode() + b"\ndata: " + jsonio.dumps(value) + b"\n\n"
