"""Pending selections (Dynamo 1.6.1's "cached replay form", docs/DECISIONS.md): a `/select` that
carries a `selection_id` remembers what it would book, so that `POST /reservations` with that id
and no `worker_id` books exactly that, once.

Entries are kept oldest first. Only an insert sweeps: it drops the entries older than the TTL,
puts the new one in (a `/select` for an id already held replaces it), then evicts the oldest
while there are more than `selection_cache_max_entries` entries or more than
`selection_cache_max_bytes` bytes. A lookup treats an expired entry as absent without removing it.
An entry's size is 1.6.1's: 8 bytes per sequence hash plus the UTF-8 lengths of the selection
id, model name, tenant, LoRA name and session id."""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

from ..bookings.prompt import PromptHashes
from ..cache.index import Rank
from .pool import Key

__all__ = ["MISSING", "PendingSelection", "PendingSelections"]

MISSING: Final = "no pending selection {sid} for model={model} routing_group={group} " \
                 "(expired, already used, or never selected)"


class PendingSelection:
    """What a selection would book: its rank, its prompt's hashes, the tokens it found cached,
    and the booking inputs the request decided at selection time."""

    __slots__ = ("rank", "prompt", "cached", "track_prefill", "reuse", "expected_output_tokens",
                 "session", "inserted_at", "size")

    def __init__(self, rank: Rank, prompt: PromptHashes, cached: int, track_prefill: bool,
                 reuse: bool, expected_output_tokens: int | None, session: str | None,
                 inserted_at: float, size: int) -> None:
        self.rank = rank
        self.prompt = prompt
        self.cached = cached
        self.track_prefill = track_prefill
        self.reuse = reuse
        self.expected_output_tokens = expected_output_tokens
        self.session = session  # the session the booking binds (with affinity on)
        self.inserted_at = inserted_at
        self.size = size


def entry_size(key: Key, sid: str, prompt: PromptHashes, lora_name: str | None,
               session_id: str | None) -> int:
    return (8 * len(prompt.seqs) + len(sid.encode()) + len(key[0].encode()) + len(key[1].encode())
            + len((lora_name or "").encode()) + len((session_id or "").encode()))


class PendingSelections:
    """The service's pending selections, one per (key, selection id), oldest first."""

    __slots__ = ("_ttl", "_max_entries", "_max_bytes", "_entries", "bytes")

    def __init__(self, ttl: float, max_entries: int, max_bytes: int) -> None:
        self._ttl = ttl
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._entries: OrderedDict[tuple[Key, str], PendingSelection] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, key: Key, sid: str, entry: PendingSelection, now: float) -> None:
        """Keep `entry` for `(key, sid)`, replacing any older one; sweep and evict first/after."""
        entries = self._entries
        while entries:
            oldest_key, oldest = next(iter(entries.items()))
            if now - oldest.inserted_at <= self._ttl:
                break
            self._drop(oldest_key)
        self._drop((key, sid))
        entries[(key, sid)] = entry
        self.bytes += entry.size
        while entries and (len(entries) > self._max_entries or self.bytes > self._max_bytes):
            self._drop(next(iter(entries)))

    def get(self, key: Key, sid: str, now: float) -> PendingSelection | None:
        """The live entry for `(key, sid)`, or None (an expired one stays until an insert sweeps)."""
        entry = self._entries.get((key, sid))
        if entry is None or now - entry.inserted_at > self._ttl or self._ttl == 0:
            return None  # a TTL of 0 keeps nothing (in 1.6.1 time always passes before a replay)
        return entry

    def forget(self, key: Key, sid: str) -> None:
        self._drop((key, sid))

    def _drop(self, at: tuple[Key, str]) -> None:
        entry = self._entries.pop(at, None)
        if entry is not None:
            self.bytes -= entry.size
