"""A worker's record moving through the catalog and the pools (core.md §6.5-§6.7): the checks an
upsert must pass, the lifecycle it earns, and what `RECONCILE` says the pools must do: a worker
joins a pool (creating it), leaves one (deleting the last), or changes in place. Deleting makes a
tombstone. Subscriptions follow the ranks that have an endpoint."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from .base import jsonio
from .base.budget import StateBudget
from .base.errors import BadRequest, NotReady
from .base.metrics import Metrics
from .base.outputs import Notice, OutputEvent
from .base.settings import Settings
from .base.types import WorkerCatalogRecord, WorkerRequest
from .cache.index import Rank
from .fleet.catalog import (
    RECONCILE,
    TOPOLOGY_PREFIX,
    Catalog,
    dp_range,
    effective_taints,
    endpoint_failure,
    event_endpoints,
    missing_metadata,
)
from .fleet.limits import Limits
from .fleet.pool import Key, Pool, key_label
from .intake.streams import Streams
from .routing.selection import Selector

__all__ = ["Workers"]


class Workers:
    """Upserts and deletes of workers, applied to the catalog, the pools and the streams."""

    __slots__ = ("_settings", "_metrics", "_limits", "_budget", "_catalog", "_pools", "_streams",
                 "_selector", "_outbox")

    def __init__(self, settings: Settings, metrics: Metrics, limits: Limits, budget: StateBudget,
                 catalog: Catalog, pools: dict[Key, Pool], streams: Streams, selector: Selector,
                 outbox: deque[OutputEvent]) -> None:
        self._outbox = outbox
        self._settings = settings
        self._budget = budget
        self._metrics = metrics
        self._limits = limits
        self._catalog = catalog
        self._pools = pools
        self._streams = streams
        self._selector = selector

    def _check(self, req: WorkerRequest) -> None:
        """What refuses an upsert outright (400, 409, 503): nothing has changed yet."""
        if self._selector.journal is not None:
            self._selector.journal.check_catalog_write()
        for taint in req.taints:
            if taint.startswith(TOPOLOGY_PREFIX):
                raise BadRequest(f"taint `{taint}` uses the reserved prefix dynamo.topology/; "
                                 "use topology_domains instead")
        limits = self._limits
        limits.dp_size(req.data_parallel_size)
        limits.id_length("model_name", req.model_name)
        limits.id_length("tenant_id", req.tenant_id)
        if self._settings.kv_events == "subscribe":
            limits.subscriptions(self._streams.subscriptions_except(req.worker_id)
                                 + len(event_endpoints(req)))
        key = (req.model_name, req.tenant_id)
        others = self._catalog.others_in_key(key, req.worker_id)
        if not others:
            live_keys = self._catalog.live_keys(req.worker_id)
            if key not in live_keys:
                limits.keys(len(live_keys) + 1)
        limits.workers_per_key(key, len(others) + 1)

    def _lifecycle(self, req: WorkerRequest) -> tuple[str, tuple[str, ...]]:
        """`schedulable`, or `incomplete` with the reasons (core.md §6.7)."""
        reasons = missing_metadata(req, self._settings)
        if reasons:
            return "incomplete", tuple(reasons)
        key = (req.model_name, req.tenant_id)
        pool = self._pools.get(key)
        # A pool without workers holds an index recovered from a peer: its block size stands.
        if pool is not None and pool.block_size != req.block_size and (
            not pool.workers or any(w != req.worker_id for w in pool.workers)
        ):
            return "incomplete", (
                f"reconciliation failed: block_size mismatch for {key_label(key)}: "
                f"existing={pool.block_size} requested={req.block_size}",
            )
        if pool is not None and any(w != req.worker_id for w in pool.workers) \
                and pool.eagle != bool(req.is_eagle):
            return "incomplete", (
                f"reconciliation failed: is_eagle mismatch for {key_label(key)}: "
                f"existing={str(pool.eagle).lower()} requested={str(bool(req.is_eagle)).lower()}",
            )
        failure = endpoint_failure(req, self._settings)
        if failure is not None:
            return "incomplete", (f"reconciliation failed: {failure}",)
        return "schedulable", ()

    def reconcile(self, req: WorkerRequest, previous: WorkerCatalogRecord | None, now: float
                  ) -> WorkerCatalogRecord:
        """Store `req` as the worker's record and move the pools as `RECONCILE` says."""
        self._check(req)
        lifecycle, reasons = self._lifecycle(req)
        record = WorkerCatalogRecord(request=req, lifecycle=lifecycle,  # type: ignore[arg-type]
                                     not_schedulable_reasons=reasons)
        encoded = jsonio.dumps(record.to_json())
        self._limits.record_bytes(len(encoded))
        if len(encoded) > self._catalog.json_size(req.worker_id):
            self._limits.state_budget(f"worker {req.worker_id}")
        was = previous is not None and previous.lifecycle == "schedulable"
        same_pool = (previous is not None and previous.key == record.key
                     and previous.request.block_size == req.block_size)
        for step in RECONCILE[(was, lifecycle == "schedulable", same_pool)]:
            if step == "update":
                assert previous is not None
                self._update_in_place(previous, record, now)
            elif step == "leave":
                assert previous is not None
                self._leave(previous, now)
            else:
                self._join(record, now)
        self._catalog.store(record, encoded)
        if self._selector.journal is not None:
            self._selector.journal.worker(req)
        self._outbox.append(Notice("worker_registered" if previous is None else "worker_replaced", (
            ("worker_id", req.worker_id), ("model_name", req.model_name), ("tenant_id", req.tenant_id),
            ("lifecycle", lifecycle), *((("was", previous.lifecycle),) if previous is not None else ()),
            *((("reasons", list(reasons)),) if reasons else ()))))
        self._selector.dispatch(self._pools.get(record.key), now)
        if previous is not None and previous.key != record.key:
            self._selector.dispatch(self._pools.get(previous.key), now)
        return record

    def delete(self, worker_id: int, now: float) -> WorkerCatalogRecord:
        """The worker becomes a tombstone (`unschedulable`); raises NotFound."""
        previous = self._catalog.require(worker_id)
        if previous.lifecycle == "unschedulable":
            return previous
        journal = self._selector.journal
        if journal is not None:
            journal.check_catalog_write()
            journal.worker_deleted(previous.request)
        if previous.lifecycle == "schedulable":
            self._leave(previous, now)
            self._selector.dispatch(self._pools.get(previous.key), now)
        record = WorkerCatalogRecord(request=previous.request, lifecycle="unschedulable")
        self._catalog.delete(record, jsonio.dumps(record.to_json()))
        self._outbox.append(Notice("worker_removed", (("worker_id", worker_id), ("was", previous.lifecycle))))
        return record

    def _subscribe(self, pool: Pool, rank: Rank, endpoint: str | None, req: WorkerRequest) -> None:
        if self._settings.kv_events == "subscribe" and endpoint:
            # The worker's one replay socket serves its one rank (an engine per rank has its own).
            replay = req.replay_endpoint if len(dp_range(req)) == 1 else None
            self._streams.subscribe(rank, pool.key, endpoint, replay)

    def _join(self, record: WorkerCatalogRecord, now: float) -> None:
        req = record.request
        pool = self._pools.get(record.key)
        if pool is None:
            assert req.block_size is not None
            pool = self._pools[record.key] = Pool(record.key, req.block_size, now, self._settings,
                                                  self._budget)
        ranks = tuple((req.worker_id, r) for r in dp_range(req))
        pool.set_worker(req.worker_id, ranks, effective_taints(req), req.role)
        pool.eagle = bool(req.is_eagle)  # its other workers agree (`_lifecycle`)
        pool.speeds.set(req.worker_id, req.prefill_tokens_per_sec, req.total_kv_blocks)
        endpoints = event_endpoints(req)
        for rank in ranks:
            pool.add_rank(rank)
            self._subscribe(pool, rank, endpoints.get(rank[1]), req)

    def _drop_ranks(self, pool: Pool, ranks: Iterable[Rank], now: float) -> None:
        gone = set(ranks)
        dropped = pool.drop_ranks(gone, now)
        if dropped:
            self._metrics.booking(pool.key, "dropped", len(dropped))
        for rank in sorted(gone):
            self._streams.unsubscribe(rank)

    def _leave(self, record: WorkerCatalogRecord, now: float) -> None:
        pool = self._pools.get(record.key)
        if pool is None:
            return
        self._drop_ranks(pool, pool.remove_worker(record.worker_id), now)
        pool.speeds.forget(record.worker_id)
        self._streams.end_pushes(record.worker_id, f"worker {record.worker_id} is no longer schedulable")
        if not pool.workers:
            del self._pools[record.key]
            pool.sessions.close()
            self._selector.fail_queue(pool, NotReady(f"no schedulable workers for {pool.label}"),
                                      "failed", now)

    def _update_in_place(self, previous: WorkerCatalogRecord, record: WorkerCatalogRecord,
                         now: float) -> None:
        pool = self._pools[record.key]
        req = record.request
        wid = req.worker_id
        old_ranks = pool.workers.get(wid, ())
        new_ranks = tuple((wid, r) for r in dp_range(req))
        old_set, new_set = set(old_ranks), set(new_ranks)
        self._drop_ranks(pool, [r for r in old_ranks if r not in new_set], now)
        pool.set_worker(wid, new_ranks, effective_taints(req), req.role)
        pool.eagle = bool(req.is_eagle)
        pool.speeds.set(wid, req.prefill_tokens_per_sec, req.total_kv_blocks)
        old_endpoints = event_endpoints(previous.request)
        new_endpoints = event_endpoints(req)
        subscribe = self._settings.kv_events == "subscribe"
        for rank in new_ranks:
            if rank not in old_set:
                pool.add_rank(rank)
                self._subscribe(pool, rank, new_endpoints.get(rank[1]), req)
            elif subscribe and (old_endpoints.get(rank[1]) != new_endpoints.get(rank[1])
                                or previous.request.replay_endpoint != req.replay_endpoint):
                pool.reset_rank_events(rank)
                self._streams.unsubscribe(rank)
                self._subscribe(pool, rank, new_endpoints.get(rank[1]), req)
