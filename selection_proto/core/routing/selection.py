"""Selection and booking (core.md §9-§10): a prompt's candidates, the overload filter, the cost and
the choice, the booking that holds a rank's load until the request ends, and the admission queue
that holds selections while every candidate is busy.

A `Selection` carries one selection in progress from `_prepare` to `_finish`, so that a queued
selection resumes from the same object. The selector appends what it causes (answers of queued
tickets, internal errors) to the service's outbox; the service decides when to dispatch."""

from __future__ import annotations

import random
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from typing import Final

import attrs

from ..base.deferred import Deferred
from ..base.errors import (
    BadRequest,
    Conflict,
    NotFound,
    NotReady,
    SelectionError,
    ShapeError,
    TooManyRequests,
)
from ..base.hashing import SignedHashes
from ..base.metrics import Metrics
from ..base.outputs import Notice, OutputEvent
from ..base.responses import Excluded, Overlap, Pending, ReservationResponse, SelectResponse
from ..base.settings import Settings
from ..base.types import (
    ReservationRequest,
    SelectAndReserveRequest,
    SelectPdAndReserveRequest,
    SelectPdRequest,
    SelectRequest,
)
from ..bookings.prompt import PromptHashes
from ..bookings.sessions import check_session_id, mismatch
from ..bookings.tracker import PIECE_BLOCKS, Booking, DuplicateReservation, rank_text
from ..cache.engine_metrics import EngineMetrics
from ..cache.index import Rank
from ..fleet.admission import QueuedSelection, Tickets
from ..fleet.catalog import Catalog
from ..fleet.decisions import Decision, decision
from ..fleet.journal import Journal
from ..fleet.limits import Limits
from ..fleet.pending import MISSING, PendingSelection, PendingSelections, entry_size
from ..fleet.pool import Key, Pool, holding, key_label
from .cost import (
    DEVICE,
    assumes_kv_reuse,
    cached_tokens,
    choose,
    estimates,
    explain,
    score,
    tracks_prefill,
)
from .pd import PlanResponse, Plans
from .prefill_reading import PrefillReading
from .queueing import Admission, Selection
from .selection_outcome import account, shadowed

__all__ = ["SHUTTING_DOWN", "Selector"]

SHUTTING_DOWN: Final = "selection service is shutting down"
NO_CAPACITY: Final = 10_000_000  # 1.6.1's prefill capacity of a worker without max_num_batched_tokens


