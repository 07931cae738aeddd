"""What the pools hold, read without changing anything: each key's loads and queue, the loads a
prompt would add (`/potential_loads`), a prompt's overlap per rank and tier with each rank's
freshness (`/overlap_scores`, events.md §6), and the gauges of `/metrics` that mirror state."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .._version import __version__
from .base import jsonio
from .base.budget import StateBudget
from .base.responses import ModelLoadResponse, OverlapScoresResponse, PotentialLoad
from .base.settings import Settings
from .base.types import RouterConfigOverride, WorkerCatalogRecord
from .bookings.prompt import PromptHashes
from .cache.engine_metrics import EngineMetrics
from .cache.freshness import RankFreshness
from .cache.index import LOWER_TIERS
from .fleet.pending import PendingSelections
from .fleet.pool import Key, Pool
from .fleet.verdict import STATES, judge, not_schedulable
from .routing.cost import cached_tokens, effective_blocks, estimates, tracks_prefill

__all__ = ["gauges", "kv_routing", "loads", "overlap_scores", "potential_loads", "with_verdict"]

Samples = dict[tuple[str, ...], float]


def kv_routing(record: WorkerCatalogRecord, pools: Mapping[Key, Pool], settings: Settings,
               now: float) -> dict[str, Any]:
    """A worker's verdict: is KV routing working for it (verdict.py)."""
    pool = pools.get(record.key)
    ranks = pool.workers.get(record.worker_id) if pool is not None else None
    if pool is None or not ranks:
        return not_schedulable(record.lifecycle)
    expected = settings.kv_events in ("subscribe", "push")
    return judge([(r[1], pool.watch[r], pool.fresh[r]) for r in ranks], pool.block_size, expected,
                 settings.kv_verdict_window_secs, now)


def with_verdict(record_json: bytes, verdict: dict[str, Any]) -> bytes:
    """A record's cached JSON with `kv_routing` as its last member."""
    return record_json[:-1] + b',"kv_routing":' + jsonio.dumps(verdict) + b"}"


def gauges(records: Iterable[WorkerCatalogRecord], pools: Mapping[Key, Pool], budget: StateBudget,
           pending: PendingSelections, settings: Settings, now: float,
           engines: EngineMetrics | None = None) -> dict[str, Samples]:
    """The gauge families that mirror state, sampled now (api.md §5)."""
    lifecycles: Samples = {("incomplete",): 0.0, ("schedulable",): 0.0, ("unschedulable",): 0.0}
    verdicts: Samples = {}
    hit_rates: Samples = {}
    for r in records:
        lifecycles[(r.lifecycle,)] = lifecycles.get((r.lifecycle,), 0.0) + 1
        if r.lifecycle == "schedulable":  # bounded by the worker limits
            state = kv_routing(r, pools, settings, now)["state"]
            for name in STATES:
                verdicts[(*r.key, str(r.worker_id), name)] = 1.0 if name == state else 0.0
        if engines is not None and (rate := engines.hit_rate(r.worker_id)) is not None:
            hit_rates[(*r.key, str(r.worker_id))] = rate
    ranks: Samples = {}
    active: Samples = {}
    queued: Samples = {}
    stale: Samples = {}
    blocks: Samples = {}
    sessions: Samples = {}
    requests: Samples = {}
    prefill: Samples = {}
    decode: Samples = {}
    learned: Samples = {}
    overheads: Samples = {}
    for key, pool in pools.items():
        sessions[key] = float(len(pool.sessions))
        pool.speeds.settle(now)
        if pool.speeds.learn:
            overheads[key] = pool.speeds.overhead
        for worker_id, speed in pool.speeds.learned().items():
            learned[(*key, str(worker_id))] = speed
        for rank in pool.ranks():  # bounded by the worker and dp-size limits
            load = pool.tracker.loads[rank]
            labels = (*key, str(rank[0]), str(rank[1]))
            requests[labels] = float(load.requests)
            prefill[labels] = float(load.prefill_tokens)
            decode[labels] = float(load.decode_blocks())
        ranks[key] = float(len(pool.ranks()))
        active[key] = float(len(pool.tracker.bookings))
        queued[key] = float(len(pool.queue))
        stale[key] = float(sum(1 for f in pool.fresh.values() if f.stale))
        blocks[(*key, "device")] = float(pool.index.device.total_size())
        for tier in LOWER_TIERS:
            blocks[(*key, tier)] = float(pool.index.lower[tier].total_size())
    return {
        "selection_proto_info": {(__version__,): 1.0},
        "selection_proto_workers": lifecycles,
        "selection_proto_schedulable_ranks": ranks,
        "selection_proto_reservations_active": active,
        "selection_proto_queue_pending": queued,
        "selection_proto_kv_stale_ranks": stale,
        "selection_proto_kv_routing_state": verdicts,
        "selection_proto_engine_prefix_cache_hit_rate": hit_rates,
        "selection_proto_index_blocks": blocks,
        "selection_proto_state_bytes": {(): float(budget.used)},
        "selection_proto_state_budget_bytes": {(): float(budget.limit)},
        "selection_proto_pending_selections": {(): float(len(pending))},
        "selection_proto_pending_selection_bytes": {(): float(pending.bytes)},
        "selection_proto_session_bindings": sessions,
        "selection_proto_rank_active_requests": requests,
        "selection_proto_rank_prefill_tokens": prefill,
        "selection_proto_rank_decode_blocks": decode,
        "selection_proto_worker_learned_speed": learned,
        "selection_proto_learned_request_overhead_tokens": overheads,
    }


