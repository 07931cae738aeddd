"""Tables keyed by block hashes that may hold millions: a dict split in `SHARDS` dicts by the
hash's low bits. One dict of millions rehashes all of them at once as it doubles (58-229 ms past
1-4 million entries, inside one piece of a booking); a shard rehashes a sixteenth
(docs/INVARIANTS.md, "Round three"). Hashes are uniform in their low bits, so the shards fill
evenly."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableMapping
from itertools import chain
from typing import Final, TypeVar

__all__ = ["LOW_BITS", "SHARDS", "HashShards"]

SHARDS: Final = 16
LOW_BITS: Final = SHARDS - 1  # hash & LOW_BITS: the shard of a hash

V = TypeVar("V")


class HashShards(MutableMapping[int, V]):
    """A dict from block hashes (ints) to values, in `SHARDS` dicts; `shards[h & 15]` holds `h`."""

    __slots__ = ("shards",)

    def __init__(self) -> None:
        self.shards: list[dict[int, V]] = [{} for _ in range(SHARDS)]

    def __getitem__(self, h: int) -> V:
        return self.shards[h & LOW_BITS][h]

    def __setitem__(self, h: int, value: V) -> None:
        self.shards[h & LOW_BITS][h] = value

    def __delitem__(self, h: int) -> None:
        del self.shards[h & LOW_BITS][h]

    def __contains__(self, h: object) -> bool:
        return isinstance(h, int) and h in self.shards[h & LOW_BITS]

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(self.shards)

    def __len__(self) -> int:
        return sum(map(len, self.shards))

    def __bool__(self) -> bool:
        return any(self.shards)

    def get(self, h: int, default: V | None = None) -> V | None:  # type: ignore[override]
        return self.shards[h & LOW_BITS].get(h, default)

    def pop(self, h: int, default: V | None = None) -> V | None:  # type: ignore[override]
        return self.shards[h & LOW_BITS].pop(h, default)

    def values_all(self) -> Iterator[V]:
        return chain.from_iterable(shard.values() for shard in self.shards)

    def set_all(self, hashes: Iterable[int], value: V) -> None:
        shards = self.shards  # (a plain loop: faster than mapping dict's slot wrappers in C)
        for h in hashes:
            shards[h & LOW_BITS][h] = value

    def get_all(self, hashes: Iterable[int]) -> list[V | None]:
        shards = self.shards
        return [shards[h & LOW_BITS].get(h) for h in hashes]

    def delete_all(self, hashes: Iterable[int]) -> None:
        """Delete these hashes, each of which is there."""
        shards = self.shards
        for h in hashes:
            del shards[h & LOW_BITS][h]

    def discard_all(self, hashes: Iterable[int]) -> None:
        shards = self.shards
        for h in hashes:
            shards[h & LOW_BITS].pop(h, None)
