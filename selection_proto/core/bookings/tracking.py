"""Tracking identities of bookings (Dynamo 1.6.1's `--router-tracking-hash`): the hashes the load
tracker counts a booked prompt's blocks by. `public-xxh3-v1` uses the public sequence hashes;
`keyed-xxh3-v1` derives two seeds per scope from a 32-byte provider key with keyed BLAKE3, so that
a client who knows the prompts cannot forge another tenant's identities. The index always uses the
public block hashes; sequence hashes a client sent are used as given, whatever the mode."""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any, Final

from ..base.hashing import block_hashes, sequence_hashes

__all__ = ["KEY_BYTES", "KeyedTracking"]

KEY_BYTES: Final = 32
_DOMAIN: Final = b"dynamo.router.tracking-hash/keyed-xxh3-v1\0"
_LE32 = struct.Struct("<I").pack
_LE64 = struct.Struct("<Q").pack

Scope = tuple[str, str, int, str | None, str | None, bool]  # model, tenant, block size, salt, LoRA, eagle


class KeyedTracking:
    """`keyed-xxh3-v1`: per scope a block seed and a chain seed, derived once and kept."""

    __slots__ = ("_key", "_key_id", "_seeds")

    def __init__(self, key: bytes, key_id: str) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"router tracking key file must contain exactly {KEY_BYTES} raw bytes; "
                             f"found {len(key)}")
        self._key = key
        self._key_id = key_id
        self._seeds: dict[Scope, tuple[int, int]] = {}

    def _derive(self, scope: Scope) -> tuple[int, int]:
        import blake3  # the keyed mode's only dependency (the `tracking` extra)

        model, tenant, block_size, salt, lora, eagle = scope
        h: Any = blake3.blake3(key=self._key)
        h.update(_DOMAIN)

        def frame(tag: int, data: bytes) -> None:
            h.update(bytes([tag]))
            h.update(_LE64(len(data)))
            h.update(data)

        def optional(tag: int, text: str | None) -> None:
            h.update(bytes([tag, 1 if text else 0]))
            if text:
                data = text.encode()
                h.update(_LE64(len(data)))
                h.update(data)

        frame(1, self._key_id.encode())
        frame(2, model.encode())
        frame(3, tenant.encode())
        frame(4, _LE32(block_size))
        optional(5, salt)
        optional(6, lora)
        frame(7, b"\1" if eagle else b"\0")
        digest: bytes = h.digest(32)
        seeds = (int.from_bytes(digest[0:8], "little"), int.from_bytes(digest[8:16], "little"))
        if len(self._seeds) >= 4096:  # scopes are few; a client minting salts cannot grow this
            self._seeds.clear()
        self._seeds[scope] = seeds
        return seeds

    def sequence(self, tokens: Sequence[int], block_size: int, model: str, tenant: str,
                 salt: str | None, lora: str | None, eagle: bool = False,
                 mm: Mapping[int, Sequence[int]] | None = None) -> list[int]:
        """The keyed tracking hashes of a prompt's complete blocks."""
        scope = (model, tenant, block_size, salt or None, lora or None, eagle)
        block_seed, chain_seed = self._seeds.get(scope) or self._derive(scope)
        blocks = block_hashes(tokens, block_size, is_eagle=eagle, seed=block_seed, mm=mm)
        return sequence_hashes(blocks, chain_seed)
