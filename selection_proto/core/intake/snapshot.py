"""Snapshots (api.md §7): `/dump` writes the catalog and the index as replayable Dynamo JSON
events; `parse_dump` checks a dump whole before anything of it is applied (`restore`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, NamedTuple

from ..._version import __version__
from ..base.codec import from_json
from ..base.errors import ShapeError, Unprocessable
from ..base.types import WorkerCatalogRecord, WorkerRequest
from ..cache.events import KvEvent, decode_json_events
from ..cache.tiers import KeyIndex
from ..fleet.catalog import dp_range
from ..fleet.pool import Key

__all__ = ["FORMAT", "RestorePlan", "dump_of", "parse_dump", "parse_peer_index"]

FORMAT: Final = "selection-proto-dump/1"


def dump_of(records: Sequence[WorkerCatalogRecord], pools: Mapping[Key, tuple[int, KeyIndex]],
            model_name: str | None, tenant_id: str | None) -> dict[str, Any]:
    """The dump of `records` (in catalog order) and each pool's (block size, index)."""
    def wanted(key: Key) -> bool:
        return (model_name is None or key[0] == model_name) and (
            tenant_id is None or key[1] == tenant_id)

    keys = [k for k in sorted(pools) if wanted(k)]
    listed = {r.worker_id for r in records if r.lifecycle != "unschedulable"}
    events: list[dict[str, Any]] = []
    for key in keys:
        for tier, rank, parent, blocks in pools[key][1].dump():
            if rank[0] not in listed:
                continue  # recovered from a peer for a worker not registered here (yet)
            events.append({
                "worker_id": rank[0], "storage_tier": tier,
                "event": {"event_id": len(events), "dp_rank": rank[1], "data": {"stored": {
                    "parent_hash": parent,
                    "blocks": [{"block_hash": e, "tokens_hash": t} for e, t in blocks]}}}})
    return {
        "format": FORMAT,
        "version": __version__,
        "keys": [{"model_name": k[0], "tenant_id": k[1], "routing_group": k[1], "block_size": pools[k][0]}
                 for k in keys],
        "workers": [r.request.to_json() for r in records
                    if r.lifecycle != "unschedulable" and wanted(r.key)],
        "events": events,
    }


class RestorePlan(NamedTuple):
    workers: list[WorkerRequest]
    events: list[KvEvent]


def _invalid(path: str, exc: Unprocessable | str) -> Unprocessable:
    reason = exc if isinstance(exc, str) else exc.detail if isinstance(exc, ShapeError) else exc.message
    return Unprocessable(f"invalid dump: {path}: {reason}")


def parse_peer_index(dump: Any) -> dict[Key, tuple[int, list[KvEvent]]]:
    """1.6.1's dump (`{"<model>:<group>": {"block_size", "events"}}`, indexer recovery): each
    partition's block size and stored events, every part checked first; raises Unprocessable."""
    if not isinstance(dump, Mapping) or "format" in dump:
        raise _invalid("(root)", "expected a map of \"<model>:<group>\" partitions")
    out: dict[Key, tuple[int, list[KvEvent]]] = {}
    for name, entry in dump.items():
        model, sep, group = str(name).partition(":")
        if not sep:
            raise _invalid(str(name), "expected a \"<model>:<group>\" partition name")
        block_size = entry.get("block_size") if isinstance(entry, Mapping) else None
        if type(block_size) is not int or not 0 < block_size < 1 << 32:
            raise _invalid(str(name), "expected {\"block_size\": u32 > 0, \"events\": [...]}")
        try:
            events = decode_json_events(entry.get("events"))
        except Unprocessable as exc:
            raise _invalid(f"{name}.events", exc) from None
        if any(e.worker_id is None or e.kind != "stored" for e in events):
            raise _invalid(f"{name}.events", "expected stored events, each with its worker_id")
        out[(model, group)] = (block_size, list(events))
    return out


def parse_dump(dump: Any) -> RestorePlan:
    """The workers and events of a dump, every part checked first; raises Unprocessable."""
    if not isinstance(dump, Mapping):
        raise _invalid("(root)", "expected a map")
    if dump.get("format") != FORMAT:
        raise _invalid("format", f"expected \"{FORMAT}\"")
    for name in ("keys", "workers", "events"):
        if not isinstance(dump.get(name), list):
            raise _invalid(name, "expected a sequence")
    workers = []
    for i, raw in enumerate(dump["workers"]):
        try:
            workers.append(from_json(WorkerRequest, raw))
        except Unprocessable as exc:
            raise _invalid(f"workers[{i}]", exc) from None
    try:
        events = decode_json_events(dump["events"])
    except Unprocessable as exc:
        raise _invalid("events", exc) from None
    ranks = {req.worker_id: dp_range(req) for req in workers}
    for i, event in enumerate(events):
        if event.worker_id not in ranks:
            raise _invalid(f"events[{i}].worker_id", f"worker {event.worker_id} is not in the dump")
        if (event.dp_rank or 0) not in ranks[event.worker_id]:
            raise _invalid(f"events[{i}].event.dp_rank", f"not a rank of worker {event.worker_id}")
    return RestorePlan(workers, list(events))
