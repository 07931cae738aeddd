"""Admission (core.md §10, docs/FLOW_CONTROL.md): when a selection must wait, whether it may, where
(its lane), and what ends its wait; the `Selector`'s half that owns the queue (admission.py holds
the order). At the door, in this order, a request that would queue is refused at once with
`overload_status_code` (429) and a `Retry-After`:

1. `do_not_queue`: it asked to run now or not at all;
2. a negative `priority` (sheddable), unless `shed_sheddable` is off;
3. a full key (`queue_max_pending`) when its fairness ID holds its share of the key's queue
   already (one below its share takes the place of the newest request of the fairness ID holding
   the most, which ends `shed`), or a full class (`max_queued`, `max_queued_tokens`) or fairness
   ID (`fairness_max_queued`, `fairness_max_queued_tokens`);
4. a `deadline_ms` it cannot meet: the work ahead of it in its share, with what its candidates
   are prefilling now, at their prefill speed, then on the rank it is sent to what that rank may
   hold, its own prefill and the batch it shares, ends after the deadline.

A request with a deadline that need not wait runs only on a candidate predicted in time, or is
refused; so does a waiting one when it is dispatched (docs/FLOW_CONTROL.md). With
`fairness_kv_share`, a request also waits, though a rank is free, while its fairness ID holds more
than its share of the KV in flight and is owed nothing by the queue.

A request that waits ends at the smaller of its class's queue timeout (503) and its deadline
(`overload_status_code`, with `Retry-After`)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final

import attrs

from ..base.errors import Internal, NotReady, SelectionError, TooManyRequests
from ..base.flow_classes import FlowClass, parse_classes
from ..base.metrics import Metrics
from ..base.outputs import OutputEvent, SelectionReady
from ..base.responses import Pending, SelectResponse
from ..base.settings import Settings
from ..base.types import SelectAndReserveRequest, SelectRequest
from ..base.wire import error_response, json_response
from ..bookings.prompt import PromptHashes
from ..cache.index import Rank
from ..fleet.admission import Lane, QueuedSelection, Tickets, order_key
from ..fleet.catalog import Catalog
from ..fleet.limits import Limits
from ..fleet.outcomes import ERRORS, REFUSALS
from ..fleet.pool import Key, Pool
from .cost import Estimates, cached_tokens

__all__ = ["Admission", "Selection"]

# What the live page counts of a selection's outcome: refusals say "not now" (backpressure, no
# worker, the queue's timeout); other errors are the request's own.
_REFUSALS: Final = frozenset({429, 503, 529})


@attrs.define(slots=True)
class Selection:
    """One selection in progress: its request and pool, the booking id (select_and_reserve), the
    prompt's hashes, the candidates with why others were excluded, and what each has cached."""

    pool: Pool
    req: SelectRequest
    rid: str | None
    prompt: PromptHashes
    candidates: list[Rank]
    excluded: dict[Rank, str]
    found: Estimates
    session: str | None = None  # the session it steers by and books under (affinity on)
    bound: Rank | None = None  # that session's live binding when the selection began
    queued_secs: float = 0.0  # how long it waited in the queue


