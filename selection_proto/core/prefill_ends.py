"""The end of a booking's prefill, read from its engine's KV events (docs/ROUTING.md, "When a
prefill ends"): an engine publishes a prompt's new full blocks (a stored event) when it has
computed them, that is when the prompt's prefill ends. So a booking whose rank comes to hold its
whole prompt, on the prompt's own path, has ended its prefill, whether or not its client says so.

A prompt with nothing new to store (its full blocks all cached, or none) publishes nothing. An
engine runs prefills first come, first served, and such a prompt's own work is less than a
block: it ends with the prefills booked ahead of it on its rank, at once when there are none.

One pool's watch: the bookings whose prefill counts, per rank in booking order; each booking
waiting for its prompt's blocks, found by the last one (a prompt's blocks are stored in order,
its last block last); each one following the bookings ahead of it. The rule, who may be watched
and what ending a prefill does are the selector's (selection.py); this keeps the watch."""

from __future__ import annotations

from collections.abc import Sequence

from .index import Block, DeviceTree, Rank
from .tracker import Booking

__all__ = ["PrefillEnds"]


class PrefillEnds:
    """Per rank: the bookings in prefill, in booking order, and the last block hash of a watched
    prompt -> the bookings waiting for it (several: one prompt booked twice on one rank). Per
    booking ahead: those following it; per follower: how many ahead of it are still in prefill.
    `ready`: followers whose prefills ahead have all ended, for the selector to end."""

    __slots__ = ("_in_prefill", "_waiting", "_behind", "_ahead", "ready")

    def __init__(self) -> None:
        self._in_prefill: dict[Rank, dict[Booking, None]] = {}
        self._waiting: dict[Rank, dict[int, list[Booking]]] = {}
        self._behind: dict[Booking, list[Booking]] = {}
        self._ahead: dict[Booking, int] = {}
        self.ready: list[Booking] = []

    def watching(self) -> bool:
        """Whether any booking waits for its blocks (the check on each stored event)."""
        return bool(self._waiting)

    def __len__(self) -> int:
        """The bookings in prefill here."""
        return sum(map(len, self._in_prefill.values()))

    def waiting(self) -> int:
        """The bookings waiting for their blocks."""
        return sum(len(b) for by_last in self._waiting.values() for b in by_last.values())

    def booked(self, booking: Booking) -> None:
        """A booking whose prefill counts, and whose end is read here."""
        self._in_prefill.setdefault(booking.rank, {})[booking] = None

    def watch(self, booking: Booking, blocks: list[int]) -> None:
        """Wait for `blocks` (the prompt's full block hashes, at least one) stored on its rank."""
        booking.awaits = blocks
        self._waiting.setdefault(booking.rank, {}).setdefault(blocks[-1], []).append(booking)

    def follow(self, booking: Booking) -> bool:
        """Follow the bookings ahead of it on its rank still in prefill; False when there are none."""
        ahead = [b for b in self._in_prefill.get(booking.rank, ()) if b is not booking]
        if not ahead:
            return False
        self._ahead[booking] = len(ahead)
        for b in ahead:
            self._behind.setdefault(b, []).append(booking)
        return True

    def ended(self, booking: Booking) -> None:
        """The booking's prefill no longer counts (it ended, by any path, or the booking did):
        forget it, and the followers of which it was the last ahead are `ready`."""
        in_prefill = self._in_prefill.get(booking.rank)
        if in_prefill is not None and booking in in_prefill:
            del in_prefill[booking]
            if not in_prefill:
                del self._in_prefill[booking.rank]
        self._unwatch(booking)
        self._ahead.pop(booking, None)
        for follower in self._behind.pop(booking, ()):
            left = self._ahead.get(follower)
            if left == 1:
                del self._ahead[follower]
                self.ready.append(follower)
            elif left is not None:
                self._ahead[follower] = left - 1

    def _unwatch(self, booking: Booking) -> None:
        blocks = booking.awaits
        if blocks is None:
            return
        booking.awaits = None
        by_last = self._waiting[booking.rank]
        waiting = by_last[blocks[-1]]
        waiting.remove(booking)  # a list of the bookings of one prompt on one rank: short
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
        ended: list[Booking] = []
        for _, block in blocks:
            waiting = by_last.get(block)
            if waiting is None:
                continue
            # The same block may end another prompt: the rank must hold this prompt's whole path.
            ended += [b for b in waiting if b.awaits is not None and b not in ended
                      and tree.find(b.awaits)[0].get(rank, 0) >= len(b.awaits)]
        for booking in ended:
            self._unwatch(booking)
        return ended
