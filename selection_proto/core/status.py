"""The fleet at a glance (issue 33): one snapshot of what an operator looks at first, per worker
(its lifecycle, KV routing verdict, booked load beside what its engine reports, index size, the age
of its last event), per key (the queue) and the latest decisions with their explanation; and the
server-sent event that carries a snapshot to the live page (`status_page.PAGE`, docs/STATUS.md).

Reading only: a snapshot changes nothing. Its size is bounded by the worker limits and `RECENT_DECISIONS`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from .._version import __version__
from . import jsonio
from .cost import explain
from .decisions import Decision
from .engine_metrics import EngineMetrics
from .pool import RECENT_DECISIONS, Key, Pool
from .readouts import kv_routing
from .settings import Settings
from .types import WorkerCatalogRecord

__all__ = ["RETRY_MS", "event", "snapshot"]

RETRY_MS: Final = 2000  # an EventSource that lost its stream asks again after this long


def _decision(key: Key, d: Decision, now: float) -> dict[str, Any]:
    chosen, runner = d.chosen, d.runner_up
    plan = {} if d.plan is None else {"plan": {  # a prefill/decode plan's: chosen is its decode worker
        "path": d.plan[0], "prefill": None if d.plan[1] is None else {"worker_id": d.plan[1][0],
                                                                       "dp_rank": d.plan[1][1]},
        "reason": d.plan[2]}}
    return {
        "age_secs": round(max(0.0, now - d.at), 3), "model_name": key[0], "tenant_id": key[1],
        "isl_tokens": d.isl, "worker_id": chosen.rank[0], "dp_rank": chosen.rank[1],
        "cached_tokens": chosen.cached, "candidate_count": d.candidates,
        "runner_up": None if runner is None else {"worker_id": runner.rank[0], "dp_rank": runner.rank[1],
                                                  "cached_tokens": runner.cached,
                                                  "margin": round(runner.logit - chosen.logit, 6)},
        "candidates": [{"worker_id": c.worker_id, "dp_rank": c.dp_rank, "cached_tokens": c.cached_tokens,
                        "logit": round(c.logit, 6), "predicted_wait_secs": c.predicted_wait_secs}
                       for c in explain(list(d.cheapest), d.predicted)],
        **plan,
    }


def _worker(record: WorkerCatalogRecord, pools: Mapping[Key, Pool], settings: Settings,
            engines: EngineMetrics, now: float) -> dict[str, Any]:
    pool = pools.get(record.key)
    ranks = pool.workers.get(record.worker_id, ()) if pool is not None else ()
    booked = []
    for rank in ranks:
        assert pool is not None
        load = pool.tracker.loads[rank]
        booked.append({"dp_rank": rank[1], "active_requests": load.requests, "prefill_tokens": load.prefill_tokens,
                       "decode_blocks": load.decode_blocks(), "index_blocks": pool.index.device.size(rank)})
    verdict = kv_routing(record, pools, settings, now)
    return {
        "worker_id": record.worker_id, "model_name": record.key[0], "tenant_id": record.key[1],
        "endpoint": record.request.endpoint, "lifecycle": record.lifecycle,
        "not_schedulable_reasons": list(record.not_schedulable_reasons),
        "kv_routing": {"state": verdict["state"], "reasons": verdict["reasons"],
                       "last_event_age_secs": verdict.get("last_event_age_secs"),
                       "restarts": verdict.get("restarts", 0)},
        "ranks": booked, "engine": engines.view(record.worker_id, now),
    }


def snapshot(records: Iterable[WorkerCatalogRecord], pools: Mapping[Key, Pool], settings: Settings,
             engines: EngineMetrics, ready: bool, serving: bool, now: float) -> dict[str, Any]:
    """Workers in id order, each key's queue, and the newest decisions of all keys."""
    workers = [_worker(r, pools, settings, engines, now) for r in sorted(records, key=lambda r: r.worker_id)]
    queues = [{"model_name": k[0], "tenant_id": k[1], "pending_count": len(p.queue),
               "pending_isl_tokens": sum(e.prompt.isl for e in p.queue), "active_reservations": len(p.tracker.bookings)}
              for k, p in sorted(pools.items()) if p.workers]
    recent = sorted(((d, k) for k, p in pools.items() for d in p.recent), key=lambda dk: -dk[0].at)[:RECENT_DECISIONS]
    return {"version": __version__, "ready": ready, "serving": serving, "policy": settings.router_policy,
            "kv_events": settings.kv_events, "workers": workers, "queues": queues,
            "decisions": [_decision(k, d, now) for d, k in recent]}


def event(value: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying `value` as JSON on one `data:` line (JSON has no raw newline)."""
    return b"retry: " + str(RETRY_MS).encode() + b"\ndata: " + jsonio.dumps(value) + b"\n\n"
