"""KV events: Dynamo's JSON `RouterEvent` / `KvCacheEvent` decoded into internal events (events.md §1, §2)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from ..base.codec import (
    ARRAY,
    ENUM,
    OBJECT,
    TYPED,
    U32,
    U32_MAX,
    U64,
    U64_MAX,
    ShapeContext,
    describe,
    from_json,
    join,
    shape_error,
)
from ..base.errors import BadRequest
from ..base.types import member
from .index import TIERS

__all__ = ["KvEvent", "decode_json_events"]

Kind = Literal["stored", "removed", "cleared"]


@attrs.frozen(kw_only=True)
class KvEvent:
    """One decoded event. `worker_id` / `dp_rank` are None when the message leaves them to the
    stream or query; `event_id` is None for engine events (assigned on application)."""

    worker_id: int | None
    dp_rank: int | None
    tier: str
    event_id: int | None
    kind: Kind
    parent_hash: int | None = None
    blocks: tuple[tuple[int, int], ...] = ()  # (engine, local)
    block_hashes: tuple[int, ...] = ()
    namespace: str | None = None  # engine stores: the cache namespace their blocks were hashed with


@attrs.frozen(kw_only=True)
class _StoredBlock:
    block_hash: int = member(U64, required=True, nullable=False)
    tokens_hash: int = member(U64, required=True, nullable=False)


@attrs.frozen(kw_only=True)
class _Stored:
    parent_hash: int | None = member(U64)
    start_position: int | None = member(U32)
    blocks: list[_StoredBlock] = member(ARRAY(OBJECT(_StoredBlock)), required=True, nullable=False)


@attrs.frozen(kw_only=True)
class _Removed:
    block_hashes: list[int] = member(ARRAY(U64), required=True, nullable=False)


_VARIANTS = "one of `stored`, `removed`, `cleared`"


_Blocks = tuple[tuple[int, int], ...]


def _stored_fast(inner: Any) -> tuple[int | None, _Blocks] | None:
    """The usual stored event read without a typed object per block: `parent_hash` a u64 or null,
    `start_position` absent, null or a u32, `blocks` a list of maps whose `block_hash` and
    `tokens_hash` are u64 (other members ignored, as the typed path ignores them). Anything else
    is None, and the typed path then names what is wrong, with the same texts."""
    if type(inner) is not dict:
        return None
    parent = inner.get("parent_hash")
    if parent is not None and (type(parent) is not int or not 0 <= parent <= U64_MAX):
        return None
    start = inner.get("start_position")
    if start is not None and (type(start) is not int or not 0 <= start <= U32_MAX):
        return None
    raw = inner.get("blocks")
    if type(raw) is not list:
        return None
    blocks = []
    for b in raw:
        if type(b) is not dict:
            return None
        engine, local = b.get("block_hash"), b.get("tokens_hash")
        if type(engine) is not int or type(local) is not int or not (
                0 <= engine <= U64_MAX and 0 <= local <= U64_MAX):
            return None
        blocks.append((engine, local))
    return parent, tuple(blocks)


def _decode_data(value: Any, path: str, ctx: ShapeContext) -> tuple[int | None, _Blocks] | _Removed | None:
    """A store as (parent hash, blocks), a `_Removed`, or None for `cleared`."""
    if isinstance(value, str):
        if value == "cleared":
            return None
        raise shape_error(path, f"unknown variant `{value}`, expected {_VARIANTS}")
    if isinstance(value, Mapping) and len(value) == 1:
        (name, inner), = value.items()
        if name == "stored":
            fast = _stored_fast(inner)
            if fast is not None:
                return fast
            typed = from_json(_Stored, inner, join(path, "stored"), ctx)
            return typed.parent_hash, tuple((b.block_hash, b.tokens_hash) for b in typed.blocks)
        if name == "removed":
            return from_json(_Removed, inner, join(path, "removed"), ctx)
        if name == "cleared":
            return None
        raise shape_error(path, f"unknown variant `{name}`, expected {_VARIANTS}")
    raise shape_error(path, f"invalid type: {describe(value)}, expected {_VARIANTS}")


@attrs.frozen(kw_only=True)
class _KvCacheEvent:
    event_id: int = member(U64, required=True, nullable=False)
    dp_rank: int | None = member(U32)


@attrs.frozen(kw_only=True)
class _RouterEvent:
    worker_id: int = member(U64, required=True, nullable=False)
    storage_tier: str = member(ENUM(*TIERS), default="device", nullable=False)


def _head_fast(obj: Any) -> tuple[int, int | None] | None:
    """(event_id, dp_rank) of the usual event read without a typed object: `event_id` a u64,
    `dp_rank` absent, null or a u32. Anything else is None, and the typed path then names what is
    wrong (a WebSocket flood of `cleared` events spent a fifth of its decoding here)."""
    if type(obj) is not dict:
        return None
    event_id, dp_rank = obj.get("event_id"), obj.get("dp_rank")
    if type(event_id) is not int or not 0 <= event_id <= U64_MAX:
        return None
    if dp_rank is not None and (type(dp_rank) is not int or not 0 <= dp_rank <= U32_MAX):
        return None
    return event_id, dp_rank


def _decode_cache_event(obj: Any, path: str, worker_id: int | None, tier: str,
                        ctx: ShapeContext) -> KvEvent:
    head = _head_fast(obj)
    if head is None:
        typed = from_json(_KvCacheEvent, obj, path, ctx)
        head = typed.event_id, typed.dp_rank
    event_id, dp_rank = head
    if "data" not in obj:
        raise shape_error(path, "missing field `data`")
    data = _decode_data(obj["data"], join(path, "data"), ctx)
    if data is None:
        return KvEvent(worker_id=worker_id, dp_rank=dp_rank, tier=tier, event_id=event_id, kind="cleared")
    if isinstance(data, tuple):
        return KvEvent(worker_id=worker_id, dp_rank=dp_rank, tier=tier, event_id=event_id,
                     kind="stored", parent_hash=data[0], blocks=data[1])
    return KvEvent(worker_id=worker_id, dp_rank=dp_rank, tier=tier, event_id=event_id,
                 kind="removed", block_hashes=tuple(data.block_hashes))


def _decode_one(obj: Any, path: str, ctx: ShapeContext) -> KvEvent:
    if isinstance(obj, Mapping) and "event" not in obj and "data" in obj:
        return _decode_cache_event(obj, path, None, "device", ctx)
    head = from_json(_RouterEvent, obj, path, ctx)
    if "event" not in obj:
        raise shape_error(path, "missing field `event`")
    return _decode_cache_event(obj["event"], join(path, "event"), head.worker_id, head.storage_tier, ctx)


def decode_json_events(payload: Any, ctx: ShapeContext = TYPED) -> list[KvEvent]:
    """A §2.3 payload (one RouterEvent, one bare KvCacheEvent, or an array of them)."""
    if isinstance(payload, list):
        return [_decode_one(item, f"[{i}]", ctx) for i, item in enumerate(payload)]
    return [_decode_one(payload, "", ctx)]


def require_worker(event: KvEvent, default: int | None) -> int:
    if event.worker_id is not None:
        return event.worker_id
    if default is None:
        raise BadRequest("worker_id is required for events without worker_id")
    return default
