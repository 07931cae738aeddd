"""This replica's own changes for a shared booking ledger (docs/REPLICATION.md): each booking,
prefill completion, output block, free and catalog write becomes a `LedgerOp`, queued in order for
the transport to drain and write, as a connection's `data_to_send` is. `Ledger` (ledger.py) owns
the journal and the mirror that applies other replicas' changes."""

from __future__ import annotations

from collections import deque
from typing import Final, Literal

import attrs

from . import jsonio
from .errors import NotReady
from .ledger_wire import (
    ADD,
    FREE,
    PREFILL,
    PROGRESS,
    WORKER,
    AddRecord,
    encode_add,
    encode_progress,
    rank_key,
)
from .pool import Key
from .tracker import Booking
from .types import WorkerRequest

__all__ = ["LEDGER_DOWN", "OUTBOX_FULL", "Journal", "LedgerOp", "LedgerSettings"]

LEDGER_DOWN: Final = "ledger unavailable"
OUTBOX_FULL: Final = "ledger outbox full"


@attrs.frozen(kw_only=True)
class LedgerSettings:
    admission: Literal["advisory", "strict"] = "advisory"
    failure: Literal["open", "closed"] = "open"
    outbox_max: int = 100_000  # own changes queued while the ledger is away, at most
    strict_tries: int = 3  # strict bookings retried after a conflict; then booked advisory
    # A free of an id no replica has written yet waits this long for the booking to reach the
    # ledger: a client may free on one replica right after another answered its booking.
    free_grace_secs: float = 2.0


class LedgerOp:
    """One change for the ledger. `count`: for a strict booking, how many bookings this replica
    had seen made on the rank (the ledger refuses the add if there are more); for output blocks,
    how many this replica has reported for the booking. `hold`: the ticket whose answer waits."""

    __slots__ = ("kind", "ident", "body", "rank_key", "count", "hold")

    def __init__(self, kind: str, ident: str, body: bytes = b"", rank_key: bytes = b"",
                 count: int | None = None) -> None:
        self.kind = kind
        self.ident = ident
        self.body = body
        self.rank_key = rank_key
        self.count = count
        self.hold: int | None = None


class Journal:
    """This replica's changes, in the order made. Muted while the mirror applies others' changes."""

    __slots__ = ("ops", "settings", "origin", "connected", "muted", "adds", "own", "sync", "in_request", "tries",
                 "through")

    def __init__(self, settings: LedgerSettings, origin: str) -> None:
        self.ops: deque[LedgerOp] = deque()
        self.settings = settings
        self.origin = origin
        self.connected = False
        self.muted = False
        self.adds: dict[bytes, int] = {}  # rank key -> bookings ever made on it, as the feed told
        self.own: dict[bytes, set[int]] = {}  # rank key -> own confirmed adds the feed has not shown
        self.sync: list[LedgerOp] = []  # ops the request being answered waits for
        self.in_request = False
        self.tries = 0  # of the strict booking being retried
        self.through: set[str] = set()  # ids freed by `free_unknown`: their feed entry applies here too

    def check_booking(self) -> None:
        """Refuse a booking the ledger cannot take (closed mode while away, or a full outbox)."""
        if not self.connected and self.settings.failure == "closed":
            raise NotReady(LEDGER_DOWN)
        if len(self.ops) >= self.settings.outbox_max:
            raise NotReady(OUTBOX_FULL)

    def check_catalog_write(self) -> None:
        """Catalog writes need the ledger: a catalog changed on one replica alone would diverge."""
        # Muted outside a request: the mirror applying the ledger's own catalog, or a warm start.
        if not self.connected and (self.in_request or not self.muted):
            raise NotReady(f"{LEDGER_DOWN}: catalog writes need the ledger")

    def _push(self, op: LedgerOp, sync: bool = False) -> None:
        if self.muted:
            return
        self.ops.append(op)
        if sync and self.in_request:
            self.sync.append(op)

    def booked(self, key: Key, booking: Booking) -> None:
        rank = booking.rank
        record = AddRecord(key[0], key[1], rank[0], rank[1], booking.prefill_tokens,
                           booking.expected_output_tokens, booking.blocks)
        rk = rank_key(key[0], key[1], rank[0], rank[1])
        strict = (self.settings.admission == "strict" and self.connected and self.in_request
                  and self.tries < self.settings.strict_tries)
        seen = self.adds.get(rk, 0) + len(self.own.get(rk, ())) if strict else None
        self._push(LedgerOp(ADD, booking.rid, encode_add(record), rk, seen), sync=strict)

    def prefilled(self, booking: Booking) -> None:
        self._push(LedgerOp(PREFILL, booking.rid))

    def progressed(self, booking: Booking, decay_fraction: float | None, again: bool = False) -> None:
        """One more output block reported here (`again`: the count so far, once more). Each
        replica's count is absolute and the ledger keeps them apart: two replicas reporting
        blocks of one booking at once add up, and a repeated report changes nothing."""
        counts = booking.outputs_by if booking.outputs_by is not None else {}
        booking.outputs_by = counts
        if not again:
            counts[self.origin] = counts.get(self.origin, 0) + 1
        count = counts.get(self.origin, 0)
        self._push(LedgerOp(PROGRESS, booking.rid, encode_progress(count, decay_fraction), count=count))

    def freed(self, booking: Booking) -> None:
        """A free names the booking's replica: the ledger ignores it for another booking that
        reuses the id meanwhile (the free was on its way while that one was made)."""
        self._push(LedgerOp(FREE, booking.rid, (booking.owner or self.origin).encode()))

    def free_unknown(self, rid: str) -> None:
        """A free of an id this replica has not seen: its booking may still be on its way from
        another replica. Written through: the ledger frees it, or remembers the free."""
        if not self.connected:  # another replica may hold it: "not found" would be a guess
            raise NotReady(f"{LEDGER_DOWN}: reservation {rid} may be booked on another replica")
        self.through.add(rid)
        self._push(LedgerOp(FREE, rid), sync=True)

    def worker(self, req: WorkerRequest) -> None:
        self._push(LedgerOp(WORKER, str(req.worker_id), jsonio.dumps(req.to_json())))

    def worker_deleted(self, worker_id: int) -> None:
        self._push(LedgerOp(WORKER, str(worker_id)))

    def take(self, limit: int) -> list[LedgerOp]:
        """Up to `limit` ops, oldest first, for one write; `requeue` them if it fails."""
        ops = self.ops
        return [ops.popleft() for _ in range(min(limit, len(ops)))]

    def requeue(self, ops: list[LedgerOp]) -> None:
        self.ops.extendleft(reversed(ops))
