"""An edge of the prefix index (index.py): its blocks' engine and local hashes packed side by
side in one u64 array, the ranks that cover it, and where an engine hash sits on it. The
coverage sets every edge holds are interned here too.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final, cast

__all__ = ["Block", "Node", "Rank", "RankSets"]

Rank = tuple[int, int]
Block = tuple[int, int]  # (engine hash, local hash)

_TABLE_MAX: Final = 16384  # a longer edge's position table is built a step at a time
_TABLE_STEP: Final = 16384  # blocks a long edge's position table takes in per search
_WINDOW: Final = 1024  # blocks searched first from a long edge's end (doubling after)
_U64_MAX: Final = (1 << 64) - 1

if TYPE_CHECKING:
    _Packed = array[int]
else:
    _Packed = array


class Node(_Packed):
    """One edge, packed: engine and local hash of each block side by side in one u64 array
    (`[e0, l0, e1, l1, ...]`), with the ranks that cover all of it (an interned frozenset, shared
    by most nodes) and those that cover a prefix of it (`part`, usually none).

    Being its own packed array, a node is one object for the cyclic collector (two for an inner
    node) and holds no per-block objects."""

    __slots__ = ("full", "part", "children", "parent", "internal", "pos", "pos_from")

    def __new__(cls, blocks: Iterable[int], full: frozenset[Rank], parent: Node | None) -> Node:
        return cast("Node", super().__new__(cls, "Q", blocks))  # typeshed's array.__new__ is not Self

    def __init__(self, blocks: Iterable[int], full: frozenset[Rank], parent: Node | None) -> None:
        self.full = full
        self.part: dict[Rank, int] | None = None
        self.children: dict[int, Node] | None = None
        # A node that no rank covers leaves its parent at once (or unique prefixes, stored and
        # evicted, would pile up there); every unlink breaks this back-reference, so no garbage
        # is ever cyclic.
        self.parent = parent
        self.internal = False
        self.pos: dict[int, int] | None = None  # engine hash -> last place; built on first use
        self.pos_from = 0  # `pos` holds the blocks from here on (a long edge's is built in steps)

    @property
    def size(self) -> int:
        return len(self) >> 1

    def local_hashes(self, start: int = 0, stop: int | None = None) -> list[int]:
        stop = self.size if stop is None else stop
        return self[2 * start + 1 : 2 * stop : 2].tolist()

    def engine_hashes(self, start: int = 0, stop: int | None = None) -> list[int]:
        stop = self.size if stop is None else stop
        return self[2 * start : 2 * stop : 2].tolist()

    def covers(self, r: Rank, i: int) -> bool:
        if r in self.full:
            return True
        part = self.part
        if not part:
            return False
        k = part.get(r)
        return k is not None and i < k

    def cutoff(self, r: Rank) -> int:
        if r in self.full:
            return len(self) >> 1
        part = self.part
        return part.get(r, 0) if part else 0

    def live(self) -> bool:
        return bool(self.full) or bool(self.part)

    def position(self, h: int) -> int | None:
        """Where engine hash `h` sits: its last place on the edge, unless a split moved a copy of
        it to the tail (Dynamo's lookup then names the tail's block). Most stores name the edge's
        last block; any other question builds the node's position table once, or, on a long
        edge, searches its packed bytes and grows the table by a bounded step from the end back:
        a million entries are never built at once (docs/INVARIANTS.md, "Round three")."""
        pos = self.pos
        if pos is not None:
            p = pos.get(h)
            if p is not None or not self.pos_from:
                return p
            return self._search_back(h, self.pos_from)
        end = (len(self) >> 1) - 1
        if self[2 * end] == h:
            return end
        if end == 0:
            return None
        if end < _TABLE_MAX:
            pos = self.pos = dict(zip(self[0::2], range(end + 1), strict=True))
            self.pos_from = 0
            return pos.get(h)
        return self._search_back(h, end + 1)

    def _search_back(self, h: int, stop: int) -> int | None:
        """The last place of `h` among blocks [0, stop), searched from `stop` back a doubling
        window at a time (a hash near the end, as evictions go, is found at once); then the
        position table takes in up to `_TABLE_STEP` more blocks below what it holds."""
        found: int | None = None
        if 0 <= h <= _U64_MAX:  # no packed hash is out of range
            needle = h.to_bytes(8, sys.byteorder)
            window = _WINDOW
            with memoryview(self) as packed, packed.cast("B") as raw:  # released before any resize
                while stop > 0 and found is None:
                    start = max(0, stop - window)
                    chunk = bytes(raw[16 * start : 16 * stop])
                    at = chunk.rfind(needle)
                    while at >= 0 and at % 16:  # a local hash's bytes, or a straddle: further back
                        at = chunk.rfind(needle, 0, at + 7)
                    if at >= 0:
                        found = start + at // 16
                    stop = start
                    window *= 2
        pos = self.pos
        if pos is None:
            pos = self.pos = {}
            self.pos_from = len(self) >> 1
        high = self.pos_from
        low = max(0, high - _TABLE_STEP)
        lower = dict(zip(self[2 * low : 2 * high : 2], range(low, high), strict=True))
        for taken in lower.keys() & pos.keys():  # a later place is already known
            del lower[taken]
        pos.update(lower)
        self.pos_from = low
        return found


class RankSets:
    """Interned coverage sets: a node holds one of a few shared frozensets instead of its own set.
    Transitions are cached; the caches are dropped when they grow past a bound (sharing is only an
    economy, never needed for correctness)."""

    __slots__ = ("added", "removed")

    _BOUND: Final = 4096

    def __init__(self) -> None:
        self.added: dict[tuple[frozenset[Rank], Rank], frozenset[Rank]] = {}
        self.removed: dict[tuple[frozenset[Rank], Rank], frozenset[Rank]] = {}

    def add(self, s: frozenset[Rank], r: Rank) -> frozenset[Rank]:
        if r in s:
            return s
        t = self.added.get((s, r))
        if t is None:
            if len(self.added) >= self._BOUND:
                self.added.clear()
            t = self.added[(s, r)] = s | {r}
        return t

    def discard(self, s: frozenset[Rank], r: Rank) -> frozenset[Rank]:
        if r not in s:
            return s
        t = self.removed.get((s, r))
        if t is None:
            if len(self.removed) >= self._BOUND:
                self.removed.clear()
            t = self.removed[(s, r)] = s - {r}
        return t
