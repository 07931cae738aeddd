"""Slot tracker: bookings and the load they put on each rank (core.md §8).

A rank's active decode blocks are its distinct booked prompt blocks, each weighing 1, plus the
output blocks its bookings reported (1.6.1's `output_block`). A `decay_fraction` re-weighs a
booking's output blocks and the tail of its prompt that no other booking shares; a block keeps its
weight when a later booking comes to share it. The count is the weighted sum rounded half away
from zero, as 1.6.1 rounds it; with no output blocks it is just the number of distinct blocks."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Final

from ..base.budget import StateBudget
from ..base.errors import Conflict, NotFound, TooManyRequests
from ..cache.index import Rank
from .sessions import Lease

__all__ = ["PIECE_BLOCKS", "Booking", "Defer", "DuplicateReservation", "RankLoad", "Tracker", "rank_text"]

# A huge booking's blocks are counted in (and out of) its rank's load this many at a time, each
# piece a few milliseconds, when the caller defers them until its answer is written (deferred.py):
# a transport lets its other clients in between pieces.
PIECE_BLOCKS: Final = 16_384
Defer = Callable[[Callable[[], object]], None]


def rank_text(rank: Rank) -> str:
    """Dynamo's debug rendering of a rank, which appears in messages."""
    return f"WorkerWithDpRank {{ worker_id: {rank[0]}, dp_rank: {rank[1]} }}"


class DuplicateReservation(Conflict):
    """The id is already booked in this key (detected by type, never by message text)."""

    def __init__(self, reservation_id: str, rank: Rank) -> None:
        super().__init__(f"Request {reservation_id} already exists (assigned to worker {rank_text(rank)})")


class RankLoad:
    __slots__ = ("prefill_tokens", "prefill_pairs", "prefilling", "requests", "unique", "weights", "extra", "changes")

    def __init__(self) -> None:
        self.prefill_tokens = 0
        # The attention of its booked prefill: each booking's new tokens times the context they
        # are computed over (`Booking.pairs`), what router_policy=ttft weighs by the learned cost
        # of context (docs/ROUTING.md, "What is left of a running prefill").
        self.prefill_pairs = 0.0
        self.prefilling = 0  # bookings whose prefill has not ended (a fully cached one included)
        self.requests = 0
        self.unique: dict[int, int] = {}  # booked prompt block -> how many bookings hold it
        self.weights: dict[int, float] = {}  # the prompt blocks that do not weigh 1
        self.extra = 0.0  # the output blocks' weight, plus each weighted block's weight - 1
        self.changes = 0  # bumped whenever `unique` changes (what was counted against it is stale)

    def decode_blocks(self) -> int:
        """Active decode blocks: distinct prompt blocks and output blocks, weighted."""
        if not self.extra:
            return len(self.unique)
        return math.floor(len(self.unique) + self.extra + 0.5)

    def new_blocks(self, distinct: set[int]) -> int:
        """How many of `distinct` this rank does not hold yet."""
        if not self.unique:
            return len(distinct)
        # In C, over the smaller side (a set's difference with a dict looks each item up in it).
        if len(distinct) <= len(unique := self.unique):
            return len(distinct.difference(unique))
        return len(distinct) - len(unique) + len(unique.keys() - distinct)


class Booking:
    __slots__ = ("rid", "rank", "blocks", "prefill_tokens", "prefill_done", "expected_output_tokens",
                 "booked_at", "outputs", "output_weight", "lease", "owner",
                 "outputs_by", "predicted_cached", "prompt_tokens", "plan", "awaits", "holder", "pairs")

    def __init__(self, rid: str, rank: Rank, blocks: list[int] | None, prefill_tokens: int,
                 expected_output_tokens: int | None, booked_at: float) -> None:
        self.rid = rid
        self.rank = rank
        self.blocks = blocks
        self.prefill_tokens = prefill_tokens
        self.prefill_done = False
        self.expected_output_tokens = expected_output_tokens
        self.booked_at = booked_at
        self.lease: Lease | None = None  # its hold on a session's binding (sessions.py)
        self.outputs = 0  # output blocks reported
        self.output_weight = 0.0  # their weight (a decay re-weighs them all)
        self.owner: str | None = None  # the replica that made it, when not this one (ledger.py)
        self.outputs_by: dict[str, int] | None = None  # output blocks per replica that reported them
        # For the verdict (verdict.py): the cached tokens the engine should report, until it has.
        self.predicted_cached: int | None = None
        self.prompt_tokens = 0
        self.plan = False  # one leg of a prefill/decode plan booked here (pd.py): its expiry is an orphan's
        # The prompt's block hashes while the end of its prefill is read from events (prefill_ends.py).
        self.awaits: list[int] | None = None
        # (fairness ID, uncached prompt tokens) it counts in `Tracker.held` (`fairness_kv_share` only).
        self.holder: tuple[str, int] | None = None
        self.pairs = 0.0  # its prefill tokens times the mean context each is computed over