def loads(pools: Mapping[Key, Pool], model_name: str | None, tenant_id: str | None,
          engines: EngineMetrics | None = None, now: float = 0.0) -> list[ModelLoadResponse]:
    """Each key's per-rank load and its queue, in key order, filtered by key; with `engines`, what
    each worker's engine last reported of itself."""
    out = []
    for key in sorted(pools):
        if (model_name is not None and key[0] != model_name) or (
            tenant_id is not None and key[1] != tenant_id
        ):
            continue
        pool = pools[key]
        if not pool.workers:
            continue  # an index recovered from a peer, awaiting its workers
        rank_loads = pool.tracker.loads
        out.append(ModelLoadResponse(
            model_name=key[0], tenant_id=key[1],
            loads=tuple(PotentialLoad(worker_id=r[0], dp_rank=r[1],
                                      potential_prefill_tokens=rank_loads[r].prefill_tokens,
                                      potential_decode_blocks=rank_loads[r].decode_blocks(),
                                      active_requests=rank_loads[r].requests)
                        for r in pool.ranks()),
            pending_count=len(pool.queue),
            pending_isl_tokens=sum(e.prompt.isl for e in pool.queue),
            engines=() if engines is None else tuple(
                v for w in sorted(pool.workers) if (v := engines.view(w, now)) is not None),
        ))
    return out


def potential_loads(pool: Pool, prompt: PromptHashes, override: RouterConfigOverride | None,
                    s: Settings) -> list[PotentialLoad]:
    """What each rank's load would be if the prompt ran there (no booking)."""
    track = tracks_prefill(s, override)
    found = estimates(pool, prompt.blocks)
    out = []
    for r in pool.ranks():
        load = pool.tracker.loads[r]
        cached = cached_tokens(r, found, pool.block_size, s)
        decode = load.decode_blocks() + (prompt.new_blocks(load) if s.track_active_blocks else 0)
        out.append(PotentialLoad(
            worker_id=r[0], dp_rank=r[1],
            potential_prefill_tokens=load.prefill_tokens + (max(0, prompt.isl - cached) if track else 0),
            potential_decode_blocks=decode, active_requests=load.requests))
    return out


def overlap_scores(pool: Pool, prompt: PromptHashes, s: Settings, now: float) -> OverlapScoresResponse:
    """Cached blocks per rank and tier for a prompt, with each rank's freshness."""
    device, host, disk = estimates(pool, prompt.blocks)
    rows = []
    for r in sorted(set(device) | set(host) | set(disk)):
        d, h, k = device.get(r, 0), host.get(r, 0), disk.get(r, 0)
        if d + h + k == 0:
            continue
        fresh = pool.fresh.get(r) or RankFreshness()
        rows.append({"worker_id": r[0], "dp_rank": r[1], "device_blocks": d,
                     "host_pinned_extension_blocks": h, "disk_extension_blocks": k,
                     "router_credit_blocks": float(effective_blocks(d, h, k, s)),
                     "last_event_id": fresh.last_event_id,
                     "last_event_age_secs": fresh.age(now), "stale": fresh.stale})
    freshness: list[dict[str, Any]] = []
    for r in pool.ranks():
        f = pool.fresh[r]
        freshness.append({"worker_id": r[0], "dp_rank": r[1], "last_event_id": f.last_event_id,
                          "last_event_age_secs": f.age(now), "event_gaps": f.event_gaps,
                          "missing_events": f.missing_events, "rewinds": f.rewinds,
                          "stale": f.stale, "open_streams": f.open_streams})
    return OverlapScoresResponse(block_size=pool.block_size, num_blocks=len(prompt.blocks),
                                 workers=tuple(rows), freshness=tuple(freshness))
