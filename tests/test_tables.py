"""The pending-selection cache and a session table against plain models of 1.6.1's rules, under a
seeded clock, as Hypothesis state machines: what is kept, what is evicted in which order, what
expires when."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from selection_proto.core.base.budget import StateBudget
from selection_proto.core.bookings.prompt import PromptHashes
from selection_proto.core.bookings.sessions import Lease, SessionTable
from selection_proto.core.fleet.pending import PendingSelection, PendingSelections

KEY = ("m", "default")
IDS = st.sampled_from(["a", "b", "c", "d", "e"])
STEPS = st.sampled_from([0.0, 0.5, 1.0, 3.0])


class PendingMachine(RuleBasedStateMachine):
    """Model: a list of (id, inserted_at, size), oldest first."""

    TTL, MAX_ENTRIES, MAX_BYTES = 2.0, 3, 40

    def __init__(self) -> None:
        super().__init__()
        self.cache = PendingSelections(self.TTL, self.MAX_ENTRIES, self.MAX_BYTES)
        self.model: list[tuple[str, float, int]] = []
        self.now = 0.0

    @rule(step=STEPS)
    def wait(self, step: float) -> None:
        self.now += step

    @rule(sid=IDS, size=st.integers(1, 30))
    def select(self, sid: str, size: int) -> None:
        self.cache.remember(KEY, sid, PendingSelection((1, 0), PromptHashes([], None, 1), 0, True, True,
                                                       None, None, self.now, size), self.now)
        model = [e for e in self.model if self.now - e[1] <= self.TTL and e[0] != sid]
        model.append((sid, self.now, size))
        while model and (len(model) > self.MAX_ENTRIES or sum(e[2] for e in model) > self.MAX_BYTES):
            model.pop(0)
        self.model = model

    @rule(sid=IDS)
    def book(self, sid: str) -> None:
        found = self.cache.get(KEY, sid, self.now)
        expected = next((e for e in self.model if e[0] == sid and self.now - e[1] <= self.TTL), None)
        assert (found is None) == (expected is None)
        if found is not None:
            self.cache.forget(KEY, sid)
            self.model = [e for e in self.model if e[0] != sid]

    @invariant()
    def bytes_match(self) -> None:
        assert self.cache.bytes == sum(e[2] for e in self.model)
        assert len(self.cache) == len(self.model)


class SessionMachine(RuleBasedStateMachine):
    """Model: session -> [rank, leases held, idle_until]."""

    TTL, LIMIT = 2.0, 3

    def __init__(self) -> None:
        super().__init__()
        self.table = SessionTable(self.TTL, self.LIMIT, StateBudget(1 << 40))
        self.model: dict[str, list[object]] = {}
        self.leases: list[tuple[Lease, list[object]]] = []
        self.now = 0.0

    def _live(self, session: str) -> list[object] | None:
        entry = self.model.get(session)
        if entry is not None and entry[1] == 0 and entry[2] <= self.now:  # type: ignore[operator]
            return None
        return entry

    @rule(step=STEPS)
    def wait(self, step: float) -> None:
        self.now += step

    @rule(session=IDS, worker=st.integers(1, 2))
    def book(self, session: str, worker: int) -> None:
        bound = self.table.target(session, self.now)
        entry = self._live(session)
        assert bound == (entry[0] if entry is not None else None)
        rank = bound if bound is not None else (worker, 0)
        lease = self.table.lease(session, rank, self.now)
        if entry is None:
            self.model = {s: e for s, e in self.model.items() if self._live(s) is not None or s == session}
            self.model.pop(session, None)
            if len(self.model) >= self.LIMIT:
                assert lease is None
                return
            entry = self.model[session] = [rank, 0, 0.0]
        assert lease is not None
        entry[1] = int(entry[1]) + 1  # type: ignore[call-overload]
        self.leases.append((lease, entry))

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if not self.leases:
            return
        lease, entry = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        self.table.release(lease, self.now)
        if self.model.get(lease.session) is entry:
            entry[1] = int(entry[1]) - 1  # type: ignore[call-overload]
            entry[2] = self.now + self.TTL

    @rule(session=IDS)
    def forget(self, session: str) -> None:
        self.table.forget(session)
        self.model.pop(session, None)

    @invariant()
    def targets_match(self) -> None:
        for session in ("a", "b", "c", "d", "e"):
            entry = self._live(session)
            assert self.table.target(session, self.now) == (entry[0] if entry is not None else None)


TestPendingMachine = PendingMachine.TestCase
TestSessionMachine = SessionMachine.TestCase


@given(n=st.integers(1, 40), lost=st.sets(st.integers(0, 39)), kept_from=st.integers(0, 40))
def test_replay_order_hands_each_batch_on_once_in_order(n: int, lost: set[int], kept_from: int) -> None:
    """`SeqOrder`: whatever the wire loses, the batches go on in order, each once; what the
    engine still keeps is recovered, the rest counted as unrecovered."""
    from selection_proto.adapters.replay import SeqOrder

    order = SeqOrder()
    delivered: list[int] = []
    for seq in range(n):
        if seq not in lost:
            order.live(seq, b"")
        if order.want is not None:
            start, order.want = order.want, None
            for kept in range(max(start, kept_from), seq + 1):  # the engine's buffer so far
                order.replayed(kept, b"")
            order.replay_done()
        delivered += [s for s, _ in order.ready()]
    assert delivered == sorted(set(delivered))
    arrived = {s for s in range(n) if s not in lost}
    assert arrived <= set(delivered)
    if delivered:  # past the first batch seen, what is missing is what the engine had dropped
        missing = set(range(delivered[-1] + 1)) - set(delivered)
        assert missing <= set(range(kept_from)) and order.unrecovered == len(missing)


def test_replay_frames_of_both_vllm_layouts() -> None:
    from selection_proto.adapters.replay import END, parse_replay_frames, replay_request

    assert replay_request(7) == [b"", (7).to_bytes(8, "big")]
    assert parse_replay_frames([b"", (3).to_bytes(8, "big"), b"p"]) == (3, b"p")
    assert parse_replay_frames([b"", b"topic", (3).to_bytes(8, "big"), b"p"]) == (3, b"p")
    assert parse_replay_frames([b"", (-1).to_bytes(8, "big", signed=True), b""]) == (END, b"")
    assert parse_replay_frames([b"", b"short", b"p"]) is None and parse_replay_frames([b""]) is None
