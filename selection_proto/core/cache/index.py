"""The device tier's prefix index: Dynamo's RadixTree, compressed (core.md §7.1).

The tree follows core.md §7.1 step by step, because several observable answers depend on where
edges are split and which engine hash a node recorded. An edge keeps its blocks' engine and local
hashes side by side in one u64 array (16 bytes a block, no per-block objects), so that a block
costs about what it costs in the reference: its packed hashes and one entry in its rank's lookup
table.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import itemgetter
from typing import Final

from ..base.shards import LOW_BITS, HashShards
from .edges import Block, Node, Rank, RankSets

__all__ = [
    "BLOCK_NOT_FOUND",
    "INVALID_BLOCK_SEQUENCE",
    "PARENT_NOT_FOUND",
    "DeviceTree",
    "IndexEventError",
    "Rank",
    "TIERS",
    "LOWER_TIERS",
]


TIERS: Final = ("device", "host_pinned", "disk", "external")
LOWER_TIERS: Final = ("host_pinned", "disk", "external")
_RUN: Final = 32  # past this many blocks, a run is handled in C rather than block by block


class IndexEventError(Exception):
    """A device event that could not be applied; `text` is Dynamo's wording, `label` the metric label."""

    def __init__(self, text: str, label: str) -> None:
        super().__init__(text)
        self.text = text
        self.label = label


PARENT_NOT_FOUND: Final = IndexEventError(
    "Failed to apply event: Failed to find parent block", "parent_not_found"
)
BLOCK_NOT_FOUND: Final = IndexEventError("Failed to apply event: Failed to find block", "block_not_found")
INVALID_BLOCK_SEQUENCE: Final = IndexEventError(
    "Failed to apply event: Invalid block sequence", "invalid_block_sequence"
)


_NOBODY: Final[frozenset[Rank]] = frozenset()


