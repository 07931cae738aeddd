"""Replicas sharing one booking ledger (docs/REPLICATION.md): the mirror that applies every
replica's changes from the ledger's ordered feed with `now`, and the answers held for the ledger.
It owns the journal (journal.py) that the transport drains and writes like `data_to_send`.

The tracker stays the one place load is counted; the ledger keeps it equal across replicas. Own
changes are applied at once and journaled; other replicas' arrive as feed entries. A snapshot
replaces the mirror whole (start, gap, reset). In strict admission a booking's answer is held
until the ledger confirms no other replica booked that rank meanwhile; a conflict undoes it and
selects again once the feed has caught up."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .base import jsonio
from .base.codec import from_json
from .base.deferred import Deferred
from .base.errors import NotFound, SelectionError
from .base.metrics import LEDGER_CONNECTED, LEDGER_EVENTS, LEDGER_OUTBOX, Metrics
from .base.outputs import OutputEvent, SelectionReady
from .base.responses import Pending, StatusOk
from .base.types import WorkerCatalogRecord, WorkerRequest
from .base.wire import Response, error_response, json_response
from .fleet.admission import Tickets
from .fleet.catalog import Catalog
from .fleet.journal import LEDGER_DOWN, Journal, LedgerOp, LedgerSettings, booked_again, may_be_booked
from .fleet.ledger_wire import (
    ADD,
    DELETED,
    EXPIRE,
    FREE,
    PREFILL,
    PROGRESS,
    TOMB,
    WORKER,
    AddRecord,
    FeedEntry,
    LedgerSnapshot,
    LedgerWireError,
    Reply,
    decode_add,
    decode_counts,
    decode_entry,
    decode_progress,
    entry_number,
    rank_key,
)
from .fleet.pool import Key, Pool
from .routing.selection import Selector

__all__ = ["Ledger"]

Request = tuple[str, str, str, tuple[tuple[str, str], ...], Any]


class _Hold:
    __slots__ = ("ticket", "request", "result", "outstanding", "retry_after", "freed", "tries", "grace")

    def __init__(self, ticket: int, request: Request, result: Response) -> None:
        self.ticket = ticket
        self.request = request
        self.result = result
        self.outstanding = 0
        self.retry_after: int | None = None  # a conflict: select again once the feed reaches this
        self.freed = False  # a written-through free found its booking
        self.tries = 0
        self.grace: float | None = None  # a free the ledger remembered: until when its booking may come


class Ledger:
    """The mirror of the shared ledger, and the answers held for it."""

    def __init__(self, settings: LedgerSettings, origin: str, *, pools: Mapping[Key, Pool],
                 catalog: Catalog, selector: Selector, metrics: Metrics, tickets: Tickets,
                 outbox: deque[OutputEvent],
                 upsert: Callable[..., object], delete: Callable[..., object],
                 rerun: Callable[[Request, float], Response | Pending], deferred: Deferred) -> None:
        self.settings = settings
        self.origin = origin  # this incarnation's name in the feed
        self.journal = Journal(settings, origin)
        self.epoch: str | None = None
        self.cursor = b"0-0"  # its id: where the feed is read on
        self.synced = False  # a snapshot has been applied since the last connect
        self.needs_snapshot = True  # a gap, a reset or a start: the transport loads one
        self.warming = False  # the transport fills the index from a peer before joining
        self._pools = pools
        self._catalog = catalog
        self._selector = selector
        self._metrics = metrics
        self._tickets = tickets
        self._outbox = outbox
        self._upsert = upsert
        self._delete = delete
        self._rerun = rerun
        self._holds: dict[int, _Hold] = {}
        self._frees: dict[str, _Hold] = {}  # rid -> a free waiting for its booking (free_grace_secs)
        self._rerunning: _Hold | None = None
        self._deferred = deferred  # run first by every input, as by every service call (deferred.py)
        selector.journal = self.journal

    @property
    def n(self) -> int:
        """The last feed entry applied (the journal stamps each booking with it)."""
        return self.journal.seen

    @n.setter
    def n(self, value: int) -> None:
        self.journal.seen = value

    # -- state for /ready and /metrics -------------------------------------------------------------

    def ready(self) -> bool:
        """Bookings may be made: synced, unless away in open mode (local state serves)."""
        if self.warming or (self.settings.failure == "closed" and not self.journal.connected):
            return False
        return self.synced or (self.epoch is not None and not self.journal.connected)

    def joined(self) -> bool:
        """Connected and synced: every request, catalog writes included, can be served (in open
        mode `ready` is also true while away, when catalog writes are refused)."""
        return self.synced and self.journal.connected and not self.warming

    def details(self) -> list[str]:
        if self.warming:
            return ["index: warming", "ledger: syncing"]
        if not self.journal.connected:
            return ["ledger: disconnected" if self.epoch is not None else "ledger: syncing"]
        return [] if self.synced else ["ledger: syncing"]

    def report(self) -> None:
        self._metrics.record(LEDGER_CONNECTED, (), 1.0 if self.journal.connected else 0.0)
        self._metrics.record(LEDGER_OUTBOX, (), float(len(self.journal.ops)))

    def _count(self, event: str, n: int = 1) -> None:
        self._metrics.record(LEDGER_EVENTS, (event,), float(n))

    # -- requests: holding answers for the ledger -------------------------------------------------

    def begin_request(self) -> None:
        self.journal.in_request = True

    def held(self, request: Request, result: Response | Pending, now: float) -> Response | Pending:
        """The answer of a request: `result`, or a `Pending` when it waits for the ledger."""
        journal = self.journal
        journal.in_request = False
        sync, journal.sync = journal.sync, []
        hold = self._rerunning
        if not sync:
            if hold is not None:
                self._answer(hold, result if isinstance(result, Response) else error_response(
                    503, "strict admission: the retried selection was queued; retry the request"))
            return result
        assert isinstance(result, Response)
        if hold is None:
            hold = _Hold(self._tickets.issue(None), request, result)
            self._holds[hold.ticket] = hold
        hold.result, hold.retry_after, hold.outstanding = result, None, len(sync)
        for op in sync:
            op.hold = hold.ticket
        return Pending(hold.ticket)

    def _answer(self, hold: _Hold, response: Response) -> None:
        self._holds.pop(hold.ticket, None)
        self._outbox.append(SelectionReady(hold.ticket, None, response))

    def _settle(self, hold: _Hold, now: float) -> None:
        if hold.outstanding or hold.grace is not None:
            return
        if hold.retry_after is not None:
            if self.n >= hold.retry_after:
                self._retry(hold, now)
        elif hold.freed and hold.result.status != 200:  # a 200 keeps its own body (a plan's release)
            self._answer(hold, json_response(200, StatusOk().to_json()))
        else:
            self._answer(hold, hold.result)

    def _retry(self, hold: _Hold, now: float) -> None:
        """Select again on the view the feed has brought: the strict booking conflicted."""
        hold.tries += 1
        self._rerunning, self.journal.tries = hold, hold.tries
        try:
            self._rerun(hold.request, now)  # through `handle`, whose `held` answers or holds again
        finally:
            self._rerunning, self.journal.tries = None, 0

    def next_deadline(self) -> float | None:
        """When `tick` has a held free to answer 404."""
        return min((h.grace for h in self._frees.values() if h.grace is not None), default=None)

    def tick(self, now: float) -> None:
        """Answer the frees whose booking did not come within `free_grace_secs`: 404, as unknown."""
        self._deferred.run()
        for rid, hold in list(self._frees.items()):
            if hold.grace is not None and hold.grace <= now:
                del self._frees[rid]
                hold.grace = None
                if hold.outstanding:  # written through before an outage, and unanswered since
                    self._answer(hold, error_response(503, may_be_booked(rid)))
                else:
                    self._settle(hold, now)

    # -- the transport's inputs --------------------------------------------------------------------

    def connected(self, up: bool, now: float) -> None:
        """The transport reached the ledger, or lost it. Lost: held strict bookings stand as
        advisory ones (open mode) or are undone and refused (closed mode)."""
        self._deferred.run()
        journal = self.journal
        if up == journal.connected:
            return
        journal.connected = up
        if up:
            return
        self.synced = False
        self.needs_snapshot = True
        closed = self.settings.failure == "closed"
        for op in list(journal.ops):
            # A booking of an id used again, still unanswered: answered now, it would reach the
            # ledger after the reconnect, maybe behind a free of it sent elsewhere after that
            # answer (`Journal.check_booking`). Undone, and answered as one made while away.
            hold = self._holds.get(op.hold) if op.kind == ADD and op.again and op.hold is not None else None
            if hold is not None:
                journal.ops.remove(op)
                self._retract(op.ident, now)
                self._answer(hold, error_response(503, booked_again(op.ident)))
        for op in list(journal.ops):
            if op.kind == ADD and op.count is not None:
                op.count = None
                if closed:
                    journal.ops.remove(op)
                    self._retract(op.ident, now)
        # A written-through free the ledger has not answered yet: its booking may be held on
        # another replica, so it is no 404. It waits for the ledger's word across the reconnect
        # (its op stays queued), at most `free_grace_secs`, then answers 503: retry.
        through = {op.hold: op.ident for op in journal.ops
                   if op.kind == FREE and not op.owner and op.hold is not None}
        remembered = {hold.ticket: rid for rid, hold in self._frees.items()}
        self._frees.clear()
        for hold in list(self._holds.values()):
            rid = through.get(hold.ticket)
            if rid is not None and not hold.freed:
                if hold.grace is None:
                    hold.grace = now + self.settings.free_grace_secs
                self._frees[rid] = hold
            elif closed and hold.retry_after is None and not _is_free(hold):
                self._answer(hold, error_response(503, LEDGER_DOWN))
            elif hold.ticket in remembered and not hold.freed:
                # The ledger remembered the free (`tombstoned`); whether its booking came
                # meanwhile is unknown until the ledger is back.
                self._answer(hold, error_response(503, may_be_booked(remembered[hold.ticket])))
            else:
                hold.outstanding, hold.retry_after, hold.grace = 0, None, None
                self._settle(hold, now)
        for op in journal.ops:
            if op.hold not in through:
                op.hold = None

    def results(self, ops: list[LedgerOp], replies: list[Reply], now: float) -> None:
        """The ledger's reply to one write of `ops`."""
        self._deferred.run()
        journal = self.journal
        for op, reply in zip(ops, replies, strict=True):
            word = reply.word
            if op.kind == ADD:
                if word == "ok" and reply.n > self.n:
                    journal.own.setdefault(op.rank_key, set()).add(reply.n)
                elif word == "queued":
                    self._count("queued")  # the id's previous booking has not ended yet: it starts then
                elif word in ("freed", "dup", "conflict"):
                    # freed: a free reached the ledger first; dup: another replica booked this id.
                    self._retract(op.ident, now)
                    self._count({"freed": "tombstone_hit", "dup": "duplicate", "conflict": "conflict"}[word])
                    if word == "dup":
                        self.needs_snapshot = True  # theirs is the booking: load it
            elif op.kind == FREE and word != "ok":
                journal.through.discard(op.ident)  # no entry of it will follow
            hold = self._holds.get(op.hold) if op.hold is not None else None
            if hold is None:
                continue
            hold.outstanding -= 1
            if op.kind == FREE and hold.grace is not None and self._frees.get(op.ident) is hold:
                del self._frees[op.ident]  # the wait across an outage ends with the ledger's word
                hold.grace = None
            if word == "conflict":
                hold.retry_after = reply.n
            elif op.kind == FREE and word == "ok":
                hold.freed = True
            elif op.kind == FREE and word == "tombstoned" and journal.ended.get(op.ident, 0) > reply.n:
                hold.freed = True  # its booking came after, was refused, and the feed already said so
            elif op.kind == FREE and word == "tombstoned" and journal.connected:
                # Unknown to the ledger: its booking may still be in another replica's journal.
                hold.grace = now + self.settings.free_grace_secs
                self._frees[op.ident] = hold
            elif op.kind == FREE and word in ("gone", "stale"):
                # Another replica's booking this mirror still held: it had ended (a retried free)
                # or the id was booked again since. One process would answer 404.
                hold.result = error_response(404, f"reservation {op.ident} not found")
            self._settle(hold, now)

    def apply(self, entries: Iterable[tuple[Any, Any]], now: float) -> None:
        """Feed entries as `XREAD` gives them, in order. A jump in sequence numbers (the feed was
        trimmed under this reader) stops here and asks for a snapshot."""
        self._deferred.run()
        for entry_id, fields in entries:
            if self.needs_snapshot:
                return
            try:
                n = entry_number(entry_id, fields)
            except LedgerWireError:
                self._count("bad_entry")  # without its number it cannot even be ordered
                continue
            if n <= self.n:
                continue  # already in the snapshot
            if n != self.n + 1:
                self._count("gap")
                self.needs_snapshot = True
                return
            self.n, self.cursor = n, entry_id
            try:
                self._apply(decode_entry(entry_id, fields), now)
            except LedgerWireError:
                self._count("bad_entry")
        for hold in list(self._holds.values()):
            if hold.retry_after is not None and not hold.outstanding:
                self._settle(hold, now)

    def _apply(self, entry: FeedEntry, now: float) -> None:
        kind, rid = entry.kind, entry.ident
        mine = entry.origin == self.origin
        if kind == WORKER:  # every replica applies every catalog change in feed order, its own too
            self._worker(rid, entry.body, now)
            return
        if kind == ADD:
            record = decode_add(entry.body)
            rk = rank_key(record.model_name, record.tenant_id, record.worker_id, record.dp_rank)
            journal = self.journal
            journal.adds[rk] = journal.adds.get(rk, 0) + 1
            if mine:
                journal.own.get(rk, set()).discard(entry.n)
            else:
                self._book(rid, record, entry.origin, now)
            return
        if kind == TOMB:
            return  # it only takes its place in the order
        waiting = self._frees.pop(rid, None) if kind == FREE else None
        if kind in (FREE, EXPIRE):
            self.journal.end(rid, entry.n)
        if waiting is not None:  # the booking it waited for reached the ledger, and was freed
            waiting.freed, waiting.grace = True, None
            self._settle(waiting, now)
        if mine and kind != EXPIRE and not (kind == FREE and rid in self.journal.through):
            return  # applied when made (an id may be booked again since: its echo must not touch it)
        if kind in (FREE, EXPIRE):  # a written-through free is applied here, from the feed
            self.journal.through.discard(rid)
        pool = self._pool_of(rid)
        if pool is None:
            return
        if entry.owner and (pool.tracker.bookings[rid].owner or self.origin) != entry.owner:
            return  # about another booking of the id: this replica's booked it again meanwhile
        booking = pool.tracker.bookings[rid]
        load = pool.tracker.loads[booking.rank]
        if kind in (FREE, EXPIRE, PREFILL) and not booking.prefill_done:
            # Another replica's booking: its prefill's end teaches this replica's speeds as the
            # owner's (docs/ROUTING.md, "Replicas"), so that every replica's cost reads the same.
            pool.speeds.ended(booking.rank, load.prefill_tokens, load.prefilling, booking.prefill_tokens, now,
                              completed=kind == PREFILL, pairs=booking.pairs)
        elif kind in (FREE, PREFILL):
            # Its prefill had ended: the owner still writes the rank's busy time down here
            # (`finish_booking`), and a learned speed is read from what was written down.
            pool.speeds.observe(booking.rank, load.prefill_tokens, now, load.prefilling)
        if kind == FREE or kind == EXPIRE:
            pool.free(rid, now)
            self._selector._end_followers(pool, now)
            self._count("expired" if kind == EXPIRE else "freed")
            self._selector.dispatch(pool, now)
        elif kind == PREFILL:
            pool.tracker.prefill_complete(rid)
            pool.prefill_ends.ended(booking)
            self._selector._end_followers(pool, now)
            self._selector.dispatch(pool, now)
        elif kind == PROGRESS:
            outputs, decay = decode_progress(entry.body)
            self._progress(pool, rid, entry.origin, outputs, decay)

    def _worker(self, ident: str, body: bytes, now: float) -> None:
        deleted = not body or body.startswith(DELETED)
        raw = body[len(DELETED):] if body.startswith(DELETED) else body
        try:
            worker_id = int(ident)
            req = from_json(WorkerRequest, jsonio.loads(raw)) if raw else None
        except (ValueError, SelectionError):
            raise LedgerWireError("worker: expected a worker id and its record") from None
        if req is not None and req.worker_id != worker_id:
            raise LedgerWireError("worker: the record names another worker")
        journal = self.journal
        journal.muted = True
        try:
            record = self._catalog.get(worker_id)
            if req is not None and (record is None or record.request != req
                                    or (not deleted and record.lifecycle == "unschedulable")):
                # A deleted one too: its record stays listed, the same on every replica.
                self._upsert(req, now=now)
                record = self._catalog.get(worker_id)
            if deleted and record is not None and record.lifecycle != "unschedulable":
                self._delete(worker_id, now=now)
        except SelectionError:
            self._count("catalog_refused")  # a limit of this replica's: counted, not fatal
        finally:
            journal.muted = False

    def _book(self, rid: str, record: AddRecord, owner: str, now: float) -> None:
        pool = self._pools.get((record.model_name, record.tenant_id))
        rank = (record.worker_id, record.dp_rank)
        if pool is None or rank not in pool.tracker.loads or self._pool_of(rid) is not None:
            self._count("dropped")  # a rank this catalog does not have (yet), or a known id
            return
        load = pool.tracker.loads[rank]
        pool.speeds.observe(rank, load.prefill_tokens, now, load.prefilling)
        pool.speeds.booked(rank, now)  # its fixed time joins the rank's backlog, as on its owner
        # Its context as its blocks say (the owner knew its cached tokens exactly).
        prefill = record.prefill_tokens
        context = max(0, len(record.blocks) * pool.block_size - prefill) if record.blocks else 0
        booking = pool.tracker.book(rid, rank, record.blocks, prefill, record.expected_output_tokens, now,
                                    checked=False, pairs=prefill * (context + prefill * 0.5))
        booking.owner = owner
        if booking.prefill_tokens and self._selector._reads_prefill_ends and pool.fresh[rank].last_event_at is not None:
            # In its rank's queue of prefills, unwatched (its owner reads its end): a prompt with
            # nothing new to store booked here after it ends behind it, as on its owner.
            pool.prefill_ends.booked(booking)
        self.journal.ended.pop(rid, None)

    def _progress(self, pool: Pool, rid: str, origin: str, outputs: int, decay: float | None) -> None:
        """`origin` has reported `outputs` blocks of the booking: absolute, so a repeated or late
        report changes nothing."""
        booking = pool.tracker.bookings[rid]
        counts = booking.outputs_by if booking.outputs_by is not None else {}
        booking.outputs_by = counts
        while counts.get(origin, 0) < outputs:
            pool.tracker.add_output_block(rid, decay)
            counts[origin] = counts.get(origin, 0) + 1

    def _pool_of(self, rid: str) -> Pool | None:
        try:
            return self._selector.booked_in(rid, None, None)
        except NotFound:
            return None

    def _retract(self, rid: str, now: float) -> None:
        """Undo a booking of this replica's that the ledger did not take."""
        pool = self._pool_of(rid)
        if pool is not None:
            if pool.free(rid, now).plan:  # a plan holds both legs or neither (docs/PD.md)
                self._selector.free_other_leg(rid, pool, now)
            self._selector.dispatch(pool, now)

    # -- snapshots and resets ----------------------------------------------------------------------

    def load(self, snap: LedgerSnapshot, now: float) -> None:
        """Replace the mirror with the ledger's state (start, gap, reconnect). Own changes still in
        the journal stand; they reach the ledger next."""
        self._deferred.run()
        self.epoch, self.n, self.cursor = snap.epoch, snap.n, snap.cursor
        journal = self.journal
        journal.adds, journal.own = dict(snap.adds), {}
        for ident, body in sorted(snap.workers.items()):
            try:
                self._worker(ident, body, now)
            except LedgerWireError:
                self._count("bad_entry")
        for record in list(self._catalog.values()):  # workers the ledger lacks: this replica's to give
            if str(record.worker_id) not in snap.workers:
                self._give(record)
        # Own bookings still in the journal, or waiting in the ledger for the id's previous one.
        queued = {op.ident for op in journal.ops if op.kind in (ADD, FREE)}
        queued.update(rid for rid, origin in snap.waiting.items() if origin == self.origin)
        for pool in self._pools.values():
            gone = [rid for rid in pool.tracker.bookings if rid not in snap.bookings and rid not in queued]
            for rid in gone:
                pool.free(rid, now)
                journal.end(rid, snap.n)
        # Ended, unseen in the feed: booked here again, each waits for the ledger, or a free sent
        # elsewhere after its answer could reach the ledger first, find it ended and answer 404.
        for rid, n in snap.ended.items():
            journal.end(rid, n)
        for rid, body in snap.bookings.items():
            try:
                if rid in queued:
                    continue  # this replica's own booking of the id stands
                if self._pool_of(rid) is None:
                    self._book(rid, decode_add(body), snap.owners.get(rid, ""), now)
                holder = self._pool_of(rid)
                if holder is None:
                    continue
                if rid in snap.prefilled:
                    holder.tracker.prefill_complete(rid)
                for origin, outputs in decode_counts(snap.progress.get(rid, b"{}")).items():
                    self._progress(holder, rid, origin, outputs, None)
            except LedgerWireError:
                self._count("bad_entry")
        for pool in self._pools.values():
            self._selector.dispatch(pool, now)
        self.synced, self.needs_snapshot = True, False
        self._count("snapshot")

    def reseed(self) -> None:
        """The ledger came back empty (its epoch changed): give it again what this replica knows
        first-hand, its own bookings and the catalog, ahead of what is queued."""
        self._deferred.run()
        journal = self.journal
        queued = {op.ident for op in journal.ops if op.kind == ADD}
        pending = list(journal.ops)
        journal.ops.clear()
        # Every booking given back or still queued was made before the new feed's first entry:
        # its view of the old feed would put it after an early free's fence in the new one.
        self.n = 0
        for op in pending:
            if op.kind == ADD:
                op.view = 0
        for record in sorted(self._catalog.values(), key=lambda r: r.worker_id):
            self._give(record)
        for key, pool in sorted(self._pools.items()):
            for booking in pool.tracker.bookings.values():
                if booking.owner is not None or booking.rid in queued:
                    continue
                journal.booked(key, booking)
                if booking.prefill_done:
                    journal.prefilled(booking)
                if booking.outputs_by and booking.outputs_by.get(self.origin):
                    journal.progressed(booking, None, again=True)
        journal.ops.extend(pending)
        self.epoch = None
        self.needs_snapshot = True
        self._count("reseed")


    def _give(self, record: WorkerCatalogRecord) -> None:
        """Give the ledger a record it lacks, a deleted one as a deletion: a seed, which a newer
        write by any replica wins over."""
        if record.lifecycle == "unschedulable":
            self.journal.worker_deleted(record.request, seed=True)
        else:
            self.journal.worker(record.request, seed=True)


def _is_free(hold: _Hold) -> bool:
    return hold.request[0] == "DELETE"
