"""`SelectionService`, the facade: it composes the components, keeps the clock guard, and offers
the typed methods of core.md §4.2 and `handle`, the bytes codec around them.

Each component owns one concept (see `core/__init__.py`): `Workers` moves records through the
catalog and the pools, `Selector` selects, books and queues, `Ingest` applies KV events, `Streams`
keeps their sources, `Limits` refuses and counts. They share the catalog, the pools, the tickets
and the outbox; the facade only orders the calls. Nothing here reads a clock: time arrives as
`now`; randomness comes only from the injected `random.Random`."""

from __future__ import annotations

import math
import random
import traceback
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import attrs

from .base.budget import StateBudget
from .base.deferred import Deferred
from .base.errors import Conflict, NotReady, SelectionError, StreamError
from .base.metrics import Metrics
from .base.outputs import InternalError, OutputEvent
from .base.responses import (
    ApplyReport,
    ModelLoadResponse,
    OverlapScoresResponse,
    Pending,
    PotentialLoad,
    ReadyResponse,
    ReservationResponse,
    SelectResponse,
    StatusOk,
)
from .base.routes import ParsedBody
from .base.settings import Settings
from .base.types import (
    OverlapScoresRequest,
    PotentialLoadsRequest,
    ReservationRequest,
    SelectAndReserveRequest,
    SelectPdRequest,
    SelectRequest,
    WorkerCatalogRecord,
    WorkerPatchRequest,
    WorkerRequest,
)
from .base.wire import Response
from .bookings.tracking import KeyedTracking
from .cache.engine_metrics import EngineMetrics, EngineSample
from .cache.events import KvEvent
from .fleet.admission import Tickets
from .fleet.catalog import Catalog
from .fleet.journal import LedgerSettings
from .fleet.limits import Limits
from .fleet.pool import Key, Pool
from .handler import handle as handle_request
from .intake.ingest import Ingest
from .intake.snapshot import dump_of, parse_dump, parse_peer_index
from .intake.streams import DecodedMessage, Streams
from .ledger import Ledger
from .readouts import gauges, kv_routing, loads, overlap_scores, potential_loads
from .routing.pd import PlanResponse
from .routing.selection import SHUTTING_DOWN, Selector
from .workers import Workers

__all__ = ["SelectionService"]

_PATCH_FIELDS: Final = tuple(f.name for f in attrs.fields(WorkerPatchRequest))


