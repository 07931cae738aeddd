"""The shared workload: token prompts from a fixed seed, so both sides time the same inputs."""

from __future__ import annotations

import random

WORKERS = 16
BLOCK_SIZE = 16


def prompts(length: int, count: int, seed: int = 1) -> list[list[int]]:
    """`count` prompts of `length` tokens; every other one shares its first half with prompt 0."""
    rng = random.Random(seed)
    base = [rng.randrange(200_000) for _ in range(length)]
    out = []
    for i in range(count):
        tail = [rng.randrange(200_000) for _ in range(length)]
        out.append(base[: length // 2] + tail[: length - length // 2] if i % 2 else tail)
    return out


def best_rate(fn: object, items: list[object], repeat: int = 5) -> tuple[float, float]:
    """(median, spread) of calls per second over `repeat` passes of `items`."""
    import statistics
    import time

    rates = []
    for _ in range(repeat):
        start = time.perf_counter()
        for item in items:
            fn(item)  # type: ignore[operator]
        rates.append(len(items) / (time.perf_counter() - start))
    return statistics.median(rates), max(rates) - min(rates)
