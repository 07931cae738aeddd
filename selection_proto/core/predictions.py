"""Predicted cache contents (Dynamo 1.6.1's approximate mode and predicted side index): when no
engine reports its cache, a booking's prompt is assumed cached on the rank it landed on for a
while. Each (rank, block) expires `ttl` seconds after it was last booked, rounded up to a 100 ms
bucket as 1.6.1 rounds it; expired blocks leave the tree. The tree is the pool's own device tree
(approximate mode) or a side tree read beside real events (`predicted_ttl_secs`)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Final

from .budget import StateBudget
from .hashing import sequence_hashes
from .index import DeviceTree, IndexEventError, Rank

__all__ = ["BUCKET", "Predictions"]

BUCKET: Final = 0.1


class Predictions:
    """One pool's predicted blocks in `tree`, with their expiry times."""

    __slots__ = ("tree", "_ttl", "_budget", "_expiry", "_heap")

    def __init__(self, tree: DeviceTree, ttl: float, budget: StateBudget) -> None:
        self.tree = tree
        self._ttl = ttl
        self._budget = budget
        self._expiry: dict[tuple[Rank, int], float] = {}  # (rank, sequence hash) -> when it goes
        self._heap: list[tuple[float, Rank, int]] = []  # the same, in time order (stale entries skipped)

    def record(self, rank: Rank, blocks: Sequence[int], now: float) -> None:
        """A booking of these public block hashes landed on `rank`."""
        if not blocks:
            return
        seqs = sequence_hashes(blocks)
        expiry = math.ceil(round((now + self._ttl) / BUCKET, 9)) * BUCKET
        tree = self.tree
        before = tree.size(rank)
        tree.store(rank, None, list(zip(seqs, blocks, strict=True)))
        self._budget.index_blocks += tree.size(rank) - before
        for h in seqs:
            self._expiry[(rank, h)] = expiry
            heapq.heappush(self._heap, (expiry, rank, h))
        if len(self._heap) > 2 * len(self._expiry) + 1024:  # refreshed blocks left stale entries
            self._heap = [(t, r, h) for (r, h), t in self._expiry.items()]
            heapq.heapify(self._heap)

    def next_expiry(self) -> float | None:
        heap = self._heap
        while heap and self._expiry.get((heap[0][1], heap[0][2])) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def expire(self, now: float) -> None:
        """Take the blocks whose time has come out of the tree."""
        heap = self._heap
        gone: dict[Rank, list[int]] = {}
        while heap and heap[0][0] <= now:
            expiry, rank, h = heapq.heappop(heap)
            if self._expiry.get((rank, h)) == expiry:
                del self._expiry[(rank, h)]
                gone.setdefault(rank, []).append(h)
        tree = self.tree
        for rank, hashes in gone.items():
            before = tree.size(rank)
            try:
                tree.remove(rank, hashes)
            except IndexEventError:
                pass  # a block its rank no longer holds (the rank left, or was cleared)
            self._budget.index_blocks -= before - tree.size(rank)
