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
from typing import TYPE_CHECKING, Final

from .decisions import Scored
from .index import Rank

if TYPE_CHECKING:
    from .metrics import Metrics
    from .pool import Pool
    from .queueing import Selection
    from .settings import Settings

__all__ = ["BUCKET_SECS", "ERRORS", "FIELDS", "REASONS", "REFUSALS", "SELECTIONS", "WINDOW_SECS", "Recent",
           "account", "achievable", "best_cached", "loss_reason", "shadow_choice", "shadowed"]

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


def account(metrics: Metrics, pool: Pool, sel: Selection, chosen: Scored, scored: Sequence[Scored], s: Settings,
            now: float) -> tuple[int, int, str | None]:
    """A selection's cached tokens against the most any eligible rank held, counted: the longest
    match in blocks (the answer's `overlap.longest_matched`), the achievable tokens, and why the
    chosen held fewer (None: it held the most)."""
    device, host, disk = sel.found
    bs, allowed = pool.block_size, sel.req.allowed_worker_ids  # 1.6.1 matches against the allowed workers only
    weights = (s.host_cache_hit_weight, s.disk_cache_hit_weight)
    if host or disk or allowed is not None:
        most = achievable(device, host, disk, bs, *weights)
        longest = max((device.get(r, 0) + host.get(r, 0) + disk.get(r, 0)
                       for r in {*device, *host, *disk} if allowed is None or r[0] in allowed), default=0)
    else:  # the common case: device blocks only
        longest = max(device.values(), default=0)
        most = longest * bs
    loss = None
    if chosen.cached < most:
        loss = loss_reason(chosen, scored, sel.excluded, best_cached(device, host, disk, bs, *weights),
                           most, sel.queued_secs > 0)
    isl = sel.prompt.isl
    metrics.achieved(pool.key, isl, chosen.cached, most, loss)
    pool.outcomes.selected(now, isl, chosen.cached, most, loss)
    return longest, most, loss


def shadowed(metrics: Metrics, pool: Pool, policy: str, scored: Sequence[Scored], chosen: Scored,
             now: float) -> Scored:
    """What the shadow policy would have chosen, counted with both choices' predicted time to
    first token (docs/STATUS.md)."""
    shadow = shadow_choice(scored, chosen)
    acting_ttft, shadow_ttft = chosen.wait + chosen.prefill, shadow.wait + shadow.prefill
    metrics.shadowed(pool.key, policy, shadow.rank != chosen.rank, acting_ttft, shadow_ttft)
    pool.outcomes.shadowed(now, shadow.rank != chosen.rank, acting_ttft, shadow_ttft)
    return shadow


def shadow_choice(scored: Sequence[Scored], chosen: Scored) -> Scored:
    """What the shadow policy would have chosen: `chosen` when it costs the shadow no more than its
    least (a tie agrees), else its cheapest, ties to the lowest rank. No draw from the service's
    random generator, so that the acting choices are the same with or without it."""
    cheapest = min(scored, key=lambda c: (c.shadow, c.rank))
    return chosen if chosen.shadow <= cheapest.shadow else cheapest
