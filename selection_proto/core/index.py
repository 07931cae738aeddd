"""The per-key prefix index: Dynamo's RadixTree for the device tier plus lower tiers (core.md §7).

The device tree follows core.md §7.1 step by step, because several observable answers depend on
where edges are split and which engine hash a node recorded. Edges keep their local and engine
hashes in two parallel lists so that matching a query is a C-level slice comparison.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

__all__ = [
    "BLOCK_NOT_FOUND",
    "INVALID_BLOCK_SEQUENCE",
    "PARENT_NOT_FOUND",
    "DeviceTree",
    "IndexEventError",
    "KeyIndex",
    "LowerTier",
    "Rank",
    "TIERS",
    "LOWER_TIERS",
]

Rank = tuple[int, int]
Block = tuple[int, int]  # (engine hash, local hash)

TIERS: Final = ("device", "host_pinned", "disk", "external")
LOWER_TIERS: Final = ("host_pinned", "disk", "external")


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


class _Node:
    __slots__ = ("locs", "engs", "pos", "full", "part", "children", "internal")

    def __init__(self, locs: list[int], engs: list[int], full: set[Rank]) -> None:
        self.locs = locs
        self.engs = engs
        self.pos: dict[int, int] = {h: i for i, h in enumerate(engs)}
        self.full = full
        self.part: dict[Rank, int] = {}
        self.children: dict[int, _Node] = {}
        self.internal = False

    def covers(self, r: Rank, i: int) -> bool:
        if r in self.full:
            return True
        k = self.part.get(r)
        return k is not None and i < k

    def cutoff(self, r: Rank) -> int:
        if r in self.full:
            return len(self.locs)
        return self.part.get(r, 0)

    def live(self) -> bool:
        return bool(self.full) or bool(self.part)


def _new_node(blocks: Sequence[Block], r: Rank) -> _Node:
    return _Node([b[1] for b in blocks], [b[0] for b in blocks], {r})


class DeviceTree:
    """Compressed radix tree over local hashes with per-rank coverage (core.md §7.1)."""

    __slots__ = ("root", "lookup")

    def __init__(self) -> None:
        self.root = _Node([], [], set())
        self.root.internal = True
        self.lookup: dict[Rank, dict[int, _Node]] = {}

    # -- helpers -------------------------------------------------------------------------------

    def _point(self, r: Rank, blocks: Sequence[Block], n: _Node) -> None:
        table = self.lookup[r]
        for b in blocks:
            table[b[0]] = n

    @staticmethod
    def _promote(n: _Node, r: Rank) -> None:
        n.part.pop(r, None)
        n.full.add(r)

    def _cover_prefix(self, n: _Node, r: Rank, k: int) -> None:
        if k == 0:
            return
        if k >= len(n.locs):
            self._promote(n, r)
            return
        if r in n.full:
            return
        n.part[r] = max(n.part.get(r, 0), k)

    def _append(self, n: _Node, r: Rank, blocks: Sequence[Block]) -> None:
        old = len(n.locs)
        for s in list(n.full):
            if s != r:
                n.full.discard(s)
                n.part[s] = old
        self._promote(n, r)
        for j, b in enumerate(blocks):
            n.locs.append(b[1])
            n.engs.append(b[0])
            n.pos[b[0]] = old + j

    def _split(self, n: _Node, k: int) -> None:
        s = _Node(n.locs[k:], n.engs[k:], set(n.full))
        s.children = n.children
        s.internal = n.internal
        for r, c in list(n.part.items()):
            if c >= k:
                del n.part[r]
                n.full.add(r)
                if c - k > 0:
                    s.part[r] = c - k
        del n.locs[k:]
        del n.engs[k:]
        for h in s.engs:
            n.pos.pop(h, None)
        n.children = {s.locs[0]: s}
        n.internal = True
        for r in s.full:
            table = self.lookup.setdefault(r, {})
            for h in s.engs:
                table[h] = s
        for r, c in s.part.items():
            table = self.lookup.setdefault(r, {})
            for h in s.engs[:c]:
                table[h] = s

    # -- operations ----------------------------------------------------------------------------

    def ensure(self, r: Rank) -> None:
        if r not in self.lookup:
            self.lookup[r] = {}

    def store(self, r: Rank, parent_hash: int | None, blocks: Sequence[Block]) -> None:
        """Store `blocks` (engine, local) after `parent_hash`; raises IndexEventError without changes."""
        table = self.lookup.setdefault(r, {})
        cur: _Node
        if parent_hash is not None:
            if any(b[0] == parent_hash for b in blocks):
                raise INVALID_BLOCK_SEQUENCE
            n = table.get(parent_hash)
            if n is None:
                raise PARENT_NOT_FOUND
            p = n.pos.get(parent_hash)
            if p is None:
                raise PARENT_NOT_FOUND
            if not n.covers(r, p):
                del table[parent_hash]
                raise PARENT_NOT_FOUND
            tail_len = len(n.locs) - p - 1
            nb = len(blocks)
            if nb <= tail_len and _equal(n, p + 1, blocks, nb):
                self._cover_prefix(n, r, p + 1 + nb)
                self._point(r, blocks, n)
                return
            if not n.internal and nb > tail_len and _equal(n, p + 1, blocks, tail_len):
                self._append(n, r, blocks[tail_len:])
                self._point(r, blocks, n)
                return
            if n.engs[-1] != parent_hash:
                self._split(n, p + 1)
            cur = n
        else:
            cur = self.root
        root = self.root
        rest: Sequence[Block] = blocks
        while rest:
            c = cur.children.get(rest[0][1])
            if c is not None and not c.live():
                del cur.children[rest[0][1]]
                c = None
            if c is None:
                if cur is not root and not cur.internal and cur.covers(r, len(cur.locs) - 1):
                    self._append(cur, r, rest)
                    self._point(r, rest, cur)
                else:
                    m = _new_node(rest, r)
                    cur.children[rest[0][1]] = m
                    cur.internal = True
                    self._point(r, rest, m)
                break
            limit = min(len(c.locs), len(rest))
            k = 0
            while k < limit and c.locs[k] == rest[k][1]:
                k += 1
            if k < len(c.locs):
                if k == len(rest):
                    self._cover_prefix(c, r, k)
                    self._point(r, rest, c)
                    break
                self._split(c, k)
                self._promote(c, r)
                self._point(r, rest[:k], c)
                t = _new_node(rest[k:], r)
                c.children[rest[k][1]] = t
                c.internal = True
                self._point(r, rest[k:], t)
                break
            self._promote(c, r)
            self._point(r, rest[: len(c.locs)], c)
            rest = rest[len(c.locs) :]
            cur = c

    def remove(self, r: Rank, hashes: Sequence[int]) -> None:
        """Remove engine hashes; unknown ones are skipped; raises the first error after applying."""
        table = self.lookup.setdefault(r, {})
        err: IndexEventError | None = None
        scrubbed: set[int] = set()
        i = 0
        total = len(hashes)
        while i < total:
            h = hashes[i]
            i += 1
            n = table.pop(h, None)
            if n is None:
                if h not in scrubbed:
                    err = err or BLOCK_NOT_FOUND
                continue
            p = n.pos.get(h)
            if p is None:
                table[h] = n
                err = err or BLOCK_NOT_FOUND
                continue
            low, low_hash = p, h
            if n.covers(r, p):
                while i < total:
                    g = hashes[i]
                    if table.get(g) is not n:
                        break
                    pg = n.pos.get(g)
                    if pg is None or not n.covers(r, pg):
                        break
                    if pg < low:
                        low, low_hash = pg, g
                    i += 1
            cc = n.cutoff(r)
            if low >= cc:
                stale = [low_hash]
            else:
                stale = n.engs[low:cc]
                n.full.discard(r)
                if low == 0:
                    n.part.pop(r, None)
                else:
                    n.part[r] = low
            if not n.full:
                n.children = {}
            for s in stale:
                table.pop(s, None)
                scrubbed.add(s)
        if err is not None:
            raise err

    def clear(self, r: Rank) -> None:
        table = self.lookup.pop(r, None)
        if not table:
            return
        seen: set[int] = set()
        for n in table.values():
            if id(n) in seen:
                continue
            seen.add(id(n))
            n.full.discard(r)
            n.part.pop(r, None)
            if not n.full:
                n.children = {}

    def size(self, r: Rank) -> int:
        table = self.lookup.get(r)
        return len(table) if table else 0

    def total_size(self) -> int:
        return sum(len(t) for t in self.lookup.values())

    def find(self, q: Sequence[int]) -> tuple[dict[Rank, int], dict[Rank, int | None]]:
        """Contiguous-prefix scores per rank and the engine hash at each rank's last match."""
        scores: dict[Rank, int] = {}
        last: dict[Rank, int | None] = {}
        if not q:
            return scores, last
        qlen = len(q)
        n = self.root.children.get(q[0])
        at = 0
        depth = 0
        active: set[Rank] | None = None
        prev: int | None = None
        while n is not None and at < qlen:
            locs = n.locs
            limit = min(len(locs), qlen - at)
            if locs[:limit] == q[at : at + limit]:
                m = limit
            else:
                m = 0
                while m < limit and locs[m] == q[at + m]:
                    m += 1
            if m == 0:
                break
            if active is None:
                active = set(n.full)
                for r, k in n.part.items():
                    s = k if k < m else m
                    if s > 0:
                        scores[r] = s
                        last[r] = n.engs[s - 1]
            else:
                full = n.full
                for r in [r for r in active if r not in full]:
                    s = min(n.part.get(r, 0), m)
                    scores[r] = depth + s
                    last[r] = n.engs[s - 1] if s > 0 else prev
                    active.discard(r)
            depth += m
            prev = n.engs[m - 1]
            if not active or m < len(locs) or depth == qlen:
                break
            at += m
            n = n.children.get(q[at])
        if active:
            for r in active:
                scores[r] = depth
                last[r] = prev
        return scores, last

    def dump(self) -> list[tuple[Rank, int | None, list[Block]]]:
        """Stores that rebuild every reachable answer, breadth first (core.md §7.5)."""
        out: list[tuple[Rank, int | None, list[Block]]] = []
        queue: list[tuple[_Node, int | None, set[Rank] | None]] = [
            (c, None, None) for c in self.root.children.values()
        ]
        head = 0
        while head < len(queue):
            n, ph, reach = queue[head]
            head += 1
            if not n.live():
                continue
            full = sorted(r for r in n.full if reach is None or r in reach)
            part = sorted((r, k) for r, k in n.part.items() if reach is None or r in reach)
            blocks = list(zip(n.engs, n.locs, strict=False))
            for r in full:
                out.append((r, ph, blocks))
            for r, k in part:
                out.append((r, ph, blocks[:k]))
            if full:
                reach_next = set(full)
                queue.extend((c, n.engs[-1], reach_next) for c in n.children.values())
        return out


