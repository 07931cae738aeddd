"""Each worker's prefill speed as `router_policy=ttft` reads it (docs/ROUTING.md): declared in its
record (`prefill_tokens_per_sec`), or else learned from the calls the service sees.

A learned speed is the prefill tokens a worker's ranks completed (at `prefill_complete`) over the
rank-seconds they had prefill booked, so time a request waits in its engine's queue does not read
as slowness; frees teach nothing (their time includes the decode). A worker is then read against
the mean of the workers learned so far, to the power 0.5: halfway, in log terms, between "all
equal" and what was measured, which damps the noise between engines that are in fact equal.
A declared speed always wins; only the ratios between workers matter to the cost.

`left` reads how far a rank's running prefill has got at its worker's learned rate (tokens a
rank-second, absolute): measured, and not used by the cost (docs/ROUTING.md, round three)."""

from __future__ import annotations

from typing import Final

from ..cache.index import Rank

__all__ = ["DEFAULT_PREFILL_TOKENS_PER_SEC", "Speeds", "worker_speed"]

# A worker's prefill speed when its record does not give one (only the ratios between workers
# matter then: every term of the cost is divided by it).
DEFAULT_PREFILL_TOKENS_PER_SEC: Final = 10_000.0
# Prefill tokens a worker must have completed before its learned speed counts.
LEARN_AFTER_TOKENS: Final = 20_000
# How far a learned speed moves the cost: (fleet mean / worker's speed) ** DAMPING.
DAMPING: Final = 0.5
# A learned worker is read at most this many times slower (or faster) than the fleet's mean.
MOST_APART: Final = 4.0


def worker_speed(prefill_tokens_per_sec: float | None, total_kv_blocks: int | None) -> tuple[float, int]:
    """Seconds per prefilled token, and KV blocks (0: unknown), of a worker record."""
    return 1.0 / (prefill_tokens_per_sec or DEFAULT_PREFILL_TOKENS_PER_SEC), total_kv_blocks or 0


