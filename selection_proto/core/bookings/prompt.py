"""A request's prompt as the index sees it: block hashes, the input length, and sequence hashes
computed only when needed (core.md §9.1), with the length limits every prompt field obeys."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Any

from ..base.errors import BadRequest
from ..base.hashing import block_hashes, pack_tokens, sequence_hashes
from .tracker import RankLoad
from .tracking import KeyedTracking

__all__ = ["Prehashed", "PromptHashes", "PromptTooLong", "booking_prompt", "prehash", "selection_prompt"]

PROMPT_FIELDS = ("token_ids", "block_hashes", "sequence_hashes", "block_mm_infos")
PREHASH_SLICE_BLOCKS = 16_384


class PromptTooLong(BadRequest):
    """A prompt field over `max_prompt_tokens` (counted as the `prompt_tokens` limit)."""


class PromptHashes:
    """A prompt's block hashes and, computed only when needed, its sequence hashes.

    Sequence hashes cost one Python-level hash per block; a selection needs them only when a
    candidate has active blocks or when it books. Hashes chained here from token ids identify
    distinct prefixes, so their count is the block count (a 64-bit collision would already
    confuse the index); hashes a client sent are counted as given, duplicates merged."""

    __slots__ = ("blocks", "isl", "_seqs", "_distinct", "counted", "chained", "encoded_seqs")

    def __init__(self, blocks: list[int], seqs: list[int] | None, isl: int, chained: bool | None = None) -> None:
        self.blocks = blocks
        self.isl = isl
        self._seqs = seqs
        # The sequence hashes are the chain of the block hashes (not a client's, nor keyed ones).
        self.chained = seqs is None if chained is None else chained
        self._distinct: set[int] | None = None
        # `new_blocks` counted ahead (`ahead.prepare_ahead`): id(load) -> (load, its
        # `changes` then, the count); used while the load has not changed since.
        self.counted: dict[int, tuple[RankLoad, int, int]] = {}
        # The sequence hashes as a booking's answer carries them, encoded ahead (`ahead.prepare_ahead`).
        self.encoded_seqs: bytes | None = None

    @property
    def seqs(self) -> list[int]:
        if self._seqs is None:
            self._seqs = sequence_hashes(self.blocks)
        return self._seqs

    def distinct(self) -> set[int]:
        """The sequence hashes as a set (kept)."""
        if self._distinct is None:
            self._distinct = set(self.seqs)
        return self._distinct

    def new_blocks(self, load: RankLoad) -> int:
        """How many of this prompt's blocks `load` does not hold yet."""
        if not load.unique and self.chained:
            return len(self.blocks)  # chained hashes are distinct (as `ahead` counts them)
        ahead = self.counted.get(id(load))
        if ahead is not None and ahead[0] is load and ahead[1] == load.changes:
            return ahead[2]
        return load.new_blocks(self.distinct())


class Prehashed:
    """A huge plain prompt hashed ahead, in a worker thread, in each block size its service's
    pools use (`prehash`): a selection then looks its hashes up instead of computing them on
    the event loop. `tokens` ties them to the one prompt they were computed from."""

    __slots__ = ("tokens", "by_key")

    def __init__(self, tokens: array[int], by_key: dict[tuple[int, str | None, str | None], PromptHashes]) -> None:
        self.tokens = tokens
        self.by_key = by_key

    def find(self, req: Any, block_size: int) -> PromptHashes | None:
        """The hashes of `req`'s `token_ids` in `block_size`, if these are its tokens."""
        found = self.by_key.get((block_size, req.lora_name, req.cache_namespace))
        return found if found is not None and req.token_ids == self.tokens else None


def prehash(value: Any, block_sizes: Iterable[int]) -> Prehashed | None:
    """A parsed request body's plain prompt (`token_ids`; no multimodal or eagle fields) hashed in
    each of `block_sizes`, sequence hashes included; None for any other body. Pure,
    and worth it only for huge prompts: for a worker thread."""
    if not isinstance(value, dict) or any(value.get(f) is not None for f in ("mm_routing_info", "block_mm_infos", "is_eagle")):
        return None
    tokens, lora, namespace = value.get("token_ids"), value.get("lora_name"), value.get("cache_namespace")
    if not isinstance(tokens, list) or not all(v is None or isinstance(v, str) for v in (lora, namespace)):
        return None
    try:
        packed = pack_tokens(tokens)
    except (OverflowError, TypeError):
        return None  # the selection refuses it, with the usual message
    by_key = {}
    for size in block_sizes:
        blocks: list[int] = []
        step = PREHASH_SLICE_BLOCKS * size  # each slice one C call holding the GIL (~1.5 ms)
        for start in range(0, len(packed) if size else 0, step):
            blocks += block_hashes(packed[start:start + step], size, lora, namespace)
        by_key[(size, lora, namespace)] = PromptHashes(blocks, sequence_hashes(blocks), len(tokens), chained=True)
    return Prehashed(packed, by_key)


