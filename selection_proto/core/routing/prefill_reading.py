"""The selector's part in reading a prefill's end from its engine's events (docs/ROUTING.md,
"When a prefill ends"): which bookings are watched (`prefill_ends.PrefillEnds` keeps the watch),
and what ending a prefill read from events does: what `prefill_complete` does."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..bookings.prompt import PromptHashes
from ..bookings.tracker import Booking
from ..fleet.pool import Key, Pool

if TYPE_CHECKING:
    from ..base.deferred import Deferred
    from ..base.metrics import Metrics
    from ..base.settings import Settings
    from ..fleet.journal import Journal

__all__ = ["PrefillReading"]


class PrefillReading:
    """A mixin of `selection.Selector`, as `queueing.Admission` is."""

    if TYPE_CHECKING:
        _settings: Settings
        _metrics: Metrics
        _deferred: Deferred
        _pools: Mapping[Key, Pool]
        journal: Journal | None

        def dispatch(self, pool: Pool | None, now: float) -> None: ...

    @property
    def _reads_prefill_ends(self) -> bool:
        """Whether a booking's prefill ends when its engine stores its prompt (router_policy=ttft,
        with events feeding the index; docs/ROUTING.md "When a prefill ends"). Dynamo's policy
        keeps 1.6.1's bookings exactly."""
        s = self._settings
        return s.router_policy == "ttft" and s.kv_events in ("push", "subscribe")

    def _watch_prefill(self, pool: Pool, booking: Booking, prompt: PromptHashes, device_blocks: int | None,
                       now: float) -> None:
        """Wait for the engine to store the prompt's full blocks (an engine never stores a partial
        one, which a client may name); a prompt the rank's index already holds whole, or without a
        full block, has nothing new to store: it ends with the prefills booked ahead of it, at
        once when there are none."""
        full = min(len(prompt.blocks), prompt.isl // pool.block_size)
        blocks = prompt.blocks if full == len(prompt.blocks) else prompt.blocks[:full]
        if blocks and device_blocks is None:
            device_blocks = pool.index.device.find(blocks)[0].get(booking.rank, 0)
        if blocks and device_blocks is not None and device_blocks < full:
            pool.prefill_ends.watch(booking, blocks)
        elif not pool.prefill_ends.follow(booking):
            self._end_prefill(pool, booking, now)

    def prefills_ended(self, pool: Pool, bookings: list[Booking], now: float) -> None:
        """Their engine stored their prompts (ingest.py): their prefill ended; queued selections
        may run once the events are applied."""
        for booking in bookings:
            self._end_prefill(pool, booking, now)
        self._end_followers(pool, now)
        if pool.queue:
            self._deferred.add(lambda: self.dispatch(pool if self._pools.get(pool.key) is pool else None, now))

    def _end_prefill(self, pool: Pool, booking: Booking, now: float) -> None:
        """What `prefill_complete` does to a booking whose prefill's end was read from events;
        its tokens teach the worker's speed, as every prefill's end does, so that a replica that
        hears of it through the ledger (which says only that it ended) learns the same."""
        if booking.prefill_done:  # its client told another replica first, and the ledger brought it
            pool.prefill_ends.ended(booking)
            return
        load = pool.tracker.loads[booking.rank]
        pool.speeds.ended(booking.rank, load.prefill_tokens, load.prefilling, booking.prefill_tokens, now,
                          completed=True, pairs=booking.pairs)
        pool.tracker.prefill_complete(booking.rid)
        pool.prefill_ends.ended(booking)
        if self.journal is not None:
            self.journal.prefilled(booking)
        self._metrics.booking(pool.key, "prefill_inferred")

    def _end_followers(self, pool: Pool, now: float) -> None:
        """End the prefill of the bookings whose prefills ahead have all ended (each may free more)."""
        ready = pool.prefill_ends.ready
        while ready:
            booking = ready.pop(0)
            if pool.tracker.bookings.get(booking.rid) is booking and not booking.prefill_done:
                self._end_prefill(pool, booking, now)
