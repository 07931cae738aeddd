"""Response types of api.md §4 as frozen attrs classes: each knows its JSON form (`to_json`),
with members in the order api.md gives (1.6.1's members beside ours, docs/DECISIONS.md)."""

from __future__ import annotations

from typing import Any, NamedTuple

import attrs

from .hashing import SignedHashes
from .types import WorkerCatalogRecord

__all__ = [
    "ApplyReport",
    "Candidate",
    "Excluded",
    "ModelLoadResponse",
    "Overlap",
    "OverlapScoresResponse",
    "Pending",
    "PotentialLoad",
    "ReadyResponse",
    "ReservationResponse",
    "SelectResponse",
    "StatusOk",
]

class _Flat:
    """A response whose JSON members are its attrs fields, in declaration order."""

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=False)  # type: ignore[arg-type]


@attrs.frozen
class StatusOk:
    def to_json(self) -> dict[str, Any]:
        return {"status": "ok"}


@attrs.frozen(kw_only=True)
class ReadyResponse:
    ready: bool
    schedulable_workers: int
    workers: tuple[WorkerCatalogRecord, ...]
    recovered_from: str | None = None  # the peer whose /dump this service started from
    details: tuple[str, ...] = ()  # subscriptions that cannot reach their engine

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ready": self.ready, "schedulable_workers": self.schedulable_workers}
        if self.recovered_from is not None:
            out["recovered_from"] = self.recovered_from
        if self.details:
            out["details"] = list(self.details)
        out["workers"] = [w.to_json() for w in self.workers]
        return out


@attrs.frozen(kw_only=True)
class PotentialLoad(_Flat):
    worker_id: int
    dp_rank: int
    potential_prefill_tokens: int
    potential_decode_blocks: int
    active_requests: int



@attrs.frozen(kw_only=True)
class ModelLoadResponse:
    model_name: str
    tenant_id: str
    loads: tuple[PotentialLoad, ...]
    pending_count: int = 0
    pending_isl_tokens: int = 0
    engines: tuple[dict[str, Any], ...] = ()  # ours: what each engine's metrics_endpoint reported

    def to_json(self) -> dict[str, Any]:
        out = {
            "model_name": self.model_name,
            "tenant_id": self.tenant_id,
            "routing_group": self.tenant_id,  # 1.6.1's name
            "loads": [p.to_json() for p in self.loads],
            "pending_count": self.pending_count,
            "pending_isl_tokens": self.pending_isl_tokens,
        }
        if self.engines:
            out["engines"] = list(self.engines)
        return out


@attrs.frozen(kw_only=True)
class Candidate(_Flat):
    """One cost breakdown of `explain` (core.md §9.8)."""

    worker_id: int
    dp_rank: int
    logit: float
    potential_prefill_tokens: int
    potential_decode_blocks: int
    device_blocks: int
    host_pinned_blocks: int
    disk_blocks: int
    cached_tokens: int
    predicted_wait_secs: float | None = None  # router_policy=ttft only
    predicted_prefill_secs: float | None = None

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=False)
        if self.predicted_wait_secs is None:
            del out["predicted_wait_secs"], out["predicted_prefill_secs"]
        return out



@attrs.frozen(kw_only=True)
class Excluded(_Flat):
    worker_id: int
    dp_rank: int
    reason: str



class Overlap(NamedTuple):
    """1.6.1's overlap summary of a selection, in tokens: the longest prefix any rank holds in any
    tier, the chosen rank's device prefix, that of each rank of the chosen worker (by dp rank),
    and the chosen rank's prefix through host-pinned and through disk blocks."""

    longest_matched: int
    gpu: int
    dp: dict[str, int]
    cpu: int
    disk: int

    def to_json(self) -> dict[str, Any]:
        return self._asdict()