class Admission:
    """The queue's methods of `Selector` (selection.py), which provides what is declared here."""

    __slots__ = ("_dispatching",)
    _dispatching: bool
    _settings: Settings
    _metrics: Metrics
    _limits: Limits
    _catalog: Catalog
    _pools: Mapping[Key, Pool]
    _tickets: Tickets
    _outbox: deque[OutputEvent]
    _internal_error: Callable[[str], None]

    if TYPE_CHECKING:
        def _finish(self, sel: Selection, now: float) -> SelectResponse: ...
        def _retry(self, pool: Pool, entry: QueuedSelection, now: float) -> Selection | None: ...

    def _outcome(self, key: Key, route: str, status: int, now: float) -> None:
        """A selection's final outcome: counted, and in its key's last minute (outcomes.py)."""
        self._metrics.selection(key, route, status)
        pool = self._pools.get(key)
        if pool is not None and status != 200:  # a selection is counted where it is made (selection.py)
            pool.outcomes.ended(now, REFUSALS if status in _REFUSALS else ERRORS)

    def _busy(self, pool: Pool, rank: Rank) -> bool:
        threshold = self._settings.queue_threshold
        assert threshold is not None
        limit = self._catalog[rank[0]].request.max_num_batched_tokens or 0
        return pool.tracker.loads[rank].prefill_tokens > threshold * limit

    def _uncached(self, sel: Selection) -> int:
        """What a selection's work costs in flow control: its uncached tokens on the candidate
        that has the most of its prompt cached (at least 1)."""
        pool = sel.pool
        cached = max((cached_tokens(r, sel.found, pool.block_size, self._settings) for r in sel.candidates), default=0)
        return max(1, sel.prompt.isl - cached)

    def _holder(self, req: SelectRequest) -> str | None:
        """The fairness ID a booking of `req` counts for, when `fairness_kv_share` is on."""
        s = self._settings
        return self._lane(req).fairness_id if s.fairness_kv_share is not None and s.queueing and s.fairness else None

    def _over_kv_share(self, pool: Pool, req: SelectRequest, uncached: int) -> bool:
        """`fairness_kv_share`: a request waits when its fairness ID is owed nothing in the queue
        (served at least as much as every other waiting in its class: `FlowQueue.ahead`), another
        fairness ID has a booking in flight or a request waiting, and the uncached tokens its
        fairness ID has in flight with its own `uncached` would pass that multiple of an equal
        share of the key's KV cache (the ranks' `total_kv_blocks`). The KV a heavy tenant's
        requests would hold while they decode is then left for the others' arrivals: the router
        cannot take it back once sent.
        A fairness ID with nothing in flight always runs one (a prompt larger than a share must
        run some time). Visits the fairness IDs in flight and the flows waiting."""
        holder = self._holder(req)
        if holder is None:
            return False
        held = pool.tracker.held
        mine = held.get(holder, 0)
        if not mine:
            return False
        present = len(held) + sum(1 for fid in pool.queue.fairness_ids() if fid not in held and fid != holder)
        if present < 2 or not pool.queue.ahead(self._lane(req)):
            return False
        blocks = sum(self._catalog[r[0]].request.total_kv_blocks or 0 for r in pool.ranks())
        share = self._settings.fairness_kv_share
        assert share is not None
        return bool(blocks) and (mine + uncached) * present > share * blocks * pool.block_size

    def policy_class(self, name: str | None) -> FlowClass:
        """The class a request names; an unknown or absent name is the default (the first)."""
        classes = parse_classes(self._settings.flow_classes)
        return next((c for c in classes if c.name == name), classes[0])

    def _refuse(self, pool: Pool, lane: Lane, reason: str, message: str, retry_after: float | None) -> TooManyRequests:
        self._metrics.queue(pool.key, "rejected_full" if reason == "full" else "shed")
        self._metrics.flow(pool.key, lane.policy_class, lane.fairness_id, "shed")
        return TooManyRequests(message, self._settings.overload_status_code, retry_after)

    @staticmethod
    def _drain_secs(pool: Pool, ranks: Iterable[Rank], tokens: int) -> float:
        """How long `ranks` take to prefill `tokens` more than what they are prefilling now."""
        ranks = list(ranks)
        rate = sum(1.0 / pool.speeds.of[r[0]][0] for r in ranks if r[0] in pool.speeds.of) or 1.0
        busy = sum(pool.tracker.loads[r].prefill_tokens for r in ranks)
        return (busy + tokens) / rate

    def _lane(self, req: SelectRequest) -> Lane:
        return Lane(req.priority or 0, self.policy_class(req.policy_class).name,
                    (req.fairness_id or "") if self._settings.fairness else "")

    def _first_token_secs(self, sel: Selection, rank: Rank, booked: int) -> float:
        """Seconds from the request's dispatch to `rank`, holding `booked` prefill tokens then, to
        its first token: those tokens, its own uncached ones, and the batch its last chunk shares.
        Other requests join that batch only while the rank is not busy, that is while what it holds,
        this request's tokens included, is at most `queue_threshold` times its batch
        (`max_num_batched_tokens`): then up to one batch of theirs is counted."""
        pool = sel.pool
        own = max(1, sel.prompt.isl - cached_tokens(rank, sel.found, pool.block_size, self._settings))
        batch = self._catalog[rank[0]].request.max_num_batched_tokens or 0
        threshold = self._settings.queue_threshold
        assert threshold is not None
        mates = batch if own <= threshold * batch else 0
        return (booked + own + mates) * pool.speeds.of[rank[0]][0]

    def _in_time(self, sel: Selection, now: float, deadline_at: float) -> TooManyRequests | None:
        """A request with a deadline runs only where it is predicted in time: on its candidates that
        are not busy and whose first token comes before `deadline_at` (the others are excluded,
        `deadline`). When some are not busy and none is in time: the refusal to answer."""
        pool = sel.pool
        free = [(r, self._first_token_secs(sel, r, pool.tracker.loads[r].prefill_tokens))
                for r in sel.candidates if not self._busy(pool, r)]
        kept = [r for r, secs in free if now + secs <= deadline_at]
        if free and not kept:
            soonest = min(secs for _, secs in free)
            return TooManyRequests(
                f"deadline_ms {sel.req.deadline_ms:g} cannot be met: predicted time to first token "
                f"{sel.queued_secs + soonest:.3f} s on its soonest candidate that is not busy",
                self._settings.overload_status_code, now + soonest - deadline_at)
        for r in sel.candidates:
            if r not in kept:
                sel.excluded[r] = "deadline"
        sel.candidates = kept
        return None

    def _enqueue(self, sel: Selection, now: float) -> Pending:
        s, pool, req = self._settings, sel.pool, sel.req
        cls = self.policy_class(req.policy_class)
        lane = self._lane(req)
        cached = max((cached_tokens(r, sel.found, pool.block_size, s) for r in sel.candidates), default=0)
        cost = max(1, sel.prompt.isl - cached)
        busy_now = f"every candidate for {pool.label} is busy"
        if req.do_not_queue:
            raise self._refuse(pool, lane, "do_not_queue", f"do_not_queue: {busy_now}", self._drain_secs(pool, sel.candidates, 0))
        if lane.tier < 0 and s.shed_sheddable:
            raise self._refuse(pool, lane, "sheddable", f"sheddable request (priority {lane.tier}) refused: "
                               f"{busy_now}", self._drain_secs(pool, sel.candidates, 0))
        ahead = pool.queue.work_ahead(lane)  # one visit of each flow: bounded by the queue's lanes
        shed = None
        if len(pool.queue) >= s.queue_max_pending:
            # Full: a fairness ID below its share takes the place of the heaviest one's newest
            # request (so the cap still bounds the queue); one at or above its share is refused.
            shed = pool.queue.make_room(lane.fairness_id, s.queue_max_pending)
        if shed is None and len(pool.queue) >= s.queue_max_pending:
            raise self._refuse(pool, lane, "full", f"queue is full for {pool.label}: {s.queue_max_pending} "
                               "requests pending", self._drain_secs(pool, sel.candidates, ahead))
        for what, name, max_queued, max_tokens in (
                ("class", cls.name, cls.max_queued, cls.max_queued_tokens),
                ("fairness", lane.fairness_id, s.fairness_max_queued, s.fairness_max_queued_tokens)):
            queued, tokens = pool.queue.queued(what, name)
            word = f"policy class {name}" if what == "class" else f"fairness ID {name!r}"
            if max_queued is not None and queued + 1 > max_queued:
                raise self._refuse(pool, lane, "full", f"queue is full for {word} of {pool.label}: {queued} "
                                   "requests pending", self._drain_secs(pool, sel.candidates, ahead))
            if max_tokens is not None and tokens + cost > max_tokens:
                raise self._refuse(pool, lane, "full", f"queue is full for {word} of {pool.label}: {tokens} "
                                   "uncached tokens pending", self._drain_secs(pool, sel.candidates, ahead))
        deadline_at = math.inf if req.deadline_ms is None else now + req.deadline_ms / 1000.0
        if req.deadline_ms is not None:
            # Until its dispatch every candidate is busy, prefilling at its speed what is booked and
            # what runs before it; then it goes to a rank that is not busy (holding at most
            # queue_threshold times its batch), and the slowest such candidate counts.
            threshold = s.queue_threshold
            assert threshold is not None
            predicted = self._drain_secs(pool, sel.candidates, ahead) + max(self._first_token_secs(
                sel, r, math.floor(threshold * (self._catalog[r[0]].request.max_num_batched_tokens or 0)))
                for r in sel.candidates)
            if now + predicted > deadline_at:
                raise self._refuse(pool, lane, "deadline", (
                    f"deadline_ms {req.deadline_ms:g} cannot be met: predicted time to first token "
                    f"{predicted:.3f} s with {ahead} uncached tokens ahead in its share"), now + predicted - deadline_at)
        timeout = cls.queue_timeout_secs if cls.queue_timeout_secs is not None else s.queue_timeout_secs
        order = order_key(s.queue_policy, max(0.0, req.priority_jump or 0.0), now - pool.epoch, sel.prompt.isl, cached)
        if shed is not None:  # every check passed: only now is anything changed
            pool.queue.remove(shed)
            held, _ = pool.queue.queued("fairness", shed.lane.fairness_id)
            self._resolve(pool, shed, TooManyRequests(
                f"queue is full for {pool.label}: shed for a fairness ID within its share (fairness ID "
                f"{shed.lane.fairness_id!r} held {held + 1} of {s.queue_max_pending} requests pending)",
                s.overload_status_code, self._drain_secs(pool, pool.ranks(), pool.queue.work_ahead(shed.lane))),
                "shed", now)
        ticket = self._tickets.issue(pool.key)
        pool.queue.push(QueuedSelection(ticket, order, req, sel.rid, sel.prompt, now, lane, cost,
                                        min(now + timeout, deadline_at), deadline_at))
        self._metrics.queue(pool.key, "queued")
        self._metrics.flow(pool.key, lane.policy_class, lane.fairness_id, "queued")
        return Pending(ticket)

    def _resolve(self, pool: Pool, entry: QueuedSelection, result: SelectResponse | SelectionError,
                 outcome: str, now: float) -> None:
        """Emit the one SelectionReady of a ticket."""
        self._tickets.end(entry.ticket)
        route = "select_and_reserve" if isinstance(entry.req, SelectAndReserveRequest) else "select"
        if isinstance(result, SelectionError):
            extra = result.headers() if isinstance(result, TooManyRequests) else ()
            response = error_response(result.status, result.message, extra)
        else:
            response = json_response(200, result.to_json())
        self._outcome(pool.key, route, response.status, now)
        self._metrics.queue(pool.key, outcome, now - entry.enqueued_at)
        self._metrics.flow(pool.key, entry.lane.policy_class, entry.lane.fairness_id, outcome, now - entry.enqueued_at)
        self._outbox.append(SelectionReady(entry.ticket, result, response))

    def fail_queue(self, pool: Pool, error: SelectionError, outcome: str, now: float) -> None:
        """End every ticket of the pool with `error` (its last worker left, or shutdown)."""
        for entry in pool.queue.take_all():
            self._resolve(pool, entry, error, outcome, now)

    def dispatch(self, pool: Pool | None, now: float) -> None:
        """Run queued requests, next first (admission.py), while one has a candidate that is not
        busy; one whose candidates are all busy is passed over until the next look, and so is a
        fairness ID over its share of the KV in flight (`fairness_kv_share`)."""
        if pool is None or not pool.queue or self._dispatching:
            return
        self._dispatching = True
        passed_over: set[int] = set()
        held_back: set[str] = set()  # over their share of the KV in flight: for this look, as it only grows
        try:
            while (entry := pool.queue.next(now, passed_over, held_back)) is not None:
                if all(self._busy(pool, r) for r in pool.ranks()):
                    break  # every rank is busy: no entry can run, whatever its candidates
                if self._over_kv_share(pool, entry.req, entry.cost):
                    held_back.add(entry.lane.fairness_id)
                    continue
                try:
                    sel = self._retry(pool, entry, now)
                    if sel is None:
                        passed_over.add(entry.ticket)
                        continue
                    late = self._in_time(sel, now, entry.deadline_at) if entry.deadline_at < math.inf else None
                    if late is not None:  # its candidates free up too late: refused now, not at its deadline
                        pool.queue.remove(entry)
                        self._resolve(pool, entry, late, "deadline", now)
                        continue
                    pool.queue.take(entry)
                    result: SelectResponse | SelectionError = self._finish(sel, now)
                    outcome = "dispatched"
                except SelectionError as exc:
                    pool.queue.remove(entry)
                    result, outcome = exc, "failed"
                except Exception:  # noqa: BLE001 - confined to this ticket; the caller's call stands
                    pool.queue.remove(entry)
                    self._internal_error("dispatch")
                    result, outcome = Internal("internal error"), "failed"
                self._resolve(pool, entry, result, outcome, now)
        finally:
            self._dispatching = False

    def expire_queue(self, pool: Pool, now: float) -> None:
        for entry in pool.queue.late(now):
            pool.queue.remove(entry)
            waited = format(now - entry.enqueued_at, ".3g")
            error: SelectionError
            if entry.deadline_at <= now:  # a refusal like the door's: when what is ahead of it has drained
                error = TooManyRequests(f"request deadline exceeded: deadline_ms {entry.req.deadline_ms:g} passed "
                                        f"after {waited} s in the queue for {pool.label}",
                                        self._settings.overload_status_code,
                                        self._drain_secs(pool, pool.ranks(), pool.queue.work_ahead(entry.lane)))
                outcome = "deadline"
            else:
                timeout = format(entry.expires_at - entry.enqueued_at, "g")
                error, outcome = NotReady(f"timed out after {timeout} s waiting in the queue for {pool.label}"), "timed_out"
            self._resolve(pool, entry, error, outcome, now)

    def cancel(self, ticket: int) -> bool:
        key = self._tickets.end(ticket)
        pool = self._pools.get(key) if key is not None else None
        entry = pool.queue.find(ticket) if pool is not None else None
        if pool is None or entry is None:
            return False
        pool.queue.remove(entry)
        self._metrics.queue(pool.key, "cancelled")
        self._metrics.flow(pool.key, entry.lane.policy_class, entry.lane.fairness_id, "cancelled")
        return True

    def lane_of(self, req: SelectRequest, queued_secs: float) -> dict[str, Any]:
        """What `explain` says of a request's lane."""
        return {"priority": req.priority or 0, "policy_class": self.policy_class(req.policy_class).name,
                "fairness_id": req.fairness_id or "", "queued_secs": round(queued_secs, 6)}
