"""Engine-native KV events: the msgpack `KVEventBatch` that vLLM and SGLang publish (events.md §3, §4).

`decode_batch` checks a whole payload before anything is applied and raises `InvalidBatch` with
the detail text; `convert` turns one decoded event into the internal `KvEvent`s for a key (the router
computes `tokens_hash` itself) or names the reason it is dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Final

import attrs
import msgpack

from ..base.hashing import block_hashes as hash_blocks
from ..base.hashing import iv, multimodal_block_hash, pack_tokens
from .events import KvEvent

__all__ = ["EngineBatch", "EngineEvent", "InvalidBatch", "NamespaceMemory", "convert", "decode_batch"]

U64_MASK: Final = (1 << 64) - 1
SALT_PREFIX: Final = "dynamo-cache-salt:"
TAGS: Final = ("BlockStored", "BlockRemoved", "AllBlocksCleared", "Ignored")
MEDIUM_TIERS: Final = {
    "GPU": "device", "DEVICE": "device",
    "CPU": "host_pinned", "CPU_PINNED": "host_pinned", "CPU_TIER1": "host_pinned",
    "CPU_TIER2": "disk", "DISK": "disk", "NVME": "disk", "STORAGE": "disk",
    "EXTERNAL": "external", "NETWORK": "external", "REMOTE": "external", "SHARED": "external",
}
_STORED_FIELDS: Final = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                         "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                         "kv_cache_spec_sliding_window", "locality", "source_kind")
_REMOVED_FIELDS: Final = ("block_hashes", "medium", "group_idx", "kv_cache_spec_kind",
                          "kv_cache_spec_sliding_window", "locality", "source_kind")
NAMESPACE_MEMORY_LIMIT: Final = 1_000_000
AMBIGUOUS: Final = object()


class InvalidBatch(ValueError):
    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


@attrs.frozen
class EngineEvent:
    """One decoded, type-checked engine event (not yet converted for a key)."""

    tag: str
    block_hashes: tuple[int, ...] = ()
    parent: int | None = None
    tokens: tuple[int, ...] = ()
    eagle: bool = False
    block_size: int = 0
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    locality: str | None = None


@attrs.frozen
class EngineBatch:
    dp_rank: int | None
    events: tuple[EngineEvent, ...]


def _engine_hash(value: Any, where: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, bytes)):
        raise InvalidBatch(f"{where}: {what}")
    if isinstance(value, bytes):
        from ..base.hashing import hash64

        return hash64(value, 0)
    if not -(1 << 63) <= value <= U64_MASK:
        raise InvalidBatch(f"{where}: {what}")
    return value & U64_MASK


def _hashes(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise InvalidBatch(f"{where}: expected an array of integers")
    return tuple(_engine_hash(v, where, "expected an array of integers") for v in value)


def _optional_str(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise InvalidBatch(f"{where}: expected a string or nil")


def _optional_int(value: Any, where: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise InvalidBatch(f"{where}: expected an integer or nil")


def _tokens(value: Any, where: str) -> tuple[tuple[int, ...], bool]:
    what = "expected u32 values or [u32, u32] pairs"
    if not isinstance(value, list):
        raise InvalidBatch(f"{where}: {what}")
    if value and isinstance(value[0], list):
        flat: list[int] = []
        for pair in value:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise InvalidBatch(f"{where}: {what}")
            flat.append(pair[0])
        if value:
            flat.append(value[-1][1])
        tokens, eagle = flat, True
    else:
        tokens, eagle = value, False
    # Checked at C speed (a prompt's thousand ids a batch): msgpack gives ints as `int` exactly,
    # so any other type (a bool, a float, a string) is refused, then the range on the extremes.
    if set(map(type, tokens)) - {int} or (tokens and not (min(tokens) >= 0 and max(tokens) <= 0xFFFFFFFF)):
        raise InvalidBatch(f"{where}: {what}")
    return tuple(tokens), eagle


def _fields(raw: Any, names: Sequence[str], i: int) -> dict[str, Any]:
    if isinstance(raw, list):
        return dict(zip(names, raw[1:], strict=False))
    return {k: raw[k] for k in (*names, "cache_salt") if k in raw}


def _event(raw: Any, i: int) -> EngineEvent:
    where = f"events[{i}]"
    if isinstance(raw, list) and raw:
        tag = raw[0]
    elif isinstance(raw, dict):
        tag = raw.get("type")
    else:
        raise InvalidBatch(f"{where}: expected an array or a map")
    if tag not in TAGS:
        raise InvalidBatch(f"{where}: unknown event tag `{tag}`")
    if tag in ("Ignored", "AllBlocksCleared"):
        return EngineEvent(tag=tag)
    if tag == "BlockRemoved":
        f = _fields(raw, _REMOVED_FIELDS, i)
        if "block_hashes" not in f:
            raise InvalidBatch(f"{where}.block_hashes: expected an array of integers")
        return EngineEvent(tag=tag, block_hashes=_hashes(f["block_hashes"], f"{where}.block_hashes"),
                           medium=_optional_str(f.get("medium"), f"{where}.medium"),
                           group_idx=_optional_int(f.get("group_idx"), f"{where}.group_idx"),
                           locality=_optional_str(f.get("locality"), f"{where}.locality"))
    f = _fields(raw, _STORED_FIELDS, i)
    if "block_hashes" not in f:
        raise InvalidBatch(f"{where}.block_hashes: expected an array of integers")
    if "token_ids" not in f:
        raise InvalidBatch(f"{where}.token_ids: expected u32 values or [u32, u32] pairs")
    block_size = f.get("block_size")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise InvalidBatch(f"{where}.block_size: expected a positive integer")
    parent = f.get("parent_block_hash")
    if parent is not None:
        parent = _engine_hash(parent, f"{where}.parent_block_hash", "expected an integer, bytes or nil")
    tokens, eagle = _tokens(f["token_ids"], f"{where}.token_ids")
    extra = f.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise InvalidBatch(f"{where}.extra_keys: expected an array or nil")
    salt = f.get("cache_salt")
    return EngineEvent(
        tag=tag, block_hashes=_hashes(f["block_hashes"], f"{where}.block_hashes"), parent=parent,
        tokens=tokens, eagle=eagle, block_size=block_size,
        medium=_optional_str(f.get("medium"), f"{where}.medium"),
        lora_name=_optional_str(f.get("lora_name"), f"{where}.lora_name"),
        cache_salt=salt if isinstance(salt, str) and salt else None,
        extra_keys=tuple(extra) if extra is not None else None,
        group_idx=_optional_int(f.get("group_idx"), f"{where}.group_idx"),
        locality=_optional_str(f.get("locality"), f"{where}.locality"))


def decode_batch(payload: bytes) -> EngineBatch:
    """One complete msgpack `KVEventBatch`, checked whole; raises InvalidBatch."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except msgpack.ExtraData:
        raise InvalidBatch("trailing bytes after the batch") from None
    except (ValueError, msgpack.UnpackException, UnicodeDecodeError, TypeError) as exc:
        raise InvalidBatch(f"not one complete msgpack value ({exc or type(exc).__name__})") from None
    if isinstance(batch, dict):
        events = batch.get("events")
        rank = batch.get("data_parallel_rank", batch.get("dp_rank"))
    elif isinstance(batch, list):
        if len(batch) not in (2, 3):
            raise InvalidBatch(f"a batch has 2 or 3 members, not {len(batch)}")
        events = batch[1]
        rank = batch[2] if len(batch) == 3 else None
    else:
        raise InvalidBatch("a batch is an array or a map")
    if not isinstance(events, list):
        raise InvalidBatch("events: expected an array")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= 0xFFFFFFFF):
        raise InvalidBatch("data_parallel_rank: expected a u32 or nil")
    return EngineBatch(rank, tuple(_event(e, i) for i, e in enumerate(events)))