@attrs.frozen(kw_only=True)
class SelectResponse:
    """The answer of `/select` and `/select_and_reserve` (api.md §4.7), with 1.6.1's members
    beside ours (`routing_group`, `overlap`, `effective_prefill_tokens`, `potential_decode_blocks`;
    a booking's `sequence_hashes`, `isl_tokens`, `track_prefill_tokens`)."""

    model_name: str
    tenant_id: str
    worker_id: int
    dp_rank: int
    endpoint: str
    effective_overlap_blocks: float
    cached_tokens: int
    block_size: int
    overlap: Overlap
    effective_prefill_tokens: int
    potential_decode_blocks: int
    selection_id: str | None = None
    reservation_id: str | None = None
    sequence_hashes: SignedHashes | None = None  # a booking's tracked hashes, as i64
    isl_tokens: int | None = None
    track_prefill_tokens: bool | None = None
    worker_load: dict[str, int] | None = None  # an advisory /select's view of the chosen rank
    candidates: tuple[Candidate, ...] | None = None
    excluded: tuple[Excluded, ...] | None = None
    decision: str | None = None  # `explain_header`: why, for the `x-selection-decision` header (not in the body)
    lane: dict[str, Any] | None = None  # with `explain`: its tier, class, fairness ID and time queued


    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.selection_id is not None:
            out["selection_id"] = self.selection_id
        if self.reservation_id is not None:
            out["reservation_id"] = self.reservation_id
            out["sequence_hashes"] = self.sequence_hashes.json_value() if self.sequence_hashes is not None else []
            out["isl_tokens"] = self.isl_tokens
            out["track_prefill_tokens"] = self.track_prefill_tokens
        out["model_name"] = self.model_name
        out["tenant_id"] = self.tenant_id
        out["routing_group"] = self.tenant_id
        out["worker_id"] = self.worker_id
        out["dp_rank"] = self.dp_rank
        out["endpoint"] = self.endpoint
        out["effective_overlap_blocks"] = float(self.effective_overlap_blocks)
        out["cached_tokens"] = self.cached_tokens
        out["block_size"] = self.block_size
        out["overlap"] = self.overlap.to_json()
        out["effective_prefill_tokens"] = self.effective_prefill_tokens
        out["potential_decode_blocks"] = self.potential_decode_blocks
        if self.worker_load is not None:
            out["worker_load"] = self.worker_load
        if self.candidates is not None:
            out["candidates"] = [c.to_json() for c in self.candidates]
        if self.excluded is not None:
            out["excluded"] = [e.to_json() for e in self.excluded]
        if self.lane is not None:
            out["lane"] = self.lane
        return out


@attrs.frozen(kw_only=True)
class ReservationResponse:
    """`POST /reservations`: the booking id under both names (`selection_id` is 1.6.1's), and the
    tenant under both (`routing_group`)."""

    reservation_id: str
    model_name: str
    tenant_id: str
    worker_id: int
    dp_rank: int
    endpoint: str

    def to_json(self) -> dict[str, Any]:
        return {"reservation_id": self.reservation_id, "selection_id": self.reservation_id,
                "model_name": self.model_name, "tenant_id": self.tenant_id,
                "routing_group": self.tenant_id, "worker_id": self.worker_id,
                "dp_rank": self.dp_rank, "endpoint": self.endpoint}



@attrs.frozen(kw_only=True)
class OverlapScoresResponse:
    """`POST /overlap_scores`: rows and freshness are already JSON-shaped dicts (api.md §4.15)."""

    block_size: int
    num_blocks: int
    workers: tuple[dict[str, Any], ...]
    freshness: tuple[dict[str, Any], ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "workers": list(self.workers),
            "freshness": list(self.freshness),
        }


@attrs.frozen(kw_only=True)
class ApplyReport:
    """What one KV-event message did (events.md §7.4)."""

    received: int
    applied: int
    failed: int
    dropped: int
    failures: tuple[tuple[int, str], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "received": self.received,
            "applied": self.applied,
            "failed": self.failed,
            "dropped": self.dropped,
            "failures": [{"index": i, "error": e} for i, e in self.failures],
        }


@attrs.frozen
class Pending:
    """A selection held back by the queue; its answer arrives as a `SelectionReady` output."""

    ticket: int
