"""Freshness of one rank's index: whether it may be missing KV events (events.md §6).

Event ids and stream seqs follow the same continuity rule, written once in `RankFreshness._step`:
the next number is fine; a jump forward is a gap (the numbers in between are missing); anything
else is a rewind. Either break marks the rank stale until a `cleared` event proves the index whole
again. A stream seq that goes back (or is 0 again) is an engine restart (its cache is empty, its numbers begin
again): the caller drops the rank's index, and when the batch is the engine's first (seq 0) the next
batch in order proves the index whole again (docs/VERDICT.md, "Engine restarts")."""

from __future__ import annotations

from typing import Final, NamedTuple

__all__ = ["GAP", "RESTART", "REWIND", "Break", "RankFreshness"]

GAP: Final = "gap"
REWIND: Final = "rewind"
RESTART: Final = "restart"


class Break(NamedTuple):
    """A break in continuity: its kind and, for a gap, how many numbers it skipped."""

    kind: str
    missing: int


class RankFreshness:
    """Per rank: the last event id and seq seen, what broke, and the streams that feed it."""

    __slots__ = ("last_event_id", "last_event_at", "last_seq", "event_gaps", "missing_events",
                 "rewinds", "restarts", "stale", "recovering", "open_streams", "loss_pending")

    def __init__(self) -> None:
        self.last_event_id: int | None = None
        self.last_event_at: float | None = None
        self.last_seq: int | None = None
        self.event_gaps = 0
        self.missing_events = 0
        self.rewinds = 0
        self.restarts = 0
        self.stale = False
        self.recovering = False  # stale by a restart seen from its first batch: the next in order heals
        self.open_streams = 0
        self.loss_pending = False  # a stream that fed this rank was lost; continuity unproven

    def age(self, now: float) -> float | None:
        """Seconds since the last event, or None before the first."""
        return None if self.last_event_at is None else now - self.last_event_at

    def _step(self, last: int | None, value: int) -> Break | None:
        if last is None:
            return None
        if value == last + 1:
            self.loss_pending = False
            if self.recovering:
                self.recovering = self.stale = False
            return None
        self.mark_stale()
        if value > last + 1:
            self.event_gaps += 1
            self.missing_events += value - last - 1
            return Break(GAP, value - last - 1)
        self.rewinds += 1
        return Break(REWIND, 0)

    def note_event_id(self, event_id: int | None, now: float) -> Break | None:
        """An event arrived; one without an id counts as the next."""
        if event_id is None:
            event_id = (self.last_event_id or 0) + 1
        broken = self._step(self.last_event_id, event_id)
        self.last_event_id = event_id
        self.last_event_at = now
        return broken

    def note_seq(self, seq: int) -> Break | None:
        """A batch with a stream seq arrived (the caller also marks the batch's own rank stale, and
        on a restart drops the index)."""
        last = self.last_seq
        broken = self._step(last, seq)
        self.last_seq = seq
        if broken is not None and last is not None and (seq < last or seq == 0):  # 0 again: a new engine
            self.restarts += 1
            self.recovering = seq == 0
            return Break(RESTART, 0)
        return broken

    def mark_stale(self) -> None:
        """The index may be missing events (a recovery under way is void)."""
        self.stale = True
        self.recovering = False

    def count_event(self, now: float) -> None:
        """An engine event: engines number batches, not events, so ids are only counted."""
        self.last_event_id = (self.last_event_id or 0) + 1
        self.last_event_at = now

    def mark_cleared(self) -> None:
        """The engine reset the rank's device cache: the index is whole again."""
        self.stale = False
        self.loss_pending = False
