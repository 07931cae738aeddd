"""The worker catalog (core.md §6): the records and their lifecycle as tables, and the metadata
rules: derived values, missing metadata, event endpoint validation."""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterable
from typing import Final

from ..base.budget import StateBudget
from ..base.errors import NotFound
from ..base.settings import Settings
from ..base.types import WorkerCatalogRecord, WorkerRequest
from ..base.wire import parse_uint

__all__ = [
    "LIFECYCLE",
    "RECONCILE",
    "TOPOLOGY_PREFIX",
    "Catalog",
    "frame",
    "dp_range",
    "effective_taints",
    "endpoint_failure",
    "event_endpoints",
    "missing_metadata",
    "validate_endpoint",
]

TOPOLOGY_PREFIX = "dynamo.topology/"
_U32_END = 1 << 32


def dp_range(req: WorkerRequest) -> range:
    start = req.data_parallel_start_rank or 0
    size = 1 if req.data_parallel_size is None else req.data_parallel_size
    return range(start, min(start + size, _U32_END))


def event_endpoints(req: WorkerRequest) -> dict[int, str]:
    if req.kv_events_endpoints:
        return dict(req.kv_events_endpoints)
    size = 1 if req.data_parallel_size is None else req.data_parallel_size
    if size == 1 and req.kv_events_endpoint is not None:
        return {req.data_parallel_start_rank or 0: req.kv_events_endpoint}
    return {}


def effective_taints(req: WorkerRequest) -> frozenset[str]:
    return frozenset(req.taints) | {f"{TOPOLOGY_PREFIX}{k}={v}" for k, v in req.topology_domains.items()}


def missing_metadata(req: WorkerRequest, settings: Settings) -> list[str]:
    reasons: list[str] = []
    if not req.endpoint:
        reasons.append("endpoint is required")
    if not req.block_size:
        reasons.append("block_size must be greater than 0")
    if req.data_parallel_size == 0:
        reasons.append("data_parallel_size must be greater than 0")
    if settings.queueing and req.max_num_batched_tokens is None:
        reasons.append("max_num_batched_tokens is required while queueing is enabled")
    if settings.kv_events == "subscribe":
        endpoints = event_endpoints(req)
        for r in dp_range(req):
            if not endpoints.get(r):
                reasons.append(f"kv_events endpoint is required for dp_rank {r}")
    return reasons


IPC_PATH_MAX: Final = 107  # a unix socket path (sun_path less its NUL), as ZMQ's ipc transport takes it


def _parse_u16(text: str) -> str | None:
    value = parse_uint(text, 16)
    return value if isinstance(value, str) else None


def validate_endpoint(endpoint: str, *, zmq_ok: bool, allow_ws: bool) -> str | None:
    """The §6.3 error text for an event (or replay) endpoint, or None when it is valid."""
    scheme, sep, address = endpoint.partition("://")
    if not sep:
        return f"invalid ZMQ endpoint `{endpoint}`: missing scheme"
    if not address:
        return f"invalid ZMQ endpoint `{endpoint}`: missing address"
    if scheme in ("tcp", "ipc") and not zmq_ok:
        return f"invalid ZMQ endpoint `{endpoint}`: ZMQ endpoints need the optional extra `zmq`"
    if scheme == "tcp":
        tcp_host, colon, tcp_port = address.rpartition(":")
        if not colon:
            return f"invalid ZMQ endpoint `{endpoint}`: missing TCP port"
        if not tcp_host:
            return f"invalid ZMQ endpoint `{endpoint}`: missing TCP host"
        if tcp_host.startswith("["):
            if not tcp_host.endswith("]"):
                return f"invalid ZMQ endpoint `{endpoint}`: missing closing `]`"
        elif ":" in tcp_host:
            return f"invalid ZMQ endpoint `{endpoint}`: missing TCP port"
        # What ZMQ's connect refuses later, on every retry: a wildcard (bind-only) or a blank.
        if tcp_host == "*" or any(c.isspace() for c in tcp_host):
            return f"invalid ZMQ endpoint `{endpoint}`: invalid TCP host"
        why = _parse_u16(tcp_port)
        if why is not None:
            return f"invalid ZMQ endpoint `{endpoint}`: invalid TCP port: {why}"
        return None
    if scheme == "ipc":
        if len(address.encode()) > IPC_PATH_MAX:
            return f"invalid ZMQ endpoint `{endpoint}`: ipc path longer than {IPC_PATH_MAX} bytes"
        return None
    if scheme in ("ws", "wss") and allow_ws:
        authority = address
        port: str | None
        for stop in ("/", "?"):
            authority = authority.split(stop, 1)[0]
        if authority.startswith("["):
            close = authority.find("]")
            host, rest = (authority[: close + 1], authority[close + 1 :]) if close >= 0 else (authority, "")
            port = rest[1:] if rest.startswith(":") else None
            if rest and not rest.startswith(":"):
                return f"invalid WebSocket endpoint `{endpoint}`: invalid port"
        else:
            host, colon, port_text = authority.partition(":")
            port = port_text if colon else None
        if not host or host == "[]":
            return f"invalid WebSocket endpoint `{endpoint}`: missing host"
        if port is not None and _parse_u16(port) is not None:
            return f"invalid WebSocket endpoint `{endpoint}`: invalid port"
        return None
    return f"invalid ZMQ endpoint `{endpoint}`: unsupported scheme `{scheme}`"


