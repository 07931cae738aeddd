"""What a selection chose and why, as values: each candidate's cost and its parts (`Scored`, built by
cost.py), the runner-up, the one-line explanation of the `x-selection-decision` header, and the
`Decision` a pool keeps for the status page (status.py)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Final, NamedTuple

from ..cache.index import Rank

__all__ = ["DECISION_CANDIDATES", "Decision", "Scored", "decision", "runner_up"]

DECISION_CANDIDATES: Final = 5  # kept of each decision for the status page


class Scored(NamedTuple):
    """One candidate's cost and its parts (a tuple: built for every candidate of every select)."""

    rank: Rank
    logit: float
    prefill_tokens: int
    decode_blocks: int
    device: int
    host_ext: int
    disk_ext: int
    effective: float
    cached: int
    wait: float = 0.0  # router_policy=ttft: predicted seconds before its prefill starts
    prefill: float = 0.0  # and the seconds of its own prefill
    dynamo_logit: float = 0.0  # and Dynamo's cost, which `logit` replaces
    shadow: float = 0.0  # with a shadow policy (shadow.py): its cost of the candidate


class Decision(NamedTuple):
    """A selection as the status page shows it (status.py), kept per pool: of its candidates only
    the cheapest few, so that a thousand-worker pool keeps as little as a small one."""

    at: float
    isl: int
    chosen: Scored
    runner_up: Scored | None
    cheapest: tuple[Scored, ...]
    candidates: int
    predicted: bool  # the candidates carry predicted wait and prefill seconds (router_policy=ttft)
    plan: tuple[str, Rank | None, str] | None = None  # a plan's path, prefill rank and reason (pd.py)
    request_id: str | None = None  # the booking's reservation id, else the request's selection id
    achievable: int = 0  # the most cached tokens any rank of the key held (outcomes.py)
    loss: str | None = None  # why the chosen held fewer (outcomes.REASONS)
    shadow: Scored | None = None  # what the shadow policy would have chosen (shadow.py)

    @classmethod
    def of(cls, at: float, isl: int, chosen: Scored, scored: Sequence[Scored], predicted: bool,
           plan: tuple[str, Rank | None, str] | None = None, request_id: str | None = None, achievable: int = 0,
           loss: str | None = None, shadow: Scored | None = None) -> Decision:
        cheapest = tuple(heapq.nsmallest(DECISION_CANDIDATES, scored, key=lambda s: (s.logit, s.rank)))
        return cls(at, isl, chosen, runner_up(chosen, scored), cheapest, len(scored), predicted, plan, request_id,
                   achievable, loss, shadow)


def runner_up(chosen: Scored, scored: Sequence[Scored]) -> Scored | None:
    """The cheapest candidate but the chosen one (sampling may choose other than the cheapest)."""
    return min((s for s in scored if s.rank != chosen.rank), key=lambda s: (s.logit, s.rank), default=None)


def decision(chosen: Scored, scored: Sequence[Scored], isl: int, policy: str) -> str:
    """A choice in one header line: the chosen rank, its cached tokens of the prompt, how many
    candidates, and the runner-up (`worker:dp_rank`) with how much more its cost (logit) was, in
    the policy's unit, and `tie=true` when it cost the same."""
    parts = [f"worker={chosen.rank[0]}", f"dp_rank={chosen.rank[1]}", f"cached={chosen.cached}", f"isl={isl}",
             f"candidates={len(scored)}", f"policy={policy}"]
    if (runner := runner_up(chosen, scored)) is not None:
        parts += [f"runner_up={runner.rank[0]}:{runner.rank[1]}", f"runner_up_cached={runner.cached}",
                  f"margin={runner.logit - chosen.logit:.4g}",
                  f"margin_unit={'seconds' if policy == 'ttft' else 'blocks'}"]
        if runner.logit == chosen.logit:
            parts.append("tie=true")  # chosen among equals: the fewest cached blocks, then at random
    return ";".join(parts)
