"""`SelectionService`: the catalog, the per-key state and every operation of api.md (core.md §4).

The typed methods hold the logic; `handle` is a thin bytes codec around them, so every adapter
answers identically. Nothing here reads a clock: time arrives as `now`; randomness comes only
from the injected `random.Random`.
"""

from __future__ import annotations

import math
import random
import traceback
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Final

import attrs

from .._version import __version__
from . import jsonio
from .admission import QueuedSelection, order_key
from .budget import InsufficientStorage, StateBudget
from .catalog import (
    RECONCILE,
    TOPOLOGY_PREFIX,
    Catalog,
    dp_range,
    effective_taints,
    endpoint_failure,
    event_endpoints,
    missing_metadata,
)
from .cost import NO_OVERRIDE, Scored, choose, effective_blocks, explain, score
from .engine import EngineBatch, NamespaceMemory, convert
from .errors import (
    BadRequest,
    Conflict,
    Internal,
    InvalidJson,
    NotFound,
    NotReady,
    SelectionError,
    ShapeError,
    StreamError,
    TooManyRequests,
    Unprocessable,
)
from .events import Event, require_worker
from .freshness import GAP, Break, RankFreshness
from .handler import handle as handle_request
from .index import LOWER_TIERS, IndexError_, Rank
from .metrics import Metrics
from .outputs import (
    CloseEventStream,
    InternalError,
    OutputEvent,
    SelectionReady,
    SubscribeKvEvents,
    UnsubscribeKvEvents,
)
from .pool import Key, Pool, key_label
from .prompt import PromptHashes, PromptTooLong, booking_prompt, selection_prompt
from .routes import ParsedBody
from .settings import Settings
from .snapshot import dump_of, parse_dump
from .streams import DecodedMessage, EventSource, decode_engine_batch, decode_stream_message
from .tally import Tally
from .tracker import DuplicateReservation, rank_text
from .types import (
    ApplyReport,
    Excluded,
    ModelLoadResponse,
    OverlapScoresRequest,
    OverlapScoresResponse,
    Pending,
    PotentialLoad,
    PotentialLoadsRequest,
    ReadyResponse,
    ReservationRequest,
    ReservationResponse,
    RouterConfigOverride,
    SelectAndReserveRequest,
    SelectRequest,
    SelectResponse,
    StatusOk,
    WorkerCatalogRecord,
    WorkerPatchRequest,
    WorkerRequest,
)
from .wire import Response, error_response, json_response

__all__ = ["SelectionService"]

SHUTTING_DOWN: Final = "selection service is shutting down"
_PATCH_FIELDS: Final = tuple(f.name for f in attrs.fields(WorkerPatchRequest))


WORKER_LEFT: Final = "Failed to apply event: its worker left while the request was applied"


class _EventJob:
    """A `POST /kv_events` applied in steps: its events, bound a step at a time, then applied."""

    __slots__ = ("ticket", "events", "target", "bound", "done", "tally")

    def __init__(self, ticket: int, events: list[Event],
                 target: tuple[int | None, int | None, str | None, str | None]) -> None:
        self.ticket = ticket
        self.events = events
        self.target = target  # the request's worker_id, dp_rank, model_name, tenant_id
        self.bound: list[tuple[Event, Pool, Rank]] = []
        self.done = 0  # events applied (or failed) so far
        self.tally = Tally(len(events))


STATE_BUDGET_EXHAUSTED: Final = IndexError_("Failed to apply event: state budget exhausted", "state_budget")


