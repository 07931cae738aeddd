"""One key's pool (core.md §6.4): everything a (model, tenant) key holds while it has a
schedulable rank: its workers and their ranks, the prefix index, the bookings, each rank's
freshness and engine cache namespaces, and the admission queue.

A pool is created with the key's first schedulable worker and deleted with its last. Per-rank
state lives in parallel dicts keyed by rank; only `add_rank` and `drop_ranks` create or drop
their entries, so they cannot drift apart."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Final

from ..base.budget import StateBudget
from ..base.errors import NotFound
from ..base.flow_classes import parse_classes
from ..base.settings import Settings
from ..bookings.prefill_ends import PrefillEnds
from ..bookings.sessions import SessionTable
from ..bookings.tracker import Booking, Defer, Tracker
from ..cache.engine import NamespaceMemory
from ..cache.freshness import RankFreshness
from ..cache.index import DeviceTree, Rank
from ..cache.predictions import Predictions
from ..cache.tiers import KeyIndex
from .admission import FlowQueue
from .decisions import Decision
from .outcomes import Recent
from .speed import Speeds
from .verdict import RankWatch

__all__ = ["RECENT_DECISIONS", "Key", "Pool", "holding", "key_label"]

Key = tuple[str, str]
RECENT_DECISIONS: Final = 20  # kept per key for the status page, newest last


def key_label(key: Key) -> str:
    return f"model={key[0]} tenant={key[1]}"


def holding(pools: Mapping[Key, Pool], rid: str, model_name: str | None, tenant_id: str | None) -> Pool:
    """The pool that holds the booking `rid` (the first in key order), or 404."""
    for key in sorted(pools):
        if (model_name is None or key[0] == model_name) and (tenant_id is None or key[1] == tenant_id):
            pool = pools[key]
            if rid in pool.tracker.bookings:
                return pool
    raise NotFound(f"reservation {rid} not found")


class Pool:
    """Everything a key (model, tenant) holds while it has a schedulable rank (core.md §6.4)."""

    __slots__ = ("key", "label", "block_size", "eagle", "speeds", "index", "tracker", "fresh", "memory", "epoch",
                 "workers", "taints", "prefill_only", "queue", "_ranks", "budget", "sessions", "side", "predictions",
                 "watch", "recent", "prefill_ends", "outcomes")

    def __init__(self, key: Key, block_size: int, now: float, settings: Settings,
                 budget: StateBudget) -> None:
        self.key = key
        self.label = key_label(key)
        self.block_size = block_size
        self.eagle = False  # its workers' `is_eagle`: prompts that do not say use eagle windows
        self.speeds = Speeds(learn=settings.router_policy == "ttft",  # what router_policy=ttft reads
                             shadow=Speeds(learn=True) if settings.shadow_policy == "ttft" else None)
        self.index = KeyIndex()
        self.budget = budget
        self.tracker = Tracker(settings.max_reservations_per_key, self.label, budget)
        self.fresh: dict[Rank, RankFreshness] = {}
        self.memory: dict[Rank, NamespaceMemory] = {}  # engine-event cache namespaces (events.md §4.5)
        self.watch: dict[Rank, RankWatch] = {}  # is KV routing working (verdict.py)
        self.epoch = now
        self.workers: dict[int, tuple[Rank, ...]] = {}  # schedulable worker -> its ranks
        self.taints: dict[int, frozenset[str]] = {}
        # Workers whose role is `prefill` (docs/PD.md): not candidates of a plain `/select`.
        self.prefill_only: set[int] = set()
        self.queue = FlowQueue({c.name: c.weight for c in parse_classes(settings.flow_classes)},
                               settings.priority_promote_secs, settings.fairness_burst_tokens or 0)
        self.sessions = SessionTable(settings.session_affinity_ttl_secs or 0.0, settings.max_sessions_per_key,
                                     budget)
        # Bookings predict the cache: into the index itself, or a side tree read beside events.
        self.side: DeviceTree | None = None
        self.predictions: Predictions | None = None
        if settings.kv_events == "approximate":
            self.predictions = Predictions(self.index.device, settings.router_ttl_secs, budget)
        elif settings.predicted_ttl_secs is not None:
            self.side = DeviceTree()
            self.predictions = Predictions(self.side, settings.predicted_ttl_secs, budget)
        self.prefill_ends = PrefillEnds()  # bookings whose prefill's end is read from events
        self._ranks: list[Rank] | None = None
        self.recent: deque[Decision] = deque(maxlen=RECENT_DECISIONS)  # for the status page (status.py)
        self.outcomes = Recent(now)  # its last minute of selections, for the status page

    def ranks(self) -> list[Rank]:
        """Schedulable ranks sorted by (worker_id, dp_rank)."""
        if self._ranks is None:
            self._ranks = sorted(r for ranks in self.workers.values() for r in ranks)
        return self._ranks

    def next_deadline(self, settings: Settings) -> float | None:
        """The earliest booking expiry, queue timeout or prediction expiry of the pool."""
        times = (self.tracker.next_expiry(settings.active_request_expiry_secs), self.queue.next_expiry(),
                 self.predictions.next_expiry() if self.predictions is not None else None)
        return min((t for t in times if t is not None), default=None)

    def set_worker(self, worker_id: int, ranks: tuple[Rank, ...], taints: frozenset[str],
                   role: str | None = None) -> None:
        """A schedulable worker joined or changed: its ranks (added with `add_rank`), taints and role."""
        self.workers[worker_id] = ranks
        self.taints[worker_id] = taints
        if role == "prefill":
            self.prefill_only.add(worker_id)
        else:
            self.prefill_only.discard(worker_id)
        self._ranks = None

    def remove_worker(self, worker_id: int) -> tuple[Rank, ...]:
        """The worker left; its ranks, for the caller to drop with `drop_ranks`."""
        self.taints.pop(worker_id, None)
        self.prefill_only.discard(worker_id)
        self._ranks = None
        return self.workers.pop(worker_id, ())

    def add_rank(self, rank: Rank) -> None:
        self.tracker.add_rank(rank)
        self.index.device.ensure(rank)
        self.fresh[rank] = RankFreshness()
        self.watch[rank] = RankWatch()
        self._ranks = None

    def drop_ranks(self, ranks: set[Rank], now: float) -> list[Booking]:
        """Forget the ranks with their index, freshness and bookings; the dropped bookings."""
        for rank in ranks:
            self.budget.index_blocks -= self.index.rank_size(rank)
            self.index.drop_rank(rank)
            if self.side is not None:
                self.budget.index_blocks -= self.side.size(rank)
                self.side.clear(rank)
            self.fresh.pop(rank, None)
            self.watch.pop(rank, None)
            self.memory.pop(rank, None)
        self._ranks = None
        return self._released(self.tracker.drop_ranks(ranks), now)

    def free(self, rid: str, now: float, defer: Defer | None = None) -> Booking:
        """End a booking (404 if unknown), and its hold on a session's binding; `defer`: see
        `Tracker.book`."""
        return self._released([self.tracker.free(rid, defer)], now)[0]

    def expire(self, now: float, max_age: float) -> list[Booking]:
        """End the bookings older than `max_age`."""
        return self._released(self.tracker.expire(now, max_age), now)

    def _released(self, bookings: list[Booking], now: float) -> list[Booking]:
        for booking in bookings:
            self.prefill_ends.ended(booking)
            if booking.lease is not None:
                self.sessions.release(booking.lease, now)
        return bookings

    def drop_index(self, rank: Rank) -> None:
        """Forget every block the rank's engine was said to hold (its cache is gone)."""
        self.budget.index_blocks -= self.index.rank_size(rank)
        self.index.drop_rank(rank)
        self.index.device.ensure(rank)
        self.memory.pop(rank, None)

    def reset_rank_events(self, rank: Rank) -> None:
        """The rank's event source changed: its index and everything known of its events start anew."""
        self.drop_index(rank)
        self.fresh[rank] = RankFreshness()
        self.watch[rank] = RankWatch()
