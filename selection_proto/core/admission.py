"""The admission queue (core.md §10): selections that found every candidate busy wait here, per
key, in run order, until a rank frees up, their time runs out, or the service stops.

How a ticket ends, once (the label is the `selection_proto_queue_events_total` event):

| outcome | when | the client gets |
|---|---|---|
| `dispatched` | a candidate stopped being busy (a free, a prefill completion, a join, an update, a tick) | its selection |
| `failed` | its selection failed when run, or the key lost its last worker | that error |
| `timed_out` | it waited `queue_timeout_secs` | 503 |
| `shutdown` | the service began shutting down | 503 |
| `cancelled` | its client went away | nothing |

A full queue refuses at the door (`rejected_full`, 429) and issues no ticket."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Final

from .prompt import PromptHashes
from .types import SelectRequest

__all__ = ["OUTCOMES", "AdmissionQueue", "QueuedSelection", "Tickets", "order_key"]

OUTCOMES: Final = ("dispatched", "failed", "timed_out", "shutdown", "cancelled")


class QueuedSelection:
    """One waiting selection: its ticket, its place, and what it needs to run later."""

    __slots__ = ("ticket", "order", "req", "rid", "prompt", "enqueued_at")

    def __init__(self, ticket: int, order: float, req: SelectRequest, rid: str | None,
                 prompt: PromptHashes, enqueued_at: float) -> None:
        self.ticket = ticket
        self.order = order
        self.req = req
        self.rid = rid
        self.prompt = prompt
        self.enqueued_at = enqueued_at


def order_key(policy: str, jump: float, age: float, isl: int, cached: int) -> float:
    """Higher runs first (core.md §10.3): arrival order (`fcfs`), newest first (`lcfs`), or the
    shortest uncached work first (`wspt`); `priority_jump` lifts a request."""
    if policy == "fcfs":
        return jump - age
    if policy == "lcfs":
        return jump + age
    return (1 + jump) / max(1, max(0, isl - cached))


def _run_order(entry: QueuedSelection) -> tuple[float, int]:
    # Tickets grow with arrival, so equal orders run in arrival order.
    return (-entry.order, entry.ticket)


class AdmissionQueue:
    """One key's waiting selections, kept in run order."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: list[QueuedSelection] = []

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[QueuedSelection]:
        """In run order, over a copy: the caller may remove entries while it walks."""
        return iter(list(self._entries))

    def push(self, entry: QueuedSelection) -> None:
        bisect.insort(self._entries, entry, key=_run_order)

    def remove(self, entry: QueuedSelection) -> bool:
        """Take `entry` out; False when it was not waiting any more."""
        if entry in self._entries:
            self._entries.remove(entry)
            return True
        return False

    def find(self, ticket: int) -> QueuedSelection | None:
        return next((e for e in self._entries if e.ticket == ticket), None)

    def take_all(self) -> list[QueuedSelection]:
        entries, self._entries = self._entries, []
        return entries

    def late(self, now: float, timeout: float) -> list[QueuedSelection]:
        """The entries that have waited `timeout` seconds, in run order (still queued)."""
        return [e for e in self._entries if now - e.enqueued_at >= timeout]

    def oldest(self) -> float | None:
        """When the longest-waiting entry arrived."""
        return min((e.enqueued_at for e in self._entries), default=None)


class Tickets:
    """Every pending ticket: numbers are global (a `Pending` names one), so they are issued here,
    with the key whose queue holds the selection (None for a request applied in steps)."""

    __slots__ = ("_next", "_keys")

    def __init__(self) -> None:
        self._next = 1
        self._keys: dict[int, tuple[str, str]] = {}

    def issue(self, key: tuple[str, str] | None) -> int:
        ticket = self._next
        self._next += 1
        if key is not None:
            self._keys[ticket] = key
        return ticket

    def end(self, ticket: int) -> tuple[str, str] | None:
        """The ticket ended (or was cancelled): the key that held it, if it was pending."""
        return self._keys.pop(ticket, None)