class Tracker:
    """One key's bookings. Ids are unique per key; insertion order is booking-time order because
    the service never lets `now` go backwards, so expiry pops from the front."""

    __slots__ = ("bookings", "loads", "limit", "label", "budget", "held")

    def __init__(self, limit: int, label: str, budget: StateBudget | None = None) -> None:
        self.bookings: dict[str, Booking] = {}
        self.loads: dict[Rank, RankLoad] = {}
        self.limit = limit
        self.label = label  # "model=<m> tenant=<t>"
        self.budget = budget if budget is not None else StateBudget(1 << 62)
        # Fairness ID -> uncached prompt tokens of its bookings in flight (booked with a holder); only
        # IDs holding some are kept, so it is bounded by the bookings.
        self.held: dict[str, int] = {}

    def add_rank(self, rank: Rank) -> None:
        self.loads.setdefault(rank, RankLoad())

    def drop_ranks(self, ranks: set[Rank]) -> list[Booking]:
        """Forget the ranks and their bookings, in one pass over the bookings (a worker with 1,024
        ranks and 100k bookings is one pass, not 1,024); returns the dropped bookings."""
        for rank in ranks:
            self.loads.pop(rank, None)
        dropped = [b for b in self.bookings.values() if b.rank in ranks]
        budget = self.budget
        for booking in dropped:
            del self.bookings[booking.rid]
            self._release(booking)
            budget.bookings -= 1
            budget.booked_blocks -= len(booking.blocks) if booking.blocks else 0
        return dropped

    def check_can_book(self, rid: str, room: int = 1) -> None:
        """`rid` is free and `room` more bookings fit (a plan books two at once)."""
        existing = self.bookings.get(rid)
        if existing is not None:
            raise DuplicateReservation(rid, existing.rank)
        if len(self.bookings) + room > self.limit:
            raise TooManyRequests(f"reservation limit reached for {self.label}: at most {self.limit} active")

    def book(self, rid: str, rank: Rank, blocks: list[int] | None, prefill_tokens: int,
             expected_output_tokens: int | None, now: float, checked: bool = True,
             defer: Defer | None = None, holder: tuple[str, int] | None = None, pairs: float = 0.0) -> Booking:
        """`checked=False`: a mirrored booking, which the ledger already took (only the id is
        checked, by the caller). `defer`: where the counting of a booking of over `PIECE_BLOCKS`
        blocks goes, in pieces (no answer of the call that books reads it). `holder`: the fairness
        ID and uncached prompt tokens it counts in `held` until it ends."""
        if checked:
            self.check_can_book(rid)
        load = self.loads[rank]
        booking = Booking(rid, rank, blocks, prefill_tokens, expected_output_tokens, now)
        self.bookings[rid] = booking
        self.budget.bookings += 1
        self.budget.booked_blocks += len(blocks) if blocks else 0
        load.requests += 1
        load.prefilling += 1
        load.prefill_tokens += prefill_tokens
        if pairs:
            booking.pairs = pairs
            load.prefill_pairs += pairs
        if blocks:
            _in_pieces(_count, load, blocks, defer)
        if holder is not None:
            booking.holder = holder
            self.held[holder[0]] = self.held.get(holder[0], 0) + holder[1]
        return booking

    def _release(self, booking: Booking) -> None:
        """A booking that ends stops counting in `held`."""
        if booking.holder is not None:
            fairness_id, tokens = booking.holder
            left = self.held[fairness_id] - tokens
            if left:
                self.held[fairness_id] = left
            else:
                del self.held[fairness_id]

    def get(self, rid: str) -> Booking:
        booking = self.bookings.get(rid)
        if booking is None:
            raise NotFound(f"reservation {rid} not found")
        return booking

    def prefill_complete(self, rid: str) -> Booking:
        booking = self.get(rid)
        if not booking.prefill_done:
            booking.prefill_done = True
            load = self.loads[booking.rank]
            load.prefill_tokens -= booking.prefill_tokens
            load.prefilling -= 1
            if booking.pairs:
                load.prefill_pairs = _less(load.prefill_pairs, booking.pairs, load.prefilling)
        return booking

    def add_output_block(self, rid: str, decay_fraction: float | None) -> None:
        """One more output block for the booking; with a `decay_fraction`, every output block of
        it, and the tail of its prompt that only it holds, weigh that fraction from now on."""
        booking = self.get(rid)
        load = self.loads[booking.rank]
        booking.outputs += 1
        booking.output_weight += 1.0
        load.extra += 1.0
        if decay_fraction is None:
            return
        weight = booking.outputs * decay_fraction
        load.extra += weight - booking.output_weight
        booking.output_weight = weight
        unique, weights = load.unique, load.weights
        for h in reversed(booking.blocks or ()):
            if unique[h] != 1:
                break  # shared with another booking: the prefix above it is shared too
            load.extra += decay_fraction - weights.get(h, 1.0)
            if decay_fraction == 1.0:
                weights.pop(h, None)
            else:
                weights[h] = decay_fraction

    def free(self, rid: str, defer: Defer | None = None) -> Booking:
        """End the booking; `defer` as for `book`."""
        booking = self.bookings.pop(rid, None)
        if booking is None:
            raise NotFound(f"reservation {rid} not found")
        self.budget.bookings -= 1
        self.budget.booked_blocks -= len(booking.blocks) if booking.blocks else 0
        self._release(booking)
        load = self.loads[booking.rank]
        load.requests -= 1
        if not booking.prefill_done:
            load.prefill_tokens -= booking.prefill_tokens
            load.prefilling -= 1
            if booking.pairs:
                load.prefill_pairs = _less(load.prefill_pairs, booking.pairs, load.prefilling)
        if booking.output_weight:
            load.extra -= booking.output_weight
        if booking.blocks:
            # A weighed block's weight leaves `extra` with it: that is read at once, so no pieces.
            _in_pieces(_uncount, load, booking.blocks, defer if not load.weights else None)
        if not load.weights and load.requests == 0:
            load.extra = 0.0  # no rounding error outlives the bookings
        return booking

    def expire(self, now: float, max_age: float) -> list[Booking]:
        expired: list[str] = []
        for rid, booking in self.bookings.items():
            if now - booking.booked_at < max_age:
                break
            expired.append(rid)
        return [self.free(rid) for rid in expired]

    def next_expiry(self, max_age: float) -> float | None:
        for booking in self.bookings.values():
            return booking.booked_at + max_age
        return None



def _less(total: float, part: float, left: int) -> float:
    """A float sum less one of its parts; exactly 0 once none is left (no rounding error outlives them)."""
    return total - part if left else 0.0


def _in_pieces(step: Callable[[RankLoad, list[int]], None], load: RankLoad, blocks: list[int],
               defer: Defer | None) -> None:
    if defer is None or len(blocks) <= PIECE_BLOCKS:
        step(load, blocks)
        return
    load.changes += 1  # what another thread counts before the pieces run is stale already
    for start in range(0, len(blocks), PIECE_BLOCKS):
        defer(partial(step, load, blocks[start:start + PIECE_BLOCKS]))


def _count(load: RankLoad, blocks: list[int]) -> None:
    unique = load.unique
    for h in blocks:
        unique[h] = unique.get(h, 0) + 1
    load.changes += 1  # after the change: a count made meanwhile (another thread) is stale


def _uncount(load: RankLoad, blocks: list[int]) -> None:
    unique, weights = load.unique, load.weights
    for h in blocks:
        left = unique[h] - 1
        if left:
            unique[h] = left
        else:
            del unique[h]
            if weights:
                weight = weights.pop(h, None)
                if weight is not None:
                    load.extra -= weight - 1.0
    load.changes += 1