class SelectionService:
    """The Sans-IO selection service. See core.md §4.2 for the method table."""

    def __init__(self, settings: Settings | None = None, rng: random.Random | None = None) -> None:
        self.settings = settings if settings is not None else Settings()
        self.rng = rng if rng is not None else random.Random(0)
        self.metrics = Metrics()
        self.budget = StateBudget(self.settings.max_state_bytes)
        self._records = Catalog(self.budget, self.settings.max_tombstones)
        self._keys: dict[Key, Pool] = {}
        self._subscriptions: dict[Rank, tuple[int, str]] = {}  # rank -> (stream, endpoint)
        self._streams: dict[int, EventSource] = {}
        self._next_stream = 1
        self._outputs: deque[OutputEvent] = deque()
        self._now = -math.inf
        self._shutting_down = False
        self._next_ticket = 1
        self._tickets: dict[int, Key] = {}  # pending ticket -> its key
        self._dispatching = False
        self._event_jobs: deque[_EventJob] = deque()

    # -- time and outputs ------------------------------------------------------------------------

    def _advance(self, now: float) -> float:
        if now > self._now:
            self._now = now
        return self._now

    def next_output(self) -> OutputEvent | None:
        """The next output event for the caller to act on (answers of queued selections, subscription
        changes, stream closes, internal errors), or None."""
        return self._outputs.popleft() if self._outputs else None

    def tick(self, now: float) -> None:
        if self._event_jobs:
            self._step_event_jobs(self._advance(now))
        self._tick(now)

    def _tick(self, now: float) -> None:
        """Let time pass to `now`: expire bookings older than `active_request_expiry_secs`, time out
        queued selections, and dispatch those that can run. Call it at `next_deadline()`."""
        now = self._advance(now)
        for state in list(self._keys.values()):
            if self._expire(state, now):
                self._dispatch(state, now)
            self._expire_queue(state, now)
            self._dispatch(state, now)

    def next_deadline(self) -> float | None:
        """The earliest `now` at which `tick` has work: a booking expiry or a queue timeout."""
        deadlines = []
        for state in self._keys.values():
            d = state.tracker.next_expiry(self.settings.active_request_expiry_secs)
            if d is not None:
                deadlines.append(d)
            oldest = state.queue.oldest()
            if oldest is not None:
                deadlines.append(oldest + self.settings.queue_timeout_secs)
        if self._event_jobs:
            deadlines.append(self._now)  # a request applied in steps: due at once
        return min(deadlines) if deadlines else None

    def _close_push_streams(self, worker_id: int | None, reason: str) -> None:
        for sid, stream in list(self._streams.items()):
            if stream.kind == "push" and (worker_id is None or stream.worker_id == worker_id):
                del self._streams[sid]
                self._outputs.append(CloseEventStream(sid, 1001, reason))

    def begin_shutdown(self, *, now: float) -> None:
        """Stop taking work: push streams get close 1001, queued selections 503, and later selections
        and bookings 503."""
        now = self._advance(now)
        self._shutting_down = True
        self._step_event_jobs(now, until_done=True)  # accepted events are applied, and answered
        self._close_push_streams(None, "server shutting down")
        for state in self._keys.values():
            self._fail_queue(state, NotReady(SHUTTING_DOWN), "shutdown", now)

    def _expire(self, state: Pool, now: float) -> bool:
        expired = state.tracker.expire(now, self.settings.active_request_expiry_secs)
        if expired:
            self.metrics.inc("selection_proto_reservation_events_total", (*state.key, "expired"),
                             len(expired))
        return bool(expired)

    # -- health and readiness ------------------------------------------------------------------

    def health(self) -> StatusOk:
        """Liveness: always `{"status": "ok"}`."""
        return StatusOk()

    def ready(self, *, now: float) -> ReadyResponse:
        """Readiness (core.md §6.8) with every record in (model, tenant, worker) order."""
        self._advance(now)
        count = self._records.schedulable
        return ReadyResponse(ready=count > 0 and not self._shutting_down, schedulable_workers=count,
                             workers=tuple(self._records.sorted()))

    def readiness(self, *, now: float) -> tuple[bool, int]:
        """(ready, schedulable workers): `ready()` without building the worker list."""
        self._advance(now)
        count = self._records.schedulable
        return count > 0 and not self._shutting_down, count

    def records_json(self, model_name: str | None = None, tenant_id: str | None = None) -> list[bytes]:
        """The JSON of each record in (model, tenant, worker) order, as `to_json` encodes it."""
        return self._records.records_json(model_name, tenant_id)

    def _gate(self, model_name: str, tenant_id: str) -> Pool:
        if not self._records.schedulable:
            raise NotReady("no schedulable workers are available")
        state = self._keys.get((model_name, tenant_id))
        if state is None or not state.workers:
            raise NotReady(f"no schedulable workers for {key_label((model_name, tenant_id))}")
        return state

    def _check_budget(self, write: str) -> None:
        try:
            self.budget.check(write)
        except InsufficientStorage:
            self.metrics.inc("selection_proto_limit_rejections_total", ("state_bytes",))
            raise

    def _check_id_length(self, field: str, value: str | None) -> None:
        if value is not None and len(value) > self.settings.max_id_length:
            self.metrics.inc("selection_proto_limit_rejections_total", ("id_length",))
            raise BadRequest(f"{field} must be at most {self.settings.max_id_length} characters")

    # -- catalog -------------------------------------------------------------------------------

    def list_workers(self, model_name: str | None = None, tenant_id: str | None = None
                     ) -> list[WorkerCatalogRecord]:
        """The catalog's records in (model, tenant, worker) order, filtered by key."""
        return [r for r in self._records.sorted()
                if (model_name is None or r.key[0] == model_name)
                and (tenant_id is None or r.key[1] == tenant_id)]

    def upsert_worker(self, req: WorkerRequest, *, now: float) -> WorkerCatalogRecord:
        """Register or replace a worker (core.md §6.5); raises SelectionError (400, 409, 507)."""
        return self._reconcile(req, self._records.get(req.worker_id), self._advance(now))

    def patch_worker(self, worker_id: int, patch: WorkerPatchRequest, *, now: float
                     ) -> WorkerCatalogRecord:
        """Change the given members of a worker's record and reconcile it; raises NotFound, or as
        `upsert_worker`."""
        now = self._advance(now)
        previous = self._records.get(worker_id)
        if previous is None:
            raise NotFound(f"worker {worker_id} not found")
        changes = {n: getattr(patch, n) for n in _PATCH_FIELDS if getattr(patch, n) is not None}
        merged = attrs.evolve(previous.request, **changes) if changes else previous.request
        return self._reconcile(merged, previous, now)

    def _pre_checks(self, req: WorkerRequest, previous: WorkerCatalogRecord | None) -> None:
        s = self.settings
        for taint in req.taints:
            if taint.startswith(TOPOLOGY_PREFIX):
                raise BadRequest(f"taint `{taint}` uses the reserved prefix dynamo.topology/; "
                                 "use topology_domains instead")
        if req.data_parallel_size is not None and req.data_parallel_size > s.max_dp_size:
            self.metrics.inc("selection_proto_limit_rejections_total", ("dp_size",))
            raise BadRequest(f"data_parallel_size {req.data_parallel_size} exceeds the limit of "
                             f"{s.max_dp_size}")
        self._check_id_length("model_name", req.model_name)
        self._check_id_length("tenant_id", req.tenant_id)
        if s.kv_events == "subscribe":
            theirs = sum(1 for rank in self._subscriptions if rank[0] != req.worker_id)
            if theirs + len(event_endpoints(req)) > s.max_subscriptions:
                self.metrics.inc("selection_proto_limit_rejections_total", ("subscriptions",))
                raise Conflict(f"subscription limit reached: at most {s.max_subscriptions} "
                               "outbound KV-event subscriptions")
        key = (req.model_name, req.tenant_id)
        others = self._records.others_in_key(key, req.worker_id)
        if not others:
            live_keys = self._records.live_keys(req.worker_id)
            if key not in live_keys and len(live_keys) >= s.max_keys:
                self.metrics.inc("selection_proto_limit_rejections_total", ("keys",))
                raise Conflict(f"key limit reached: at most {s.max_keys} model/tenant keys")
        if len(others) + 1 > s.max_workers_per_key:
            self.metrics.inc("selection_proto_limit_rejections_total", ("workers_per_key",))
            raise Conflict(f"worker limit reached for {key_label(key)}: at most "
                           f"{s.max_workers_per_key} workers")

    def _decide(self, req: WorkerRequest) -> tuple[str, tuple[str, ...]]:
        reasons = missing_metadata(req, self.settings)
        if reasons:
            return "incomplete", tuple(reasons)
        key = (req.model_name, req.tenant_id)
        state = self._keys.get(key)
        if state is not None and state.block_size != req.block_size and any(
            w != req.worker_id for w in state.workers
        ):
            return "incomplete", (
                f"reconciliation failed: block_size mismatch for {key_label(key)}: "
                f"existing={state.block_size} requested={req.block_size}",
            )
        failure = endpoint_failure(req, self.settings)
        if failure is not None:
            return "incomplete", (f"reconciliation failed: {failure}",)
        return "schedulable", ()

    def _reconcile(self, req: WorkerRequest, previous: WorkerCatalogRecord | None, now: float
                   ) -> WorkerCatalogRecord:
        self._pre_checks(req, previous)
        lifecycle, reasons = self._decide(req)
        record = WorkerCatalogRecord(request=req, lifecycle=lifecycle,  # type: ignore[arg-type]
                                     not_schedulable_reasons=reasons)
        encoded = jsonio.dumps(record.to_json())
        limit = self.settings.max_record_bytes
        if len(encoded) > limit:
            self.metrics.inc("selection_proto_limit_rejections_total", ("record_bytes",))
            raise Conflict(f"worker record exceeds the limit of {limit} bytes ({len(encoded)} bytes as JSON)")
        if len(encoded) > self._records.json_size(req.worker_id):
            self._check_budget(f"worker {req.worker_id}")
        was = previous is not None and previous.lifecycle == "schedulable"
        same_pool = (previous is not None and previous.key == record.key
                     and previous.request.block_size == req.block_size)
        for step in RECONCILE[(was, lifecycle == "schedulable", same_pool)]:
            if step == "update":
                assert previous is not None
                self._update_in_place(previous, record)
            elif step == "leave":
                assert previous is not None
                self._leave(previous)
            else:
                self._join(record, now)
        self._records.store(record, encoded)
        self._dispatch(self._keys.get(record.key), now)
        if previous is not None and previous.key != record.key:
            self._dispatch(self._keys.get(previous.key), now)
        return record

    def _subscribe(self, state: Pool, rank: Rank, endpoint: str | None) -> None:
        if self.settings.kv_events != "subscribe" or not endpoint:
            return
        stream = self._next_stream
        self._next_stream += 1
        self._subscriptions[rank] = (stream, endpoint)
        self._streams[stream] = EventSource(stream, "subscription", rank[0], rank[1], state.key)
        self._outputs.append(SubscribeKvEvents(stream, rank[0], rank[1], endpoint, *state.key))

    def _unsubscribe(self, rank: Rank) -> None:
        sub = self._subscriptions.pop(rank, None)
        if sub is not None:
            self._streams.pop(sub[0], None)
            self._outputs.append(UnsubscribeKvEvents(sub[0]))

    def _join(self, record: WorkerCatalogRecord, now: float) -> None:
        req = record.request
        key = record.key
        state = self._keys.get(key)
        if state is None:
            assert req.block_size is not None
            state = self._keys[key] = Pool(key, req.block_size, now, self.settings, self.budget)
        ranks = tuple((req.worker_id, r) for r in dp_range(req))
        state.set_worker(req.worker_id, ranks, effective_taints(req))
        endpoints = event_endpoints(req)
        for rank in ranks:
            state.add_rank(rank)
            self._subscribe(state, rank, endpoints.get(rank[1]))

    def _drop_ranks(self, state: Pool, ranks: Iterable[Rank]) -> None:
        gone = set(ranks)
        dropped = state.drop_ranks(gone)
        if dropped:
            self.metrics.inc("selection_proto_reservation_events_total", (*state.key, "dropped"),
                             len(dropped))
        for rank in sorted(gone):
            self._unsubscribe(rank)

    def _leave(self, record: WorkerCatalogRecord) -> None:
        state = self._keys.get(record.key)
        if state is None:
            return
        ranks = state.remove_worker(record.worker_id)
        self._drop_ranks(state, ranks)
        self._close_push_streams(record.worker_id, f"worker {record.worker_id} is no longer schedulable")
        if not state.workers:
            del self._keys[record.key]
            self._fail_queue(state, NotReady(f"no schedulable workers for {state.label}"), "failed",
                             self._now)

    def _update_in_place(self, previous: WorkerCatalogRecord, record: WorkerCatalogRecord) -> None:
        state = self._keys[record.key]
        req = record.request
        wid = req.worker_id
        old_ranks = state.workers.get(wid, ())
        new_ranks = tuple((wid, r) for r in dp_range(req))
        old_set, new_set = set(old_ranks), set(new_ranks)
        self._drop_ranks(state, [r for r in old_ranks if r not in new_set])
        state.set_worker(wid, new_ranks, effective_taints(req))
        old_endpoints = event_endpoints(previous.request)
        new_endpoints = event_endpoints(req)
        subscribe = self.settings.kv_events == "subscribe"
        for rank in new_ranks:
            if rank not in old_set:
                state.add_rank(rank)
                self._subscribe(state, rank, new_endpoints.get(rank[1]))
            elif subscribe and old_endpoints.get(rank[1]) != new_endpoints.get(rank[1]):
                state.reset_rank_events(rank)
                self._unsubscribe(rank)
                self._subscribe(state, rank, new_endpoints.get(rank[1]))

    def delete_worker(self, worker_id: int, *, now: float) -> WorkerCatalogRecord:
        """Make a worker `unschedulable`: its ranks, bookings and push streams go, its record stays as
        a tombstone. Raises NotFound."""
        self._advance(now)
        previous = self._records.get(worker_id)
        if previous is None:
            raise NotFound(f"worker {worker_id} not found")
        if previous.lifecycle == "unschedulable":
            return previous
        if previous.lifecycle == "schedulable":
            self._leave(previous)
            self._dispatch(self._keys.get(previous.key), self._now)
        record = WorkerCatalogRecord(request=previous.request, lifecycle="unschedulable")
        self._records.delete(record, jsonio.dumps(record.to_json()))
        return record

    # -- prompts ---------------------------------------------------------------------------------

    def _prompt(self, req: Any, state: Pool, booking: bool = False) -> PromptHashes:
        """The request's prompt in the key's block size, its length limits checked and counted."""
        make = booking_prompt if booking else selection_prompt
        try:
            return make(req, state.block_size, self.settings.max_prompt_tokens)
        except PromptTooLong:
            self.metrics.inc("selection_proto_limit_rejections_total", ("prompt_tokens",))
            raise

    # -- estimates -----------------------------------------------------------------------------

    def _estimates(self, state: Pool, blocks: Sequence[int]
                   ) -> tuple[dict[Rank, int], dict[Rank, int], dict[Rank, int]]:
        """Device prefix, host extension and disk+external extension blocks per rank (§7.4)."""
        device, hits = state.index.tiered(blocks)
        host = hits["host_pinned"]
        disk = dict(hits["disk"])
        for r, n in hits["external"].items():
            disk[r] = disk.get(r, 0) + n
        return device, host, disk

    # -- selection -----------------------------------------------------------------------------

    def select(self, req: SelectRequest, *, now: float) -> SelectResponse | Pending:
        """Pick a rank for a prompt (core.md §9.7) without booking it; a `Pending` when it was queued."""
        return self._select_counted(req, now, "select")

    def select_and_reserve(self, req: SelectAndReserveRequest, *, now: float
                           ) -> SelectResponse | Pending:
        """Pick a rank and book the prompt on it under `reservation_id` (drawn from the seeded
        generator when absent); a `Pending` when it was queued."""
        return self._select_counted(req, now, "select_and_reserve")

    def _select_counted(self, req: SelectRequest, now: float, route: str) -> SelectResponse | Pending:
        labels = (req.model_name, req.tenant_id, route)
        try:
            result = self._select(req, self._advance(now), route == "select_and_reserve")
        except SelectionError as exc:
            self.metrics.inc("selection_proto_selections_total", (*labels, str(exc.status)))
            raise
        if not isinstance(result, Pending):
            self.metrics.inc("selection_proto_selections_total", (*labels, "200"))
        return result

    def _candidates(self, req: SelectRequest, state: Pool
                    ) -> tuple[list[Rank], dict[Rank, str]]:
        excluded: dict[Rank, str] = {}
        ranks = state.ranks()
        allowed = req.allowed_worker_ids
        pinned = req.pinned_worker
        required = req.routing_constraints.required_taints
        if pinned is not None:
            if allowed is not None and pinned.worker_id not in allowed:
                raise BadRequest(f"pinned worker {pinned.worker_id} is not in allowed worker set")
            rank = (pinned.worker_id, pinned.dp_rank)
            taints = state.taints.get(pinned.worker_id, frozenset())
            if rank not in state.tracker.loads or not taints.issuperset(required):
                raise NotReady("no endpoints available to route work")
            for r in ranks:
                if r != rank:
                    excluded[r] = "not_pinned"
            return [rank], excluded
        candidates = ranks
        if allowed is not None:
            candidates = []
            for r in ranks:
                if r[0] in allowed:
                    candidates.append(r)
                else:
                    excluded[r] = "not_allowed"
        if required:
            kept = []
            for r in candidates:
                if state.taints[r[0]].issuperset(required):
                    kept.append(r)
                else:
                    excluded[r] = "missing_required_taint"
            candidates = kept
        if not candidates:
            raise NotReady("no endpoints available to route work")
        return candidates, excluded

    def _overloaded(self, state: Pool, rank: Rank) -> bool:
        s = self.settings
        load = state.tracker.loads[rank]
        if s.active_prefill_tokens_threshold is not None and (
            load.prefill_tokens > s.active_prefill_tokens_threshold
        ):
            return True
        record = self._records[rank[0]].request
        if (s.active_prefill_tokens_threshold_frac is not None
                and record.max_num_batched_tokens is not None
                and load.prefill_tokens > s.active_prefill_tokens_threshold_frac
                * record.max_num_batched_tokens):
            return True
        total = record.total_kv_blocks
        return (s.active_decode_blocks_threshold is not None and bool(total)
                and len(load.unique) > s.active_decode_blocks_threshold * (total or 0))

    def _filter_overloaded(self, req: SelectRequest, state: Pool, candidates: list[Rank],
                           excluded: dict[Rank, str]) -> list[Rank]:
        s = self.settings
        if (s.active_prefill_tokens_threshold is None and s.active_decode_blocks_threshold is None
                and s.active_prefill_tokens_threshold_frac is None):
            return candidates
        by_worker: dict[int, list[Rank]] = {}
        for r in candidates:
            by_worker.setdefault(r[0], []).append(r)
        busy_workers = {w for w, rs in by_worker.items() if all(self._overloaded(state, r) for r in rs)}
        if not busy_workers:
            return candidates
        kept = [r for r in candidates if r[0] not in busy_workers]
        for r in candidates:
            if r[0] in busy_workers:
                excluded[r] = "overloaded"
        if not kept:
            if req.pinned_worker is not None:
                raise TooManyRequests(f"pinned worker {req.pinned_worker.worker_id} is overloaded")
            raise TooManyRequests("all eligible workers are overloaded")
        return kept

    def _select(self, req: SelectRequest, now: float, reserve: bool) -> SelectResponse | Pending:
        """Steps 2-11 of core.md §9.7."""
        if self._shutting_down:
            raise NotReady(SHUTTING_DOWN)
        state = self._gate(req.model_name, req.tenant_id)
        rid: str | None = None
        if reserve:
            assert isinstance(req, SelectAndReserveRequest)
            rid = req.reservation_id
            if rid is None:
                rid = str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
            else:
                self._check_id_length("reservation_id", rid)
        self._check_id_length("selection_id", req.selection_id)
        prompt = self._prompt(req, state)
        candidates, excluded = self._candidates(req, state)
        estimates = self._estimates(state, prompt.blocks)
        if (self.settings.queue_threshold is not None and req.allowed_worker_ids is None
                and all(self._busy(state, r) for r in candidates)):
            return self._enqueue(state, req, rid, prompt, candidates, estimates, now)
        return self._finish_selection(state, req, rid, prompt, candidates, excluded, estimates, now)

    def _finish_selection(self, state: Pool, req: SelectRequest, rid: str | None, prompt: PromptHashes,
                          candidates: list[Rank], excluded: dict[Rank, str],
                          estimates: tuple[dict[Rank, int], dict[Rank, int], dict[Rank, int]],
                          now: float) -> SelectResponse:
        """Steps 9-11: overload filter, cost, choice, booking, answer."""
        candidates = self._filter_overloaded(req, state, candidates, excluded)
        scored = score(req, state, prompt, candidates, estimates, self.settings)
        o = req.router_config_override
        temperature = (o.router_temperature if o is not None and o.router_temperature is not None
                       else self.settings.temperature)
        chosen = choose(state, scored, temperature, self.rng)
        if rid is not None:
            self._book(state, rid, chosen.rank, prompt, chosen.cached, o, req.expected_output_tokens,
                       now, wrap=True)
        self._observe_selection(state, prompt, chosen, scored)
        record = self._records[chosen.rank[0]].request
        response = SelectResponse(
            selection_id=req.selection_id, reservation_id=rid, model_name=req.model_name,
            tenant_id=req.tenant_id, worker_id=chosen.rank[0], dp_rank=chosen.rank[1],
            endpoint=record.endpoint or "", effective_overlap_blocks=float(chosen.effective),
            cached_tokens=chosen.cached, block_size=state.block_size,
        )
        if req.explain:
            response = attrs.evolve(response, candidates=explain(scored),
                                    excluded=tuple(Excluded(worker_id=r[0], dp_rank=r[1], reason=why)
                                                   for r, why in sorted(excluded.items())))
        return response

    # -- queue (core.md §10) -------------------------------------------------------------------

    def _busy(self, state: Pool, rank: Rank) -> bool:
        threshold = self.settings.queue_threshold
        assert threshold is not None
        limit = self._records[rank[0]].request.max_num_batched_tokens or 0
        return state.tracker.loads[rank].prefill_tokens > threshold * limit

    def _enqueue(self, state: Pool, req: SelectRequest, rid: str | None, prompt: PromptHashes,
                 candidates: list[Rank],
                 estimates: tuple[dict[Rank, int], dict[Rank, int], dict[Rank, int]],
                 now: float) -> Pending:
        s = self.settings
        if len(state.queue) >= s.queue_max_pending:
            self.metrics.inc("selection_proto_queue_events_total", (*state.key, "rejected_full"))
            self.metrics.inc("selection_proto_limit_rejections_total", ("queue_full",))
            raise TooManyRequests(f"queue is full for {state.label}: {s.queue_max_pending} requests pending")
        cached = 0
        if s.queue_policy == "wspt":
            device, host, disk = estimates
            cached = max(max(0, math.floor(effective_blocks(
                device.get(r, 0), host.get(r, 0), disk.get(r, 0), s) * state.block_size + 0.5))
                         for r in candidates)
        order = order_key(s.queue_policy, max(0.0, req.priority_jump or 0.0), now - state.epoch,
                          prompt.isl, cached)
        ticket = self._next_ticket
        self._next_ticket += 1
        entry = QueuedSelection(ticket, order, req, rid, prompt, now)
        state.queue.push(entry)
        self._tickets[ticket] = state.key
        self.metrics.inc("selection_proto_queue_events_total", (*state.key, "queued"))
        return Pending(ticket)

    def _resolve(self, state: Pool, entry: QueuedSelection, result: SelectResponse | SelectionError,
                 event: str, now: float) -> None:
        """Emit the one SelectionReady of a ticket."""
        self._tickets.pop(entry.ticket, None)
        route = "select_and_reserve" if isinstance(entry.req, SelectAndReserveRequest) else "select"
        if isinstance(result, SelectionError):
            response = error_response(result.status, result.message)
        else:
            response = json_response(200, result.to_json())
        self.metrics.inc("selection_proto_selections_total",
                         (*state.key, route, str(response.status)))
        self.metrics.inc("selection_proto_queue_events_total", (*state.key, event))
        self.metrics.observe("selection_proto_queue_wait_seconds", state.key, now - entry.enqueued_at)
        self._outputs.append(SelectionReady(entry.ticket, result, response))

    def _fail_queue(self, state: Pool, error: SelectionError, event: str, now: float) -> None:
        for entry in state.queue.take_all():
            self._resolve(state, entry, error, event, now)

    def _dispatch(self, state: Pool | None, now: float) -> None:
        """Run queued requests whose candidates now include a rank that is not busy (§10.4)."""
        if state is None or not state.queue or self._dispatching:
            return
        self._dispatching = True
        try:
            for entry in state.queue:
                req = entry.req
                try:
                    candidates, excluded = self._candidates(req, state)
                    if all(self._busy(state, r) for r in candidates):
                        continue
                    state.queue.remove(entry)
                    estimates = self._estimates(state, entry.prompt.blocks)
                    result: SelectResponse | SelectionError = self._finish_selection(
                        state, req, entry.rid, entry.prompt, candidates, excluded, estimates, now)
                    event = "dispatched"
                except SelectionError as exc:
                    state.queue.remove(entry)
                    result, event = exc, "failed"
                except Exception:  # noqa: BLE001 - confined to this ticket; the caller's call stands
                    state.queue.remove(entry)
                    self.internal_error("dispatch")
                    result, event = Internal("internal error"), "failed"
                self._resolve(state, entry, result, event, now)
        finally:
            self._dispatching = False

    def _expire_queue(self, state: Pool, now: float) -> None:
        timeout = self.settings.queue_timeout_secs
        for entry in state.queue.late(now, timeout):
            state.queue.remove(entry)
            self._resolve(state, entry, NotReady(
                f"timed out after {format(timeout, 'g')} s waiting in the queue for {state.label}"),
                "timed_out", now)

    def cancel(self, ticket: int, *, now: float) -> bool:
        """The client went away: forget its pending selection; no SelectionReady follows."""
        self._advance(now)
        key = self._tickets.pop(ticket, None)
        state = self._keys.get(key) if key is not None else None
        if state is None:
            return False
        entry = state.queue.find(ticket)
        if entry is None:
            return False
        state.queue.remove(entry)
        self.metrics.inc("selection_proto_queue_events_total", (*state.key, "cancelled"))
        return True

    def _observe_selection(self, state: Pool, prompt: PromptHashes, chosen: Scored,
                           scored: list[Scored]) -> None:
        if prompt.isl > 0:
            self.metrics.observe("selection_proto_predicted_hit_ratio", state.key,
                                 chosen.cached / prompt.isl)
        if chosen.device < max(c.device for c in scored):
            self.metrics.inc("selection_proto_non_max_overlap_selections_total", state.key)

    def _book(self, state: Pool, rid: str, rank: Rank, prompt: PromptHashes, cached: int,
              override: RouterConfigOverride | None, expected_output_tokens: int | None,
              now: float, *, wrap: bool) -> None:
        s = self.settings
        o = override or NO_OVERRIDE
        track = s.track_prefill_tokens if o.track_prefill_tokens is None else o.track_prefill_tokens
        reuse = s.assume_kv_reuse if o.assume_kv_reuse is None else o.assume_kv_reuse
        self._expire(state, now)
        try:
            state.tracker.check_can_book(rid)
        except DuplicateReservation as exc:
            if wrap:
                raise Conflict(f"failed to book scheduler state: {exc.message}") from None
            raise
        except TooManyRequests:
            self.metrics.inc("selection_proto_limit_rejections_total", ("reservations_per_key",))
            raise
        self._check_budget(f"booking {rid}")
        seqs = prompt.seqs
        blocks: list[int] | None = None
        if s.track_active_blocks:
            blocks = list(seqs) if reuse else [self.rng.getrandbits(64) for _ in seqs]
        prefill = max(0, prompt.isl - cached) if track else 0
        state.tracker.book(rid, rank, blocks, prefill, expected_output_tokens, now)
        self.metrics.inc("selection_proto_reservation_events_total", (*state.key, "booked"))

    # -- reservations --------------------------------------------------------------------------

    def reserve(self, req: ReservationRequest, *, now: float) -> ReservationResponse:
        """Book a prompt on a given rank (`POST /reservations`); raises SelectionError (400, 404, 409,
        429, 503, 507)."""
        now = self._advance(now)
        if self._shutting_down:
            raise NotReady(SHUTTING_DOWN)
        state = self._gate(req.model_name, req.tenant_id)
        self._check_id_length("reservation_id", req.reservation_id)
        prompt = self._prompt(req, state, booking=True)
        if req.worker_id not in state.workers:
            raise NotFound(f"schedulable worker {req.worker_id} not found for {state.label}")
        rank = (req.worker_id, 0 if req.dp_rank is None else req.dp_rank)
        if rank not in state.workers[req.worker_id]:
            raise NotFound(f"Worker {rank_text(rank)} not found")
        cached = 0
        if prompt.blocks:
            device, host, disk = self._estimates(state, prompt.blocks)
            effective = effective_blocks(device.get(rank, 0), host.get(rank, 0), disk.get(rank, 0),
                                         self.settings)
            cached = max(0, math.floor(effective * state.block_size + 0.5))
        self._book(state, req.reservation_id, rank, prompt, cached, req.router_config_override,
                   req.expected_output_tokens, now, wrap=False)
        record = self._records[req.worker_id].request
        return ReservationResponse(reservation_id=req.reservation_id, model_name=req.model_name,
                                   tenant_id=req.tenant_id, worker_id=rank[0], dp_rank=rank[1],
                                   endpoint=record.endpoint or "")

    def _find_booking(self, rid: str, model_name: str | None, tenant_id: str | None) -> Pool:
        for key in sorted(self._keys):
            if model_name is not None and key[0] != model_name:
                continue
            if tenant_id is not None and key[1] != tenant_id:
                continue
            state = self._keys[key]
            if rid in state.tracker.bookings:
                return state
        raise NotFound(f"reservation {rid} not found")

    def prefill_complete(self, reservation_id: str, *, model_name: str | None = None,
                         tenant_id: str | None = None, now: float) -> None:
        """The booking's prefill is done: its prefill tokens stop counting. Raises NotFound."""
        self._finish_booking(reservation_id, model_name, tenant_id, now, free=False)

    def free(self, reservation_id: str, *, model_name: str | None = None,
             tenant_id: str | None = None, now: float) -> None:
        """End a booking: its load goes, and queued selections may run. Raises NotFound."""
        self._finish_booking(reservation_id, model_name, tenant_id, now, free=True)

    def _finish_booking(self, rid: str, model_name: str | None, tenant_id: str | None, now: float,
                        *, free: bool) -> None:
        """Prefill completion or free: both release load, so both may dispatch queued requests."""
        now = self._advance(now)
        state = self._find_booking(rid, model_name, tenant_id)
        if free:
            state.tracker.free(rid)
        else:
            state.tracker.prefill_complete(rid)
        self.metrics.inc("selection_proto_reservation_events_total",
                         (*state.key, "freed" if free else "prefill_complete"))
        self._dispatch(state, now)

    # -- loads and scores ----------------------------------------------------------------------

    def loads(self, model_name: str | None = None, tenant_id: str | None = None
              ) -> list[ModelLoadResponse]:
        """Each key's per-rank load and its queue, filtered by key."""
        out = []
        for key in sorted(self._keys):
            if (model_name is not None and key[0] != model_name) or (
                tenant_id is not None and key[1] != tenant_id
            ):
                continue
            state = self._keys[key]
            loads = state.tracker.loads
            pending = state.queue
            out.append(ModelLoadResponse(
                model_name=key[0], tenant_id=key[1],
                loads=tuple(PotentialLoad(worker_id=r[0], dp_rank=r[1],
                                          potential_prefill_tokens=loads[r].prefill_tokens,
                                          potential_decode_blocks=len(loads[r].unique),
                                          active_requests=loads[r].requests)
                            for r in state.ranks()),
                pending_count=len(pending),
                pending_isl_tokens=sum(e.prompt.isl for e in pending),
            ))
        return out

    def potential_loads(self, req: PotentialLoadsRequest, *, now: float) -> list[PotentialLoad]:
        """What each candidate's load would be if the prompt ran there (no booking)."""
        self._advance(now)
        state = self._gate(req.model_name, req.tenant_id)
        prompt = self._prompt(req, state)
        o = req.router_config_override or NO_OVERRIDE
        s = self.settings
        track = s.track_prefill_tokens if o.track_prefill_tokens is None else o.track_prefill_tokens
        device, host, disk = self._estimates(state, prompt.blocks)
        out = []
        for r in state.ranks():
            load = state.tracker.loads[r]
            effective = effective_blocks(device.get(r, 0), host.get(r, 0), disk.get(r, 0), self.settings)
            cached = max(0, math.floor(effective * state.block_size + 0.5))
            decode = len(load.unique) + (prompt.new_blocks(load) if s.track_active_blocks else 0)
            out.append(PotentialLoad(
                worker_id=r[0], dp_rank=r[1],
                potential_prefill_tokens=load.prefill_tokens
                + (max(0, prompt.isl - cached) if track else 0),
                potential_decode_blocks=decode, active_requests=load.requests))
        return out

    def overlap_scores(self, req: OverlapScoresRequest, *, now: float) -> OverlapScoresResponse:
        """Cached blocks per rank and tier for a prompt, with each rank's freshness (events.md §6)."""
        now = self._advance(now)
        state = self._gate(req.model_name, req.tenant_id)
        prompt = self._prompt(req, state)
        device, host, disk = self._estimates(state, prompt.blocks)
        rows = []
        for r in sorted(set(device) | set(host) | set(disk)):
            d, h, k = device.get(r, 0), host.get(r, 0), disk.get(r, 0)
            if d + h + k == 0:
                continue
            fresh = state.fresh.get(r) or RankFreshness()
            rows.append({"worker_id": r[0], "dp_rank": r[1], "device_blocks": d,
                         "host_pinned_extension_blocks": h, "disk_extension_blocks": k,
                         "router_credit_blocks": float(effective_blocks(d, h, k, self.settings)),
                         "last_event_id": fresh.last_event_id,
                         "last_event_age_secs": fresh.age(now), "stale": fresh.stale})
        freshness = []
        for r in state.ranks():
            f = state.fresh[r]
            freshness.append({"worker_id": r[0], "dp_rank": r[1], "last_event_id": f.last_event_id,
                              "last_event_age_secs": f.age(now), "event_gaps": f.event_gaps,
                              "missing_events": f.missing_events, "rewinds": f.rewinds,
                              "stale": f.stale, "open_streams": f.open_streams})
        return OverlapScoresResponse(block_size=state.block_size, num_blocks=len(prompt.blocks),
                                     workers=tuple(rows), freshness=tuple(freshness))

    # -- KV events -----------------------------------------------------------------------------

    def check_push_mode(self) -> None:
        """409 unless KV events may be pushed in this mode (events.md §7.1)."""
        mode = self.settings.kv_events
        if mode == "subscribe":
            raise Conflict("kv events are pushed only when kv_events=push "
                           "(this service runs kv_events=subscribe)")
        if mode == "off":
            raise Conflict("kv events are disabled (kv_events=off)")

    def _bind(self, worker_id: int, dp_rank: int | None, model_name: str | None,
              tenant_id: str | None) -> tuple[Pool, Rank]:
        """The §7.2 checks of events.md for one worker and rank."""
        record = self._records.get(worker_id)
        if record is None:
            raise NotFound(f"worker {worker_id} not found")
        if record.lifecycle != "schedulable":
            raise Conflict(f"worker {worker_id} is not schedulable")
        if (model_name is not None and model_name != record.key[0]) or (
            tenant_id is not None and tenant_id != record.key[1]
        ):
            raise Conflict(f"worker {worker_id} belongs to {key_label(record.key)}")
        state = self._keys[record.key]
        ranks = state.workers[worker_id]
        rank = (worker_id, 0 if dp_rank is None else dp_rank)
        if rank not in ranks:
            raise BadRequest(f"dp_rank {rank[1]} is not a rank of worker {worker_id} "
                             f"(ranks {ranks[0][1]}..{ranks[-1][1]})")
        return state, rank

    def apply_kv_events(self, events: Sequence[Event], *, now: float, worker_id: int | None = None,
                        dp_rank: int | None = None, model_name: str | None = None,
                        tenant_id: str | None = None) -> ApplyReport:
        """Apply decoded JSON events (`POST /kv_events`); every check runs before the first event."""
        now = self._advance(now)
        return self._apply_bound(self._bind_events(events, worker_id, dp_rank, model_name, tenant_id), now)

    def begin_kv_events(self, events: Sequence[Event], *, now: float, worker_id: int | None = None,
                        dp_rank: int | None = None, model_name: str | None = None,
                        tenant_id: str | None = None) -> ApplyReport | Pending:
        """`apply_kv_events`, except that more than `max_events_per_step` events are applied that
        many at a time by `tick` (due at once), so that one request does not hold everyone up; a
        `Pending` then, answered by a `SelectionReady` with the whole report. Every check still runs
        before the first event; a worker that leaves meanwhile fails the rest of its events."""
        now = self._advance(now)
        step = self.settings.max_events_per_step
        if step is None or len(events) <= step:
            return self._apply_bound(self._bind_events(events, worker_id, dp_rank, model_name, tenant_id), now)
        self.check_push_mode()
        if worker_id is not None:
            self._bind(worker_id, dp_rank, model_name, tenant_id)
        ticket = self._next_ticket
        self._next_ticket += 1
        self._event_jobs.append(_EventJob(ticket, list(events), (worker_id, dp_rank, model_name, tenant_id)))
        return Pending(ticket)

    def _bind_events(self, events: Sequence[Event], worker_id: int | None, dp_rank: int | None,
                     model_name: str | None, tenant_id: str | None) -> list[tuple[Event, Pool, Rank]]:
        self.check_push_mode()
        if worker_id is not None:
            self._bind(worker_id, dp_rank, model_name, tenant_id)
        bound = []
        for event in events:
            wid = require_worker(event, worker_id)
            rank_id = event.dp_rank if event.dp_rank is not None else dp_rank
            bound.append((event, *self._bind(wid, rank_id, model_name, tenant_id)))
        if self.budget.exhausted and any(event.kind == "stored" for event in events):
            self._check_budget("kv events")  # a request is refused whole; a stream drops stores
        return bound

    def _step_event_jobs(self, now: float, until_done: bool = False) -> None:
        """Apply the next `max_events_per_step` events of the oldest job (all of every job when
        `until_done`), answering each job that ends."""
        step = self.settings.max_events_per_step or 1
        while self._event_jobs:
            job = self._event_jobs[0]
            if len(job.bound) < len(job.events):  # first every event is bound, a step at a time
                worker_id, dp_rank, model_name, tenant_id = job.target
                try:
                    for event in job.events[len(job.bound):len(job.bound) + step]:
                        wid = require_worker(event, worker_id)
                        rank_id = event.dp_rank if event.dp_rank is not None else dp_rank
                        job.bound.append((event, *self._bind(wid, rank_id, model_name, tenant_id)))
                    if len(job.bound) == len(job.events) and self.budget.exhausted and any(
                            event.kind == "stored" for event in job.events):
                        self._check_budget("kv events")
                except SelectionError as exc:  # refused whole, as a request applied at once
                    self._event_jobs.popleft()
                    self._outputs.append(SelectionReady(job.ticket, exc, error_response(exc.status, exc.message)))
                if not until_done:
                    return
                continue
            start = job.done
            chunk = job.bound[start:start + step]
            for k, (event, pool, rank) in enumerate(chunk, start):
                if self._keys.get(pool.key) is pool and rank in pool.fresh:
                    self._tally_bound([(event, pool, rank)], now, True, job.tally, (k,))
                else:
                    job.tally.fail(k, WORKER_LEFT)
            job.done += len(chunk)
            if job.done >= len(job.events):
                self._event_jobs.popleft()
                total = job.tally.report()
                self._outputs.append(SelectionReady(job.ticket, total, json_response(200, total.to_json())))
            if not until_done:
                return

    def _apply_bound(self, bound: Sequence[tuple[Event, Pool, Rank]], now: float,
                     touch_freshness: bool = True) -> ApplyReport:
        return self._tally_bound(bound, now, touch_freshness, Tally(len(bound))).report()

    def _tally_bound(self, bound: Sequence[tuple[Event, Pool, Rank]], now: float, touch_freshness: bool,
                     tally: Tally, indices: Sequence[int] | None = None) -> Tally:
        """Apply `bound` in order, counting into `tally`; `indices` are the events' positions in
        the request (their order in `bound` when not given)."""
        over_budget = self.budget.exhausted
        for i, (event, state, rank) in enumerate(bound):
            if touch_freshness:
                self._note_event_id(state, rank, event.event_id, now)
            error = self._apply_event(state, rank, event, over_budget)
            result = "ok" if error is None else error.label
            self.metrics.inc("selection_proto_kv_events_total",
                             (*state.key, event.tier, event.kind, result))
            if error is None:
                tally.applied += 1
            else:
                tally.fail(i if indices is None else indices[i], error.text)
        return tally

    def _count_break(self, key: Key, rank: Rank, broken: Break) -> None:
        labels = (*key, str(rank[0]), str(rank[1]))
        if broken.kind == GAP:
            self.metrics.inc("selection_proto_kv_event_gaps_total", labels)
            self.metrics.inc("selection_proto_kv_missing_events_total", labels, broken.missing)
        else:
            self.metrics.inc("selection_proto_kv_event_rewinds_total", labels)

    def _note_event_id(self, state: Pool, rank: Rank, event_id: int | None, now: float) -> None:
        broken = state.fresh[rank].note_event_id(event_id, now)
        if broken is not None:
            self._count_break(state.key, rank, broken)

    def _apply_event(self, state: Pool, rank: Rank, event: Event, over_budget: bool
                     ) -> IndexError_ | None:
        """Apply one event to the index. `over_budget` is read once per message by the caller
        (a message overshoots the budget by at most itself)."""
        index = state.index
        budget = self.budget
        if over_budget and event.kind == "stored":
            # Removes and clears still apply (they free memory); the rank misses these stores.
            state.fresh[rank].stale = True
            self.metrics.inc("selection_proto_limit_rejections_total", ("state_bytes",))
            return STATE_BUDGET_EXHAUSTED
        if event.tier == "device":
            tree = index.device
            tree.ensure(rank)
            lookup = tree.lookup
            before = len(lookup[rank])
            try:
                if event.kind == "stored":
                    tree.store(rank, event.parent_hash, event.blocks)
                elif event.kind == "removed":
                    tree.remove(rank, event.block_hashes)
                else:
                    tree.clear(rank)
                    tree.ensure(rank)
                    state.fresh[rank].mark_cleared()
            except IndexError_ as exc:
                return exc
            finally:  # a clear replaces the rank's table
                budget.index_blocks += len(lookup[rank]) - before
            return None
        tier = index.lower[event.tier]
        before = tier.size(rank)
        if event.kind == "stored":
            tier.store(rank, event.parent_hash, event.blocks)
        elif event.kind == "removed":
            tier.remove(rank, event.block_hashes)
        else:
            tier.clear(rank)
        budget.index_blocks += tier.size(rank) - before
        return None

    def apply_engine_batch(self, payload: bytes, *, worker_id: int | None, dp_rank: int | None = None,
                           seq: int | None = None, stream: int | None = None, now: float,
                           model_name: str | None = None, tenant_id: str | None = None) -> ApplyReport:
        """Apply one msgpack `KVEventBatch` (`POST /kv_events` with a msgpack body)."""
        now = self._advance(now)
        self.check_push_mode()
        if worker_id is None:
            raise BadRequest("worker_id is required for events without worker_id")
        return self._engine_batch(payload, worker_id, dp_rank, seq, None, model_name, tenant_id, now)

    def _engine_batch(self, payload: bytes | EngineBatch, worker_id: int, dp_rank: int | None,
                      seq: int | None, source: EventSource | None, model_name: str | None,
                      tenant_id: str | None, now: float, start: int = 0,
                      stop: int | None = None) -> ApplyReport:
        batch = decode_engine_batch(payload) if isinstance(payload, bytes) else payload
        state, rank = self._bind(worker_id, batch.dp_rank if batch.dp_rank is not None else dp_rank,
                                 model_name, tenant_id)
        over_budget = self.budget.exhausted
        if over_budget and source is None and any(e.tag == "BlockStored" for e in batch.events):
            self._check_budget("kv events")  # a request is refused whole; a stream drops stores
        stream_rank = (worker_id, source.dp_rank) if source is not None else rank
        if stream_rank not in state.fresh:
            stream_rank = rank
        if start > 0:
            pass  # a later slice: the batch's seq was noted with its first
        elif seq is not None:
            self._note_seq(state, stream_rank, rank, seq)
        elif source is not None and source.first and state.fresh[rank].loss_pending:
            state.fresh[rank].stale = True  # a reconnect without proof of continuity
        memory = state.memory.setdefault(rank, NamespaceMemory())
        events = batch.events if start == 0 and stop is None else batch.events[start:stop]
        tally = Tally(len(events))
        for i, raw in enumerate(events, start):
            event = convert(raw, state.block_size, memory)
            if isinstance(event, str):
                tally.dropped += 1
                self.metrics.inc("selection_proto_kv_events_dropped_total", (*state.key, event))
                continue
            state.fresh[rank].count_event(now)
            if event.kind == "stored":
                for engine_hash, _ in event.blocks:
                    memory.remember(engine_hash, event.namespace)
            elif event.kind == "removed":
                memory.forget(event.block_hashes)
            elif event.tier == "device":
                memory.clear()
            error = self._apply_event(state, rank, event, over_budget)
            self.metrics.inc("selection_proto_kv_events_total", (*state.key, event.tier, event.kind,
                                                                 "ok" if error is None else error.label))
            if error is None:
                tally.applied += 1
            else:
                tally.fail(i, error.text)
        if source is not None:
            source.delivered.add(rank)
            if stop is None or stop >= len(batch.events):
                source.first = False
        return tally.report()

    def _note_seq(self, state: Pool, stream_rank: Rank, batch_rank: Rank, seq: int) -> None:
        broken = state.fresh[stream_rank].note_seq(seq)
        if broken is not None:
            self._count_break(state.key, stream_rank, broken)
            state.fresh[batch_rank].stale = True

    # -- event streams (WebSocket push, outbound subscriptions) ---------------------------------

    def open_event_stream(self, worker_id: int, dp_rank: int = 0, *, model_name: str | None = None,
                          tenant_id: str | None = None, now: float) -> int:
        """Bind an inbound push stream (after the WebSocket handshake); raises SelectionError."""
        self._advance(now)
        self.check_push_mode()
        state, rank = self._bind(worker_id, dp_rank, model_name, tenant_id)
        sid = self._next_stream
        self._next_stream += 1
        self._streams[sid] = EventSource(sid, "push", worker_id, dp_rank, state.key)
        state.fresh[rank].open_streams += 1
        return sid

    def stream_message(self, stream: int, data: bytes | str | DecodedMessage | SelectionError, *,
                       seq: int | None = None, now: float, start: int = 0,
                       stop: int | None = None) -> ApplyReport:
        """One message of a stream: text is JSON events, bytes one engine batch, or what
        `decode_stream_message` made of either (possibly in another thread). `start`/`stop` apply
        only those events, so that a large message can be applied in slices, in order, with the
        event loop running in between. A push stream that must be closed raises StreamError; a
        subscription drops and counts bad messages."""
        now = self._advance(now)
        source = self._streams.get(stream)
        if source is None:
            raise StreamError(1008, "stream is not open")
        try:
            message = decode_stream_message(data) if isinstance(data, (bytes, str)) else data
            if isinstance(message, SelectionError):
                raise message
            if isinstance(message, EngineBatch):
                return self._engine_batch(message, source.worker_id, source.dp_rank, seq, source, None,
                                          None, now, start, stop)
            return self._stream_json(source, message, now, start, stop)
        except SelectionError as exc:
            decoding = isinstance(exc, (Unprocessable, InvalidJson))
            if source.kind == "subscription":
                reason = "invalid_message" if decoding else "binding"
                self.metrics.inc("selection_proto_kv_events_dropped_total", (*source.key, reason))
                return ApplyReport(received=0, applied=0, failed=0, dropped=1)
            if decoding:
                detail = (f"invalid kv event: {exc.detail}" if isinstance(exc, (ShapeError, InvalidJson))
                          else exc.message)
                raise StreamError(1007, detail) from None
            raise StreamError(1008, exc.message) from None

    def _stream_json(self, source: EventSource, events: tuple[Event, ...], now: float, start: int,
                     stop: int | None) -> ApplyReport:
        if start == 0:  # every event of the message is checked before its first slice applies
            for event in events:
                if event.worker_id is not None and event.worker_id != source.worker_id:
                    raise Conflict(f"event worker_id {event.worker_id} does not match stream worker_id "
                                   f"{source.worker_id}")
        bound = []
        for event in events[start:stop]:
            rank_id = event.dp_rank if event.dp_rank is not None else source.dp_rank
            bound.append((event, *self._bind(source.worker_id, rank_id, None, None)))
        report = self._apply_bound(bound, now)
        for _, _, rank in bound:
            source.delivered.add(rank)
        if stop is None or stop >= len(events):
            source.first = False
        return report

    def _stream_lost(self, source: EventSource) -> None:
        state = self._keys.get(source.key)
        if state is None:
            return
        for rank in source.delivered:
            fresh = state.fresh.get(rank)
            if fresh is not None:
                fresh.loss_pending = True
        if source.connected:
            fresh = state.fresh.get((source.worker_id, source.dp_rank))
            if fresh is not None and fresh.open_streams > 0:
                fresh.open_streams -= 1
        source.delivered.clear()
        source.connected = False

    def close_event_stream(self, stream: int, *, now: float) -> None:
        """The inbound WebSocket closed."""
        self._advance(now)
        source = self._streams.pop(stream, None)
        if source is not None:
            self._stream_lost(source)

    def subscription_state(self, stream: int, connected: bool, *, now: float) -> None:
        """An outbound subscription connected or was lost."""
        self._advance(now)
        source = self._streams.get(stream)
        if source is None or source.kind != "subscription":
            return
        if connected and not source.connected:
            state = self._keys.get(source.key)
            fresh = state.fresh.get((source.worker_id, source.dp_rank)) if state is not None else None
            if fresh is not None:
                fresh.open_streams += 1
            source.connected = True
            source.first = True
        elif not connected and source.connected:
            self._stream_lost(source)

    def stream_dropped(self, stream: int, reason: str) -> None:
        """A transport or adapter dropped a message of `stream` before it reached the core (a
        framing it could not read): counted under the stream's key."""
        source = self._streams.get(stream)
        key = source.key if source is not None else ("", "")
        self.metrics.inc("selection_proto_kv_events_dropped_total", (*key, reason))

    def subscription_failed(self, stream: int, *, now: float) -> None:
        """An outbound subscription could not connect or ended: its rank's index may be missing
        events from now on (stale) until a `cleared` or a continuous stream proves otherwise."""
        self.subscription_state(stream, False, now=now)
        source = self._streams.get(stream)
        state = self._keys.get(source.key) if source is not None else None
        if source is not None and state is not None:
            fresh = state.fresh.get((source.worker_id, source.dp_rank))
            if fresh is not None:
                fresh.stale = True

    # -- dump ----------------------------------------------------------------------------------

    def dump(self, model_name: str | None = None, tenant_id: str | None = None) -> dict[str, Any]:
        """A replayable snapshot of catalog and index (api.md §7), filtered by key."""
        return dump_of(self._records.sorted(), {k: (p.block_size, p.index) for k, p in self._keys.items()},
                       model_name, tenant_id)

    def restore(self, dump: Any, *, now: float) -> None:
        """Replay a `/dump` into this empty service (api.md §7): validated whole first."""
        now = self._advance(now)
        if self._records:
            raise Conflict("restore needs an empty catalog")
        plan = parse_dump(dump)
        for req in plan.workers:
            self.upsert_worker(req, now=now)
        bound = []
        for event in plan.events:
            try:
                bound.append((event, *self._bind(event.worker_id or 0, event.dp_rank, None, None)))
            except SelectionError:
                continue  # its worker did not become schedulable here (e.g. another kv_events mode)
        self._apply_bound(bound, now, touch_freshness=False)

    # -- metrics -------------------------------------------------------------------------------

    def internal_error(self, where: str) -> None:
        """Count the exception being handled and queue its traceback for the transport to log.
        Call it from an `except` block: the caller answers (500, close 1011, -32603)."""
        self.metrics.inc("selection_proto_internal_errors_total", (where,))
        self._outputs.append(InternalError(where, traceback.format_exc()))

    def observe(self, family: str, labels: Sequence[str], value: float) -> None:
        """Transports report timings and connection counts here (api.md §5.3)."""
        self.metrics.record(family, tuple(labels), value)

    def metrics_text(self, *, now: float) -> str:
        """The Prometheus text exposition (api.md §5)."""
        self._advance(now)
        lifecycles: dict[tuple[str, ...], float] = {
            ("incomplete",): 0.0, ("schedulable",): 0.0, ("unschedulable",): 0.0}
        for r in self._records.values():
            lifecycles[(r.lifecycle,)] = lifecycles.get((r.lifecycle,), 0.0) + 1
        ranks: dict[tuple[str, ...], float] = {}
        active: dict[tuple[str, ...], float] = {}
        pending: dict[tuple[str, ...], float] = {}
        stale: dict[tuple[str, ...], float] = {}
        blocks: dict[tuple[str, ...], float] = {}
        for key, state in self._keys.items():
            ranks[key] = float(len(state.ranks()))
            active[key] = float(len(state.tracker.bookings))
            pending[key] = float(len(state.queue))
            stale[key] = float(sum(1 for f in state.fresh.values() if f.stale))
            blocks[(*key, "device")] = float(state.index.device.total_size())
            for tier in LOWER_TIERS:
                blocks[(*key, tier)] = float(state.index.lower[tier].total_size())
        return self.metrics.render({
            "selection_proto_info": {(__version__,): 1.0},
            "selection_proto_workers": lifecycles,
            "selection_proto_schedulable_ranks": ranks,
            "selection_proto_reservations_active": active,
            "selection_proto_queue_pending": pending,
            "selection_proto_kv_stale_ranks": stale,
            "selection_proto_index_blocks": blocks,
            "selection_proto_state_bytes": {(): float(self.budget.used)},
            "selection_proto_state_budget_bytes": {(): float(self.budget.limit)},
        })

    # -- bytes ---------------------------------------------------------------------------------

    def handle(self, method: str, path: str, query: str, headers: Iterable[tuple[str, str]],
               body: bytes | ParsedBody, *, now: float) -> Response | Pending:
        """Answer one HTTP-shaped request with `Response(status, headers, body)`; never raises.
        `body` may be a `ParsedBody` when the caller has parsed the JSON already."""
        return handle_request(self, method, path, query, headers, body, now)




