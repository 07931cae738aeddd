"""The cost of a candidate rank and the choice among them (core.md §9.5-§9.6): cached and new
prefill work against the overlap credit, decode blocks and active requests, preferred taints;
or, with `router_policy=ttft`, its predicted time to first token (docs/ROUTING.md); then the
minimum or a softmax draw. Pure functions over one pool's state."""

from __future__ import annotations

import math
import random
from operator import itemgetter
from typing import Final

from ..base.responses import Candidate
from ..base.settings import Settings, resolve_weights
from ..base.types import RouterConfigOverride, SelectRequest
from ..bookings.prompt import PromptHashes
from ..cache.index import Rank
from ..fleet.decisions import Scored
from ..fleet.pool import Pool
from ..fleet.speed import worker_speed

__all__ = [
    "DEVICE",
    "LOGIT",
    "NO_OVERRIDE",
    "Estimates",
    "Scored",
    "assumes_kv_reuse",
    "cached_tokens",
    "choose",
    "effective_blocks",
    "estimates",
    "explain",
    "queue_secs",
    "score",
    "tracks_prefill",
]

# The context (tokens) at which a new token's attention costs as much as the rest of its prefill.
ATTENTION_CONTEXT_TOKENS: Final = 65_536.0
# How much slower prefill runs on a rank whose KV cache is full of decoding requests (each
# iteration also runs their decode step).
DECODE_DRAG: Final = 0.1
# Each block a rank's running requests hold counts as this many of its tokens still to wait for:
# a full KV cache delays admission. The weights here were chosen on a grid over 13 simulated cases
# and checked on 8 others (docs/ROUTING.md, "How the weights were chosen").
KV_PRESSURE: Final = 0.15
# Each block booked beyond a rank's total_kv_blocks counts as this many of its tokens to wait for.
OVERFLOW_WEIGHT: Final = 1.0
# Each cached prompt token lowers the cost by this fraction of its prefill time beyond what it
# saves now: what staying where a conversation's cache is saves its later turns.
REUSE_CREDIT: Final = 0.5

NO_OVERRIDE: Final = RouterConfigOverride()
# Count a rank's running prefill by what is left of it at the worker's learned rate since the
# rank's last prefill ended (speed.py, `Speeds.left`) instead of whole until it ends: over the
# simulated cases of docs/ROUTING.md ("How close to the oracle") it brought the mean TTFT from
# 1.058x the oracle's to 1.010x (geometric mean). bench/round3.py turns it off to compare.
COUNT_WHAT_IS_LEFT = True
# Also measure how far a running prefill has got in work, each token weighed by the context it is
# computed over as the cost weighs its own prefill, and count the larger of what is left in work
# and in plain tokens: a long prompt's late chunks run slower than the learned mean rate, and in
# plain tokens its rank read idle while it still ran (docs/ROUTING.md, "What is left of a running
# prefill"). bench/round3.py turns it off.
WEIGH_CONTEXT_IN_LEFT = True
# A rank with more prefill booked than its KV blocks hold is saturated: its engine allocates all
# of it before it admits the next request, and LRU evicts what this prompt holds cached there, so
# it is counted (and booked) uncached; and its queue is counted in work, each booked token's
# context weighing SATURATED_CONTEXT_WEIGHT times as it does in the cost of its own prefill, against
# the worker's learned rate (speed.py, `Speeds.heavier`). Read in plain tokens with its cache kept,
# a rank that took a long prompt read light while its queue ran twice the others' (docs/ROUTING.md,
# "How close to the oracle (round three)": the p99 past saturation). False measures without it.
SATURATED_CONTEXT_WEIGHT: Final = 1.5
READ_SATURATION = True

# Device prefix, host extension and disk+external extension blocks per rank (core.md §7.4).
Estimates = tuple[dict[Rank, int], dict[Rank, int], dict[Rank, int]]


LOGIT: Final = itemgetter(1)  # Scored.logit, for map()
DYNAMO_LOGIT: Final = itemgetter(11)  # Scored.dynamo_logit
DEVICE: Final = itemgetter(4)  # Scored.device


