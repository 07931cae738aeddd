"""The all-knowing router of `simulate --compare oracle` (docs/ROUTING.md): greedy on the fleet's
true state. For each request it runs a copy of every engine ahead (its exact cache, queue, running
requests and speed) with the request at the back of its queue, and sends the request where its
first token comes soonest, ties at random. What it cannot know is what arrives later: a later
request queued behind this one never delays its admission (first come, first served), but may
share its iterations, so the time it predicts is exact when nothing else arrives meanwhile and a
little early otherwise. It books nothing and reads no events: it is the yardstick a real router's
mean TTFT is measured against, not a router one could deploy."""

from __future__ import annotations

import random
from collections.abc import Sequence

from .engine import Engine, SimRequest

__all__ = ["first_token_at", "fastest"]


def first_token_at(engine: Engine, req: SimRequest, now: float, give_up_after: float = float("inf")) -> float:
    """When `req`'s first token would come if it joined `engine` now and nothing else arrived:
    a fork of the engine run ahead to that iteration's end. Past `give_up_after` it stops and
    answers infinity (another engine is known to be sooner)."""
    twin = engine.fork()
    probe = req.fork()
    twin.waiting.append(probe)
    at = twin.busy_until if twin.busy_until is not None else twin.start(now)
    while at is not None and at <= give_up_after:
        twin.finish(at)
        if probe.first_token >= 0:
            return at
        at = twin.start(at)
    return float("inf")


def fastest(engines: Sequence[Engine], req: SimRequest, now: float, rng: random.Random) -> int:
    """The engine where `req`'s first token comes soonest; ties at random. The least busy engines
    are tried first, so that the bound they set lets the others stop early."""
    best, tied = float("inf"), []
    for engine in sorted(engines, key=lambda e: (len(e.waiting), len(e.prefilling), len(e.decoding), e.index)):
        at = first_token_at(engine, req, now, best)
        if at < best:
            best, tied = at, [engine.index]
        elif at == best and at < float("inf"):
            tied.append(engine.index)
    if not tied:  # no engine could ever take it (refused when the trace is read)
        return rng.randrange(len(engines))
    return tied[0] if len(tied) == 1 else rng.choice(sorted(tied))