class Speeds:
    """One pool's workers: `of` is what the cost reads (worker -> `worker_speed`, learned ones
    scaled); `observe`, `stopped` and `completed` are fed by the bookings when `learn` is on."""

    __slots__ = ("of", "learn", "shadow", "_declared", "_busy", "_done", "_since", "_unread", "_started", "_rate")

    def __init__(self, learn: bool, shadow: Speeds | None = None) -> None:
        self.of: dict[int, tuple[float, int]] = {}
        self.learn = learn
        # A shadow policy's own speeds, fed the same calls: what the acting cost reads stays as
        # it would be without a shadow (docs/STATUS.md, "The shadow policy").
        self.shadow = shadow
        self._declared: set[int] = set()
        self._busy: dict[int, float] = {}  # worker -> rank-seconds with prefill booked
        self._done: dict[int, int] = {}  # worker -> prefill tokens completed
        self._since: dict[Rank, float] = {}  # rank -> when its booked prefill last changed
        self._unread = 0  # tokens completed since the speeds were last worked out
        # Rank -> (when its booked prefill last went from none to some, tokens that stopped
        # counting on it since): how far its running prefill has got (`left`).
        self._started: dict[Rank, tuple[float, int]] = {}
        self._rate: dict[int, float] = {}  # worker -> prefill tokens a rank-second, once learned

    def set(self, worker_id: int, prefill_tokens_per_sec: float | None, total_kv_blocks: int | None) -> None:
        """The worker joined or its record changed."""
        if self.shadow is not None:
            self.shadow.set(worker_id, prefill_tokens_per_sec, total_kv_blocks)
        per_token, kv_blocks = worker_speed(prefill_tokens_per_sec, total_kv_blocks)
        if prefill_tokens_per_sec:
            self._declared.add(worker_id)
        else:
            self._declared.discard(worker_id)
            per_token *= self._slowness().get(worker_id, 1.0)
        self.of[worker_id] = (per_token, kv_blocks)

    def forget(self, worker_id: int) -> None:
        """The worker left: what was learned of it goes too (it may come back another engine)."""
        if self.shadow is not None:
            self.shadow.forget(worker_id)
        self.of.pop(worker_id, None)
        self._declared.discard(worker_id)
        self._busy.pop(worker_id, None)
        self._done.pop(worker_id, None)
        self._rate.pop(worker_id, None)
        for rank in [r for r in self._since if r[0] == worker_id]:
            del self._since[rank]
            self._started.pop(rank, None)

    def observe(self, rank: Rank, booked_prefill: int, now: float) -> None:
        """Called before the rank's booked prefill changes, with what it was until `now`."""
        if self.shadow is not None:
            self.shadow.observe(rank, booked_prefill, now)
        if not self.learn:
            return
        since = self._since.get(rank)
        if since is not None and booked_prefill > 0 and now > since:
            self._busy[rank[0]] = self._busy.get(rank[0], 0.0) + (now - since)
        self._since[rank] = now
        if booked_prefill <= 0:
            self._started[rank] = (now, 0)

    def stopped(self, rank: Rank, prefill_tokens: int) -> None:
        """A booking's prefill tokens stopped counting on the rank (completed, or freed before)."""
        started = self._started.get(rank)
        if started is not None and prefill_tokens > 0:
            self._started[rank] = (started[0], started[1] + prefill_tokens)

    def left(self, rank: Rank, booked_prefill: int, now: float) -> float:
        """The rank's booked prefill still to run: what was booked, less what its engine has
        done at the worker's learned rate since it began, beyond the tokens that stopped counting
        (all of it until a rate is learned)."""
        rate = self._rate.get(rank[0])
        started = self._started.get(rank)
        if rate is None or started is None or booked_prefill <= 0:
            return booked_prefill
        done = rate * (now - started[0]) - started[1]
        return booked_prefill - done if done < booked_prefill else 0.0

    def completed(self, worker_id: int, prefill_tokens: int) -> None:
        """A booking on the worker finished its prefill: the learned speeds move."""
        if self.shadow is not None:
            self.shadow.completed(worker_id, prefill_tokens)
        if not self.learn or prefill_tokens <= 0:
            return
        self._done[worker_id] = self._done.get(worker_id, 0) + prefill_tokens
        self._unread += prefill_tokens
        # Working the speeds out is one pass over the workers: in a large pool, once for every
        # so many tokens, which one completion among many barely moves.
        if self._done[worker_id] < LEARN_AFTER_TOKENS or self._unread * 16 < LEARN_AFTER_TOKENS * len(self._done):
            return
        self._unread = 0
        self._rate = {w: done / self._busy[w] for w, done in self._done.items()
                      if done >= LEARN_AFTER_TOKENS and self._busy.get(w, 0.0) > 0.0}
        base = worker_speed(None, None)[0]
        for worker, slower in self._slowness().items():
            if worker in self.of and worker not in self._declared:
                self.of[worker] = (base * slower, self.of[worker][1])

    def _slowness(self) -> dict[int, float]:
        """Each learned worker's time per token against the fleet's mean (1: as fast), damped."""
        rates = {w: done / self._busy[w] for w, done in self._done.items()
                 if done >= LEARN_AFTER_TOKENS and self._busy.get(w, 0.0) > 0.0}
        if len(rates) < 2:
            return {}
        mean = sum(rates.values()) / len(rates)
        return {w: min(MOST_APART, max(1.0 / MOST_APART, (mean / rate) ** DAMPING)) for w, rate in rates.items()}

    def learned(self) -> dict[int, float]:
        """Each learned worker's speed against the mean, undamped (2.0: twice as fast), for the
        operator; declared workers are not listed."""
        return {w: 1.0 / slower ** (1.0 / DAMPING) for w, slower in self._slowness().items()
                if w in self.of and w not in self._declared}