def effective_blocks(device: int, host: int, disk: int, s: Settings) -> float:
    """Overlap blocks with lower tiers discounted by their weights (core.md §7.4)."""
    return device + s.host_cache_hit_weight * host + s.disk_cache_hit_weight * disk


def cached_tokens(rank: Rank, found: Estimates, block_size: int, s: Settings) -> int:
    """The tokens a rank holds of the prompt, its lower tiers discounted, rounded half up."""
    device, host, disk = found
    effective = effective_blocks(device.get(rank, 0), host.get(rank, 0), disk.get(rank, 0), s)
    return max(0, math.floor(effective * block_size + 0.5))


def estimates(pool: Pool, blocks: list[int]) -> Estimates:
    """Device prefix, host extension and disk+external extension blocks per rank (§7.4)."""
    device, hits = pool.index.tiered(blocks)
    if pool.side is not None:  # predicted blocks beside real events: the larger prefix counts
        for r, n in pool.side.find(blocks)[0].items():
            if n > device.get(r, 0):
                device[r] = n
    disk = dict(hits["disk"])
    for r, n in hits["external"].items():
        disk[r] = disk.get(r, 0) + n
    return device, hits["host_pinned"], disk


def tracks_prefill(s: Settings, o: RouterConfigOverride | None) -> bool:
    """Whether prefill tokens count as load, the request's override first."""
    o = o or NO_OVERRIDE
    return s.track_prefill_tokens if o.track_prefill_tokens is None else o.track_prefill_tokens


def assumes_kv_reuse(s: Settings, o: RouterConfigOverride | None) -> bool:
    """Whether a booking tracks the prompt's own block hashes (shared blocks count once) rather
    than random ones, the request's override first."""
    o = o or NO_OVERRIDE
    return s.assume_kv_reuse if o.assume_kv_reuse is None else o.assume_kv_reuse