class Selector(Admission, Plans, PrefillReading):
    """Selections, bookings, prefill/decode plans and the admission queue of every pool."""

    __slots__ = ("_settings", "_rng", "_metrics", "_limits", "_catalog", "_pools", "_tickets",
                 "_outbox", "_internal_error", "stopping", "pending", "log_decisions",
                 "journal", "_deferred", "engines")

    def __init__(self, settings: Settings, rng: random.Random, metrics: Metrics, limits: Limits,
                 catalog: Catalog, pools: Mapping[Key, Pool], tickets: Tickets,
                 outbox: deque[OutputEvent], internal_error: Callable[[str], None], deferred: Deferred,
                 engines: EngineMetrics | None = None) -> None:
        self._settings = settings
        self._rng = rng
        self._metrics = metrics
        self._limits = limits
        self._catalog = catalog
        self._pools = pools
        self._tickets = tickets
        self._outbox = outbox
        self._internal_error = internal_error
        self._deferred = deferred
        self._dispatching = False
        self.stopping = False  # set by the service's shutdown: no new selections or bookings
        self.log_decisions = False  # a debug notice for every choice (`--log-level debug`)
        self.journal: Journal | None = None  # a shared ledger's (--ledger): bookings are journaled
        self.engines = engines  # what engines' metrics endpoints reported: a plan reads a decode worker's KV use
        self.pending = PendingSelections(settings.selection_cache_ttl_secs, settings.selection_cache_max_entries,
                                         settings.selection_cache_max_bytes)

    def gate(self, model_name: str, tenant_id: str, now: float) -> Pool:
        """The key's pool, or 503 while it has no schedulable worker; predictions past their
        time are gone from it."""
        if not self._catalog.schedulable:
            raise NotReady("no schedulable workers are available")
        pool = self._pools.get((model_name, tenant_id))
        if pool is None or not pool.workers:
            raise NotReady(f"no schedulable workers for {key_label((model_name, tenant_id))}")
        if pool.predictions is not None:
            pool.predictions.expire(now)
        if pool.prefill_ends.ready:  # the prefills ahead of them ended (a peer's free, say)
            self._end_followers(pool, now)
        return pool

    # -- selection (core.md §9.7) ----------------------------------------------------------------

    def select(self, req: SelectRequest, now: float, reserve: bool) -> SelectResponse | Pending:
        """A selection with its outcome counted (a queued one counts when its ticket ends)."""
        route = "select_and_reserve" if reserve else "select"
        key = (req.model_name, req.tenant_id)
        try:
            sel = self._prepare(req, reserve, now)
            if self._settings.queue_threshold is not None and req.allowed_worker_ids is None:
                busy = all(self._busy(sel.pool, r) for r in sel.candidates)
                if busy or (self._settings.fairness_kv_share is not None
                            and self._over_kv_share(sel.pool, req, self._uncached(sel))):
                    return self._enqueue(sel, now, held=not busy)
                if req.deadline_ms is not None and (late := self._in_time(sel, now, now + req.deadline_ms / 1000.0)):
                    lane = self._lane(req)
                    raise self._refuse(sel.pool, lane, "deadline", late.message, late.retry_after)
            result = self._finish(sel, now)
        except SelectionError as exc:
            self._outcome(key, route, exc.status, now)
            raise
        self._outcome(key, route, 200, now)
        return result

    def plan(self, req: SelectPdRequest, now: float) -> PlanResponse:
        """A prefill/decode plan (pd.py), booked on both workers or neither for a
        `SelectPdAndReserveRequest`; its outcome counted. Plans are never queued."""
        reserve = isinstance(req, SelectPdAndReserveRequest)
        route = "select_pd_and_reserve" if reserve else "select_pd"
        key = (req.model_name, req.tenant_id)
        try:
            if self.stopping:
                raise NotReady(SHUTTING_DOWN)
            answer = self._plan(req, reserve, now, _scheduler_conflict)
        except SelectionError as exc:
            self._metrics.selection(key, route, exc.status)
            raise
        self._metrics.selection(key, route, 200)
        self._metrics.plan(key, route, answer.path, answer.verdict.decider)
        return answer

    def _prepare(self, req: SelectRequest, reserve: bool, now: float) -> Selection:
        """Steps 2-8: gate, booking id, prompt, session, candidates, what each has cached."""
        if self.stopping:
            raise NotReady(SHUTTING_DOWN)
        pool = self.gate(req.model_name, req.tenant_id, now)
        rid: str | None = None
        if reserve:
            assert isinstance(req, SelectAndReserveRequest)
            self._limits.id_length("reservation_id", req.reservation_id)
            # The booking id: ours, else 1.6.1's name for it, else drawn.
            rid = req.reservation_id if req.reservation_id is not None else req.selection_id
            if rid is None:
                rid = str(uuid.UUID(int=self._rng.getrandbits(128), version=4))
        self._limits.id_length("selection_id", req.selection_id)
        self._limits.id_length("fairness_id", req.fairness_id)
        self._limits.id_length("policy_class", req.policy_class)
        prompt = self._limits.prompt(req, pool)
        session, bound = self._session(pool, req, reserve, now)
        candidates, excluded = self._candidates(req, pool, bound)
        return Selection(pool, req, rid, prompt, candidates, excluded, estimates(pool, prompt.blocks),
                         session, bound)

    def _session(self, pool: Pool, req: SelectRequest, booking: bool, now: float
                 ) -> tuple[str | None, Rank | None]:
        """The session a request steers by (none with a `pinned_worker`, or with affinity off) and
        its live binding. A booking forgets a binding whose rank left; a `/select` only reads."""
        session = req.session
        if self._settings.session_affinity_ttl_secs is None or session is None or req.pinned_worker:
            return None, None
        check_session_id(session)
        bound = pool.sessions.target(session, now)
        if bound is not None and bound not in pool.workers.get(bound[0], ()):
            if booking:
                pool.sessions.forget(session)
            bound = None
        return session, bound

    def _candidates(self, req: SelectRequest, pool: Pool, bound: Rank | None = None,
                    roles: bool = True) -> tuple[list[Rank], dict[Rank, str]]:
        """`roles`: a prefill worker is no candidate unless the request names its workers
        (docs/PD.md); a plan sorts roles itself."""
        excluded: dict[Rank, str] = {}
        ranks = pool.ranks()
        allowed = req.allowed_worker_ids
        pinned = req.pinned_worker
        required = req.routing_constraints.required_taints
        if pinned is not None:
            if allowed is not None and pinned.worker_id not in allowed:
                raise BadRequest(f"pinned worker {pinned.worker_id} is not in allowed worker set")
            rank = (pinned.worker_id, pinned.dp_rank)
            taints = pool.taints.get(pinned.worker_id, frozenset())
            if rank not in pool.tracker.loads or not taints.issuperset(required):
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
        elif roles and pool.prefill_only:
            candidates = []
            for r in ranks:
                if r[0] in pool.prefill_only:
                    excluded[r] = "prefill_role"
                else:
                    candidates.append(r)
        if required:
            kept = []
            for r in candidates:
                if pool.taints[r[0]].issuperset(required):
                    kept.append(r)
                else:
                    excluded[r] = "missing_required_taint"
            candidates = kept
        if bound is not None and bound in candidates and not self._overloaded(pool, bound):
            # A session's live binding is the only candidate while it is eligible.
            for r in candidates:
                if r != bound:
                    excluded[r] = "session_affinity"
            candidates = [bound]
        if not candidates:
            raise NotReady("no endpoints available to route work")
        return candidates, excluded

    def _overloaded(self, pool: Pool, rank: Rank) -> bool:
        s = self._settings
        load = pool.tracker.loads[rank]
        if s.active_prefill_tokens_threshold is not None and (
            load.prefill_tokens > s.active_prefill_tokens_threshold
        ):
            return True
        record = self._catalog[rank[0]].request
        if (s.active_prefill_tokens_threshold_frac is not None
                and record.max_num_batched_tokens is not None
                and load.prefill_tokens > s.active_prefill_tokens_threshold_frac
                * record.max_num_batched_tokens):
            return True
        total = record.total_kv_blocks
        return (s.active_decode_blocks_threshold is not None and bool(total)
                and load.decode_blocks() > s.active_decode_blocks_threshold * (total or 0))

    def _filter_overloaded(self, sel: Selection) -> list[Rank]:
        """Step 9: candidates of workers whose every rank is overloaded are excluded."""
        s = self._settings
        candidates = sel.candidates
        if (s.active_prefill_tokens_threshold is None and s.active_decode_blocks_threshold is None
                and s.active_prefill_tokens_threshold_frac is None):
            return candidates
        by_worker: dict[int, list[Rank]] = {}
        for r in candidates:
            by_worker.setdefault(r[0], []).append(r)
        busy = {w for w, rs in by_worker.items() if all(self._overloaded(sel.pool, r) for r in rs)}
        if not busy:
            return candidates
        for r in candidates:
            if r[0] in busy:
                sel.excluded[r] = "overloaded"
        kept = [r for r in candidates if r[0] not in busy]
        if not kept:
            if sel.req.pinned_worker is not None:
                raise TooManyRequests(f"pinned worker {sel.req.pinned_worker.worker_id} is overloaded")
            raise TooManyRequests("all eligible workers are overloaded")
        return kept

    def _finish(self, sel: Selection, now: float) -> SelectResponse:
        """Steps 9-11: overload filter, cost, choice, booking, answer."""
        pool, req, prompt = sel.pool, sel.req, sel.prompt
        scored, lowest = score(req, pool, prompt, self._filter_overloaded(sel), sel.found, self._settings, now)
        o = req.router_config_override
        temperature = (o.router_temperature if o is not None and o.router_temperature is not None
                       else self._settings.temperature)
        chosen = choose(pool, scored, temperature, self._rng)
        track, reuse = tracks_prefill(self._settings, o), assumes_kv_reuse(self._settings, o)
        if sel.rid is not None:
            if sel.session is not None and sel.bound is not None and chosen.rank != sel.bound:
                pool.sessions.forget(sel.session)  # hard affinity: the binding is dropped, 400
                raise mismatch(sel.session, sel.bound, chosen.rank)
            booking = self._book(pool, sel.rid, chosen.rank, prompt, chosen.cached, track, reuse,
                                 req.expected_output_tokens, now, _scheduler_conflict,
                                 chosen.device if pool.side is None else None, holder=self._holder(req))
            if sel.session is not None:
                booking.lease = pool.sessions.lease(sel.session, chosen.rank, now)
        elif req.selection_id is not None:
            session = req.session if req.pinned_worker is None else None
            self.pending.remember(pool.key, req.selection_id, PendingSelection(
                chosen.rank, prompt, chosen.cached, track, reuse, req.expected_output_tokens, session,
                now, entry_size(pool.key, req.selection_id, prompt, req.lora_name, session)), now)
        differs = lowest is not None and chosen.dynamo_logit > lowest  # Dynamo's cost would choose otherwise
        self._metrics.selected(pool.key, chosen.cached / prompt.isl if prompt.isl > 0 else None,
                               chosen.device < max(map(DEVICE, scored)), differs)
        device, bs = sel.found[0], pool.block_size
        longest, most, loss = account(self._metrics, pool, sel, chosen, scored, self._settings, now)
        shadow = None
        if self._settings.shadow_policy is not None:
            shadow = shadowed(self._metrics, pool, self._settings.shadow_policy, scored, chosen, now)
        request_id = sel.rid if sel.rid is not None else req.selection_id
        pool.recent.append(Decision.of(now, prompt.isl, chosen, scored, lowest is not None, request_id=request_id,
                                       achievable=most, loss=loss, shadow=shadow))
        if self.log_decisions:
            self._outbox.append(Notice("selection", (
                ("model_name", req.model_name), ("tenant_id", req.tenant_id), ("worker_id", chosen.rank[0]),
                ("dp_rank", chosen.rank[1]), ("logit", chosen.logit), ("cached_tokens", chosen.cached),
                ("isl_tokens", prompt.isl), ("candidates", len(scored)), ("excluded", len(sel.excluded)),
                ("booked", sel.rid), ("session", sel.session)), "debug"))
        record = self._catalog[chosen.rank[0]].request
        worker = chosen.rank[0]
        ranks = pool.workers[worker]
        overlap = Overlap(longest_matched=longest * bs, gpu=chosen.device * bs,
                          dp={str(chosen.rank[1]): chosen.device * bs} if len(ranks) == 1 else
                          {str(r[1]): device.get(r, 0) * bs for r in ranks},
                          cpu=(chosen.device + chosen.host_ext) * bs,
                          disk=(chosen.device + chosen.host_ext + chosen.disk_ext) * bs)
        # 1.6.1 counts the prompt's partial last block as one more decode block.
        partial = 1 if self._settings.track_active_blocks and prompt.isl > len(prompt.blocks) * bs else 0
        booked = pool.tracker.bookings.get(sel.rid) if sel.rid is not None else None
        worker_load: dict[str, int] | None = None
        if req.advisory and sel.rid is None:
            worker_load = {"active_prefill_tokens": pool.tracker.loads[chosen.rank].prefill_tokens,
                           "prefill_token_capacity": record.max_num_batched_tokens or NO_CAPACITY}
            if record.total_kv_blocks is not None:
                worker_load["total_kv_blocks"] = record.total_kv_blocks
        response = SelectResponse(
            selection_id=req.selection_id if req.selection_id is not None else sel.rid,
            reservation_id=sel.rid, model_name=req.model_name, tenant_id=req.tenant_id, worker_id=worker,
            dp_rank=chosen.rank[1],
            endpoint=record.endpoint or "", effective_overlap_blocks=float(chosen.effective),
            cached_tokens=chosen.cached, block_size=bs, overlap=overlap,
            effective_prefill_tokens=max(0, prompt.isl - chosen.cached),
            potential_decode_blocks=chosen.decode_blocks + partial,
            sequence_hashes=None if booked is None else SignedHashes(
                booked.blocks or prompt.seqs, prompt.encoded_seqs if reuse or not booked.blocks else None),
            isl_tokens=None if booked is None else prompt.isl,
            track_prefill_tokens=None if booked is None else track, worker_load=worker_load, decision=decision(
                chosen, scored, prompt.isl, self._settings.router_policy) if self._settings.explain_header else None)
        if req.explain:
            response = attrs.evolve(response, candidates=explain(scored, lowest is not None),
                                    lane=self.lane_of(req, sel.queued_secs) if self._settings.queueing else None,
                                    excluded=tuple(Excluded(worker_id=r[0], dp_rank=r[1], reason=why)
                                                   for r, why in sorted(sel.excluded.items())))
        return response

    # -- the admission queue (core.md §10; queueing.py) --------------------------------------------

    def _retry(self, pool: Pool, entry: QueuedSelection, now: float) -> Selection | None:
        """A queued selection made ready to run, or None while its candidates are all busy."""
        req = entry.req
        session, bound = self._session(pool, req, entry.rid is not None, now)
        candidates, excluded = self._candidates(req, pool, bound)
        if all(self._busy(pool, r) for r in candidates):
            return None
        return Selection(pool, req, entry.rid, entry.prompt, candidates, excluded,
                         estimates(pool, entry.prompt.blocks), session, bound, now - entry.enqueued_at)

    # -- bookings ----------------------------------------------------------------------------------

    def expire(self, pool: Pool, now: float) -> bool:
        """Forget bookings older than `active_request_expiry_secs`; True when any went."""
        if expired := pool.expire(now, self._settings.active_request_expiry_secs):
            self._metrics.booking(pool.key, "expired", len(expired))
            if orphans := sum(1 for b in expired if b.plan):
                self._metrics.plan_event(pool.key, "orphan_expired", orphans)
            self._end_followers(pool, now)
        return bool(expired)

    def _book(self, pool: Pool, rid: str, rank: Rank, prompt: PromptHashes, cached: int,
              track_prefill: bool, reuse: bool, expected_output_tokens: int | None, now: float,
              duplicate: Callable[[DuplicateReservation], SelectionError] | None = None,
              device_blocks: int | None = None, *, decode_blocks: bool = True, predict: bool = True,
              holder: str | None = None) -> Booking:
        """Book `prompt` on `rank` as `rid`; `duplicate` words the 409 of an id already booked;
        `device_blocks`: the prompt's blocks the rank's index holds, when the caller knows;
        `decode_blocks`: the booking holds the prompt's blocks (a plan's prefill leg does not);
        `predict`: the prompt's blocks are predicted cached on the rank now (else `_predict`);
        `holder`: the fairness ID whose in-flight prompts it counts in (`fairness_kv_share`)."""
        self.expire(pool, now)
        if self.journal is not None and getattr(pool.tracker.bookings.get(rid), "owner", None) is not None:
            self.journal.check_booking(rid, again=True)  # another replica's booking of the id, its free
            pool.free(rid, now)  # maybe on its way: the ledger keeps this one behind it (REPLICATION.md)
        try:
            self._limits.reservations(pool, rid)
        except DuplicateReservation as exc:
            if duplicate is not None:
                raise duplicate(exc) from None
            raise
        self._limits.state_budget(f"booking {rid}")
        if self.journal is not None:
            self.journal.check_booking(rid)
        blocks: list[int] | None = None
        if self._settings.track_active_blocks and decode_blocks:
            blocks = list(prompt.seqs) if reuse else [self._rng.getrandbits(64) for _ in prompt.seqs]
        prefill = max(0, prompt.isl - cached) if track_prefill else 0
        load = pool.tracker.loads[rank]
        pool.speeds.observe(rank, load.prefill_tokens, now, load.prefilling)
        pool.speeds.booked(rank, now)
        booking = pool.tracker.book(rid, rank, blocks, prefill, expected_output_tokens, now, pairs=prefill * (
            cached + prefill * 0.5), defer=self._deferred.add if not self._dispatching else None,
                                    holder=None if holder is None else (holder, max(1, prompt.isl - cached)))
        pool.watch[rank].booked(booking, len(prompt.blocks), prompt.isl, cached, pool.block_size, now)
        self._metrics.booking(pool.key, "booked")
        if self.journal is not None:
            self.journal.booked(pool.key, booking, len(pool.ranks()))
        if prefill and self._reads_prefill_ends and pool.fresh[rank].last_event_at is not None:
            pool.prefill_ends.booked(booking)
            self._watch_prefill(pool, booking, prompt, device_blocks, now)
        if predict:
            self._predict(pool, rank, prompt, now)
        return booking

    def _predict(self, pool: Pool, rank: Rank, prompt: PromptHashes, now: float) -> None:
        """The prompt's blocks will be in the rank's cache (predicted_ttl_secs, approximate mode)."""
        if pool.predictions is not None:
            pieces = pool.predictions.pieces(rank, prompt.blocks, now, prompt.seqs if prompt.chained else None,
                                             PIECE_BLOCKS)
            for piece in pieces:
                if self._dispatching:
                    piece()  # a queued selection's: the next one this dispatch runs must see them
                else:
                    self._deferred.add(piece)  # after the answer is written (deferred.py): no answer reads them

    def reserve(self, req: ReservationRequest, now: float) -> ReservationResponse:
        """An explicit booking on `worker_id` (it discards a pending selection of the same id),
        or without it the booking of a pending selection."""
        rid = req.reservation_id if req.reservation_id is not None else req.selection_id
        if rid is None:
            raise ShapeError("missing field `selection_id`")
        if self.stopping:
            raise NotReady(SHUTTING_DOWN)
        self._limits.id_length("reservation_id", req.reservation_id)
        self._limits.id_length("selection_id", req.selection_id)
        key = (req.model_name, req.tenant_id)
        if req.worker_id is None:
            return self._book_pending(key, rid, req.selection_id or rid, now)
        self.pending.forget(key, req.selection_id or rid)
        pool = self.gate(req.model_name, req.tenant_id, now)
        prompt = self._limits.prompt(req, pool, booking=True)
        if req.worker_id not in pool.workers:
            raise NotFound(f"schedulable worker {req.worker_id} not found for model={key[0]} routing_group={key[1]}")
        rank = (req.worker_id, 0 if req.dp_rank is None else req.dp_rank)
        if rank not in pool.workers[req.worker_id]:
            raise NotFound(f"Worker {rank_text(rank)} not found")
        cached = 0
        if prompt.blocks:
            cached = cached_tokens(rank, estimates(pool, prompt.blocks), pool.block_size, self._settings)
        o = req.router_config_override
        self._book(pool, rid, rank, prompt, cached, tracks_prefill(self._settings, o),
                   assumes_kv_reuse(self._settings, o), req.expected_output_tokens, now)
        return self._booked(rid, key, rank)

    def _book_pending(self, key: Key, rid: str, sid: str, now: float) -> ReservationResponse:
        """Book what the pending selection `sid` chose, exactly; it is used up only when the
        booking succeeds (a 503, 404 or 409 may be retried)."""
        entry = self.pending.get(key, sid, now)
        if entry is None:
            raise NotFound(MISSING.format(sid=sid, model=key[0], group=key[1]))
        pool = self.gate(*key, now)
        rank = entry.rank
        if rank not in pool.workers.get(rank[0], ()):
            raise NotFound(f"schedulable worker {rank[0]} (dp_rank {rank[1]}) not found for "
                           f"model={key[0]} routing_group={key[1]}")
        session = entry.session if self._settings.session_affinity_ttl_secs is not None else None
        if session is not None:
            bound = pool.sessions.target(session, now)
            if bound is not None and bound not in pool.workers.get(bound[0], ()):
                pool.sessions.forget(session)
            elif bound is not None and bound != rank:
                pool.sessions.forget(session)
                self.pending.forget(key, sid)  # a 400 uses the selection up
                raise mismatch(session, bound, rank)
        booking = self._book(pool, rid, rank, entry.prompt, entry.cached, entry.track_prefill,
                             entry.reuse, entry.expected_output_tokens, now,
                             lambda _: Conflict(f"selection {rid} is already reserved or being reserved"))
        if session is not None:
            booking.lease = pool.sessions.lease(session, rank, now)
        self.pending.forget(key, sid)
        return self._booked(rid, key, rank)

    def _booked(self, rid: str, key: Key, rank: Rank) -> ReservationResponse:
        return ReservationResponse(reservation_id=rid, model_name=key[0], tenant_id=key[1],
                                   worker_id=rank[0], dp_rank=rank[1],
                                   endpoint=self._catalog[rank[0]].request.endpoint or "")

    def booked_in(self, rid: str, model_name: str | None, tenant_id: str | None) -> Pool:
        """The pool that holds the booking `rid` (the first in key order), or 404."""
        return holding(self._pools, rid, model_name, tenant_id)

    def output_block(self, rid: str, decay_fraction: float | None) -> None:
        """One more decode block for a booking (1.6.1); the range is checked before the lookup."""
        if decay_fraction is not None and not 0.0 <= decay_fraction <= 1.0:
            raise BadRequest("decay_fraction must be between 0.0 and 1.0")
        pool = self.booked_in(rid, None, None)
        pool.tracker.add_output_block(rid, decay_fraction)
        if self.journal is not None:
            self.journal.progressed(pool.tracker.bookings[rid], decay_fraction)
        self._metrics.booking(pool.key, "output_block")

    def finish_booking(self, rid: str, model_name: str | None, tenant_id: str | None, now: float, *,
                       free: bool, cached_tokens: int | None = None) -> Pool:
        """Prefill completion or free of a booking; its pool. `cached_tokens`: the engine's (verdict.py)."""
        try:
            pool = self.booked_in(rid, model_name, tenant_id)
        except NotFound:
            if free and self.journal is not None and len(rid) <= self._settings.max_id_length:
                self.journal.free_unknown(rid)  # its booking may be on its way from a replica
            raise
        booked = pool.tracker.bookings[rid]
        load = pool.tracker.loads[booked.rank]
        if booked.prefill_done:
            pool.speeds.observe(booked.rank, load.prefill_tokens, now, load.prefilling)
        else:
            pool.speeds.ended(booked.rank, load.prefill_tokens, load.prefilling, booked.prefill_tokens, now,
                              completed=not free, pairs=booked.pairs)
        # The blocks a huge booking leaves are uncounted after the answer, unless queued
        # selections are about to run (they must see them gone).
        defer = self._deferred.add if not pool.queue and not self._dispatching else None
        booking = pool.free(rid, now, defer) if free else pool.tracker.prefill_complete(rid)
        pool.prefill_ends.ended(booking)  # an explicit completion is the authority: no inference follows
        self._end_followers(pool, now)
        watch = pool.watch.get(booking.rank)
        if cached_tokens is not None and watch is not None and (seen := watch.observe(booking, cached_tokens)):
            self._metrics.kv_observed(pool.key, booking.rank[0], *seen)
        if self.journal is not None:
            (self.journal.freed if free else self.journal.prefilled)(booking)
        self._metrics.booking(pool.key, "freed" if free else "prefill_complete")
        return pool


def _scheduler_conflict(exc: DuplicateReservation) -> SelectionError:
    return Conflict(f"failed to book scheduler state: {exc.message}")
