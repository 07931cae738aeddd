"""Block and sequence hashes, bit for bit equal to Dynamo's (core.md §5).

`X(data, k)` is XXH3-64 with seed `k`. Token ids are packed little-endian u32; packing goes
through `array` because it is several times faster than a Python loop and validates the u32
range for free.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import lru_cache
from itertools import chain, repeat
from typing import Any, overload

from xxhash import xxh3_64_intdigest

from . import jsonio

__all__ = ["XXH_SEED", "SignedHashes", "block_hashes", "iv", "pack_tokens", "sequence_hashes", "hash64", "signed",
           "signed_json"]

XXH_SEED = 1337
U64 = 0xFFFFFFFFFFFFFFFF
_LITTLE = sys.byteorder == "little"
_pack_pair = struct.Struct("<QQ").pack
_pack_u64 = struct.Struct("<Q").pack
# Blocks are cut out of the packed prompt this many at a time, by one `Struct` of as many byte
# strings: no tuple per block, which makes cutting three times faster than one block per step.
_GROUP = 64


def hash64(data: bytes | bytearray | memoryview, seed: int = 0) -> int:
    """`X(data, seed)`."""
    return xxh3_64_intdigest(data, seed)


def iv(lora_name: str | None = None, cache_namespace: str | None = None) -> int:
    """The seed of local block hashes: 1337, salted by LoRA name and cache namespace."""
    k = XXH_SEED
    if lora_name:
        k = (k + xxh3_64_intdigest(lora_name.encode("utf-8"), 0)) & U64
    if cache_namespace:
        k = (k + xxh3_64_intdigest(cache_namespace.encode("utf-8"), 1)) & U64
    return k


def pack_tokens(tokens: Iterable[int]) -> array[int]:
    """Token ids as a u32 array; raises OverflowError / TypeError for a value that is not a u32."""
    if isinstance(tokens, array) and tokens.typecode == "I":
        return tokens
    packed = array("I")
    if packed.itemsize != 4:  # pragma: no cover - no such platform in practice
        raise RuntimeError("array('I') is not 32 bits wide on this platform")
    packed.fromlist(tokens if isinstance(tokens, list) else list(tokens))
    return packed


def _le_bytes(packed: array[int]) -> bytes | memoryview:
    if _LITTLE:
        return memoryview(packed).cast("B")  # no copy
    swapped = array("I", packed)  # pragma: no cover - big-endian hosts only
    swapped.byteswap()  # pragma: no cover
    return swapped.tobytes()  # pragma: no cover


def block_hashes(
    tokens: Sequence[int] | array[int],
    block_size: int,
    lora_name: str | None = None,
    cache_namespace: str | None = None,
    is_eagle: bool = False,
    seed: int | None = None,
    mm: Mapping[int, Sequence[int]] | None = None,
) -> list[int]:
    """Local hashes of the complete blocks of `tokens` (the tail is ignored), seeded by
    `iv(lora_name, cache_namespace)` unless `seed` is given. `mm`: block index -> the multimodal
    hashes hashed into that block after its tokens."""
    if block_size == 0:
        return []
    k = iv(lora_name, cache_namespace) if seed is None else seed
    if mm:
        hashes = block_hashes(tokens, block_size, is_eagle=is_eagle, seed=k)
        width = block_size + 1 if is_eagle else block_size
        for i, items in mm.items():
            if i < len(hashes):
                hashes[i] = multimodal_block_hash(tokens[i * block_size:i * block_size + width], items, k)
        return hashes
    count = len(tokens)
    view = memoryview(_le_bytes(pack_tokens(tokens)))
    step = block_size * 4
    if not is_eagle:
        return list(map(xxh3_64_intdigest, _blocks(view, step, count // block_size), repeat(k)))
    # Eagle windows overlap by one token: bs+1 tokens, stepping bs.
    n = (count - 1) // block_size if count else 0
    width = step + 4
    return [xxh3_64_intdigest(view[i : i + width], k) for i in range(0, n * step, step)]


@lru_cache(maxsize=256)
def _cutter(step: int, count: int) -> struct.Struct:
    """A `Struct` that cuts `count` blocks of `step` bytes (cached: block sizes are few)."""
    return struct.Struct(f"{step}s" * count)


def _blocks(view: memoryview, step: int, n: int) -> Iterator[bytes]:
    """The first `n` blocks of `step` bytes of `view`, as byte strings."""
    whole = n - n % _GROUP
    groups = _cutter(step, _GROUP).iter_unpack(view[: whole * step]) if whole else ()
    rest = n - whole
    tail = _cutter(step, rest).unpack(view[whole * step: n * step]) if rest else ()
    return chain(chain.from_iterable(groups), tail)


def sequence_hashes(blocks: Sequence[int], seed: int = XXH_SEED) -> list[int]:
    """Rolling prefix hashes: seq[0] = blocks[0]; seq[i] = X(LE64(seq[i-1]) || LE64(blocks[i]), seed)."""
    if not blocks:
        return []
    prev = blocks[0]
    out = [prev]
    append = out.append
    pack, digest = _pack_pair, xxh3_64_intdigest  # locals: this loop is the hot path
    for h in blocks[1:]:
        append(prev := digest(pack(prev, h), seed))
    return out


def signed(hashes: Sequence[int]) -> tuple[int, ...]:
    """Unsigned 64-bit hashes as the i64 the wire carries them as; in C, by reinterpreting the
    packed array (a million-block booking's answer would take ~120 ms on the loop otherwise)."""
    try:
        return tuple(array("q", array("Q", hashes).tobytes()))
    except OverflowError:  # already signed, or out of range: value by value
        return tuple(h - (1 << 64) if h >= 1 << 63 else h for h in hashes)


# Hashes encoded per step of `signed_json`: each step one short C call, so that a worker thread
# encoding a million lets the event loop have the GIL between steps (~1 ms each).
ENCODE_SLICE = 16_384


def signed_json(hashes: Sequence[int]) -> bytes:
    """`hashes` as the JSON array of i64 an answer carries, encoded a slice at a time (for a
    worker thread: the GIL is let go between slices)."""
    parts = [jsonio.dumps(list(signed(hashes[start:start + ENCODE_SLICE])))[1:-1]
             for start in range(0, len(hashes), ENCODE_SLICE)]
    return b"[" + b",".join(parts) + b"]"


class SignedHashes(Sequence[int]):
    """A booking's hashes as the i64 the wire carries them as, converted only when read: an answer
    of a million-block booking would otherwise build a million ints on the event loop. `encoded`:
    their JSON array, when a worker thread wrote it ahead (`signed_json`)."""

    __slots__ = ("_hashes", "encoded")

    def __init__(self, hashes: Sequence[int], encoded: bytes | None = None) -> None:
        self._hashes = hashes  # never changed once booked
        self.encoded = encoded

    def __len__(self) -> int:
        return len(self._hashes)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            return signed(self._hashes[index])
        h = self._hashes[index]
        return h - (1 << 64) if h >= 1 << 63 else h

    def __iter__(self) -> Iterator[int]:
        return iter(signed(self._hashes))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SignedHashes({list(self)!r})"

    def json_value(self) -> Any:
        """What an answer's JSON carries: the array written ahead, else the values."""
        return jsonio.fragment(self.encoded) if self.encoded is not None else list(signed(self._hashes))


def multimodal_block_hash(window: Sequence[int], mm_hashes: Iterable[int], seed: int) -> int:
    """Local hash of a block carrying multimodal hashes (core.md §5.1, events only)."""
    data = b"".join((_le_bytes(pack_tokens(list(window))), *map(_pack_u64, sorted(mm_hashes))))
    return xxh3_64_intdigest(data, seed)