class SelectionService:
    """The Sans-IO selection service (core.md §4.2 has the method table). `catalog` and `pools` may
    be read; only the service writes them. Run `deferred` once answers are written (deferred.py)."""

    def __init__(self, settings: Settings | None = None, rng: random.Random | None = None,
                 tracking_key: bytes | None = None, log_decisions: bool = False) -> None:
        """`tracking_key`: the 32-byte provider key of `router_tracking_hash=keyed-xxh3-v1`;
        `log_decisions`: a debug `Notice` output for every choice made."""
        self.settings = s = settings if settings is not None else Settings()
        self.rng = rng if rng is not None else random.Random(0)
        self.metrics = Metrics()
        self.budget = StateBudget(s.max_state_bytes)
        keyed = s.router_tracking_hash == "keyed-xxh3-v1"
        if keyed != (tracking_key is not None):
            raise ValueError("keyed-xxh3-v1 requires router_tracking_key_file" if keyed else
                             "router tracking key options require router_tracking_hash=keyed-xxh3-v1")
        tracking = (KeyedTracking(tracking_key, s.router_tracking_key_id or "") if tracking_key is not None
                    else None)
        self.limits = Limits(s, self.metrics, self.budget, tracking)
        self.catalog = Catalog(self.budget, s.max_tombstones)
        self._pools: dict[Key, Pool] = {}
        self._outbox: deque[OutputEvent] = deque()
        self._tickets = tickets = Tickets()
        self._streams = Streams(self._pools, self._outbox)
        self.deferred = Deferred(self.internal_error)
        self.engines = EngineMetrics()  # what each engine's metrics_endpoint last reported
        self._selector = Selector(s, self.rng, self.metrics, self.limits, self.catalog, self._pools,
                                  tickets, self._outbox, self.internal_error, self.deferred, self.engines)
        self.ledger: Ledger | None = None  # the mirror of a ledger shared with replicas (`share`)
        self._selector.log_decisions = log_decisions
        self._workers = Workers(s, self.metrics, self.limits, self.budget, self.catalog, self._pools,
                                self._streams, self._selector, self._outbox)
        self._ingest = Ingest(s, self.metrics, self.limits, self.budget, self.catalog, self._pools,
                              tickets, self._outbox, self._selector.prefills_ended)
        self._now = -math.inf
        self._shutting_down = False
        self._draining = False  # marked not ready, still serving (`begin_drain`)
        self.recovered_from: str | None = None  # the peer this service started from (`recover`)

    def share(self, settings: LedgerSettings, origin: str) -> Ledger:
        """Share bookings and catalog through a ledger (docs/REPLICATION.md), fed and drained by the transport."""
        self.ledger = Ledger(settings, origin, pools=self._pools, catalog=self.catalog,
                             selector=self._selector, metrics=self.metrics, tickets=self._tickets,
                             outbox=self._outbox, upsert=self.upsert_worker, delete=self.delete_worker,
                             rerun=lambda request, now: self.handle(*request, now=now), deferred=self.deferred)
        return self.ledger

    @property
    def pools(self) -> Mapping[Key, Pool]:
        """The pool of each key with a schedulable worker."""
        return self._pools

    # -- time and outputs ------------------------------------------------------------------------

    def _advance(self, now: float) -> float:
        """The clock guard (time never runs backwards inside the service), after deferred work."""
        self.deferred.run()
        if now > self._now:
            self._now = now
        return self._now

    def next_output(self) -> OutputEvent | None:
        """The next output for the caller (held answers, subscription changes, closes, errors), or None."""
        self.deferred.run()  # (a deferred free may let queued selections run)
        return self._outbox.popleft() if self._outbox else None

    def tick(self, now: float) -> None:
        """Let time pass to `now` (call it at `next_deadline()`): the next step of a request applied in
        steps, bookings past `active_request_expiry_secs` expired, queued selections timed out or run."""
        now = self._advance(now)
        if self._ingest.stepping:
            self._ingest.step(now)
        for pool in list(self._pools.values()):
            if pool.predictions is not None:
                pool.predictions.expire(now)
            if self._selector.expire(pool, now):
                self._selector.dispatch(pool, now)
            self._selector.expire_queue(pool, now)
            self._selector.dispatch(pool, now)

    def next_deadline(self) -> float | None:
        """The earliest `now` at which `tick` has work: a booking expiry or a queue timeout, or at
        once while a request is applied in steps."""
        self.deferred.run()
        deadlines = [d for pool in self._pools.values() if (d := pool.next_deadline(self.settings)) is not None]
        if self._ingest.stepping:
            deadlines.append(self._now)
        return min(deadlines) if deadlines else None

    def begin_drain(self, *, now: float) -> None:
        """`/ready` and `/readyz` answer 503 while serving goes on (`--drain-delay-secs`)."""
        self._advance(now)
        self._draining = True

    def begin_shutdown(self, *, now: float) -> None:
        """Stop taking work: accepted events are applied and answered, push streams get close 1001,
        queued selections 503, and later selections and bookings 503."""
        now = self._advance(now)
        self._shutting_down = self._selector.stopping = True
        self._ingest.step(now, until_done=True)
        self._streams.end_pushes(None, "server shutting down")
        for pool in self._pools.values():
            self._selector.fail_queue(pool, NotReady(SHUTTING_DOWN), "shutdown", now)

    # -- health, readiness and the catalog -----------------------------------------------------

    def health(self) -> StatusOk:
        """Liveness: always `{"status": "ok"}`."""
        return StatusOk()

    def serving(self) -> bool:
        """`/readyz`: the process takes traffic (not draining, not shutting down), workers or not."""
        return not (self._draining or self._shutting_down)

    def ready(self, *, now: float) -> ReadyResponse:
        """Readiness (core.md §6.8) with every record in (model, tenant, worker) order."""
        ready, count = self.readiness(now=now)
        return ReadyResponse(ready=ready, schedulable_workers=count, workers=tuple(self.catalog.sorted()),
                             recovered_from=self.recovered_from, details=tuple(self.ready_details()))

    def ready_details(self) -> list[str]:
        """Beside readiness: subscriptions that cannot reach their engine, and the ledger's state."""
        return self._streams.failing() + (self.ledger.details() if self.ledger is not None else [])

    def readiness(self, *, now: float) -> tuple[bool, int]:
        """(ready, schedulable workers): `ready()` without building the worker list."""
        self._advance(now)
        count = self.catalog.schedulable
        return count > 0 and self.serving() and (self.ledger is None or self.ledger.ready()), count

    def list_workers(self, model_name: str | None = None, tenant_id: str | None = None) -> list[WorkerCatalogRecord]:
        """The catalog's records in (model, tenant, worker) order, filtered by key."""
        return [r for r in self.catalog.sorted()
                if (model_name is None or r.key[0] == model_name)
                and (tenant_id is None or r.key[1] == tenant_id)]

    def upsert_worker(self, req: WorkerRequest, *, now: float) -> WorkerCatalogRecord:
        """Register or replace a worker (core.md §6.5); raises SelectionError (400, 409, 507)."""
        return self._workers.reconcile(req, self.catalog.get(req.worker_id), self._advance(now))

    def patch_worker(self, worker_id: int, patch: WorkerPatchRequest, *, now: float
                     ) -> WorkerCatalogRecord:
        """Change the given members of a worker's record and reconcile it; raises NotFound, or as
        `upsert_worker`."""
        now = self._advance(now)
        previous = self.catalog.require(worker_id)
        changes = {n: getattr(patch, n) for n in _PATCH_FIELDS if getattr(patch, n) is not None}
        merged = attrs.evolve(previous.request, **changes) if changes else previous.request
        return self._workers.reconcile(merged, previous, now)

    def delete_worker(self, worker_id: int, *, now: float) -> WorkerCatalogRecord:
        """Make a worker `unschedulable`: its ranks, bookings and push streams go, its record stays as
        a tombstone. Raises NotFound."""
        return self._workers.delete(worker_id, self._advance(now))

    # -- selections and bookings ---------------------------------------------------------------

    def select(self, req: SelectRequest, *, now: float) -> SelectResponse | Pending:
        """Pick a rank for a prompt (core.md §9.7) without booking it; a `Pending` when it was queued."""
        return self._selector.select(req, self._advance(now), reserve=False)

    def select_and_reserve(self, req: SelectAndReserveRequest, *, now: float) -> SelectResponse | Pending:
        """Pick a rank and book the prompt on it under `reservation_id` (drawn from the seeded
        generator when absent); a `Pending` when it was queued."""
        return self._selector.select(req, self._advance(now), reserve=True)

    def plan(self, req: SelectPdRequest, *, now: float) -> PlanResponse:
        """A prefill/decode plan (docs/PD.md); a `SelectPdAndReserveRequest` books both legs or neither."""
        return self._selector.plan(req, self._advance(now))

    def release_plan(self, plan_id: str, *, end: bool, model_name: str | None = None, tenant_id: str | None = None,
                     now: float) -> list[str]:
        """The handoff (the prefill leg ends) or with `end` the end of a plan (both); idempotent: what ended."""
        return self._selector.release_plan(plan_id, model_name, tenant_id, self._advance(now), end=end)

    def cancel(self, ticket: int, *, now: float) -> bool:
        """The client went away: forget its pending selection; no SelectionReady follows."""
        self._advance(now)
        return self._selector.cancel(ticket)

    def reserve(self, req: ReservationRequest, *, now: float) -> ReservationResponse:
        """Book a prompt on a given rank (`POST /reservations`); raises SelectionError."""
        return self._selector.reserve(req, self._advance(now))

    def prefill_complete(self, reservation_id: str, *, model_name: str | None = None, tenant_id: str | None = None,
                         cached_tokens: int | None = None, now: float) -> None:
        """The booking's prefill is done: its prefill tokens stop counting. `cached_tokens`: what
        the engine found cached, for the verdict (verdict.py). Raises NotFound."""
        now = self._advance(now)
        pool = self._selector.finish_booking(reservation_id, model_name, tenant_id, now, free=False,
                                             cached_tokens=cached_tokens)
        self._selector.dispatch(pool, now)

    def free(self, reservation_id: str, *, model_name: str | None = None,
             tenant_id: str | None = None, cached_tokens: int | None = None, now: float) -> None:
        """End a booking: its load goes, and queued selections may run. Raises NotFound."""
        now = self._advance(now)
        pool = self._selector.finish_booking(reservation_id, model_name, tenant_id, now, free=True,
                                             cached_tokens=cached_tokens)
        self._selector.dispatch(pool, now)

    def kv_routing(self, worker_id: int, *, now: float) -> dict[str, Any]:
        """Is KV routing working for the worker: its verdict (verdict.py). Raises NotFound."""
        return kv_routing(self.catalog.require(worker_id), self._pools, self.settings, self._advance(now))

    def engine_scraped(self, worker_id: int, sample: EngineSample | None, error: str | None, *, now: float) -> None:
        """A scrape of the worker's `metrics_endpoint`: its sample (`engine_metrics.parse`) or why not."""
        self.engines.record(worker_id, sample, error, self._advance(now))

    def output_block(self, reservation_id: str, decay_fraction: float | None = None, *, now: float) -> None:
        """One more decode block for a booking, optionally re-weighing its output and unshared
        prompt blocks (1.6.1's `output_block`). Raises BadRequest (range), NotFound."""
        self._advance(now)
        self._selector.output_block(reservation_id, decay_fraction)

    def loads(self, model_name: str | None = None, tenant_id: str | None = None) -> list[ModelLoadResponse]:
        """Each key's per-rank load and its queue, filtered by key."""
        self.deferred.run()
        return loads(self._pools, model_name, tenant_id, self.engines, self._now)

    def potential_loads(self, req: PotentialLoadsRequest, *, now: float) -> list[PotentialLoad]:
        """What each rank's load would be if the prompt ran there (no booking)."""
        now = self._advance(now)
        pool = self._selector.gate(req.model_name, req.tenant_id, now)
        return potential_loads(pool, self.limits.prompt(req, pool), req.router_config_override, self.settings)

    def overlap_scores(self, req: OverlapScoresRequest, *, now: float) -> OverlapScoresResponse:
        """Cached blocks per rank and tier for a prompt, with each rank's freshness (events.md §6)."""
        now = self._advance(now)
        pool = self._selector.gate(req.model_name, req.tenant_id, now)
        return overlap_scores(pool, self.limits.prompt(req, pool), self.settings, now)

    # -- KV events -----------------------------------------------------------------------------

    def check_push_mode(self) -> None:
        """409 unless KV events may be pushed in this mode (events.md §7.1)."""
        self._ingest.check_push_mode()

    def apply_kv_events(self, events: Sequence[KvEvent], *, now: float, worker_id: int | None = None,
                        dp_rank: int | None = None, model_name: str | None = None,
                        tenant_id: str | None = None) -> ApplyReport:
        """Apply decoded JSON events (`POST /kv_events`); every check runs before the first event."""
        return self._ingest.apply_events(events, (worker_id, dp_rank, model_name, tenant_id),
                                         self._advance(now))

    def begin_kv_events(self, events: Sequence[KvEvent], *, now: float, worker_id: int | None = None,
                        dp_rank: int | None = None, model_name: str | None = None,
                        tenant_id: str | None = None) -> ApplyReport | Pending:
        """`apply_kv_events`, but over `max_events_per_step` events they go that many at a time by
        `tick` (due at once): a `Pending`, answered by a `SelectionReady` with the whole report.
        Every check runs before the first event; a worker that leaves fails the rest of its events."""
        return self._ingest.begin(events, (worker_id, dp_rank, model_name, tenant_id), self._advance(now))

    def apply_engine_batch(self, payload: bytes, *, worker_id: int | None, dp_rank: int | None = None,
                           seq: int | None = None, stream: int | None = None, now: float,
                           model_name: str | None = None, tenant_id: str | None = None) -> ApplyReport:
        """Apply one msgpack `KVEventBatch` (`POST /kv_events` with a msgpack body)."""
        now = self._advance(now)
        self._ingest.check_push_mode()
        return self._ingest.engine_batch(payload, worker_id, dp_rank, seq, None, model_name, tenant_id, now)

    def open_event_stream(self, worker_id: int, dp_rank: int = 0, *, model_name: str | None = None,
                          tenant_id: str | None = None, now: float) -> int:
        """Bind an inbound push stream (after the WebSocket handshake); raises SelectionError."""
        self._advance(now)
        self._ingest.check_push_mode()
        pool, rank = self._ingest.bind(worker_id, dp_rank, model_name, tenant_id)
        return self._streams.open_push((worker_id, dp_rank), pool.key)

    def stream_message(self, stream: int, data: bytes | str | DecodedMessage | SelectionError, *,
                       seq: int | None = None, now: float, start: int = 0,
                       stop: int | None = None) -> ApplyReport:
        """One message of a stream: text is JSON events, bytes one engine batch, or what
        `decode_stream_message` made of either (maybe in a thread). `start`/`stop`: only those
        events (a large message applied in slices). A push stream that must be closed raises
        StreamError; a subscription drops and counts bad messages."""
        now = self._advance(now)
        source = self._streams.get(stream)
        if source is None:
            raise StreamError(1008, "stream is not open")
        return self._ingest.stream_message(source, data, seq, now, start, stop)

    def stream_position(self, stream: int) -> int | None:
        """The last seq applied for the stream's rank (from any stream of it), for a sender that
        resumes where the index stands (`resume=true`); None when none was seen."""
        fresh = self._streams.freshness(stream)
        return fresh.last_seq if fresh is not None else None

    def close_event_stream(self, stream: int, *, now: float) -> None:
        """The inbound WebSocket closed."""
        self._advance(now)
        source = self._streams.get(stream)
        if source is not None:
            self._streams.move(source, "closed")

    def subscription_state(self, stream: int, connected: bool, *, now: float, engine_gone: bool = False) -> None:
        """An outbound subscription connected or was lost; `engine_gone`: the engine closed the
        connection, so its process went away, and its cache with it (`Ingest.engine_gone`)."""
        self._advance(now)
        source = self._streams.get(stream)
        if source is not None and source.kind == "subscription":
            if engine_gone:
                self._ingest.engine_gone(source)
            self._streams.move(source, "connected" if connected else "lost")

    def stream_dropped(self, stream: int, reason: str) -> None:
        """A transport or adapter dropped a message of `stream` before it reached the core (a
        framing it could not read): counted under the stream's key."""
        source = self._streams.get(stream)
        self.metrics.kv_dropped(source.key if source is not None else ("", ""), reason)

    def subscription_failed(self, stream: int, *, now: float) -> None:
        """An outbound subscription could not connect or ended: its rank's index may be missing
        events from now on (stale) until a `cleared` or a continuous stream proves otherwise."""
        self.subscription_state(stream, False, now=now)
        source, fresh = self._streams.get(stream), self._streams.freshness(stream)
        if source is not None:
            source.failing = True
        if fresh is not None:
            fresh.mark_stale()

    # -- dump ----------------------------------------------------------------------------------

    def dump(self, model_name: str | None = None, tenant_id: str | None = None) -> dict[str, Any]:
        """A replayable snapshot of catalog and index (api.md §7), filtered by key."""
        self.deferred.run()
        indexes = {k: (p.block_size, p.index) for k, p in self._pools.items()}
        return dump_of(self.catalog.sorted(), indexes, model_name, tenant_id)

    def restore(self, dump: Any, *, now: float) -> None:
        """Replay a `/dump` into this empty service (api.md §7): validated whole first."""
        now = self._advance(now)
        if self.catalog:
            raise Conflict("restore needs an empty catalog")
        plan = parse_dump(dump)
        for req in plan.workers:
            self.upsert_worker(req, now=now)
        self._ingest.replay(plan.events, now)

    def recover(self, dump: Any, source: str, *, now: float) -> None:
        """Start warm from a peer's `/dump` (`--indexer-peers`): ours is restored whole (catalog
        and index); 1.6.1's fills each partition's index before its workers register here (they
        must then use its block size). Validated whole first; raises SelectionError."""
        now = self._advance(now)
        if isinstance(dump, dict) and "format" in dump:
            self.restore(dump, now=now)
        else:
            partitions = parse_peer_index(dump)
            if self._pools or self.catalog:
                raise Conflict("recovery needs an empty service")
            if len(partitions) > self.settings.max_keys:
                raise Conflict(f"key limit reached: at most {self.settings.max_keys} model/tenant keys")
            self._ingest.seed(partitions, now)
        self.recovered_from = source

    # -- metrics -------------------------------------------------------------------------------

    def internal_error(self, where: str) -> None:
        """Count the exception being handled and queue its traceback for the transport to log.
        Call it from an `except` block: the caller answers (500, close 1011, -32603)."""
        self.metrics.internal_error(where)
        self._outbox.append(InternalError(where, traceback.format_exc()))

    def observe(self, family: str, labels: Sequence[str], value: float) -> None:
        """Transports report timings and connection counts here (api.md §5.3)."""
        self.metrics.record(family, tuple(labels), value)

    def metrics_text(self, *, now: float) -> str:
        """The Prometheus text exposition (api.md §5)."""
        self._advance(now)
        if self.ledger is not None:
            self.ledger.report()
        return self.metrics.render(gauges(self.catalog.values(), self._pools, self.budget,
                                          self._selector.pending, self.settings, now, self.engines))

    # -- bytes ---------------------------------------------------------------------------------

    def handle(self, method: str, path: str, query: str, headers: Iterable[tuple[str, str]],
               body: bytes | ParsedBody, *, now: float) -> Response | Pending:
        """Answer one HTTP-shaped request with `Response(status, headers, body)`; never raises.
        `body` may be a `ParsedBody` when the caller has parsed the JSON already."""
        if self.ledger is None:
            return handle_request(self, method, path, query, headers, body, now)
        self.deferred.run()  # before the request begins: its answer waits for its own ledger writes only
        request = (method, path, query, tuple(headers), body)
        self.ledger.begin_request()
        return self.ledger.held(request, handle_request(self, *request, now), now)

