"""One key's index: the device tree beside the host-pinned, disk and external tiers (core.md §7.2-7.4).

Lower tiers hold continuation edges, not a tree: a lookup extends each rank's device prefix
through them, tier by tier.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .edges import Block
from .index import LOWER_TIERS, DeviceTree, Rank

__all__ = ["KeyIndex", "LowerTier"]


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
