"""The end of a booking's prefill, read from its engine's KV events (docs/ROUTING.md, "When a
prefill ends"): an engine publishes a prompt's new full blocks (a stored event) when it has
computed them, that is when the prompt's prefill ends. So a booking whose rank comes to hold its
whole prompt, on the prompt's own path, has ended its prefill, whether or not its client says so.

One pool's watch: each booking waiting for its prompt's blocks, found by the last one (a prompt's
blocks are stored in order, its last block last). The rule, the checks of who may be watched and
what ending a prefill does are the selector's (selection.py); this keeps the watch."""

from __future__ import annotations

from collections.abc import Sequence

from .index import Block, DeviceTree, Rank
from .tracker import Booking

__all__ = ["PrefillEnds"]


class PrefillEnds:
    """Rank -> the last block hash of a watched prompt -> the bookings waiting for it (several:
    the same prompt booked twice on one rank)."""

    __slots__ = ("_waiting",)

    def __init__(self) -> None:
        self._waiting: dict[Rank, dict[int, list[Booking]]] = {}

    def __bool__(self) -> bool:
        """Any booking watched (empty ranks are dropped)."""
        return bool(self._waiting)

    def __len__(self) -> int:
        """The bookings watched."""
        return sum(len(b) for by_last in self._waiting.values() for b in by_last.values())

    def watch(self, booking: Booking, blocks: list[int]) -> None:
        """Wait for `blocks` (the prompt's block hashes, at least one) stored on the booking's rank."""
        booking.awaits = blocks
        self._waiting.setdefault(booking.rank, {}).setdefault(blocks[-1], []).append(booking)

    def forget(self, booking: Booking) -> None:
        """The booking ended its prefill or itself: stop waiting for it (nothing if it was not)."""
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
        prompt the rank now holds, forgotten here, for the caller to end their prefill."""
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
            self.forget(booking)
        return ended
