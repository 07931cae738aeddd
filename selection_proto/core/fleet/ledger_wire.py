"""The booking ledger's wire (docs/REPLICATION.md §3): how a replica's changes are written as script
arguments, and how the ledger's feed entries, script replies and snapshots are read back.

Pure functions over bytes and the shapes a Redis client returns (lists, bytes, ints). Every reader
checks what it is given and raises `LedgerWireError` for anything else: a feed is shared with every
replica, and with anyone who can write to its keys."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Final, NamedTuple

import msgpack

from ..base import jsonio

__all__ = ["ADD", "DELETED", "EXPIRE", "FREE", "KINDS", "PREFILL", "PROGRESS", "TOMB", "WORKER", "AddRecord", "FeedEntry",
           "LedgerSnapshot", "LedgerWireError", "Reply", "decode_add", "decode_counts", "decode_entry", "decode_progress",
           "decode_replies", "decode_snapshot", "encode_add", "entry_number", "encode_progress", "rank_key"]

ADD: Final = "add"
PREFILL: Final = "prefill"
PROGRESS: Final = "progress"
FREE: Final = "free"
EXPIRE: Final = "expire"  # written only by the ledger's reaper
# A catalog record (JSON); "-" and the record for a deletion (the record stays as a tombstone);
# empty for a deletion whose record is unknown (written by earlier versions).
WORKER: Final = "worker"
# A free of an id the ledger does not hold: its position fences the bookings it may refuse.
TOMB: Final = "tomb"
KINDS: Final = frozenset((ADD, PREFILL, PROGRESS, FREE, EXPIRE, WORKER, TOMB))
# Replies of the batch script, one per op (a number follows "ok", "conflict" and "tombstoned").
REPLIES: Final = frozenset(("ok", "dup", "freed", "tombstoned", "missing", "conflict", "stale", "gone", "queued"))
DELETED: Final = b"-"  # the prefix of a deleted worker's record in the ledger
MAX_ID_BYTES: Final = 4096
_U64: Final = (1 << 64) - 1


class LedgerWireError(ValueError):
    """A feed entry, reply or snapshot that is not what this version writes."""


class AddRecord(NamedTuple):
    """A booking as the ledger holds it."""

    model_name: str
    tenant_id: str
    worker_id: int
    dp_rank: int
    prefill_tokens: int
    expected_output_tokens: int | None
    blocks: list[int] | None  # its sequence hashes (u64), None when blocks are not tracked


class FeedEntry(NamedTuple):
    entry_id: bytes  # the stream's own id, where a reader resumes
    n: int  # the ledger's sequence number: contiguous, so a jump is a gap
    origin: str
    kind: str
    ident: str  # reservation id, or worker id for WORKER
    body: bytes
    owner: str = ""  # the replica whose booking the entry is about (an id is booked again elsewhere)


class Reply(NamedTuple):
    word: str  # one of REPLIES
    n: int  # the entry's sequence number after "ok" and "tombstoned"; the ledger's after "conflict"; else 0


class LedgerSnapshot(NamedTuple):
    epoch: str
    n: int
    cursor: bytes  # the last entry's id when the snapshot was taken
    bookings: dict[str, bytes]  # rid -> encoded AddRecord
    prefilled: set[str]
    progress: dict[str, bytes]  # rid -> output blocks per replica that reported them (JSON)
    adds: dict[bytes, int]  # rank key -> adds ever made on it
    workers: dict[str, bytes]  # worker id -> record JSON, DELETED + record JSON, or b"" (deleted)
    owners: dict[str, str]  # rid -> the replica that made the booking
    waiting: dict[str, str]  # rid -> the replica whose booking of it waits for the current one to end
    ended: dict[str, int] = {}  # rid -> where its booking ended, for the ends after the reader's place


def rank_key(model_name: str, tenant_id: str, worker_id: int, dp_rank: int) -> bytes:
    """A rank's name in the ledger: unambiguous whatever characters the names hold."""
    return msgpack.packb((model_name, tenant_id, worker_id, dp_rank))  # type: ignore[no-any-return]


def encode_add(record: AddRecord) -> bytes:
    blocks = None if record.blocks is None else array("Q", record.blocks).tobytes()
    return msgpack.packb((*record[:6], blocks))  # type: ignore[no-any-return]


def _unpack(body: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, use_list=True, max_bin_len=1 << 26, max_array_len=16)
    except (ValueError, msgpack.UnpackException, UnicodeDecodeError, TypeError):
        raise LedgerWireError(f"{what}: not one msgpack value") from None


def _is_int(v: Any, low: int, high: int) -> bool:
    return type(v) is int and low <= v <= high


def decode_add(body: bytes) -> AddRecord:
    v = _unpack(body, "add")
    if not (isinstance(v, list) and len(v) == 7 and isinstance(v[0], str) and isinstance(v[1], str)
            and _is_int(v[2], 0, _U64) and _is_int(v[3], 0, 0xFFFFFFFF) and _is_int(v[4], 0, _U64)
            and (v[5] is None or _is_int(v[5], 0, _U64))
            and (v[6] is None or (isinstance(v[6], bytes) and len(v[6]) % 8 == 0))):
        raise LedgerWireError("add: expected [model, tenant, worker, rank, prefill, output, blocks]")
    blocks = None if v[6] is None else array("Q", v[6]).tolist()
    return AddRecord(v[0], v[1], v[2], v[3], v[4], v[5], blocks)


