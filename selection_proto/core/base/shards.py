"""Tables keyed by block hashes that may hold millions: a dict split in `SHARDS` dicts by the
hash's low bits. One dict of millions rehashes all of them at once as it doubles (58-229 ms past
1-4 million entries, inside one piece of a booking). Shards of equal shares would fill evenly and
double together, in the same piece; so their shares of the 256 values of the hash's low byte
are spread over an octave (23 to 42 of them), and as the table doubles its shards double one at
a time, a few pieces apart (docs/INVARIANTS.md, "Round three")."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableMapping
from itertools import chain
from typing import Final, TypeVar

__all__ = ["LOW_BITS", "SHARDS", "HashShards"]

SHARDS: Final = 8
LOW_BITS: Final = 255  # `shards[hash & LOW_BITS]` is the hash's shard


def _shares() -> list[int]:
    """Which shard each value of the low byte goes to: shard i takes a share growing by 2**(1/8)
    from one to the next (rounded, the largest remainders taking what is left)."""
    weights = [2 ** (i / SHARDS) for i in range(SHARDS)]
    exact = [(LOW_BITS + 1) * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(SHARDS), key=lambda i: counts[i] - exact[i])[: LOW_BITS + 1 - sum(counts)]:
        counts[i] += 1
    return [i for i, count in enumerate(counts) for _ in range(count)]


_SHARD_OF_LOW_BYTE: Final = _shares()

V = TypeVar("V")


class HashShards(MutableMapping[int, V]):
    """A dict from block hashes (ints) to values, in `SHARDS` dicts: `shards[h & LOW_BITS]` holds
    `h` (256 entries naming the 8 `tables`, so that finding one costs one index)."""

    __slots__ = ("shards", "tables")

    def __init__(self) -> None:
        self.tables: list[dict[int, V]] = [{} for _ in range(SHARDS)]
        self.shards: list[dict[int, V]] = [self.tables[i] for i in _SHARD_OF_LOW_BYTE]

    def __getitem__(self, h: int) -> V:
        return self.shards[h & LOW_BITS][h]

    def __setitem__(self, h: int, value: V) -> None:
        self.shards[h & LOW_BITS][h] = value

    def __delitem__(self, h: int) -> None:
        del self.shards[h & LOW_BITS][h]

    def __contains__(self, h: object) -> bool:
        return isinstance(h, int) and h in self.shards[h & LOW_BITS]

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(self.tables)

    def __len__(self) -> int:
        return sum(map(len, self.tables))

    def __bool__(self) -> bool:
        return any(self.tables)

    def get(self, h: int, default: V | None = None) -> V | None:  # type: ignore[override]
        return self.shards[h & LOW_BITS].get(h, default)

    def pop(self, h: int, default: V | None = None) -> V | None:  # type: ignore[override]
        return self.shards[h & LOW_BITS].pop(h, default)

    def values_all(self) -> Iterator[V]:
        return chain.from_iterable(table.values() for table in self.tables)

    def set_all(self, hashes: Iterable[int], value: V) -> None:
        shards, bits = self.shards, LOW_BITS  # (a plain loop: faster than mapping dict's slot wrappers)
        for h in hashes:
            shards[h & bits][h] = value

    def get_all(self, hashes: Iterable[int]) -> list[V | None]:
        shards, bits = self.shards, LOW_BITS
        return [shards[h & bits].get(h) for h in hashes]

    def delete_all(self, hashes: Iterable[int]) -> None:
        """Delete these hashes, each of which is there."""
        shards = self.shards
        for h in hashes:
            del shards[h & LOW_BITS][h]

    def discard_all(self, hashes: Iterable[int]) -> None:
        shards = self.shards
        for h in hashes:
            shards[h & LOW_BITS].pop(h, None)
