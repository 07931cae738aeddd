"""Ingestion of KV events (events.md §7): binding each event to its worker's pool and rank, then
applying it to the index, with one tally per batch and the rank's freshness kept.

Every check of a request runs before its first event applies (a request is refused whole); a
stream instead drops what it cannot apply and goes on. A `POST /kv_events` of more than
`max_events_per_step` events becomes an `_EventJob`, bound and then applied a step per `tick`."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from ..base.budget import StateBudget
from ..base.errors import (
    BadRequest,
    Conflict,
    InvalidJson,
    SelectionError,
    ShapeError,
    StreamError,
    Unprocessable,
)
from ..base.metrics import Metrics
from ..base.outputs import Notice, OutputEvent, SelectionReady
from ..base.responses import ApplyReport, Pending
from ..base.settings import Settings
from ..base.wire import error_response, json_response
from ..bookings.tracker import Booking
from ..cache.engine import EngineBatch, NamespaceMemory, convert
from ..cache.events import KvEvent, require_worker
from ..cache.freshness import GAP, RESTART, Break
from ..cache.index import IndexEventError, Rank
from ..cache.tally import Tally
from ..fleet.admission import Tickets
from ..fleet.catalog import Catalog
from ..fleet.limits import Limits
from ..fleet.pool import Key, Pool, key_label
from .streams import DecodedMessage, EventSource, decode_engine_batch, decode_stream_message, slice_end

__all__ = ["WORKER_LEFT", "Ingest", "Target"]

WORKER_LEFT: Final = "Failed to apply event: its worker left while the request was applied"
STATE_BUDGET_EXHAUSTED: Final = IndexEventError("Failed to apply event: state budget exhausted", "state_budget")

# A step applies at most `max_events_per_step` events and this many blocks per event of it: a
# remove of a hundred hashes is a hundred lookups.
BLOCKS_PER_EVENT: Final = 8

# What a request names for its events: worker_id, dp_rank, model_name, tenant_id.
Target = tuple[int | None, int | None, str | None, str | None]
Bound = tuple[KvEvent, Pool, Rank]


class _EventJob:
    """A `POST /kv_events` applied in steps: its events, bound a step at a time, then applied."""

    __slots__ = ("ticket", "events", "target", "bound", "done", "tally")

    def __init__(self, ticket: int, events: list[KvEvent], target: Target) -> None:
        self.ticket = ticket
        self.events = events
        self.target = target
        self.bound: list[Bound] = []
        self.done = 0  # events applied (or failed) so far
        self.tally = Tally(len(events))


class Ingest:
    """Binds and applies KV events for the service; owns the requests being applied in steps."""

    __slots__ = ("_settings", "_metrics", "_limits", "_budget", "_catalog", "_pools", "_tickets",
                 "_outbox", "_jobs", "_prefills_ended")

    def __init__(self, settings: Settings, metrics: Metrics, limits: Limits, budget: StateBudget,
                 catalog: Catalog, pools: dict[Key, Pool], tickets: Tickets,
                 outbox: deque[OutputEvent], prefills_ended: Callable[[Pool, list[Booking], float], None]) -> None:
        self._settings = settings
        self._metrics = metrics
        self._limits = limits
        self._budget = budget
        self._catalog = catalog
        self._pools = pools
        self._tickets = tickets
        self._outbox = outbox
        self._jobs: deque[_EventJob] = deque()
        # Bookings whose prompt a stored event completed (prefill_ends.py): the selector ends them.
        self._prefills_ended = prefills_ended

    @property
    def stepping(self) -> bool:
        """A request is being applied in steps (`tick` is due at once)."""
        return bool(self._jobs)

    def check_push_mode(self) -> None:
        """409 unless KV events may be pushed in this mode (events.md §7.1)."""
        mode = self._settings.kv_events
        if mode == "subscribe":
            raise Conflict("kv events are pushed only when kv_events=push "
                           "(this service runs kv_events=subscribe)")
        if mode == "off":
            raise Conflict("kv events are disabled (kv_events=off)")
        if mode == "approximate":
            raise Conflict("kv events are not used (kv_events=approximate: bookings predict the cache)")

    def bind(self, worker_id: int, dp_rank: int | None, model_name: str | None,
             tenant_id: str | None) -> tuple[Pool, Rank]:
        """The §7.2 checks of events.md for one worker and rank."""
        record = self._catalog.require(worker_id)
        if record.lifecycle != "schedulable":
            raise Conflict(f"worker {worker_id} is not schedulable")
        if (model_name is not None and model_name != record.key[0]) or (
            tenant_id is not None and tenant_id != record.key[1]
        ):
            raise Conflict(f"worker {worker_id} belongs to {key_label(record.key)}")
        pool = self._pools[record.key]
        ranks = pool.workers[worker_id]
        rank = (worker_id, 0 if dp_rank is None else dp_rank)
        if rank not in ranks:
            raise BadRequest(f"dp_rank {rank[1]} is not a rank of worker {worker_id} "
                             f"(ranks {ranks[0][1]}..{ranks[-1][1]})")
        return pool, rank

    def _bind_each(self, events: Sequence[KvEvent], target: Target) -> list[Bound]:
        worker_id, dp_rank, model_name, tenant_id = target
        bound = []
        for event in events:
            rank_id = event.dp_rank if event.dp_rank is not None else dp_rank
            bound.append((event, *self.bind(require_worker(event, worker_id), rank_id, model_name,
                                            tenant_id)))
        return bound

    def _budget_for(self, events: Sequence[KvEvent]) -> None:
        if self._budget.exhausted and any(event.kind == "stored" for event in events):
            self._limits.state_budget("kv events")  # a request is refused whole; a stream drops stores

    def _check_target(self, target: Target) -> None:
        self.check_push_mode()
        worker_id, dp_rank, model_name, tenant_id = target
        if worker_id is not None:
            self.bind(worker_id, dp_rank, model_name, tenant_id)

    def apply_events(self, events: Sequence[KvEvent], target: Target, now: float) -> ApplyReport:
        """Check every event, then apply them all (`POST /kv_events` with JSON)."""
        self._check_target(target)
        bound = self._bind_each(events, target)
        self._budget_for(events)
        return self.apply_bound(bound, now)

    def begin(self, events: Sequence[KvEvent], target: Target, now: float) -> ApplyReport | Pending:
        """`apply_events`, or a job applied a step per tick when there are more events than a step."""
        step = self._settings.max_events_per_step
        if step is None or len(events) <= step:
            return self.apply_events(events, target, now)
        self._check_target(target)
        ticket = self._tickets.issue(None)
        self._jobs.append(_EventJob(ticket, list(events), target))
        return Pending(ticket)

    def step(self, now: float, until_done: bool = False) -> None:
        """Bind or apply the next `max_events_per_step` events of the oldest job (fewer when they
        carry many blocks; all of every job when `until_done`), answering each job that ends."""
        step = self._settings.max_events_per_step or 1
        while self._jobs:
            job = self._jobs[0]
            if len(job.bound) < len(job.events):  # first every event is bound, a step at a time
                try:
                    job.bound += self._bind_each(job.events[len(job.bound):len(job.bound) + step],
                                                 job.target)
                    if len(job.bound) == len(job.events):
                        self._budget_for(job.events)
                except SelectionError as exc:  # refused whole, as a request applied at once
                    self._jobs.popleft()
                    self._outbox.append(SelectionReady(job.ticket, exc,
                                                       error_response(exc.status, exc.message)))
            else:
                start = job.done
                chunk = job.bound[start:slice_end(job.events, start, step, step * BLOCKS_PER_EVENT)]
                for k, bound in enumerate(chunk, start):
                    pool, rank = bound[1], bound[2]
                    if self._pools.get(pool.key) is pool and rank in pool.fresh:
                        self._tally([bound], now, True, job.tally, (k,))
                    else:
                        job.tally.fail(k, WORKER_LEFT)
                job.done += len(chunk)
                if job.done >= len(job.events):
                    self._jobs.popleft()
                    total = job.tally.report()
                    self._outbox.append(SelectionReady(job.ticket, total,
                                                       json_response(200, total.to_json())))
            if not until_done:
                return

    def apply_bound(self, bound: Sequence[Bound], now: float, touch_freshness: bool = True
                    ) -> ApplyReport:
        return self._tally(bound, now, touch_freshness, Tally(len(bound))).report()

    def _tally(self, bound: Sequence[Bound], now: float, touch_freshness: bool, tally: Tally,
               indices: Sequence[int] | None = None) -> Tally:
        """Apply `bound` in order, counting into `tally`; `indices` are the events' positions in
        the request (their order in `bound` when not given)."""
        over_budget = self._budget.exhausted
        for i, (event, pool, rank) in enumerate(bound):
            if touch_freshness:
                broken = pool.fresh[rank].note_event_id(event.event_id, now)
                if broken is not None:
                    self._count_break(pool.key, rank, broken)
                pool.watch[rank].event(now)
            self._apply(pool, rank, event, over_budget, tally, i if indices is None else indices[i], now)
        return tally

    def _count_break(self, key: Key, rank: Rank, broken: Break) -> None:
        labels = (*key, str(rank[0]), str(rank[1]))
        if broken.kind == GAP:
            self._metrics.kv_gap(labels, broken.missing)
        else:
            self._metrics.kv_rewind(labels)
            if broken.kind == RESTART:
                self._metrics.kv_restart(labels)
        self._outbox.append(Notice(f"kv_{broken.kind}", (("worker_id", rank[0]), ("dp_rank", rank[1]),
                                                          ("missing", broken.missing))))

    def _apply(self, pool: Pool, rank: Rank, event: KvEvent, over_budget: bool, tally: Tally,
               position: int, now: float) -> None:
        """Apply one event to the index, count it, and tally it at `position`. `over_budget` is
        read once per message by the caller (a message overshoots the budget by at most itself)."""
        error = self._write(pool, rank, event, over_budget)
        self._metrics.kv_event(pool.key, event.tier, event.kind, "ok" if error is None else error.label)
        if error is None:
            tally.applied += 1
            if event.kind == "stored" and event.tier == "device" and pool.prefill_ends.watching():
                if ended := pool.prefill_ends.stored(rank, event.blocks, pool.index.device):
                    self._prefills_ended(pool, ended, now)
        else:
            tally.fail(position, error.text)

    def _write(self, pool: Pool, rank: Rank, event: KvEvent, over_budget: bool) -> IndexEventError | None:
        index = pool.index
        budget = self._budget
        if over_budget and event.kind == "stored":
            # Removes and clears still apply (they free memory); the rank misses these stores.
            fresh = pool.fresh.get(rank)  # none for a rank recovered from a peer, not registered
            if fresh is not None:
                fresh.mark_stale()
            self._limits.stale_store()
            return STATE_BUDGET_EXHAUSTED
        if event.tier == "device":
            tree = index.device
            tree.ensure(rank)
            before = tree.size(rank)
            try:
                if event.kind == "stored":
                    tree.store(rank, event.parent_hash, event.blocks)
                elif event.kind == "removed":
                    tree.remove(rank, event.block_hashes)
                else:
                    tree.clear(rank)
                    tree.ensure(rank)
                    pool.fresh[rank].mark_cleared()
            except IndexEventError as exc:
                return exc
            finally:  # a clear replaces the rank's table
                budget.index_blocks += tree.size(rank) - before
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

    def engine_batch(self, payload: bytes | EngineBatch, worker_id: int | None, dp_rank: int | None,
                     seq: int | None, source: EventSource | None, model_name: str | None,
                     tenant_id: str | None, now: float, start: int = 0,
                     stop: int | None = None) -> ApplyReport:
        """Apply one msgpack `KVEventBatch`, or its events `start:stop` (a large stream message is
        applied in slices)."""
        if worker_id is None:
            raise BadRequest("worker_id is required for events without worker_id")
        batch = decode_engine_batch(payload) if isinstance(payload, bytes) else payload
        pool, rank = self.bind(worker_id, batch.dp_rank if batch.dp_rank is not None else dp_rank,
                               model_name, tenant_id)
        over_budget = self._budget.exhausted
        if over_budget and source is None and any(e.tag == "BlockStored" for e in batch.events):
            self._limits.state_budget("kv events")  # a request is refused whole; a stream drops stores
        stream_rank = source.rank if source is not None else rank
        if stream_rank not in pool.fresh:
            stream_rank = rank
        fresh = pool.fresh[rank]
        if start > 0:
            pass  # a later slice: the batch's seq was noted with its first
        elif seq is not None:
            stream_fresh = pool.fresh[stream_rank]
            broken = stream_fresh.note_seq(seq)
            if broken is not None:
                self._count_break(pool.key, stream_rank, broken)
                if broken.kind == RESTART:  # the engine's cache is empty: forget what it held
                    pool.drop_index(stream_rank)
                    if rank != stream_rank:
                        pool.drop_index(rank)
                if fresh is not stream_fresh:
                    fresh.mark_stale()
        elif source is not None and source.first and fresh.loss_pending:
            fresh.mark_stale()  # a reconnect without proof of continuity
        memory = pool.memory.setdefault(rank, NamespaceMemory())
        events = batch.events if start == 0 and stop is None else batch.events[start:stop]
        tally = Tally(len(events))
        watch = pool.watch.get(rank)
        for i, raw in enumerate(events, start):
            event = convert(raw, pool.block_size, memory)
            if watch is not None:
                watch.event(now, raw.block_size if raw.tag == "BlockStored" else None,
                            event == "block_size_mismatch")
            if isinstance(event, str):
                tally.dropped += 1
                self._metrics.kv_dropped(pool.key, event)
                continue
            fresh.count_event(now)
            memory.observe(event)
            self._apply(pool, rank, event, over_budget, tally, i, now)
        if source is not None:
            source.delivered.add(rank)
            if stop is None or stop >= len(batch.events):
                source.first = False
        return tally.report()

    def replay(self, events: Sequence[KvEvent], now: float) -> None:
        """A dump's events (`restore`), freshness untouched; those of a worker that did not become
        schedulable here (e.g. in another kv_events mode) are left out."""
        bound = []
        for event in events:
            try:
                bound.append((event, *self.bind(event.worker_id or 0, event.dp_rank, None, None)))
            except SelectionError:
                continue
        self.apply_bound(bound, now, touch_freshness=False)

    def seed(self, partitions: Mapping[Key, tuple[int, Sequence[KvEvent]]], now: float) -> None:
        """A 1.6.1 peer's index (`recover`): each partition a pool of its block size, filled."""
        for key, (block_size, events) in partitions.items():
            pool = self._pools[key] = Pool(key, block_size, now, self._settings, self._budget)
            self.apply_bound([(e, pool, (e.worker_id or 0, e.dp_rank or 0)) for e in events], now,
                             touch_freshness=False)

    def engine_gone(self, source: EventSource) -> None:
        """The engine behind a subscription closed its connection: its process went away, and its
        cache with it. The ranks it fed forget what it held (stale) and are trusted again once its
        batches follow in order, from 0 if it restarted (docs/VERDICT.md)."""
        pool = self._pools.get(source.key)
        if pool is None or not source.delivered:  # nothing to forget where it never published
            return
        for rank in source.delivered:
            fresh = pool.fresh.get(rank)
            if fresh is not None:
                pool.drop_index(rank)
                fresh.mark_stale()
                fresh.recovering = fresh.loss_pending = True
        self._outbox.append(Notice("kv_engine_disconnected", (("worker_id", source.worker_id),
                                                              ("dp_rank", source.dp_rank))))

    def stream_message(self, source: EventSource, data: bytes | str | DecodedMessage | SelectionError,
                       seq: int | None, now: float, start: int = 0, stop: int | None = None
                       ) -> ApplyReport:
        """One message of a stream (see `SelectionService.stream_message`)."""
        try:
            message = decode_stream_message(data) if isinstance(data, (bytes, str)) else data
            if isinstance(message, SelectionError):
                raise message
            if isinstance(message, EngineBatch):
                return self.engine_batch(message, source.worker_id, source.dp_rank, seq, source, None,
                                         None, now, start, stop)
            return self._stream_json(source, message, now, start, stop)
        except SelectionError as exc:
            decoding = isinstance(exc, (Unprocessable, InvalidJson))
            if source.kind == "subscription":
                self._metrics.kv_dropped(source.key, "invalid_message" if decoding else "binding")
                return ApplyReport(received=0, applied=0, failed=0, dropped=1)
            if decoding:
                detail = (f"invalid kv event: {exc.detail}" if isinstance(exc, (ShapeError, InvalidJson))
                          else exc.message)
                raise StreamError(1007, detail) from None
            raise StreamError(1008, exc.message) from None

    def _stream_json(self, source: EventSource, events: tuple[KvEvent, ...], now: float, start: int,
                     stop: int | None) -> ApplyReport:
        if start == 0:  # every event of the message is checked before its first slice applies
            for event in events:
                if event.worker_id is not None and event.worker_id != source.worker_id:
                    raise Conflict(f"event worker_id {event.worker_id} does not match stream worker_id "
                                   f"{source.worker_id}")
        bound = self._bind_each(events[start:stop], (source.worker_id, source.dp_rank, None, None))
        report = self.apply_bound(bound, now)
        for _, _, rank in bound:
            source.delivered.add(rank)
        if stop is None or stop >= len(events):
            source.first = False
        return report
