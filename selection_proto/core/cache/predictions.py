"""Predicted cache contents (Dynamo 1.6.1's approximate mode and predicted side index): when no
engine reports its cache, a booking's prompt is assumed cached on the rank it landed on for a
while. Each (rank, block) expires `ttl` seconds after it was last booked, rounded up to a 100 ms
bucket as 1.6.1 rounds it; expired blocks leave the tree. The tree is the pool's own device tree
(approximate mode) or a side tree read beside real events (`predicted_ttl_secs`)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from functools import partial
from itertools import compress, repeat
from operator import eq
from typing import Final

from ..base.budget import StateBudget
from ..base.hashing import sequence_hashes
from ..base.shards import LOW_BITS, HashShards
from .index import DeviceTree, IndexEventError, Rank

__all__ = ["BUCKET", "Predictions"]

BUCKET: Final = 0.1
_SLICE: Final = 65536  # blocks of a batch read in one call looking for its first one still due
# Blocks one `expire` takes out of the tree at most: a million-block prediction expires over many
# ticks, its tail first as an engine evicts, instead of holding the loop for seconds in one.
_EXPIRE_SLICE: Final = 8192


class _Batch:
    """A booking's sequence hashes, sharing one expiry; `start` skips the leading blocks found
    booked again since (each is skipped once, so asking when the next expiry is stays cheap);
    `end` stops before the trailing blocks already expired (a long batch expires tail first, a
    slice a `tick`)."""

    __slots__ = ("end", "hashes", "start")

    def __init__(self, hashes: Sequence[int]) -> None:
        self.hashes = hashes
        self.start = 0
        self.end = len(hashes)


class Predictions:
    """One pool's predicted blocks in `tree`, with their expiry times. A booking's blocks share one
    expiry, so they are kept as one batch in the time-ordered heap (a million-block prompt is one
    entry, not a million); a block booked again later is left in its old batch as stale."""

    __slots__ = ("tree", "_ttl", "_budget", "_expiry", "_heap", "_order")

    def __init__(self, tree: DeviceTree, ttl: float, budget: StateBudget) -> None:
        self.tree = tree
        self._ttl = ttl
        self._budget = budget
        self._expiry: dict[Rank, HashShards[float]] = {}  # rank -> sequence hash -> when it goes
        self._heap: list[tuple[float, int, Rank, _Batch]] = []  # (when, order, rank, its batch)
        self._order = 0  # ties between batches of one time break by booking order

    def record(self, rank: Rank, blocks: Sequence[int], now: float, seqs: Sequence[int] | None = None) -> None:
        """A booking of these public block hashes landed on `rank`; `seqs`, their sequence hashes
        when the caller has them already (computed here otherwise)."""
        for piece in self.pieces(rank, blocks, now, seqs, len(blocks)):
            piece()

    def pieces(self, rank: Rank, blocks: Sequence[int], now: float, seqs: Sequence[int] | None,
               size: int) -> list[Callable[[], None]]:
        """`record` as steps of `size` blocks each, to run in order with nothing read between:
        each stores its blocks after the last one's, as an engine's events would."""
        if not blocks:
            return []
        expiry = math.ceil(round((now + self._ttl) / BUCKET, 9)) * BUCKET
        chained: list[int] = []  # the sequence hashes so far, the whole booking's at the end
        starts = range(0, len(blocks), size)

        def piece(start: int) -> None:
            part = blocks[start:start + size]
            if seqs is not None:
                hashes = seqs[start:start + size]
            else:  # the chain goes on from the last piece's last hash
                hashes = sequence_hashes([chained[-1], *part])[1:] if chained else sequence_hashes(part)
            chained.extend(hashes)
            tree = self.tree
            before = tree.size(rank)
            tree.store(rank, chained[start - 1] if start else None, list(zip(hashes, part, strict=True)))
            self._budget.index_blocks += tree.size(rank) - before
            due = self._expiry.get(rank)
            if due is None:
                due = self._expiry[rank] = HashShards()
            due.set_all(hashes, expiry)
            if start == starts[-1]:
                self._order += 1
                heapq.heappush(self._heap, (expiry, self._order, rank, _Batch(chained if seqs is None else seqs)))

        return [partial(piece, start) for start in starts]

    def _live(self, expiry: float, rank: Rank, hashes: Sequence[int]) -> list[int]:
        """The blocks among `hashes` still due at `expiry` (not booked again since)."""
        due = self._expiry.get(rank)
        if due is None:
            return []
        return list(compress(hashes, map(eq, due.get_all(hashes), repeat(expiry))))

    def _any_live(self, expiry: float, rank: Rank, batch: _Batch) -> bool:
        """Whether a block of the batch may still be due: a batch booked again whole (a million
        stale blocks) is read `_SLICE` blocks a call, so no call holds the loop reading all of
        them; until it is read through it counts as live (a timer then fires early, harmlessly)."""
        due = self._expiry.get(rank)
        if due is None:
            return False
        hashes, i, end = batch.hashes, batch.start, batch.end
        shards, bits = due.shards, LOW_BITS  # (inline: the hot loop)
        if i < end and shards[hashes[i] & bits].get(hashes[i]) == expiry:
            return True
        stop = min(end, i + _SLICE)
        dues = [shards[h & bits].get(h) for h in hashes[i:stop]]
        batch.start = i + dues.index(expiry) if expiry in dues else stop
        return batch.start < end

    def next_expiry(self) -> float | None:
        heap = self._heap
        while heap and not self._any_live(heap[0][0], heap[0][2], heap[0][3]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def expire(self, now: float) -> None:
        """Take the blocks whose time has come out of the tree, at most `_EXPIRE_SLICE` of them:
        while more are due, `next_expiry` stays at or before `now`, so the next `tick` goes on."""
        heap, tree = self._heap, self.tree
        budget = _EXPIRE_SLICE
        while heap and heap[0][0] <= now and budget > 0:
            expiry, _, rank, batch = heap[0]
            start = max(batch.start, batch.end - budget)
            live = self._live(expiry, rank, batch.hashes[start:batch.end])
            budget -= batch.end - start
            batch.end = start
            if batch.end <= batch.start:
                heapq.heappop(heap)
            if not live:
                continue
            due = self._expiry[rank]
            due.delete_all(live)
            if not due:
                del self._expiry[rank]
            before = tree.size(rank)
            try:
                tree.remove(rank, live)
            except IndexEventError:
                pass  # a block its rank no longer holds (the rank left, or was cleared)
            self._budget.index_blocks -= before - tree.size(rank)
