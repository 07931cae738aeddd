"""The booking ledger of simulated replicas (docs/ROUTING.md, "Replicas"): what the Valkey/Redis
scripts of docs/REPLICATION.md do with a replica's journal, in process. It takes the `LedgerOp`s a
replica's journal gives (`Journal.take`), answers each with the `Reply` the batch script would,
and appends the accepted changes to one feed, as the `XREAD` entries every replica's `Ledger.apply`
reads. The replicas' cores are the real ones; only the server is modelled.

It models what a simulated fleet does: ids unique, each booking freed by the replica that made it,
advisory or strict admission (a strict booking names how many bookings its replica had seen on the
rank; any more and it is refused, `conflict`), no leases (every booking is freed). Early frees,
waiting bookings and the reaper are the real ledger's; an op that would need them raises
`UnmodelledOp` rather than answer wrongly."""

from __future__ import annotations

from ..core.fleet.journal import LedgerOp
from ..core.fleet.ledger_wire import ADD, FREE, PREFILL, PROGRESS, WORKER, Reply

__all__ = ["FeedLedger", "UnmodelledOp"]

Entry = tuple[bytes, dict[bytes, bytes]]


class UnmodelledOp(RuntimeError):
    """An op the simulated ledger does not model (an early free, an id reused)."""


class FeedLedger:
    """One ledger: who made each live booking, the feed's sequence number."""

    def __init__(self) -> None:
        self.seq = 0  # the last entry's number
        self.owner: dict[str, str] = {}  # reservation id -> the replica that booked it
        self.gone: set[str] = set()  # ids whose booking ended (a retried free answers `gone`)
        self.workers: set[str] = set()  # worker ids written
        self.adds: dict[bytes, int] = {}  # rank key -> bookings ever made on it (strict admission's check)

    def _emit(self, out: list[Entry], origin: str, kind: str, ident: str, body: bytes, whose: str) -> int:
        self.seq += 1
        out.append((f"{self.seq}-0".encode(), {b"n": str(self.seq).encode(), b"o": origin.encode(),
                                                b"k": kind.encode(), b"i": ident.encode(), b"b": body,
                                                b"w": whose.encode()}))
        return self.seq

    def write(self, origin: str, ops: list[LedgerOp]) -> tuple[list[Reply], list[Entry]]:
        """One batch of `origin`'s journal: the replies, in the ops' order, and the feed entries it
        appended (for every replica, `origin` included: its mirror skips its own echoes)."""
        replies: list[Reply] = []
        entries: list[Entry] = []
        for op in ops:
            replies.append(self._one(origin, op, entries))
        return replies, entries

    def _one(self, origin: str, op: LedgerOp, out: list[Entry]) -> Reply:
        kind, ident = op.kind, op.ident
        owner = self.owner.get(ident)
        if kind == ADD:
            if owner == origin:
                return Reply("ok", 0)  # a retried write
            if owner is not None or ident in self.gone:
                raise UnmodelledOp(f"reservation {ident} booked again")
            if op.count is not None and self.adds.get(op.rank_key, 0) != op.count:
                return Reply("conflict", self.seq)  # select again once the feed has reached here
            self.adds[op.rank_key] = self.adds.get(op.rank_key, 0) + 1
            self.owner[ident] = origin
            return Reply("ok", self._emit(out, origin, ADD, ident, op.body, origin))
        if kind in (PREFILL, PROGRESS):
            whose = op.rank_key.decode() or op.owner.decode()  # the transport's fourth argument
            if owner is None:
                return Reply("missing", 0)
            if whose and owner != whose:
                return Reply("stale", 0)
            return Reply("ok", self._emit(out, origin, kind, ident, op.body if kind == PROGRESS else b"", owner))
        if kind == FREE:
            named = op.body.decode()  # the booking's replica; empty for a written-through free
            if named and owner is not None and owner != named:
                return Reply("stale", 0)
            if owner is not None:
                del self.owner[ident]
                self.gone.add(ident)
                return Reply("ok", self._emit(out, origin, FREE, ident, b"", owner))
            if named or ident in self.gone:
                return Reply("gone", 0)
            raise UnmodelledOp(f"an early free of {ident}")
        if kind == WORKER:
            if op.count is not None and ident in self.workers:
                return Reply("ok", 0)  # a seed never overwrites a newer write
            self.workers.add(ident)
            return Reply("ok", self._emit(out, origin, WORKER, ident, op.body, ""))
        raise UnmodelledOp(f"op {kind}")
