"""The admission queue (core.md §10, docs/FLOW_CONTROL.md): selections that found every candidate
busy wait here, per key, until a rank frees up, their time runs out, or the service stops; and
which of them runs next.

Which runs next: the highest priority tier first (a request climbs one tier for every
`priority_promote_secs` it has waited, so no tier starves for ever); within a tier the policy
classes share by weight in uncached tokens, and within a class the fairness IDs share equally, both
kept by virtual time (start-time fair queuing: deficit round robin's shares without its rounds, so
one arbitration costs the same whatever a head's size); within a fairness ID, the queue policy
(fcfs, lcfs, wspt, lifted by `priority_jump`). A request whose candidates are all busy is passed
over for now: it holds back no one, in its lane or another.

How a ticket ends, once (the label is the `selection_proto_queue_events_total` event):

| outcome | when | the client gets |
|---|---|---|
| `dispatched` | a candidate stopped being busy (a free, a prefill completion, a join, an update, a tick) | its selection |
| `failed` | its selection failed when run, or the key lost its last worker | that error |
| `timed_out` | it waited its class's (or the service's) queue timeout | 503 |
| `deadline` | its `deadline_ms` passed while it waited | 429 (`overload_status_code`), `Retry-After` |
| `shed` | the key's queue was full and a fairness ID within its share arrived: it was the newest request of the fairness ID holding the most | 429 (`overload_status_code`), `Retry-After` |
| `shutdown` | the service began shutting down | 503 |
| `cancelled` | its client went away | nothing |

Refusals at the door issue no ticket (queueing.py): a full queue or lane, `do_not_queue`, a
sheddable request, a deadline that cannot be met."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Mapping, Set
from typing import Final, NamedTuple

from ..base.types import SelectRequest
from ..bookings.prompt import PromptHashes

__all__ = ["OUTCOMES", "FlowQueue", "Lane", "QueuedSelection", "Tickets", "order_key"]

OUTCOMES: Final = ("dispatched", "failed", "timed_out", "deadline", "shed", "shutdown", "cancelled")

class Lane(NamedTuple):
    """Where a waiting request stands: its tier (`priority`), its class, its fairness ID."""

    tier: int
    policy_class: str
    fairness_id: str


class QueuedSelection:
    """One waiting selection: its ticket, lane and place, what its work costs (uncached tokens),
    when it expires, and what it needs to run later."""

    __slots__ = ("ticket", "order", "req", "rid", "prompt", "enqueued_at", "lane", "cost", "expires_at",
                 "deadline_at")

    def __init__(self, ticket: int, order: float, req: SelectRequest, rid: str | None,
                 prompt: PromptHashes, enqueued_at: float, lane: Lane, cost: int, expires_at: float,
                 deadline_at: float) -> None:
        self.ticket = ticket
        self.order = order
        self.req = req
        self.rid = rid
        self.prompt = prompt
        self.enqueued_at = enqueued_at
        self.lane = lane
        self.cost = cost
        self.expires_at = expires_at  # the smaller of the class's timeout and the client's deadline
        self.deadline_at = deadline_at


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


class _Flow:
    """One fairness ID's waiting requests in a class, in run order, their uncached tokens, and its
    virtual time."""

    __slots__ = ("entries", "tokens", "vtime")

    def __init__(self, vtime: float) -> None:
        self.entries: list[QueuedSelection] = []
        self.tokens = 0
        self.vtime = vtime


class _Class:
    """One class of one tier: its flows, its virtual time, its flows' clock (the virtual time of
    the flow it served last, the highest with a burst allowance: where a flow that starts waiting
    begins), and, with a burst allowance, the virtual time of each fairness ID whose flow emptied."""

    __slots__ = ("flows", "vtime", "clock", "idle")

    def __init__(self, vtime: float) -> None:
        self.flows: dict[str, _Flow] = {}
        self.vtime = vtime
        self.clock = 0.0
        self.idle: dict[str, float] = {}  # fairness ID -> its virtual time when its flow emptied, oldest first


MAX_IDLE_FLOWS: Final = 4096  # per class: idle fairness IDs whose use is remembered (the oldest go first)


class FlowQueue:
    """One key's waiting selections, by lane. `weights`: each class's weight; `promote_secs`: the
    wait that lifts a request one tier (None: never); `burst_tokens`: how far ahead of its class's
    clock a fairness ID that starts waiting again may begin, if it used less than its share
    meanwhile (0: none, every flow begins at the clock)."""

    __slots__ = ("_classes", "_tier_clocks", "_tier_classes", "_tickets", "_weights", "_promote", "_counts",
                 "_burst")

    def __init__(self, weights: Mapping[str, float] | None = None, promote_secs: float | None = None,
                 burst_tokens: int = 0) -> None:
        self._classes: dict[tuple[int, str], _Class] = {}
        # Per tier with a class waiting, and only then: a tier's clock matters to classes that join
        # it while others wait, so an empty tier forgets it, and the memory is what is queued
        # (a client naming a new priority each time kept an entry per value for ever).
        self._tier_clocks: dict[int, float] = {}
        self._tier_classes: dict[int, int] = {}  # tier -> its classes waiting
        self._tickets: dict[int, QueuedSelection] = {}
        self._weights = dict(weights or {"default": 1.0})
        self._promote = promote_secs
        self._burst = burst_tokens
        self._counts: dict[tuple[str, str], list[int]] = {}  # ("class"|"fairness", name) -> [requests, tokens]

    def __len__(self) -> int:
        return len(self._tickets)

    def __iter__(self) -> Iterator[QueuedSelection]:
        """In each one's own run order (for one lane, the order they run in), over a copy: the
        caller may remove entries while it walks."""
        return iter(sorted(self._tickets.values(), key=_run_order))

    def queued(self, kind: str, name: str) -> tuple[int, int]:
        """(requests, uncached tokens) waiting in a class (`kind="class"`) or fairness ID."""
        count = self._counts.get((kind, name))
        return (count[0], count[1]) if count is not None else (0, 0)

    def fairness_ids(self) -> Iterator[str]:
        """The fairness IDs with a request waiting (over every tier and class)."""
        return (name for kind, name in self._counts if kind == "fairness")

    def ahead(self, lane: Lane) -> bool:
        """Whether a request in `lane` is owed nothing: its fairness ID's flow in the lane's class
        (where it would begin, if it waits nowhere there) is at or past every other flow waiting
        in the class, in virtual time; so too when no other waits there. Visits the class's flows."""
        cls = self._classes.get((lane.tier, lane.policy_class))
        if cls is None:
            return True
        fid = lane.fairness_id
        flow = cls.flows.get(fid)
        vtime = flow.vtime if flow is not None else self._start(cls, fid)
        return all(other.vtime <= vtime for name, other in cls.flows.items() if name != fid)

    def _start(self, cls: _Class, fairness_id: str) -> float:
        """Where a flow of `fairness_id` that starts waiting in `cls` begins: at the class's clock;
        with a burst allowance, up to that far before it, but never before where its own use left
        it (a light fairness ID's burst runs ahead of those waiting all along, a heavy one that
        empties now and then gains nothing)."""
        if not self._burst:
            return cls.clock
        return max(cls.idle.get(fairness_id, -math.inf), cls.clock - self._burst)

    def lanes(self) -> list[tuple[int, str, int, int, int]]:
        """(priority tier, class, queued requests, their uncached tokens, fairness IDs waiting) of
        each class of each tier with a request waiting, highest tier first."""
        out = []
        for (tier, name), cls in sorted(self._classes.items(), key=lambda item: (-item[0][0], item[0][1])):
            waiting = [flow for flow in cls.flows.values() if flow.entries]
            if waiting:
                out.append((tier, name, sum(len(f.entries) for f in waiting), sum(f.tokens for f in waiting),
                            len(waiting)))
        return out

    def _count(self, entry: QueuedSelection, sign: int) -> None:
        for counted in (("class", entry.lane.policy_class), ("fairness", entry.lane.fairness_id)):
            count = self._counts.setdefault(counted, [0, 0])
            count[0] += sign
            count[1] += sign * entry.cost
            if count[0] == 0:
                del self._counts[counted]

    def push(self, entry: QueuedSelection) -> None:
        tier, name, fid = entry.lane
        cls = self._classes.get((tier, name))
        if cls is None:  # a class that starts waiting begins at its tier's clock: no credit banked
            cls = self._classes[(tier, name)] = _Class(self._tier_clocks.get(tier, 0.0))
            self._tier_classes[tier] = self._tier_classes.get(tier, 0) + 1
        flow = cls.flows.get(fid)
        if flow is None:
            flow = cls.flows[fid] = _Flow(self._start(cls, fid))
            cls.idle.pop(fid, None)
        bisect.insort(flow.entries, entry, key=_run_order)
        flow.tokens += entry.cost
        self._tickets[entry.ticket] = entry
        self._count(entry, 1)

    def remove(self, entry: QueuedSelection) -> bool:
        """Take `entry` out, charging no one; False when it was not waiting any more."""
        if self._tickets.pop(entry.ticket, None) is None:
            return False
        tier, name, fid = entry.lane
        cls = self._classes[(tier, name)]
        flow = cls.flows[fid]
        flow.entries.remove(entry)
        flow.tokens -= entry.cost
        self._count(entry, -1)
        if not flow.entries:  # an idle flow keeps no credit (nor debt), but its use with a burst allowance
            del cls.flows[fid]
            if not cls.flows:  # nobody waits: nobody is owed anything, the class starts afresh
                del self._classes[(tier, name)]
                self._tier_classes[tier] -= 1
                if not self._tier_classes[tier]:  # no class waits in the tier: nobody to compare with
                    del self._tier_classes[tier]
                    self._tier_clocks.pop(tier, None)
            elif self._burst:
                self._remember(cls, fid, flow.vtime)
        return True

    def _remember(self, cls: _Class, fid: str, vtime: float) -> None:
        """Keep where `fid`'s use left it; forget, oldest first, those a burst allowance covers
        (they begin at the clock minus it anyway) and any past `MAX_IDLE_FLOWS`."""
        idle = cls.idle
        idle.pop(fid, None)
        idle[fid] = vtime
        floor = cls.clock - self._burst
        while idle:
            oldest = next(iter(idle))
            if idle[oldest] > floor and len(idle) <= MAX_IDLE_FLOWS:
                break
            del idle[oldest]

    def take(self, entry: QueuedSelection) -> None:
        """`entry` runs: out of the queue, its cost charged to its flow and its class."""
        tier, name, fid = entry.lane
        cls = self._classes[(tier, name)]
        flow = cls.flows[fid]
        self._tier_clocks[tier] = cls.vtime
        # With a burst allowance, a flow begun before the clock does not set it back (else each one
        # served would let the next begin further back).
        cls.clock = max(cls.clock, flow.vtime) if self._burst else flow.vtime
        cls.vtime += entry.cost / self._weights.get(name, 1.0)
        flow.vtime += entry.cost
        self.remove(entry)

    def find(self, ticket: int) -> QueuedSelection | None:
        return self._tickets.get(ticket)

    def take_all(self) -> list[QueuedSelection]:
        entries = list(self)
        self._classes.clear()
        self._tier_clocks.clear()
        self._tier_classes.clear()
        self._tickets.clear()
        self._counts.clear()
        return entries

    def make_room(self, fairness_id: str, cap: int) -> QueuedSelection | None:
        """When the queue holds `cap` requests and one of `fairness_id` would join: the request to
        shed for it, or None when `fairness_id` already holds its share. A fairness ID's share is
        `cap / k`, k the fairness IDs waiting with it; one below its share means another is above
        (the queue is full), and that one, the fairness ID holding the most, gives up its newest
        request. Visits the fairness IDs, then that one's flows."""
        counts = {name: count[0] for (kind, name), count in self._counts.items() if kind == "fairness"}
        mine = counts.get(fairness_id, 0)
        sharing = len(counts) + (fairness_id not in counts)
        if mine * sharing >= cap:
            return None
        heaviest = max((name for name in counts if name != fairness_id), key=lambda name: (counts[name], name))
        return max((e for cls in self._classes.values() if (flow := cls.flows.get(heaviest)) is not None
                    for e in flow.entries), key=lambda e: e.ticket)

    def late(self, now: float) -> list[QueuedSelection]:
        """The entries whose time is up (still queued), in run order."""
        return [e for e in self if e.expires_at <= now]

    def next_expiry(self) -> float | None:
        return min((e.expires_at for e in self._tickets.values()), default=None)

    def next(self, now: float, passed_over: set[int], held_back: Set[str] = frozenset()) -> QueuedSelection | None:
        """The entry that runs next, skipping `passed_over` (their candidates are busy) and the
        fairness IDs `held_back` (over their share of what is in flight); None when every entry is
        skipped. Visits each flow once."""
        best: tuple[float, ...] | None = None
        chosen = None
        for (tier, _), cls in self._classes.items():
            for fid, flow in cls.flows.items():
                if fid in held_back:
                    continue
                head = next((e for e in flow.entries if e.ticket not in passed_over), None)
                if head is None:
                    continue
                lifted = tier if self._promote is None else tier + int((now - head.enqueued_at) // self._promote)
                rank = (-lifted, -tier, cls.vtime, flow.vtime, -head.order, head.ticket)
                if best is None or rank < best:
                    best, chosen = rank, head
        return chosen

    def footprint(self) -> int:
        """Entries the queue keeps, of every kind (tickets, classes, flows, tiers, counts): bounded
        by what waits, whatever has waited before (tests read it)."""
        flows = sum(len(cls.flows) for cls in self._classes.values())
        return (len(self._tickets) + len(self._classes) + flows + len(self._tier_clocks) + len(self._tier_classes)
                + len(self._counts))

    def work_ahead(self, lane: Lane) -> int:
        """Uncached tokens that run before a request joining `lane` would, were every lane to keep
        its share: every higher tier's, its own flow's, and as much of each other flow and class
        as their shares let run meanwhile. Visits each flow once."""
        tier, name, fid = lane
        higher = sum(f.tokens for (t, _), c in self._classes.items() if t > tier for f in c.flows.values())
        own_class = self._classes.get((tier, name))
        own_flow = own_class.flows.get(fid) if own_class is not None else None
        flow_ahead = own_flow.tokens if own_flow is not None else 0
        class_ahead = flow_ahead + (sum(min(f.tokens, flow_ahead) for k, f in own_class.flows.items() if k != fid)
                                    if own_class is not None else 0)
        weight = self._weights.get(name, 1.0)
        others = sum(min(sum(f.tokens for f in c.flows.values()), class_ahead * self._weights.get(n, 1.0) / weight)
                     for (t, n), c in self._classes.items() if t == tier and n != name)
        return higher + class_ahead + math.ceil(others)


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
