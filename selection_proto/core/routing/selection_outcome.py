"""A selection's outcome, counted: its cached tokens against the most any eligible rank held
(with the reason when fewer: outcomes.py), and what the shadow policy would have chosen with both
choices' predicted time to first token (docs/STATUS.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..base.metrics import Metrics
from ..base.settings import Settings
from ..fleet.decisions import Scored
from ..fleet.outcomes import achievable, best_cached, loss_reason
from ..fleet.pool import Pool

if TYPE_CHECKING:
    from .queueing import Selection

__all__ = ["account", "shadow_choice", "shadowed"]


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
