"""Whether KV routing works for a worker: what its engine's events and its own reports of
cached tokens say about the index's predictions, reduced to one state and reasons an operator can
act on (docs/VERDICT.md).

Each rank keeps a `RankWatch`, fed by ingestion (events, block sizes, restarts), by bookings (a
prompt with blocks the engine does not hold must make it publish) and by observations (the engine's
own `cached_tokens` for a booking). `judge` turns a worker's watches into its `kv_routing` member.
The states, worst first (a worker shows its worst rank's):

| state | when |
|---|---|
| `block_size_mismatch` | the engine's stored events carry a block size other than the record's |
| `stale` | a rank's index may be missing events: a gap not replayed, or an engine restart seen |
| `misses` | over the last observations, the engine found well under what the index predicted |
| `no_events` | bookings that must make the engine publish, and no event within the window |
| `waiting` | nothing to judge yet: no event and no observation, or the worker is not schedulable |
| `ok` | events arrive (or observations agree) and nothing above holds |
"""

from __future__ import annotations

from collections import deque
from typing import Any, Final

from ..bookings.tracker import Booking
from ..cache.freshness import RankFreshness

__all__ = ["MIN_OBSERVATIONS", "MISS_RATIO", "ORDER", "RECENT", "SEVERITY", "SEVERITY_ORDER", "STATES", "RankWatch",
           "judge", "not_schedulable", "visible_cached"]

STATES: Final = ("ok", "waiting", "no_events", "block_size_mismatch", "stale", "misses")
# Which state a worker shows when several hold (the table above, worst first).
ORDER: Final = {"block_size_mismatch": 5, "stale": 4, "misses": 3, "no_events": 2, "waiting": 1, "ok": 0}
# How urgent each state is: the one scale of the status page's colours, the alert rules'
# `severity` label (deploy/prometheus/alerts.yaml) and docs/VERDICT.md. `critical`: KV routing is
# off for the worker (nothing of its engine's cache reaches the index); `warning`: it routes on a
# picture that may be wrong; `info`: nothing to judge yet.
SEVERITY: Final = {"block_size_mismatch": "critical", "no_events": "critical", "stale": "warning",
                   "misses": "warning", "waiting": "info", "ok": "ok"}
SEVERITY_ORDER: Final = {"ok": 0, "info": 1, "warning": 2, "critical": 3}
_RECOVERING: Final = 1.5  # stale awaiting its next batch: below no_events, so an engine gone for good says so
RECENT: Final = 32  # observations with a prediction kept per rank for `misses`
MIN_OBSERVATIONS: Final = 5  # of them, before `misses` may be said
MISS_RATIO: Final = 0.5  # `misses` when the engine found less than this share of the prediction


