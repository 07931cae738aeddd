"""What selections achieved against what they could have (docs/STATUS.md, "Achieved against
achievable"): the cached tokens of the chosen rank beside the most that any schedulable rank of
the key held of the prompt at the same moment, read from the overlap the selection computed
already (no second look at the index); when the chosen got less, the one reason why
(`loss_reason`); and `Recent`, the last minute of a key's outcomes that the live page reads
(`/metrics` counts the totals)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Final

from ..cache.index import Rank
from .decisions import Scored

__all__ = ["BUCKET_SECS", "ERRORS", "FIELDS", "REASONS", "REFUSALS", "SELECTIONS", "WINDOW_SECS", "Recent",
           "achievable", "best_cached", "loss_reason"]

# Why a selection got fewer cached tokens than the best-cached rank held, in the order they are
# looked for (docs/STATUS.md says what each means and what to do about it).
REASONS: Final = ("constraints", "affinity", "load", "queue", "sampling")
_CONSTRAINED: Final = frozenset({"not_allowed", "missing_required_taint", "not_pinned"})

WINDOW_SECS: Final = 60.0  # what the live page calls "the last minute"
BUCKET_SECS: Final = 5.0


def best_cached(device: Mapping[Rank, int], host: Mapping[Rank, int], disk: Mapping[Rank, int],
                block_size: int, host_weight: float, disk_weight: float) -> dict[Rank, int]:
    """The tokens each rank that holds any of the prompt holds (lower tiers discounted and rounded
    as a candidate's `cached` is, cost.py), from the selection's overlap per rank (`estimates`)."""
    if not host and not disk:
        return {r: n * block_size for r, n in device.items()}
    return {r: math.floor((device.get(r, 0) + host_weight * host.get(r, 0) + disk_weight * disk.get(r, 0))
                          * block_size + 0.5) for r in {*device, *host, *disk}}


def achievable(device: Mapping[Rank, int], host: Mapping[Rank, int], disk: Mapping[Rank, int],
               block_size: int, host_weight: float, disk_weight: float) -> int:
    """The most tokens any rank holds of the prompt (device blocks only in the common case: one max)."""
    if not host and not disk:
        return max(device.values(), default=0) * block_size
    return max(best_cached(device, host, disk, block_size, host_weight, disk_weight).values(), default=0)


def loss_reason(chosen: Scored, scored: Sequence[Scored], excluded: Mapping[Rank, str],
                cached: Mapping[Rank, int], most: int, queued: bool) -> str:
    """Why `chosen` holds fewer cached tokens than `most`, which the ranks of `cached` that hold
    that many hold (its cost could not do better):

    - `constraints`: every best rank was ruled out by the request (allowed workers, required taints,
      a pinned worker);
    - `affinity`: by the request's session, bound to another rank;
    - `load`: it was scored and cost more than the chosen, or every worker of it was overloaded;
    - `queue`: the same, for a selection that waited in the admission queue for room;
    - `sampling`: it cost no more than the chosen: a draw at temperature > 0, or a tie broken.
    """
    best = {r for r, n in cached.items() if n == most}
    costs = [s.logit for s in scored if s.rank in best]
    if costs:
        if min(costs) <= chosen.logit:
            return "sampling"
        return "queue" if queued else "load"
    why = {excluded.get(r) for r in best}
    if why & _CONSTRAINED:
        return "constraints"
    if "session_affinity" in why:
        return "affinity"
    return "queue" if queued else "load"  # overloaded


# What `Recent` counts, by position in a bucket.
FIELDS: Final = ("selections", "refusals", "errors", "prompt_tokens", "achieved", "achievable", "shadow_scored",
                 "shadow_disagreed", "ttft_acting", "ttft_shadow", *(f"lost:{r}" for r in REASONS))
SELECTIONS, REFUSALS, ERRORS = 0, 1, 2
_LOST: Final = {r: FIELDS.index(f"lost:{r}") for r in REASONS}


class Recent:
    """Counts of one key over the last `WINDOW_SECS`, in `BUCKET_SECS` buckets of `FIELDS`: bounded
    by one window's buckets. Each selection adds to the newest bucket, a list: no allocation."""

    __slots__ = ("_buckets", "_since", "_slot", "_current")

    def __init__(self, now: float) -> None:
        self._buckets: deque[tuple[int, list[float]]] = deque()
        self._since = now
        self._slot = -(1 << 62)
        self._current: list[float] = []

    def _bucket(self, now: float) -> list[float]:
        slot = math.floor(now / BUCKET_SECS)
        if slot <= self._slot:  # a time that went backwards counts in the newest bucket
            return self._current
        self._slot, self._current = slot, [0.0] * len(FIELDS)
        self._buckets.append((slot, self._current))
        while self._buckets[0][0] <= slot - WINDOW_SECS / BUCKET_SECS:
            self._buckets.popleft()
        return self._current

    def ended(self, now: float, field: int) -> None:
        """A selection ended other than selected: `REFUSALS` or `ERRORS`."""
        self._bucket(now)[field] += 1.0

    def selected(self, now: float, prompt_tokens: int, achieved: int, achievable: int, loss: str | None) -> None:
        bucket = self._bucket(now)
        bucket[0] += 1.0
        bucket[3] += prompt_tokens
        bucket[4] += achieved
        bucket[5] += achievable
        if loss is not None:
            bucket[_LOST[loss]] += achievable - achieved

    def shadowed(self, now: float, disagrees: bool, acting_ttft: float, shadow_ttft: float) -> None:
        bucket = self._bucket(now)
        bucket[6] += 1.0
        bucket[7] += disagrees
        bucket[8] += acting_ttft
        bucket[9] += shadow_ttft

    def totals(self, now: float) -> dict[str, float]:
        """The sums of the window that ends now, by name."""
        oldest = math.floor(now / BUCKET_SECS) - WINDOW_SECS / BUCKET_SECS
        sums = [0.0] * len(FIELDS)
        for slot, bucket in self._buckets:
            if slot > oldest:
                for i, value in enumerate(bucket):
                    sums[i] += value
        return {name: value for name, value in zip(FIELDS, sums, strict=True) if value}

    def span(self, now: float) -> float:
        """The seconds the window covers: less than a minute for a key seen lately (at least a bucket)."""
        return min(WINDOW_SECS, max(BUCKET_SECS, now - self._since))