class NamespaceMemory:
    """engine hash -> cache namespace (or AMBIGUOUS) for one rank, oldest forgotten first."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: OrderedDict[int, object] = OrderedDict()

    def get(self, h: int) -> object | None:
        return self.entries.get(h)

    def observe(self, event: KvEvent) -> None:
        """Follow a converted event: a store remembers its blocks' namespace, a remove forgets its
        blocks, a device clear forgets everything."""
        entries = self.entries
        if event.kind == "stored":
            namespace = event.namespace
            for h, _ in event.blocks:
                known = entries.get(h)
                if known is None:
                    if namespace is None:
                        continue
                    entries[h] = namespace
                    if len(entries) > NAMESPACE_MEMORY_LIMIT:
                        entries.popitem(last=False)
                elif known != namespace:
                    entries[h] = AMBIGUOUS
        elif event.kind == "removed":
            for h in event.block_hashes:
                entries.pop(h, None)
        elif event.tier == "device":
            entries.clear()


def _mm_hash(item: Any, lora_name: str | None) -> int | None:
    """One multimodal hash from an `extra_keys` item (events.md §4.6), or None."""
    from ..base.hashing import hash64

    if isinstance(item, str):
        if item == lora_name or item.startswith(SALT_PREFIX):
            return None
        if len(item) == 64 and all(c in "0123456789abcdefABCDEF" for c in item):
            return int(item[:16], 16)
        return None
    if isinstance(item, list) and item and isinstance(item[0], str):
        ident = item[0]
        if len(ident) == 64 and all(c in "0123456789abcdefABCDEF" for c in ident):
            return int(ident[:16], 16)
        return hash64(ident.encode("utf-8"), 0) if ident else None
    return None


def _namespace(event: EngineEvent, memory: NamespaceMemory) -> str | None | object:
    if event.cache_salt:
        return event.cache_salt
    if event.extra_keys:
        first = event.extra_keys[0]
        if isinstance(first, list):
            items = list(first)
            if items and event.lora_name is not None and items[0] == event.lora_name:
                items = items[1:]
            for item in items:
                if isinstance(item, str) and item.startswith(SALT_PREFIX):
                    return item[len(SALT_PREFIX):]
    if event.parent is not None:
        return memory.get(event.parent)
    return None


def convert(event: EngineEvent, block_size: int, memory: NamespaceMemory) -> KvEvent | str:
    """The internal event for a key with `block_size`, or the reason label it is dropped."""
    if event.tag == "Ignored":
        return "ignored"
    if event.locality is not None and event.locality != "LOCAL":
        return "remote_locality"
    if event.group_idx is not None and event.group_idx != 0:
        return "non_main_group"
    tier = MEDIUM_TIERS.get((event.medium or "").strip(), "device")
    if event.tag == "AllBlocksCleared":
        return KvEvent(worker_id=None, dp_rank=None, tier="device", event_id=None, kind="cleared")
    if event.tag == "BlockRemoved":
        return KvEvent(worker_id=None, dp_rank=None, tier=tier, event_id=None, kind="removed",
                     block_hashes=event.block_hashes)
    hashes = event.block_hashes
    if len(set(hashes)) != len(hashes) or (event.parent is not None and event.parent in hashes):
        return "duplicate_hash"
    if event.block_size != block_size:
        return "block_size_mismatch"
    namespace = _namespace(event, memory)
    if namespace is AMBIGUOUS:
        return "ambiguous_namespace"
    assert namespace is None or isinstance(namespace, str)
    lora = event.lora_name or None
    bs = block_size
    width = bs + 1 if event.eagle else bs
    complete = min(len(hashes), max(0, (len(event.tokens) - (width - bs)) // bs) if event.tokens else 0)
    if complete == 0:
        return "no_complete_blocks"
    tokens = event.tokens
    extra = event.extra_keys
    if extra is None or not any(isinstance(e, list) and any(_mm_hash(i, lora) is not None for i in e)
                                for e in extra[:complete]):
        if event.eagle:
            locals_ = hash_blocks(pack_tokens(list(tokens[: (complete * bs) + 1])), bs, lora, namespace,
                                  is_eagle=True)
        else:
            locals_ = hash_blocks(pack_tokens(list(tokens[: complete * bs])), bs, lora, namespace)
    else:
        seed = iv(lora, namespace)
        locals_ = []
        for i in range(complete):
            window = tokens[i * bs: i * bs + width]
            items = extra[i] if i < len(extra) and isinstance(extra[i], list) else []
            mm = [h for h in (_mm_hash(item, lora) for item in items) if h is not None]
            locals_.append(multimodal_block_hash(window, mm, seed))
    blocks = tuple(zip(hashes[:complete], locals_, strict=True))
    return KvEvent(worker_id=None, dp_rank=None, tier=tier, event_id=None, kind="stored",
                 parent_hash=event.parent, blocks=blocks, namespace=namespace)