def endpoint_failure(req: WorkerRequest, settings: Settings) -> str | None:
    """The first invalid event or replay endpoint (subscribe mode only), as a failure text."""
    if settings.kv_events != "subscribe":
        return None
    zmq_ok = settings.zmq_endpoints
    for r, endpoint in sorted(event_endpoints(req).items()):
        error = validate_endpoint(endpoint, zmq_ok=zmq_ok, allow_ws=True)
        if error is not None:
            return f"invalid kv_events endpoint for worker {req.worker_id} dp_rank {r}: {error}"
        if req.replay_endpoint is not None:
            error = validate_endpoint(req.replay_endpoint, zmq_ok=zmq_ok, allow_ws=False)
            if error is not None:
                return f"invalid replay endpoint for worker {req.worker_id} dp_rank {r}: {error}"
    return None


# core.md §6.7, the worker lifecycle: (from, input) -> to. "decided" is `incomplete` or
# `schedulable`, as the metadata and reconciliation rules find (§6.5); None is "absent".
LIFECYCLE: Final[dict[tuple[str | None, str], str | None]] = {
    (None, "POST"): "decided",
    ("incomplete", "POST"): "decided",
    ("incomplete", "PATCH"): "decided",
    ("unschedulable", "POST"): "decided",
    ("unschedulable", "PATCH"): "decided",
    ("schedulable", "POST"): "decided",
    ("schedulable", "PATCH"): "decided",
    ("incomplete", "DELETE"): "unschedulable",
    ("schedulable", "DELETE"): "unschedulable",
    ("unschedulable", "DELETE"): "unschedulable",
    (None, "PATCH"): None,  # 404
    (None, "DELETE"): None,  # 404
    ("unschedulable", "evict"): None,  # the oldest tombstone beyond max_tombstones
}

# What a reconciliation means for the pools (core.md §6.5): (was schedulable, is schedulable,
# same key and block size) -> the steps, in order. `update` keeps the worker's bookings and index
# on the ranks it keeps; `leave` drops them; `join` adds the worker's ranks afresh.
RECONCILE: Final[dict[tuple[bool, bool, bool], tuple[str, ...]]] = {
    (True, True, True): ("update",),
    (True, True, False): ("leave", "join"),
    (True, False, True): ("leave",),
    (True, False, False): ("leave",),
    (False, True, True): ("join",),
    (False, True, False): ("join",),
    (False, False, True): (),
    (False, False, False): (),
}