class DeviceTree:
    """Compressed radix tree over local hashes with per-rank coverage (core.md §7.1)."""

    __slots__ = ("root", "lookup", "sets")

    def __init__(self) -> None:
        self.root = Node((), _NOBODY, None)
        self.root.internal = True
        self.lookup: dict[Rank, HashShards[Node]] = {}  # a rank may hold millions
        self.sets = RankSets()

    # -- helpers -------------------------------------------------------------------------------

    def _new_node(self, blocks: Sequence[Block], r: Rank, parent: Node) -> Node:
        return Node(list(chain.from_iterable(blocks)), self.sets.add(_NOBODY, r), parent)  # sized exactly

    @staticmethod
    def _prune(n: Node) -> None:
        """After a rank's cover shrank: a node no rank covers whole loses its subtree (no rank can
        reach it), and a node nobody covers at all leaves its parent."""
        if not n.full and n.children:
            stack = list(n.children.values())
            n.children = None
            while stack:  # break each back-reference, so the subtree is freed by reference counts
                c = stack.pop()
                c.parent = None
                if c.children:
                    stack.extend(c.children.values())
                    c.children = None
        if not n.live() and n.parent is not None:
            siblings = n.parent.children
            if siblings is not None and siblings.get(n[1]) is n:
                del siblings[n[1]]
            n.parent = None

    def _point(self, r: Rank, blocks: Sequence[Block], n: Node) -> None:
        shards, bits = self.lookup[r].shards, LOW_BITS  # (inline: this is the hot path)
        for h in map(itemgetter(0), blocks):
            shards[h & bits][h] = n

    def _promote(self, n: Node, r: Rank) -> None:
        if n.part:
            n.part.pop(r, None)
        n.full = self.sets.add(n.full, r)

    def _cover_prefix(self, n: Node, r: Rank, k: int) -> None:
        if k == 0:
            return
        if k >= n.size:
            self._promote(n, r)
            return
        if r in n.full:
            return
        part = n.part
        if part is None:
            part = n.part = {}
        part[r] = max(part.get(r, 0), k)

    def _append(self, n: Node, r: Rank, blocks: Sequence[Block]) -> None:
        old = n.size
        others = [s for s in n.full if s != r]
        if others:
            part = n.part
            if part is None:
                part = n.part = {}
            for s in others:
                part[s] = old
        n.full = _NOBODY
        self._promote(n, r)
        n.extend(chain.from_iterable(blocks))
        pos = n.pos
        if pos is not None:
            for j, b in enumerate(blocks):
                pos[b[0]] = old + j

    def _split(self, n: Node, k: int) -> dict[int, Node]:
        """Cut `n` after `k` blocks; the tail becomes its only child. Returns `n`'s children."""
        s = Node(n[2 * k :], n.full, n)
        s.children = n.children
        if s.children:
            for child in s.children.values():
                child.parent = s
        s.internal = n.internal
        full = n.full
        if n.part:
            for r, c in list(n.part.items()):
                if c >= k:
                    del n.part[r]
                    full = self.sets.add(full, r)
                    if c - k > 0:
                        if s.part is None:
                            s.part = {}
                        s.part[r] = c - k
        n.full = full
        del n[2 * k :]
        tail = s.engine_hashes()
        head_pos = n.pos if not n.pos_from else None  # (a partial table is dropped)
        if head_pos is None and not set(tail).isdisjoint(n[0::2]):
            head_pos = dict(zip(n[0::2], range(k), strict=True))
        if head_pos is not None:  # the tail's hashes are the tail's, even where the head repeats one
            for h in tail:
                head_pos.pop(h, None)
        n.pos = head_pos
        n.pos_from = 0
        kids = n.children = {s[1]: s}
        n.internal = True
        for r in s.full:
            self._table(r).set_all(tail, s)
        if s.part:
            for r, c in s.part.items():
                self._table(r).set_all(tail[:c], s)
        return kids

    # -- operations ----------------------------------------------------------------------------

    def ensure(self, r: Rank) -> None:
        if r not in self.lookup:
            self.lookup[r] = HashShards()

    def _table(self, r: Rank) -> HashShards[Node]:
        table = self.lookup.get(r)  # (not setdefault: a HashShards is costlier to make than a dict)
        if table is None:
            table = self.lookup[r] = HashShards()
        return table

    def store(self, r: Rank, parent_hash: int | None, blocks: Sequence[Block]) -> None:
        """Store `blocks` (engine, local) after `parent_hash`; raises IndexEventError without changes."""
        table = self._table(r)
        cur: Node
        if parent_hash is not None:
            if any(b[0] == parent_hash for b in blocks):
                raise INVALID_BLOCK_SEQUENCE
            n = table.shards[parent_hash & LOW_BITS].get(parent_hash)
            if n is None:
                raise PARENT_NOT_FOUND
            p = n.position(parent_hash)
            if p is None:
                raise PARENT_NOT_FOUND
            if not n.covers(r, p):
                del table[parent_hash]
                raise PARENT_NOT_FOUND
            tail_len = n.size - p - 1
            nb = len(blocks)
            if nb <= tail_len and _equal(n, p + 1, blocks, nb):
                self._cover_prefix(n, r, p + 1 + nb)
                self._point(r, blocks, n)
                return
            if not n.internal and nb > tail_len and _equal(n, p + 1, blocks, tail_len):
                self._append(n, r, blocks[tail_len:])
                self._point(r, blocks, n)
                return
            if n[-2] != parent_hash:
                self._split(n, p + 1)
            cur = n
        else:
            cur = self.root
        root = self.root
        rest: Sequence[Block] = blocks
        while rest:
            children = cur.children
            c = children.get(rest[0][1]) if children else None
            if c is not None and not c.live():  # a tail no rank kept when its edge was split
                self._prune(c)
                c = None
            if c is None:
                if cur is not root and not cur.internal and cur.covers(r, cur.size - 1):
                    self._append(cur, r, rest)
                    self._point(r, rest, cur)
                else:
                    m = self._new_node(rest, r, cur)
                    if cur.children is None:
                        cur.children = {}
                    cur.children[rest[0][1]] = m
                    cur.internal = True
                    self._point(r, rest, m)
                break
            edge = c.size
            limit = min(edge, len(rest))
            k = 0
            while k < limit and c[2 * k + 1] == rest[k][1]:
                k += 1
            if k < edge:
                if k == len(rest):
                    self._cover_prefix(c, r, k)
                    self._point(r, rest, c)
                    break
                kids = self._split(c, k)
                self._promote(c, r)
                self._point(r, rest[:k], c)
                t = self._new_node(rest[k:], r, c)
                kids[rest[k][1]] = t
                c.internal = True
                self._point(r, rest[k:], t)
                break
            self._promote(c, r)
            self._point(r, rest[:edge], c)
            rest = rest[edge:]
            cur = c

    def remove(self, r: Rank, hashes: Sequence[int]) -> None:
        """Remove engine hashes; unknown ones are skipped; raises the first error after applying."""
        table = self.lookup.get(r)
        if table is None:
            table = self._table(r)
        shards, bits = table.shards, LOW_BITS  # (each hash's own shard, inline: the hot path)
        err: IndexEventError | None = None
        scrubbed: set[int] = set()
        i = 0
        total = len(hashes)
        while i < total:
            h = hashes[i]
            i += 1
            n = shards[h & bits].pop(h, None)
            if n is None:
                if h not in scrubbed:
                    err = err or BLOCK_NOT_FOUND
                continue
            p = n.position(h)
            if p is None:
                shards[h & bits][h] = n
                err = err or BLOCK_NOT_FOUND
                continue
            cc = n.cutoff(r)
            low, low_hash = p, h
            run = min(cc - p, total - i + 1)
            if run > _RUN and list(hashes[i - 1:i - 1 + run]) == n.engine_hashes(p, p + run):
                # The usual shape (a prediction expiring, a prefix evicted whole): the hashes that
                # follow are this edge's next blocks in order. Each lies past `p`, and all go with
                # the edge's cut below, as the loop would find one by one.
                i += run - 1
            elif p < cc:
                while i < total:
                    g = hashes[i]
                    if shards[g & bits].get(g) is not n:
                        break
                    pg = n.position(g)
                    if pg is None or pg >= cc:
                        break
                    if pg < low:
                        low, low_hash = pg, g
                    i += 1
            if low >= cc:
                stale = [low_hash]
            else:
                stale = n.engine_hashes(low, cc)
                n.full = self.sets.discard(n.full, r)
                if low == 0:
                    if n.part:
                        n.part.pop(r, None)
                else:
                    if n.part is None:
                        n.part = {}
                    n.part[r] = low
            self._prune(n)
            if len(stale) > _RUN:
                table.discard_all(stale)
                if i < total:  # only hashes still to come are looked up in it
                    scrubbed.update(stale)
            else:
                for s in stale:
                    shards[s & bits].pop(s, None)
                    scrubbed.add(s)
        if err is not None:
            raise err

    def clear(self, r: Rank) -> None:
        table = self.lookup.pop(r, None)
        if not table:
            return
        seen: set[int] = set()
        for n in table.values_all():
            if id(n) in seen:
                continue
            seen.add(id(n))
            n.full = self.sets.discard(n.full, r)
            if n.part:
                n.part.pop(r, None)
            self._prune(n)

    def size(self, r: Rank) -> int:
        table = self.lookup.get(r)
        return len(table) if table is not None else 0

    def total_size(self) -> int:
        return sum(map(len, self.lookup.values()))

    def find(self, q: Sequence[int]) -> tuple[dict[Rank, int], dict[Rank, int | None]]:
        """Contiguous-prefix scores per rank and the engine hash at each rank's last match."""
        scores: dict[Rank, int] = {}
        last: dict[Rank, int | None] = {}
        if not q:
            return scores, last
        qlen = len(q)
        children = self.root.children
        n = children.get(q[0]) if children else None
        at = 0
        depth = 0
        active: set[Rank] | None = None
        prev: int | None = None
        while n is not None and at < qlen:
            size = len(n) >> 1
            limit = min(size, qlen - at)
            if limit == 1:
                m = 1  # the child was found by this block's hash
            else:
                edge = n[1 : 2 * limit : 2].tolist()
                if edge == q[at : at + limit]:
                    m = limit
                else:
                    m = 1
                    while m < limit and edge[m] == q[at + m]:
                        m += 1
            if active is None:
                active = set(n.full)
                if n.part:
                    for r, k in n.part.items():
                        s = k if k < m else m
                        if s > 0:
                            scores[r] = s
                            last[r] = n[2 * s - 2]
            else:
                full = n.full
                part = n.part
                for r in [r for r in active if r not in full]:
                    s = min(part.get(r, 0) if part else 0, m)
                    scores[r] = depth + s
                    last[r] = n[2 * s - 2] if s > 0 else prev
                    active.discard(r)
            depth += m
            prev = n[2 * m - 2]
            if not active or m < size or depth == qlen:
                break
            at += m
            children = n.children
            n = children.get(q[at]) if children else None
        if active:
            for r in active:
                scores[r] = depth
                last[r] = prev
        return scores, last

    def dump(self) -> list[tuple[Rank, int | None, list[Block]]]:
        """Stores that rebuild every reachable answer, breadth first (core.md §7.5)."""
        out: list[tuple[Rank, int | None, list[Block]]] = []
        queue: list[tuple[Node, int | None, set[Rank] | None]] = [
            (c, None, None) for c in (self.root.children or {}).values()
        ]
        head = 0
        while head < len(queue):
            n, ph, reach = queue[head]
            head += 1
            if not n.live():
                continue
            full = sorted(r for r in n.full if reach is None or r in reach)
            part = sorted((r, k) for r, k in (n.part or {}).items() if reach is None or r in reach)
            blocks = list(zip(n.engine_hashes(), n.local_hashes(), strict=True))
            for r in full:
                out.append((r, ph, blocks))
            for r, k in part:
                out.append((r, ph, blocks[:k]))
            if full and n.children:
                reach_next = set(full)
                queue.extend((c, n[-2], reach_next) for c in n.children.values())
        return out


def _equal(n: Node, start: int, blocks: Sequence[Block], count: int) -> bool:
    """Whether blocks[:count] equal the node's edge from `start`, local and engine hashes alike."""
    return n[2 * start : 2 * (start + count)].tolist() == list(chain.from_iterable(blocks[:count]))
