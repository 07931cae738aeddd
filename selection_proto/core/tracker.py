"""Slot tracker: bookings and the load they put on each rank (core.md §8)."""

from __future__ import annotations

from .budget import StateBudget
from .errors import Conflict, NotFound, TooManyRequests
from .index import Rank

__all__ = ["Booking", "DuplicateReservation", "RankLoad", "Tracker", "rank_text"]


def rank_text(rank: Rank) -> str:
    """Dynamo's debug rendering of a rank, which appears in messages."""
    return f"WorkerWithDpRank {{ worker_id: {rank[0]}, dp_rank: {rank[1]} }}"


class DuplicateReservation(Conflict):
    """The id is already booked in this key (detected by type, never by message text)."""

    def __init__(self, reservation_id: str, rank: Rank) -> None:
        super().__init__(f"Request {reservation_id} already exists (assigned to worker {rank_text(rank)})")


class RankLoad:
    __slots__ = ("prefill_tokens", "requests", "unique")

    def __init__(self) -> None:
        self.prefill_tokens = 0
        self.requests = 0
        self.unique: dict[int, int] = {}

    def new_blocks(self, distinct: set[int]) -> int:
        """How many of `distinct` this rank does not hold yet (iterating the smaller side)."""
        unique = self.unique
        if not unique:
            return len(distinct)
        if len(unique) < len(distinct):
            return len(distinct) - sum(1 for h in unique if h in distinct)
        return sum(1 for h in distinct if h not in unique)


class Booking:
    __slots__ = ("rid", "rank", "blocks", "prefill_tokens", "prefill_done", "expected_output_tokens",
                 "booked_at")

    def __init__(self, rid: str, rank: Rank, blocks: list[int] | None, prefill_tokens: int,
                 expected_output_tokens: int | None, booked_at: float) -> None:
        self.rid = rid
        self.rank = rank
        self.blocks = blocks
        self.prefill_tokens = prefill_tokens
        self.prefill_done = False
        self.expected_output_tokens = expected_output_tokens
        self.booked_at = booked_at


class Tracker:
    """One key's bookings. Ids are unique per key; insertion order is booking-time order because
    the service never lets `now` go backwards, so expiry pops from the front."""

    __slots__ = ("bookings", "loads", "limit", "label", "budget")

    def __init__(self, limit: int, label: str, budget: StateBudget | None = None) -> None:
        self.bookings: dict[str, Booking] = {}
        self.loads: dict[Rank, RankLoad] = {}
        self.limit = limit
        self.label = label  # "model=<m> tenant=<t>"
        self.budget = budget if budget is not None else StateBudget(1 << 62)

    def add_rank(self, rank: Rank) -> None:
        self.loads.setdefault(rank, RankLoad())

    def drop_ranks(self, ranks: set[Rank]) -> list[str]:
        """Forget the ranks and their bookings, in one pass over the bookings (a worker with 1,024
        ranks and 100k bookings is one pass, not 1,024); returns the dropped ids."""
        for rank in ranks:
            self.loads.pop(rank, None)
        dropped = [rid for rid, b in self.bookings.items() if b.rank in ranks]
        budget = self.budget
        for rid in dropped:
            blocks = self.bookings.pop(rid).blocks
            budget.bookings -= 1
            budget.booked_blocks -= len(blocks) if blocks else 0
        return dropped

    def check_can_book(self, rid: str) -> None:
        existing = self.bookings.get(rid)
        if existing is not None:
            raise DuplicateReservation(rid, existing.rank)
        if len(self.bookings) >= self.limit:
            raise TooManyRequests(f"reservation limit reached for {self.label}: at most {self.limit} active")

    def book(self, rid: str, rank: Rank, blocks: list[int] | None, prefill_tokens: int,
             expected_output_tokens: int | None, now: float) -> Booking:
        self.check_can_book(rid)
        load = self.loads[rank]
        booking = Booking(rid, rank, blocks, prefill_tokens, expected_output_tokens, now)
        self.bookings[rid] = booking
        self.budget.bookings += 1
        self.budget.booked_blocks += len(blocks) if blocks else 0
        load.requests += 1
        load.prefill_tokens += prefill_tokens
        if blocks:
            unique = load.unique
            for h in blocks:
                unique[h] = unique.get(h, 0) + 1
        return booking

    def get(self, rid: str) -> Booking:
        booking = self.bookings.get(rid)
        if booking is None:
            raise NotFound(f"reservation {rid} not found")
        return booking

    def prefill_complete(self, rid: str) -> None:
        booking = self.get(rid)
        if not booking.prefill_done:
            booking.prefill_done = True
            self.loads[booking.rank].prefill_tokens -= booking.prefill_tokens

    def free(self, rid: str) -> Booking:
        booking = self.bookings.pop(rid, None)
        if booking is None:
            raise NotFound(f"reservation {rid} not found")
        self.budget.bookings -= 1
        self.budget.booked_blocks -= len(booking.blocks) if booking.blocks else 0
        load = self.loads[booking.rank]
        load.requests -= 1
        if not booking.prefill_done:
            load.prefill_tokens -= booking.prefill_tokens
        if booking.blocks:
            unique = load.unique
            for h in booking.blocks:
                left = unique[h] - 1
                if left:
                    unique[h] = left
                else:
                    del unique[h]
        return booking

    def expire(self, now: float, max_age: float) -> list[str]:
        expired: list[str] = []
        for rid, booking in self.bookings.items():
            if now - booking.booked_at < max_age:
                break
            expired.append(rid)
        for rid in expired:
            self.free(rid)
        return expired

    def next_expiry(self, max_age: float) -> float | None:
        for booking in self.bookings.values():
            return booking.booked_at + max_age
        return None