def _equal(n: _Node, start: int, blocks: Sequence[Block], count: int) -> bool:
    """Whether blocks[:count] equal the node's edge from `start`, local and engine hashes alike."""
    locs, engs = n.locs, n.engs
    for j in range(count):
        b = blocks[j]
        if locs[start + j] != b[1] or engs[start + j] != b[0]:
            return False
    return True


class LowerTier:
    """Continuation edges for host-pinned, disk or external blocks (core.md §7.2)."""

    __slots__ = ("edges", "owned")

    def __init__(self) -> None:
        # (parent engine hash or None, local hash) -> [child engine hash, owners]
        self.edges: dict[tuple[int | None, int], tuple[int, set[Rank]]] = {}
        self.owned: dict[Rank, dict[int, tuple[int | None, int]]] = {}

    def store(self, r: Rank, parent_hash: int | None, blocks: Sequence[Block]) -> None:
        owned = self.owned.setdefault(r, {})
        cur = parent_hash
        for engine, local in blocks:
            key = (cur, local)
            mine = owned.get(engine)
            if mine is not None and mine != key:
                break
            edge = self.edges.get(key)
            if edge is not None and edge[0] != engine:
                break
            if edge is None:
                edge = (engine, set())
                self.edges[key] = edge
            edge[1].add(r)
            owned[engine] = key
            cur = engine

    def _release(self, r: Rank, key: tuple[int | None, int]) -> None:
        edge = self.edges.get(key)
        if edge is None:
            return
        edge[1].discard(r)
        if not edge[1]:
            del self.edges[key]

    def remove(self, r: Rank, hashes: Iterable[int]) -> None:
        owned = self.owned.get(r)
        if not owned:
            return
        for h in hashes:
            key = owned.pop(h, None)
            if key is not None:
                self._release(r, key)

    def clear(self, r: Rank) -> None:
        owned = self.owned.pop(r, None)
        if not owned:
            return
        for key in owned.values():
            self._release(r, key)

    def size(self, r: Rank) -> int:
        owned = self.owned.get(r)
        return len(owned) if owned else 0

    def total_size(self) -> int:
        return sum(len(o) for o in self.owned.values())