def score(req: SelectRequest, state: Pool, prompt: PromptHashes, candidates: list[Rank],
          estimates: Estimates, s: Settings, now: float) -> tuple[list[Scored], float | None]:
    """Every candidate's cost (core.md §9.5), and with `router_policy=ttft` the lowest of Dynamo's
    costs (a choice above it is one Dynamo's cost would not have made: they are counted). The hot loop
    of a selection: one pass, locals bound once, the rounding of `cached_tokens` inlined.

    `ttft`: the cost is the predicted time to first token, in seconds: the prefill booked on the
    rank and not complete, then this prompt's own prefill after what the rank holds cached (its
    attention over that context growing with it), both slowed by the drag of the rank's decoding
    requests; with a learned per-request overhead (speed.py), this request's and what is left of
    the rank's recent requests' (its backlog); plus the pressure of the blocks its running requests hold and, when its KV blocks
    would not hold this request beside them, the time for the overflow to drain. From bookings,
    completions, frees and KV events alone: no clock."""
    o = req.router_config_override or NO_OVERRIDE
    base_scale, base_credit = resolve_weights(s.overlap_score_weight, s.prefill_load_scale,
                                              s.overlap_score_credit, 1.0, 1.0)
    scale, credit = resolve_weights(o.overlap_score_weight, o.prefill_load_scale,
                                    o.overlap_score_credit, base_scale, base_credit)
    track = tracks_prefill(s, o)
    bs = state.block_size
    isl = prompt.isl
    w_host, w_disk = s.host_cache_hit_weight, s.disk_cache_hit_weight
    w_req = s.decode_active_request_weight
    device, host, disk = estimates
    loads = state.tracker.loads
    track_blocks = s.track_active_blocks
    decay_setting = s.overlap_score_credit_decay
    use_decay = decay_setting != 0 and track
    if use_decay:
        min_prefill = min(loads[r].prefill_tokens for r in candidates)
        query_blocks = max(1, math.ceil(isl / bs))
    preferred = req.routing_constraints.preferred_taints
    floor = math.floor
    new_blocks = prompt.new_blocks
    fresh = -1  # the prompt's new blocks on a rank holding none: the same for every such rank
    make = tuple.__new__  # a Scored without the Python-level __new__ of a NamedTuple
    scored: list[Scored] = []
    append = scored.append
    ttft = s.router_policy == "ttft"
    shadow = s.shadow_policy  # scored beside the acting policy, never acting (docs/STATUS.md)
    predict = ttft or shadow == "ttft"
    learned = state.speeds if ttft or state.speeds.shadow is None else state.speeds.shadow
    if predict:
        learned.settle(now)  # what the moments before now taught (speed.py)
    speeds, unknown, pressure = learned.of, worker_speed(None, None), KV_PRESSURE * bs
    left, count_left = learned.left, COUNT_WHAT_IS_LEFT
    context_weight = 1.0 / ATTENTION_CONTEXT_TOKENS if WEIGH_CONTEXT_IN_LEFT else 0.0
    # Only where prefill ends are read from events does the booked prefill drop as engines run it
    # (with silent clients, else, it stays booked until the request is freed).
    saturation = READ_SATURATION and s.kv_events in ("push", "subscribe")
    saturated_context = SATURATED_CONTEXT_WEIGHT / ATTENTION_CONTEXT_TOKENS
    heavier = learned.heavier
    overhead = learned.overhead  # prefill tokens every request costs whatever it holds (0: not learned)
    backlog = learned.backlog
    # The constants as locals: this loop runs once per candidate of every selection.
    drag_full, overflow_tokens = DECODE_DRAG, OVERFLOW_WEIGHT * bs
    per_context, reuse_credit = 1.0 / ATTENTION_CONTEXT_TOKENS, REUSE_CREDIT
    # The prefill work of the whole prompt, on every rank that has none of it cached.
    uncached_work = (isl * (1.0 + (0 + isl * 0.5) * per_context) if isl > 0 else 0.0) + overhead
    for r in candidates:
        load = loads[r]
        d = device.get(r, 0)
        h = host.get(r, 0) if host else 0
        k = disk.get(r, 0) if disk else 0
        effective = d + w_host * h + w_disk * k
        cached = floor(effective * bs + 0.5)  # effective >= 0: floor(x + 0.5) rounds half up
        new_prefill = isl - cached if isl > cached else 0
        active_prefill = load.prefill_tokens
        raw_prefill_blocks = (active_prefill + new_prefill + cached) / bs if track else 0.0
        decay = 1.0
        if use_decay:
            decay = 1.0 / (1.0 + decay_setting * ((active_prefill - min_prefill) / bs)
                           / query_blocks)
        credit_blocks = credit * decay * d + w_host * h + w_disk * k
        extra = load.extra  # output blocks and decayed prompt blocks (tracker.py)
        unique = load.unique
        decode_blocks = floor(len(unique) + extra + 0.5) if extra else len(unique)
        if track_blocks:
            if unique:
                decode_blocks += new_blocks(load)
            else:
                if fresh < 0:
                    fresh = new_blocks(load)
                decode_blocks += fresh
        excess = raw_prefill_blocks - credit_blocks
        logit = scale * (excess if excess > 0.0 else 0.0) + decode_blocks + w_req * load.requests
        if preferred:
            taints = state.taints[r[0]]
            preference = math.exp(-math.tanh(sum(w for t, w in preferred.items() if t in taints)))
            logit *= preference
        if not predict:
            append(make(Scored, (r, logit, active_prefill + (new_prefill if track else 0),
                                 decode_blocks, d, h, k, effective, cached, 0.0, 0.0, logit, 0.0)))
            continue
        per_token, kv_blocks = speeds.get(r[0], unknown)
        # What is left of it, its progress also weighed by each token's context (speed.py, `Speeds.left`).
        queued = (left(r, active_prefill, now, load.prefill_pairs, context_weight) if count_left and active_prefill
                  else active_prefill)
        saturated = saturation and kv_blocks and active_prefill >= kv_blocks * bs
        if saturated:
            if queued and load.prefill_pairs:
                queued *= heavier(r, active_prefill, load.prefill_pairs, saturated_context)
            if cached and ttft:  # a shadow's cached tokens are Dynamo's booking's: left as they are
                cached, new_prefill = 0, isl
        if overhead:  # with the prefill still booked, an engine behind its prediction reads busy
            queued += backlog(r, now, active_prefill)
        work = new_prefill * (1.0 + (cached + new_prefill * 0.5) * per_context) + overhead if cached else uncached_work
        if kv_blocks:
            drag = 1.0 + (drag_full if decode_blocks >= kv_blocks else drag_full * decode_blocks / kv_blocks)
            wait = queued * drag + pressure * decode_blocks
            if decode_blocks > kv_blocks:
                wait += (decode_blocks - kv_blocks) * overflow_tokens
            wait *= per_token
            prefill = work * per_token * drag
        else:
            wait = (queued + pressure * decode_blocks) * per_token
            prefill = work * per_token
        predicted = wait + prefill - reuse_credit * cached * per_token if cached else wait + prefill
        if preferred:
            predicted *= preference
        if ttft:  # a shadow then can only be Dynamo's cost
            append(make(Scored, (r, predicted, active_prefill + (new_prefill if track else 0),
                                 decode_blocks, d, h, k, effective, cached, wait, prefill, logit,
                                 logit if shadow else 0.0)))
        else:  # Dynamo's cost acts; the predicted time to first token shadows it
            append(make(Scored, (r, logit, active_prefill + (new_prefill if track else 0),
                                 decode_blocks, d, h, k, effective, cached, wait, prefill, logit, predicted)))
    return scored, min(map(DYNAMO_LOGIT, scored)) if ttft else None