class Catalog:
    """Every worker record, deleted ones kept as tombstones (the newest `max_tombstones`).

    Kept with the records, so that reads cost a join and the limits a lookup: each record's
    JSON (what `/ready` and `/workers` splice, and the budget counts), the (model, tenant, worker)
    order, the ids of the non-deleted records of each key, and the schedulable count."""

    def __init__(self, budget: StateBudget, max_tombstones: int) -> None:
        self._budget = budget
        self._max_tombstones = max_tombstones
        self._records: dict[int, WorkerCatalogRecord] = {}
        self._json: dict[int, bytes] = {}
        self._order: list[tuple[str, str, int]] = []
        self._ids_by_key: dict[tuple[str, str], set[int]] = {}
        self._tombstones: OrderedDict[int, None] = OrderedDict()
        self.schedulable = 0
        self._version = 0  # moves with every record written or forgotten
        self._spliced: dict[tuple[bytes, bytes], tuple[int, bytes]] = {}

    def __bool__(self) -> bool:
        return bool(self._records)

    def get(self, worker_id: int) -> WorkerCatalogRecord | None:
        return self._records.get(worker_id)

    def require(self, worker_id: int) -> WorkerCatalogRecord:
        """The worker's record, or 404."""
        record = self._records.get(worker_id)
        if record is None:
            raise NotFound(f"worker {worker_id} not found")
        return record

    def metrics_endpoints(self) -> list[tuple[int, str]]:
        """(worker, metrics_endpoint) of each schedulable worker that has one, to scrape."""
        return [(wid, r.request.metrics_endpoint) for wid, r in sorted(self._records.items())
                if r.request.metrics_endpoint is not None and r.lifecycle == "schedulable"]

    def __getitem__(self, worker_id: int) -> WorkerCatalogRecord:
        return self._records[worker_id]

    def values(self) -> Iterable[WorkerCatalogRecord]:
        return self._records.values()

    def json_size(self, worker_id: int) -> int:
        return len(self._json.get(worker_id, b""))

    def sorted(self) -> list[WorkerCatalogRecord]:
        """Every record in (model, tenant, worker) order."""
        records = self._records
        return [records[wid] for _, _, wid in self._order]

    def records_json(self, model_name: str | None = None, tenant_id: str | None = None) -> list[bytes]:
        """The JSON of each record in (model, tenant, worker) order, filtered by key."""
        order, cached = self._order, self._json
        if model_name is None:
            return [cached[wid] for m, t, wid in order if tenant_id is None or t == tenant_id]
        start = bisect.bisect_left(order, (model_name,))
        out = []
        for m, t, wid in order[start:]:
            if m != model_name:
                break
            if tenant_id is None or t == tenant_id:
                out.append(cached[wid])
        return out

    def records_json_of(self, worker_id: int) -> bytes:
        """One record's JSON (the worker is in the catalog)."""
        return self._json[worker_id]

    def spliced(self, head: bytes, tail: bytes) -> bytes:
        """`head`, every record's JSON in order and comma-separated, `tail`: the body of `/ready`
        or of an unfiltered `/workers`. Kept until the catalog changes, so that a probe asking
        again gets the same bytes instead of a fresh copy of tens of megabytes (with 100k
        workers, the copy's page faults alone held the event loop 60-130 ms)."""
        kept = self._spliced.get((head, tail))
        if kept is not None and kept[0] == self._version:
            return kept[1]
        body = b",".join(frame(head, self.records_json(), tail))
        if len(self._spliced) >= 2:  # /ready and /workers; a head that changes replaces the old
            self._spliced.clear()
        self._spliced[(head, tail)] = (self._version, body)
        return body

    def others_in_key(self, key: tuple[str, str], worker_id: int) -> set[int]:
        """The other non-deleted records of `key`."""
        return self._ids_by_key.get(key, set()) - {worker_id}

    def live_keys(self, worker_id: int) -> set[tuple[str, str]]:
        """The keys that would still have a non-deleted record without `worker_id`."""
        return {k for k, ids in self._ids_by_key.items() if ids - {worker_id}}

    def store(self, record: WorkerCatalogRecord, data: bytes) -> None:
        """A record written by POST or PATCH, with `data`, its JSON."""
        wid = record.worker_id
        previous = self._records.get(wid)
        if previous is not None:
            ids = self._ids_by_key.get(previous.key, set())
            ids.discard(wid)
            if not ids:
                self._ids_by_key.pop(previous.key, None)
        self._ids_by_key.setdefault(record.key, set()).add(wid)
        self._tombstones.pop(wid, None)
        self._put(record, data)

    def delete(self, record: WorkerCatalogRecord, data: bytes) -> None:
        """The `unschedulable` record of a DELETE becomes a tombstone; the oldest beyond
        `max_tombstones` are forgotten."""
        wid = record.worker_id
        self._put(record, data)
        ids = self._ids_by_key.get(record.key)
        if ids is not None:
            ids.discard(wid)
            if not ids:
                del self._ids_by_key[record.key]
        self._tombstones[wid] = None
        while len(self._tombstones) > self._max_tombstones:
            oldest, _ = self._tombstones.popitem(last=False)
            self._forget(oldest)

    def _put(self, record: WorkerCatalogRecord, data: bytes) -> None:
        wid = record.worker_id
        old = self._records.get(wid)
        if old is not None and old.lifecycle == "schedulable":
            self.schedulable -= 1
        if old is not None and old.key != record.key:
            del self._order[bisect.bisect_left(self._order, (*old.key, wid))]
        if old is None or old.key != record.key:
            bisect.insort(self._order, (*record.key, wid))
        if record.lifecycle == "schedulable":
            self.schedulable += 1
        self._budget.record_bytes += len(data) - len(self._json.get(wid, b""))
        self._json[wid] = data
        self._records[wid] = record
        self._version += 1

    def _forget(self, worker_id: int) -> None:
        old = self._records.pop(worker_id)
        if old.lifecycle == "schedulable":
            self.schedulable -= 1
        del self._order[bisect.bisect_left(self._order, (*old.key, worker_id))]
        self._budget.record_bytes -= len(self._json.pop(worker_id))
        self._version += 1


def frame(head: bytes, items: list[bytes], tail: bytes) -> list[bytes]:
    """`items` with `head` glued to the first and `tail` to the last, for one `b",".join`."""
    if not items:
        return [head + tail]
    items[0] = head + items[0]
    items[-1] = items[-1] + tail
    return items
