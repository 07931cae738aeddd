"""The state budget: what the index, the bookings and the catalog hold in memory, estimated in O(1)
per change, and the one check every write that grows them makes against `max_state_bytes`.

The estimate counts what a client can make grow, at the sizes `bench/` measured on CPython 3.11
(docs/INVARIANTS.md): an indexed block, a booking and each block it books, and a catalog record
as a multiple of its JSON size. Reads never consult it: past the budget they keep working."""

from __future__ import annotations

from typing import Final

from .errors import SelectionError

__all__ = ["BLOCK_BYTES", "BOOKED_BLOCK_BYTES", "BOOKING_BYTES", "RECORD_FACTOR", "SESSION_BYTES",
           "InsufficientStorage", "StateBudget"]

BLOCK_BYTES: Final = 200  # one (rank, block) in a radix tree or a lower tier
BOOKING_BYTES: Final = 300  # a booking without blocks
BOOKED_BLOCK_BYTES: Final = 70  # each sequence hash a booking holds
RECORD_FACTOR: Final = 5  # a catalog record's memory / its JSON size (typical records)
SESSION_BYTES: Final = 250  # a session binding, besides its id


class InsufficientStorage(SelectionError):
    status = 507


class StateBudget:
    """Counters kept by their owners (tracker, index writes, catalog) and the limit."""

    __slots__ = ("limit", "index_blocks", "bookings", "booked_blocks", "record_bytes", "session_bytes")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.index_blocks = 0
        self.bookings = 0
        self.booked_blocks = 0
        self.record_bytes = 0  # JSON bytes of every stored record, tombstones included
        self.session_bytes = 0  # session bindings (made only by bookings, which check the budget)

    @property
    def used(self) -> int:
        return (self.index_blocks * BLOCK_BYTES + self.bookings * BOOKING_BYTES
                + self.booked_blocks * BOOKED_BLOCK_BYTES + self.record_bytes * RECORD_FACTOR
                + self.session_bytes)

    @property
    def exhausted(self) -> bool:
        return self.used >= self.limit

    def check(self, write: str) -> None:
        """Refuse a write that would grow the state once the budget is used up."""
        if self.used >= self.limit:
            raise InsufficientStorage(f"state budget exhausted: {write} refused (the index, bookings and "
                                      f"catalog use about {self.used} of {self.limit} bytes)")