def queue_secs(state: Pool, c: Scored) -> float:
    """The part of a `router_policy=ttft` candidate's predicted wait that is the prefill booked
    on its rank (the rest is the pressure of its KV blocks), as `score` predicts it: a plan
    compares where the prefill runs, while the blocks land on the decode worker either way."""
    per_token, kv_blocks = state.speeds.of.get(c.rank[0], worker_speed(None, None))
    active = state.tracker.loads[c.rank].prefill_tokens
    if not kv_blocks:
        return active * per_token
    drag = 1.0 + (DECODE_DRAG if c.decode_blocks >= kv_blocks else DECODE_DRAG * c.decode_blocks / kv_blocks)
    return active * drag * per_token



def choose(state: Pool, scored: list[Scored], temperature: float, rng: random.Random) -> Scored:
    """The minimum cost at temperature 0 (ties: the rank with the fewest cached blocks, then
    at random), else a softmax draw over the costs (core.md §9.6)."""
    if len(scored) == 1:
        return scored[0]
    logits = list(map(LOGIT, scored))
    lo = min(logits)
    hi = max(logits)
    spread = (hi - lo) * temperature
    if temperature == 0 or (lo != hi and not spread > 0):
        # A temperature so small that the spread underflows to zero degrades to the
        # minimum-cost rule instead of dividing by zero (an infinite spread is uniform).
        tied = [c for c, logit in zip(scored, logits, strict=True) if logit == lo]
        if len(tied) > 1:
            size = state.index.device.size
            sizes = [size(c.rank) for c in tied]
            smallest = min(sizes)
            tied = [c for c, size in zip(tied, sizes, strict=True) if size == smallest]
        if len(tied) == 1:
            return tied[0]
        return tied[rng.randrange(len(tied))]
    if lo == hi:
        weights = [1.0] * len(scored)
    else:
        weights = [math.exp(-(c.logit - lo) / spread) for c in scored]
    total = sum(weights)
    u = rng.random()
    cumulative = 0.0
    for c, w in zip(scored, weights, strict=False):
        cumulative += w / total
        if cumulative >= u:
            return c
    return scored[-1]


def explain(scored: list[Scored], predicted: bool = False) -> tuple[Candidate, ...]:
    """Each candidate's cost and parts, cheapest first; `predicted`: with its predicted wait
    and prefill seconds (router_policy=ttft)."""
    ordered = sorted(scored, key=lambda c: (c.logit, c.rank))
    return tuple(
        Candidate(worker_id=c.rank[0], dp_rank=c.rank[1], logit=float(c.logit),
                  potential_prefill_tokens=c.prefill_tokens, potential_decode_blocks=c.decode_blocks,
                  device_blocks=c.device, host_pinned_blocks=c.device + c.host_ext,
                  disk_blocks=c.device + c.host_ext + c.disk_ext, cached_tokens=c.cached,
                  predicted_wait_secs=c.wait if predicted else None,
                  predicted_prefill_secs=c.prefill if predicted else None)
        for c in ordered)