def _from_tokens(req: Any, block_size: int, limit: int, tracking: KeyedTracking | None,
                 eagle_default: bool, prehashed: Prehashed | None = None) -> PromptHashes | None:
    """Enforce the length limits; the prompt of `token_ids` when the request has them, with its
    keyed tracking hashes when `tracking` is given."""
    for field in PROMPT_FIELDS:
        value = getattr(req, field)
        if value is not None and len(value) > limit:
            raise PromptTooLong(f"{field} has {len(value)} entries; the limit is {limit}")
    routing = req.mm_routing_info
    eagle = bool(eagle_default if req.is_eagle is None else req.is_eagle)  # the request's, else its key's
    if routing is None and not req.block_mm_infos and not eagle and tracking is None:
        if req.token_ids is None:
            return None  # the plain prompt, by far the most common: nothing more to decide
        if prehashed is not None and (found := prehashed.find(req, block_size)) is not None:
            return found
        blocks = block_hashes(req.token_ids, block_size, req.lora_name, req.cache_namespace)
        return PromptHashes(blocks, None, len(req.token_ids))
    if routing is not None:
        for field in ("routing_token_ids", "block_mm_infos"):
            value = getattr(routing, field)
            if len(value) > limit:
                raise PromptTooLong(f"mm_routing_info.{field} has {len(value)} entries; the limit is {limit}")
    if routing is not None and len(routing.routing_token_ids):  # 1.6.1: they replace token_ids
        tokens, infos = routing.routing_token_ids, routing.block_mm_infos
    elif req.token_ids is not None:
        tokens, infos = req.token_ids, req.block_mm_infos
    else:
        return None
    # Blocks with multimodal items hash their items' hashes after their tokens.
    mm = {i: [o.mm_hash for o in info.mm_objects] for i, info in enumerate(infos or ())
          if info is not None and info.mm_objects}
    blocks = block_hashes(tokens, block_size, req.lora_name, req.cache_namespace, eagle, mm=mm)
    seqs = None if tracking is None else tracking.sequence(
        tokens, block_size, req.model_name, req.tenant_id, req.cache_namespace, req.lora_name, eagle, mm)
    return PromptHashes(blocks, seqs, len(tokens))


def _required(req: Any, names: tuple[str, ...]) -> None:
    """The members a prompt given as hashes needs, checked in order."""
    for name in names:
        if getattr(req, name) is None:
            raise BadRequest(f"{name} is required without token_ids")


def selection_prompt(req: Any, block_size: int, limit: int, tracking: KeyedTracking | None = None,
                     eagle_default: bool = False, prehashed: Prehashed | None = None) -> PromptHashes:
    """The prompt of a selection (`select`, `select_and_reserve`, scores, potential loads)."""
    prompt = _from_tokens(req, block_size, limit, tracking, eagle_default, prehashed)
    if prompt is not None:
        return prompt
    _required(req, ("block_hashes", "sequence_hashes", "isl_tokens"))
    if req.isl_tokens <= 0:
        raise BadRequest("isl_tokens must be greater than 0")
    if len(req.block_hashes) != len(req.sequence_hashes):
        raise BadRequest(f"block_hashes length {len(req.block_hashes)} must match "
                         f"sequence_hashes length {len(req.sequence_hashes)}")
    return PromptHashes(list(req.block_hashes), list(req.sequence_hashes), req.isl_tokens)


def booking_prompt(req: Any, block_size: int, limit: int, tracking: KeyedTracking | None = None,
                   eagle_default: bool = False, prehashed: Prehashed | None = None) -> PromptHashes:
    """The prompt of a direct booking (`POST /reservations`): no block hashes needed."""
    prompt = _from_tokens(req, block_size, limit, tracking, eagle_default, prehashed)
    if prompt is not None:
        return prompt
    _required(req, ("sequence_hashes", "isl_tokens"))
    # Block hashes, when sent, say what the booking predicts cached (approximate mode).
    return PromptHashes(list(req.block_hashes or ()), list(req.sequence_hashes), req.isl_tokens)