def visible_cached(predicted: int, prompt_tokens: int, block_size: int) -> int:
    """The predicted cached tokens an engine can report: whole blocks, and never the prompt's last
    token (an engine computes at least one token of every prompt, as vLLM and SGLang do)."""
    return max(0, min(predicted, (prompt_tokens - 1) // block_size * block_size))


class RankWatch:
    """One rank's evidence. Reset when the rank joins or its endpoint changes, as its freshness."""

    __slots__ = ("events", "last_event_at", "engine_block_size", "mismatched", "awaiting_since",
                 "awaiting_bookings", "predicted", "observed", "observations", "recent")

    def __init__(self) -> None:
        self.events = 0  # events that arrived for the rank, applied or dropped
        self.last_event_at: float | None = None
        self.engine_block_size: int | None = None  # of the last stored engine event
        self.mismatched = 0  # stored events dropped: their block size is not the record's
        self.awaiting_since: float | None = None  # first booking with new blocks since the last event
        self.awaiting_bookings = 0
        self.predicted = 0  # totals over observations
        self.observed = 0
        self.observations = 0
        self.recent: deque[tuple[int, int]] = deque(maxlen=RECENT)  # (predicted, observed), predicted > 0

    def event(self, now: float, block_size: int | None = None, mismatched: bool = False) -> None:
        """An event arrived for the rank (engine events say their block size when they store)."""
        self.events += 1
        self.last_event_at = now
        self.awaiting_since = None
        self.awaiting_bookings = 0
        if block_size is not None:
            self.engine_block_size = block_size
        if mismatched:
            self.mismatched += 1

    def booked(self, booking: Booking, blocks: int, prompt_tokens: int, cached: int, block_size: int,
               now: float) -> None:
        """A booking of a prompt of `blocks` blocks landed on the rank with `cached` tokens
        predicted: the blocks beyond them must make the engine publish."""
        booking.predicted_cached = visible_cached(cached, prompt_tokens, block_size)
        booking.prompt_tokens = prompt_tokens
        if blocks > cached // block_size:
            if self.awaiting_since is None:
                self.awaiting_since = now
            self.awaiting_bookings += 1

    def observe(self, booking: Booking, cached_tokens: int) -> tuple[int, int] | None:
        """The engine reported the booking's cached tokens (capped at its prompt): the first report
        counts. (predicted, observed), or None when the booking has none to compare."""
        predicted = booking.predicted_cached
        if predicted is None:
            return None
        booking.predicted_cached = None
        observed = min(cached_tokens, booking.prompt_tokens)
        self.predicted += predicted
        self.observed += observed
        self.observations += 1
        if predicted > 0:
            self.recent.append((predicted, observed))
        return predicted, observed

    def state(self, fresh: RankFreshness, block_size: int, events_expected: bool, window: float,
              now: float) -> tuple[str, list[str]]:
        """This rank's state and the reasons behind it (every finding, worst first)."""
        found: list[tuple[float, str, str]] = []  # (severity, state, reason)
        if self.engine_block_size is not None and self.engine_block_size != block_size:
            found.append((ORDER["block_size_mismatch"], "block_size_mismatch", (
                f"the engine stores blocks of {self.engine_block_size} tokens but the worker record says "
                f"block_size {block_size}: {self.mismatched} stored events were dropped; register the "
                f"worker with block_size {self.engine_block_size}")))
        if fresh.stale and fresh.recovering:
            found.append((_RECOVERING, "stale", (
                "the engine restarted or its event stream dropped: the index forgot what it held for it, "
                "and trusts it again once its next events follow in order")))
        elif fresh.stale:
            found.append((ORDER["stale"], "stale", (
                "KV events were lost (a gap the engine could not replay, a stream lost without proof of "
                "continuity, or stores over the state budget): the index may be wrong for this worker "
                "until its engine clears its cache or restarts")))
        if len(self.recent) >= MIN_OBSERVATIONS and (
                (observed := sum(o for _, o in self.recent)) < MISS_RATIO * (predicted := sum(p for p, _ in self.recent))):
            found.append((ORDER["misses"], "misses", (
                f"over the last {len(self.recent)} observed requests the engine found {observed} of "
                f"{predicted} predicted cached tokens: is prefix caching on in the engine, and do the "
                "router and the engine tokenize alike (tokenizer, chat template, BOS)?")))
        if events_expected and self.awaiting_since is not None and now - self.awaiting_since >= window:
            found.append((ORDER["no_events"], "no_events", (
                f"{self.awaiting_bookings} bookings with new blocks and no KV event in "
                f"{now - self.awaiting_since:.0f} s: is the engine running and publishing to the worker's "
                "kv_events_endpoint, with prefix caching and KV events enabled?")))
        if found:
            found.sort(key=lambda f: -f[0])
            return found[0][1], [text for _, _, text in found]
        if self.events == 0 and self.observations == 0:
            return "waiting", ["no KV event and no observed cached tokens yet"]
        return "ok", []


def judge(watches: list[tuple[int, RankWatch, RankFreshness]], block_size: int, events_expected: bool,
          window: float, now: float) -> dict[str, Any]:
    """A worker's `kv_routing` from its ranks' (dp_rank, watch, freshness): its worst rank's state."""
    # One pass: a status snapshot judges every worker of the fleet each second.
    state, reasons = "ok", []
    several = len(watches) > 1
    events = restarts = predicted = observed = observations = 0
    last: float | None = None
    size: int | None = None
    for dp_rank, watch, fresh in watches:
        rank_state, rank_reasons = watch.state(fresh, block_size, events_expected, window, now)
        if ORDER[rank_state] > ORDER[state]:
            state = rank_state
        if rank_state != "ok":
            reasons.extend([f"dp_rank {dp_rank}: {r}" for r in rank_reasons] if several else rank_reasons)
        events += watch.events
        restarts += fresh.restarts
        predicted += watch.predicted
        observed += watch.observed
        observations += watch.observations
        if watch.last_event_at is not None and (last is None or watch.last_event_at > last):
            last = watch.last_event_at
        if watch.engine_block_size is not None:
            size = watch.engine_block_size
    return {
        "state": state,
        "reasons": reasons if state != "ok" else [],
        "events_total": events,
        "last_event_age_secs": max(0.0, now - last) if last is not None else None,
        "engine_block_size": size,
        "restarts": restarts,
        "predicted_cached_tokens": predicted,
        "observed_cached_tokens": observed,
        "observations": observations,
    }


def not_schedulable(lifecycle: str) -> dict[str, Any]:
    """The `kv_routing` of a worker with no ranks to judge."""
    return {"state": "waiting", "reasons": [f"the worker is {lifecycle}: nothing is routed to it"],
            "events_total": 0, "last_event_age_secs": None, "engine_block_size": None, "restarts": 0,
            "predicted_cached_tokens": 0, "observed_cached_tokens": 0, "observations": 0}
