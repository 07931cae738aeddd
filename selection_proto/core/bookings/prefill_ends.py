"""The end of a booking's prefill, read from its engine's KV events (docs/ROUTING.md, "When a
prefill ends"): an engine publishes a prompt's new full blocks (a stored event) when it has
computed them, that is when the prompt's prefill ends. So a booking whose rank comes to hold its
whole prompt, on the prompt's own path, has ended its prefill, whether or not its client says so.

A prompt with nothing new to store (its full blocks all cached, or none) publishes nothing. An
engine runs prefills first come, first served, and such a prompt's own work is less than a
block: it ends with the prefills booked ahead of it on its rank, at once when there are none.

One pool's watch: the bookings whose prefill counts, per rank in booking order; each booking
waiting for its prompt's blocks, found by the last one (a prompt's blocks are stored in order,
its last block last); each one following the bookings ahead of it. Who is watched and what
ending a prefill does are the selector's (`prefill_reading.PrefillReading`); this keeps the watch."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from ..cache.edges import Block
from ..cache.index import DeviceTree, Rank
from .tracker import Booking

__all__ = ["PrefillEnds"]


class PrefillEnds:
    """Per rank: the bookings in prefill, in booking order (a queue whose front is the oldest
    still in prefill), and the last block hash of a watched prompt -> the bookings waiting for it
    (several: one prompt booked twice on one rank). A follower ends when it comes to the front of
    its rank's queue: every booking ahead of it has ended its prefill. `ready`: followers there,
    for the selector to end. Each booking is queued and dequeued once: O(1) amortized."""

    __slots__ = ("_rank_of", "_queues", "_waiting", "_following", "ready")

    def __init__(self) -> None:
        self._rank_of: dict[Booking, Rank] = {}  # the bookings in prefill here
        self._queues: dict[Rank, deque[Booking]] = {}  # in booking order; ended ones leave lazily
        self._waiting: dict[Rank, dict[int, dict[Booking, None]]] = {}  # ordered sets
        self._following: set[Booking] = set()
        self.ready: list[Booking] = []

    def watching(self) -> bool:
        """Whether any booking waits for its blocks (the check on each stored event)."""
        return bool(self._waiting)

    def __len__(self) -> int:
        """The bookings in prefill here."""
        return len(self._rank_of)

    def waiting(self) -> int:
        """The bookings waiting for their blocks."""
        return sum(len(b) for by_last in self._waiting.values() for b in by_last.values())

    def following(self) -> set[Booking]:
        """The bookings following those ahead of them."""
        return self._following

    def booked(self, booking: Booking) -> None:
        """A booking whose prefill counts, and whose end is read here."""
        self._rank_of[booking] = booking.rank
        self._queues.setdefault(booking.rank, deque()).append(booking)

    def watch(self, booking: Booking, blocks: list[int]) -> None:
        """Wait for `blocks` (the prompt's full block hashes, at least one) stored on its rank."""
        booking.awaits = blocks
        self._waiting.setdefault(booking.rank, {}).setdefault(blocks[-1], {})[booking] = None

    def follow(self, booking: Booking) -> bool:
        """Follow the bookings ahead of it on its rank still in prefill; False when there are none."""
        if self._front(booking.rank) is booking:
            return False
        self._following.add(booking)
        return True

    def _front(self, rank: Rank) -> Booking | None:
        """The oldest booking on the rank still in prefill (the ended ones ahead of it dropped)."""
        queue, rank_of = self._queues.get(rank), self._rank_of
        while queue and (queue[0] not in rank_of or queue[0].prefill_done):
            # Ended, or ended where this was not told (a peer's prefill_complete, by the ledger).
            gone = queue.popleft()
            if rank_of.pop(gone, None) is not None:
                self._unwatch(gone)
                self._following.discard(gone)
        if not queue:
            self._queues.pop(rank, None)
            return None
        return queue[0]

    def ended(self, booking: Booking) -> None:
        """The booking's prefill no longer counts (it ended, by any path, or the booking did):
        forget it; a follower that comes to the front of its rank's queue is `ready`."""
        rank = self._rank_of.pop(booking, None)
        self._unwatch(booking)
        self._following.discard(booking)
        if rank is None:
            return
        front = self._front(rank)
        if front is not None and front in self._following:
            self._following.discard(front)
            self.ready.append(front)

    def _unwatch(self, booking: Booking) -> None:
        blocks = booking.awaits
        if blocks is None:
            return
        booking.awaits = None
        by_last = self._waiting[booking.rank]
        waiting = by_last[blocks[-1]]
        del waiting[booking]
        if not waiting:
            del by_last[blocks[-1]]
            if not by_last:
                del self._waiting[booking.rank]

    def stored(self, rank: Rank, blocks: Sequence[Block], tree: DeviceTree) -> list[Booking]:
        """`blocks` (engine, block hash) were stored on `rank` into `tree`: the bookings whose whole
        prompt the rank now holds, no longer waiting, for the caller to end their prefill."""
        by_last = self._waiting.get(rank)
        if not by_last:
            return []
        ended: dict[Booking, None] = {}
        for _, block in blocks:
            waiting = by_last.get(block)
            if waiting is None:
                continue
            # The same block may end another prompt: the rank must hold this prompt's whole path
            # (one lookup per booking: linear in the prompts booked).
            for booking in waiting:
                awaits = booking.awaits
                if awaits is not None and booking not in ended and tree.find(awaits)[0].get(rank, 0) >= len(awaits):
                    ended[booking] = None
        for booking in ended:
            self._unwatch(booking)
        return list(ended)