def encode_progress(outputs: int, decay_fraction: float | None) -> bytes:
    return msgpack.packb((outputs, decay_fraction))  # type: ignore[no-any-return]


def decode_progress(body: bytes) -> tuple[int, float | None]:
    v = _unpack(body, "progress")
    if not (isinstance(v, list) and len(v) == 2 and _is_int(v[0], 1, _U64)
            and (v[1] is None or (type(v[1]) is float and 0.0 <= v[1] <= 1.0))):
        raise LedgerWireError("progress: expected [outputs >= 1, decay fraction or nil]")
    return v[0], v[1]


def decode_counts(body: bytes) -> dict[str, int]:
    """A booking's output blocks in a snapshot: a JSON object, replica -> blocks it reported."""
    try:
        value = jsonio.loads(body)
    except jsonio.JSONSyntaxError:
        raise LedgerWireError("out: not JSON") from None
    if not isinstance(value, dict) or not all(_is_int(v, 0, _U64) for v in value.values()):
        raise LedgerWireError("out: expected an object of counts")
    return value


def _text(value: Any, what: str) -> str:
    if not isinstance(value, bytes) or len(value) > MAX_ID_BYTES:
        raise LedgerWireError(f"{what}: expected a short byte string")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise LedgerWireError(f"{what}: not UTF-8") from None


def _count(value: Any, what: str) -> int:
    if isinstance(value, bytes) and 0 < len(value) <= 20 and value.isdigit():
        number = int(value)
        if number <= _U64:
            return number
    if _is_int(value, 0, _U64):
        return int(value)
    raise LedgerWireError(f"{what}: expected a count")


def entry_number(entry_id: Any, fields: Any) -> int:
    """A feed entry's sequence number, read before the rest: an entry whose body does not read
    still takes its place in the order."""
    if not isinstance(entry_id, bytes) or not isinstance(fields, dict):
        raise LedgerWireError("entry: expected an id and a map of fields")
    return _count(fields.get(b"n"), "entry.n")


def decode_entry(entry_id: Any, fields: Any) -> FeedEntry:
    """One feed entry as `XREAD` returns it: its id and a map of its fields."""
    n = entry_number(entry_id, fields)
    kind = _text(fields.get(b"k"), "entry.k")
    if kind not in KINDS:
        raise LedgerWireError(f"entry.k: unknown kind {kind[:40]!r}")
    body = fields.get(b"b")
    if not isinstance(body, bytes):
        raise LedgerWireError("entry.b: expected bytes")
    whose = fields.get(b"w", b"")
    return FeedEntry(entry_id, n, _text(fields.get(b"o"), "entry.o"), kind,
                     _text(fields.get(b"i"), "entry.i"), body, _text(whose, "entry.w"))


def decode_replies(raw: Any, count: int) -> list[Reply] | None:
    """The batch script's answer for `count` ops; None when the ledger's epoch is not ours (it was
    reset: see `Ledger.reseed`)."""
    if isinstance(raw, list) and len(raw) == 1 and raw[0] == b"epoch":
        return None
    if not isinstance(raw, list) or len(raw) != count:
        raise LedgerWireError(f"replies: expected {count}")
    replies = []
    for item in raw:
        word, _, number = _text(item, "reply").partition(" ")
        if word not in REPLIES:
            raise LedgerWireError(f"reply: unknown word {word[:40]!r}")
        replies.append(Reply(word, _count(number.encode(), "reply.n") if number else 0))
    return replies


def _pairs(raw: Any, what: str) -> dict[bytes, bytes]:
    if not isinstance(raw, list) or len(raw) % 2 or not all(isinstance(v, bytes) for v in raw):
        raise LedgerWireError(f"snapshot.{what}: expected field, value pairs")
    return dict(zip(raw[::2], raw[1::2], strict=True))


def decode_snapshot(raw: Any) -> LedgerSnapshot:
    """The snapshot script's answer: epoch, seq, last entry id, then the hashes."""
    if not isinstance(raw, list) or len(raw) != 11:
        raise LedgerWireError("snapshot: expected 11 parts")
    epoch = _text(raw[0], "snapshot.epoch")
    n = 0 if raw[1] is None else _count(raw[1], "snapshot.seq")
    cursor = b"0-0" if raw[2] is None else raw[2]
    if not isinstance(cursor, bytes):
        raise LedgerWireError("snapshot.last: expected an entry id")
    parts: Sequence[dict[bytes, bytes]] = [_pairs(part, name) for part, name in zip(
        raw[3:], ("res", "pre", "out", "adds", "workers", "owner", "wait", "gone"), strict=True)]
    res, pre, out, adds, workers, owners, waiting, gone = parts
    return LedgerSnapshot(
        epoch, n, cursor,
        {_text(k, "snapshot.res"): v for k, v in res.items()},
        {_text(k, "snapshot.pre") for k in pre},
        {_text(k, "snapshot.out"): v for k, v in out.items()},
        {k: _count(v, "snapshot.adds") for k, v in adds.items()},
        {_text(k, "snapshot.workers"): v for k, v in workers.items()},
        {_text(k, "snapshot.owner"): _text(v, "snapshot.owner") for k, v in owners.items()},
        {_text(k, "snapshot.wait"): _text(v, "snapshot.wait") for k, v in waiting.items()},
        {_text(k, "snapshot.gone"): _count(v, "snapshot.gone") for k, v in gone.items()})
