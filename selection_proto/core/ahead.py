"""Work done ahead for a huge request, in a worker thread while the event loop serves others: its
body parsed (`handler.prepare_large_body`), its prompt hashed in each block size the pools use,
its new blocks on every booked rank counted, and for a booking the sequence hashes its answer
carries encoded.

The state is read here only by single C-level operations (a list of a dict's values, a slice of
hash lookups), each atomic under the GIL; a count carries its rank's change counter and is used
only while the rank has not changed since (`PromptHashes.new_blocks`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from .base import jsonio
from .base.hashing import signed_json
from .base.routes import ParsedBody
from .bookings.prompt import PromptHashes, prehash
from .bookings.tracker import RankLoad
from .fleet.pool import Key, Pool
from .handler import prepare_large_body

__all__ = ["hash_ahead", "prepare_ahead"]

MAX_BLOCK_SIZES: Final = 4  # past this many, a huge prompt is hashed where it is selected
COUNT_SLICE: Final = 8_192  # lookups per GIL-holding step: a few ms, mostly cache misses


def prepare_ahead(pools: Mapping[Key, Pool], path: str, raw: bytes, media: str | None = None) -> ParsedBody | None:
    """`handler.prepare_large_body` with the pools' block sizes, and the prompt's new blocks on
    each rank with bookings counted."""
    listed = list(pools.values())
    sizes = frozenset(pool.block_size for pool in listed)
    body = prepare_large_body(path, raw, media, sizes if len(sizes) <= MAX_BLOCK_SIZES else ())
    if body is None or body.prehashed is None:
        return body
    _count(listed, body)
    if path == "/select_and_reserve":  # (the picker's answers are not encoded)
        for prompt in body.prehashed.by_key.values():
            prompt.encoded_seqs = signed_json(prompt.seqs)
    return body


def hash_ahead(pools: Mapping[Key, Pool], body: ParsedBody) -> ParsedBody:
    """A body parsed elsewhere (the picker's OpenAI request, as a `/select_and_reserve` body):
    its prompt hashed and its new blocks counted, as `prepare_ahead` does."""
    listed = list(pools.values())
    sizes = frozenset(pool.block_size for pool in listed)
    if len(sizes) <= MAX_BLOCK_SIZES:
        with jsonio.gc_paused():
            body.prehashed = prehash(body.value, sizes)
    if body.prehashed is not None:
        _count(listed, body)
    return body


def _count(listed: list[Pool], body: ParsedBody) -> None:
    assert body.prehashed is not None
    for pool in listed:
        for load in list(pool.tracker.loads.values()):
            if not load.unique:
                continue  # nothing to count: every block is new
            for (size, _, _), prompt in body.prehashed.by_key.items():
                if size == pool.block_size:
                    prompt.counted[id(load)] = (load, load.changes, _new_blocks_in_slices(prompt, load))


def _new_blocks_in_slices(prompt: PromptHashes, load: RankLoad) -> int:
    """`prompt.new_blocks(load)` in slices, the GIL let go between them. The prompt's sequence
    hashes were chained from tokens (`prompt.prehash`): distinct, so their count is the set's."""
    held, unique, seqs = 0, load.unique, prompt.seqs
    for start in range(0, len(seqs), COUNT_SLICE):
        held += sum(map(unique.__contains__, seqs[start:start + COUNT_SLICE]))
    return len(seqs) - held
