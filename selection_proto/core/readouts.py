"""What the pools hold, read without changing anything: each key's loads and queue, the loads a
prompt would add (`/potential_loads`), and a prompt's overlap per rank and tier with each rank's
freshness (`/overlap_scores`, events.md §6)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .cost import cached_tokens, effective_blocks, estimates, tracks_prefill
from .freshness import RankFreshness
from .pool import Key, Pool
from .prompt import PromptHashes
from .responses import ModelLoadResponse, OverlapScoresResponse, PotentialLoad
from .settings import Settings
from .types import RouterConfigOverride

__all__ = ["loads", "overlap_scores", "potential_loads"]


def loads(pools: Mapping[Key, Pool], model_name: str | None, tenant_id: str | None
          ) -> list[ModelLoadResponse]:
    """Each key's per-rank load and its queue, in key order, filtered by key."""
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
