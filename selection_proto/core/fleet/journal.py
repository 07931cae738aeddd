"""This replica's own changes for a shared booking ledger (docs/REPLICATION.md): each booking,
prefill completion, output block, free and catalog write becomes a `LedgerOp`, queued in order for
the transport to drain and write, as a connection's `data_to_send` is. `Ledger` (ledger.py) owns
the journal and the mirror that applies other replicas' changes."""

from __future__ import annotations

from collections import deque
from typing import Final, Literal

import attrs

from ..base import jsonio
from ..base.errors import NotReady
from ..base.types import WorkerRequest
from ..bookings.tracker import Booking
from .ledger_wire import (
    ADD,
    DELETED,
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

__all__ = ["LEDGER_DOWN", "OUTBOX_FULL", "Journal", "LedgerOp", "LedgerSettings", "booked_again", "may_be_booked"]

LEDGER_DOWN: Final = "ledger unavailable"
OUTBOX_FULL: Final = "ledger outbox full"
RECENT_ENDS: Final = 65_536  # ended bookings a replica remembers (the ledger keeps as many)
STRICT_TRIES: Final = 3  # conflicts a strict booking may take at least, however few ranks its pool has


def may_be_booked(rid: str) -> str:
    """Why a free of an id this replica does not hold is not answered while the ledger is away."""
    return f"{LEDGER_DOWN}: reservation {rid} may be booked on another replica"


def booked_again(rid: str) -> str:
    """Why a booking of an id used again is refused while the ledger is away."""
    return f"{LEDGER_DOWN}: reservation {rid} was booked lately; book it again once the ledger is back"


@attrs.frozen(kw_only=True)
class LedgerSettings:
    admission: Literal["advisory", "strict"] = "advisory"
    failure: Literal["open", "closed"] = "open"
    outbox_max: int = 100_000  # own changes queued while the ledger is away, at most
    # A free of an id no replica has written yet waits this long for the booking to reach the
    # ledger: a client may free on one replica right after another answered its booking.
    free_grace_secs: float = 2.0


class LedgerOp:
    """One change for the ledger. `count`: for a strict booking, how many bookings this replica
    had seen made on the rank (the ledger refuses the add if there are more); for output blocks,
    how many this replica has reported for the booking; for a worker, 1 when it is a seed.
    `view`: for a booking, the last feed
    entry this replica had applied when it made it (an early free fenced after it may refuse it;
    one fenced before it cannot). `owner`: for prefill and progress, the replica that made the
    booking (a free names it in its body): an op never touches another booking of the same id.
    `hold`: the ticket whose answer waits. `again`: a booking of an id used again (answered once
    the ledger has it)."""

    __slots__ = ("kind", "ident", "body", "rank_key", "count", "view", "owner", "hold", "again")

    def __init__(self, kind: str, ident: str, body: bytes = b"", rank_key: bytes = b"",
                 count: int | None = None, view: int = 0, owner: bytes = b"", again: bool = False) -> None:
        self.kind = kind
        self.ident = ident
        self.body = body
        self.rank_key = rank_key
        self.count = count
        self.view = view
        self.owner = owner
        self.again = again
        self.hold: int | None = None


class Journal:
    """This replica's changes, in the order made. Muted while the mirror applies others' changes."""

    __slots__ = ("ops", "settings", "origin", "connected", "muted", "adds", "own", "sync", "in_request", "tries",
                 "through", "seen", "ended")

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
        self.seen = 0  # the last feed entry the mirror applied
        # Ids whose booking ended lately (freed or expired), newest last -> the feed position of
        # the end (0 while this replica's own free is still on its way): a free of one of them
        # is a retry and answers 404, as in one process.
        self.ended: dict[str, int] = {}

    def check_booking(self, rid: str, again: bool = False) -> None:
        """Refuse a booking the ledger cannot take (closed mode while away, or a full outbox), and
        while away one of an id used again (`again`: another replica's booking of it is held
        here; or its end was seen lately). Answered at once, its booking would reach the ledger
        after the reconnect, maybe after a free of it sent to another replica after that answer:
        the ledger would find the id ended, answer that free 404 and keep the booking."""
        if not self.connected and self.settings.failure == "closed":
            raise NotReady(LEDGER_DOWN)
        if not self.connected and (again or rid in self.ended):
            raise NotReady(booked_again(rid))
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

    def booked(self, key: Key, booking: Booking, ranks: int = 0) -> None:
        """`ranks`: how many ranks the booking's pool has. A strict booking that conflicted is
        selected again on the view the feed brought, as a strict one while it has conflicted
        fewer times than that (at least `STRICT_TRIES`), then booked advisory: a burst selected
        on one view spreads one booking a rank each round, so that by then it has had every
        rank's chance (docs/REPLICATION.md, "Strict admission")."""
        rank = booking.rank
        record = AddRecord(key[0], key[1], rank[0], rank[1], booking.prefill_tokens,
                           booking.expected_output_tokens, booking.blocks)
        rk = rank_key(key[0], key[1], rank[0], rank[1])
        strict = (self.settings.admission == "strict" and self.connected and self.in_request
                  and self.tries < max(STRICT_TRIES, ranks))
        seen = self.adds.get(rk, 0) + len(self.own.get(rk, ())) if strict else None
        # An id used again after its booking ended is answered once the ledger has the booking:
        # a free of it sent after that answer, to any replica, then finds it there (not `gone`).
        reused = self.ended.pop(booking.rid, None) is not None and self.connected
        self._push(LedgerOp(ADD, booking.rid, encode_add(record), rk, seen, self.seen, again=reused),
                   sync=strict or reused)

    def prefilled(self, booking: Booking) -> None:
        self._push(LedgerOp(PREFILL, booking.rid, owner=self._owner(booking)))

    def _owner(self, booking: Booking) -> bytes:
        return (booking.owner or self.origin).encode()

    def progressed(self, booking: Booking, decay_fraction: float | None, again: bool = False) -> None:
        """One more output block reported here (`again`: the count so far, once more). Each
        replica's count is absolute and the ledger keeps them apart: two replicas reporting
        blocks of one booking at once add up, and a repeated report changes nothing."""
        counts = booking.outputs_by if booking.outputs_by is not None else {}
        booking.outputs_by = counts
        if not again:
            counts[self.origin] = counts.get(self.origin, 0) + 1
        count = counts.get(self.origin, 0)
        self._push(LedgerOp(PROGRESS, booking.rid, encode_progress(count, decay_fraction), count=count,
                            owner=self._owner(booking)))

    def freed(self, booking: Booking) -> None:
        """A free names the booking's replica: the ledger ignores it for another booking that
        reuses the id meanwhile (the free was on its way while that one was made). Its answer
        waits for the ledger's word: another replica may have freed the booking a moment ago,
        unseen here yet (a client's retry), and then it answers 404 as one process would."""
        self.end(booking.rid, 0)
        self._push(LedgerOp(FREE, booking.rid, self._owner(booking)), sync=self.connected)

    def end(self, rid: str, n: int) -> None:
        """The booking `rid` ended at feed position `n` (0: here, not yet in the feed)."""
        ended = self.ended
        ended[rid] = max(n, ended.pop(rid, 0))
        if len(ended) > RECENT_ENDS:
            del ended[next(iter(ended))]

    def free_unknown(self, rid: str) -> None:
        """A free of an id this replica does not hold: written through, and the ledger decides by
        its order. It frees the booking it holds (200); or the id's booking has ended (a retry:
        404 at once); or it has never seen the id, whose booking may still be on its way from
        another replica's journal: it remembers the free, which refuses that booking (200), or
        answers 404 after the grace."""
        if not self.connected:  # another replica may hold it: "not found" would be a guess
            raise NotReady(may_be_booked(rid))
        self.through.add(rid)
        self._push(LedgerOp(FREE, rid), sync=True)

    def worker(self, req: WorkerRequest, seed: bool = False) -> None:
        """`seed`: a record the ledger lacks, given back (a reset, a snapshot without it); the
        ledger takes it only if no replica has written the worker since."""
        self._push(LedgerOp(WORKER, str(req.worker_id), jsonio.dumps(req.to_json()), count=1 if seed else None))

    def worker_deleted(self, req: WorkerRequest, seed: bool = False) -> None:
        """The record stays in the ledger as it stays here, a tombstone: every catalog lists it."""
        self._push(LedgerOp(WORKER, str(req.worker_id), DELETED + jsonio.dumps(req.to_json()),
                            count=1 if seed else None))

    def take(self, limit: int) -> list[LedgerOp]:
        """Up to `limit` ops, oldest first, for one write; `requeue` them if it fails."""
        ops = self.ops
        return [ops.popleft() for _ in range(min(limit, len(ops)))]

    def requeue(self, ops: list[LedgerOp]) -> None:
        self.ops.extendleft(reversed(ops))