class KeyIndex:
    """One key's index: the device tree and the three lower tiers."""

    __slots__ = ("device", "lower")

    def __init__(self) -> None:
        self.device = DeviceTree()
        self.lower: dict[str, LowerTier] = {t: LowerTier() for t in LOWER_TIERS}

    def rank_size(self, r: Rank) -> int:
        """Blocks the rank holds in every tier."""
        return self.device.size(r) + sum(tier.size(r) for tier in self.lower.values())

    def drop_rank(self, r: Rank) -> None:
        self.device.clear(r)
        for tier in self.lower.values():
            tier.clear(r)

    def tiered(
        self, q: Sequence[int]
    ) -> tuple[dict[Rank, int], dict[str, dict[Rank, int]]]:
        """Device prefix per rank and lower-tier extension blocks beyond it (core.md §7.3)."""
        device, last = self.device.find(q)
        hits: dict[str, dict[Rank, int]] = {}
        cont: dict[Rank, tuple[int, int | None]] | None = None
        qlen = len(q)
        for name in LOWER_TIERS:
            tier = self.lower[name]
            edges = tier.edges
            if not edges:
                hits[name] = {}
                continue
            if cont is None:
                cont = {r: (device[r], last[r]) for r in device}
            if q:
                first = edges.get((None, q[0]))
                if first is not None:
                    for r in sorted(first[1]):
                        cont.setdefault(r, (0, None))
            tier_hits: dict[Rank, int] = {}
            for r, (start, cur) in cont.items():
                p = start
                while p < qlen:
                    edge = edges.get((cur, q[p]))
                    if edge is None or r not in edge[1]:
                        break
                    cur = edge[0]
                    p += 1
                if p > start:
                    tier_hits[r] = p - start
                    cont[r] = (p, cur)
            hits[name] = tier_hits
        return device, hits

    def dump(self) -> list[tuple[str, Rank, int | None, list[Block]]]:
        out: list[tuple[str, Rank, int | None, list[Block]]] = [
            ("device", r, ph, blocks) for r, ph, blocks in self.device.dump()
        ]
        for name in LOWER_TIERS:
            tier = self.lower[name]
            for r in sorted(tier.owned):
                for h, (parent, local) in tier.owned[r].items():
                    out.append((name, r, parent, [(h, local)]))
        return out
