"""The end of a booking's prefill read from its engine's KV events (docs/ROUTING.md, "When a
prefill ends"), in the core: with `router_policy=ttft`, a booking whose rank stores its prompt's
blocks stops counting its prefill, as `prefill_complete` would; an explicit `prefill_complete`
stays the authority; Dynamo's policy, engines without events and approximate mode are unchanged."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from conftest import Client, stored, worker
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from selection_proto import SelectionService, Settings
from selection_proto.core.base.hashing import block_hashes, sequence_hashes, signed
from selection_proto.core.base.outputs import SelectionReady
from selection_proto.core.fleet.pool import Pool

PROMPT = list(range(32))  # 8 blocks of 4
LOCAL = block_hashes(PROMPT, 4)
# The prompt of 8 full blocks and a partial ninth of 2 tokens, as a client that hashes names it.
PARTIAL = {"model_name": "m", "block_hashes": [*signed(LOCAL), 999],
           "sequence_hashes": signed(sequence_hashes([*LOCAL, 999])), "isl_tokens": 34}


def _prefill(c: Client, worker_id: int = 1) -> int:
    """The prefill tokens booked on the worker and not complete (`/loads`)."""
    (key,) = c.ok("GET", "/loads")
    return sum(row["potential_prefill_tokens"] for row in key["loads"] if row["worker_id"] == worker_id)


def _counted(c: Client, event: str) -> float:
    text = c.service.metrics_text(now=c.now)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("selection_proto_reservation_events_total{") and f'event="{event}"' in line)


def _engine_says_hello(c: Client, worker_id: int = 1) -> None:
    """The worker's engine has published: an unrelated block."""
    c.ok("POST", "/kv_events", [stored(worker_id, 1, [(9_000 + worker_id, 12345)])])


def _book(c: Client, rid: str, prompt: list[int] = PROMPT, **extra: Any) -> dict[str, Any]:
    answer: dict[str, Any] = c.ok("POST", "/select_and_reserve", {"model_name": "m", "token_ids": prompt,
                                                                   "reservation_id": rid, **extra})
    return answer


def _client(make_client: Callable[..., Client], workers: tuple[int, ...] = (1,), **settings: Any) -> Client:
    c = make_client(**{"router_policy": "ttft", **settings})
    for wid in workers:
        c.ok("POST", "/workers", worker(wid), status=201)
    return c


def test_the_prompt_stored_on_its_rank_ends_the_prefill(make_client: Callable[..., Client]) -> None:
    c = _client(make_client)
    _engine_says_hello(c)
    _book(c, "a")
    assert _prefill(c) == 32
    # The first half is not the end of it; the rest is.
    c.ok("POST", "/kv_events", [stored(1, 2, [(100 + i, LOCAL[i]) for i in range(4)])])
    assert _prefill(c) == 32
    c.ok("POST", "/kv_events", [stored(1, 3, [(100 + i, LOCAL[i]) for i in range(4, 8)], parent=103)])
    assert _prefill(c) == 0
    assert _counted(c, "prefill_inferred") == 1
    # The client's own call comes later: 200, and nothing more changes.
    c.ok("POST", "/reservations/a/prefill_complete")
    assert _prefill(c) == 0 and _counted(c, "prefill_inferred") == 1
    c.ok("DELETE", "/reservations/a")
    assert not c.service.pools[("m", "default")].prefill_ends


def test_only_the_booked_rank_and_the_prompts_own_path_count(make_client: Callable[..., Client]) -> None:
    c = _client(make_client, workers=(1, 2))
    for wid in (1, 2):
        _engine_says_hello(c, wid)
    wid = _book(c, "a")["worker_id"]
    other = 3 - wid
    # The same blocks on the other worker: not this booking's engine.
    c.ok("POST", "/kv_events", [stored(other, 2, [(100 + i, LOCAL[i]) for i in range(8)])])
    assert _prefill(c, wid) == 32
    # Its last block after another prefix on its own worker: another prompt's.
    c.ok("POST", "/kv_events", [stored(wid, 3, [(200, 777), (201, LOCAL[7])])])
    assert _prefill(c, wid) == 32
    c.ok("POST", "/kv_events", [stored(wid, 4, [(100 + i, LOCAL[i]) for i in range(8)])])
    assert _prefill(c, wid) == 0


def test_a_prompt_with_nothing_new_to_store_ends_at_once(make_client: Callable[..., Client]) -> None:
    c = _client(make_client)
    c.ok("POST", "/kv_events", [stored(1, 1, [(100 + i, LOCAL[i]) for i in range(8)])])
    # Its 8 full blocks held, and 2 tokens more in a partial block the client names: an engine
    # never stores a partial block, so no event will say when those 2 are computed.
    c.ok("POST", "/select_and_reserve", {**PARTIAL, "reservation_id": "held"})
    assert _prefill(c) == 0 and _counted(c, "prefill_inferred") == 1
    # Shorter than a block: nothing to store either.
    _book(c, "short", [5, 6, 7])
    assert _prefill(c) == 0 and _counted(c, "prefill_inferred") == 2
    assert not c.service.pools[("m", "default")].prefill_ends


def test_a_prompt_with_nothing_new_to_store_ends_with_the_prefills_ahead(make_client: Callable[..., Client]) -> None:
    """First come, first served: a prompt whose blocks are all cached still waits for the
    prefills booked ahead of it on its rank, and ends with the last of them, however it ends."""
    other = [p + 100 for p in PROMPT]
    for end in ("event", "prefill_complete", "free"):
        c = _client(make_client)
        c.ok("POST", "/kv_events", [stored(1, 1, [(100 + i, LOCAL[i]) for i in range(8)])])
        _book(c, "ahead", other)  # 32 new tokens
        c.ok("POST", "/select_and_reserve", {**PARTIAL, "reservation_id": "held"})  # 2 tokens, nothing to store
        assert _prefill(c) == 34
        if end == "event":
            c.ok("POST", "/kv_events", [stored(1, 2, [(200 + i, h) for i, h in enumerate(block_hashes(other, 4))])])
        elif end == "prefill_complete":
            c.ok("POST", "/reservations/ahead/prefill_complete")
        else:
            c.ok("DELETE", "/reservations/ahead")
        assert _prefill(c) == 0, end
        assert _counted(c, "prefill_inferred") == (2 if end == "event" else 1)


def test_a_partial_last_block_is_not_waited_for(make_client: Callable[..., Client]) -> None:
    c = _client(make_client)
    _engine_says_hello(c)
    c.ok("POST", "/select_and_reserve", {**PARTIAL, "reservation_id": "a"})
    assert _prefill(c) == 34
    c.ok("POST", "/kv_events", [stored(1, 2, [(100 + i, LOCAL[i]) for i in range(8)])])
    assert _prefill(c) == 0


def test_an_explicit_prefill_complete_first_and_a_free_end_the_watch(make_client: Callable[..., Client]) -> None:
    c = _client(make_client)
    _engine_says_hello(c)
    _book(c, "a")
    _book(c, "b", [p + 100 for p in PROMPT])
    watch = c.service.pools[("m", "default")].prefill_ends
    assert len(watch) == 2
    c.ok("POST", "/reservations/a/prefill_complete")
    c.ok("DELETE", "/reservations/b")
    assert len(watch) == 0 and not watch
    c.ok("POST", "/kv_events", [stored(1, 2, [(100 + i, LOCAL[i]) for i in range(8)])])
    assert _counted(c, "prefill_inferred") == 0 and _counted(c, "prefill_complete") == 1


def test_without_events_or_with_dynamos_policy_nothing_is_inferred(make_client: Callable[..., Client]) -> None:
    events = [stored(1, 2, [(100 + i, LOCAL[i]) for i in range(8)])]
    # An engine that has never published: today's behaviour, even once it starts.
    c = _client(make_client)
    _book(c, "a")
    c.ok("POST", "/kv_events", events)
    assert _prefill(c) == 32
    # Dynamo's policy keeps 1.6.1's bookings exactly.
    c = _client(make_client, router_policy="dynamo")
    _engine_says_hello(c)
    _book(c, "a")
    c.ok("POST", "/kv_events", events)
    assert _prefill(c) == 32 and _counted(c, "prefill_inferred") == 0
    # Approximate mode reads no events: the bookings predict the cache.
    c = _client(make_client, kv_events="approximate")
    _book(c, "a")
    assert _prefill(c) == 32


def test_two_bookings_of_one_prompt_end_together(make_client: Callable[..., Client]) -> None:
    """The engine computes a prompt's blocks once: the second prefill stores nothing new, and ends
    (as far as the router can tell) when the first stores them."""
    c = _client(make_client)
    _engine_says_hello(c)
    _book(c, "a")
    _book(c, "b")
    assert _prefill(c) == 64
    c.ok("POST", "/kv_events", [stored(1, 2, [(100 + i, LOCAL[i]) for i in range(8)])])
    assert _prefill(c) == 0 and _counted(c, "prefill_inferred") == 2


def test_a_queued_selection_runs_when_the_event_ends_a_prefill(make_client: Callable[..., Client]) -> None:
    c = _client(make_client, queue_threshold=1.0)
    c.ok("POST", "/workers", worker(1, max_num_batched_tokens=16), status=201)
    _engine_says_hello(c)
    _book(c, "a")  # 32 tokens booked: over 1 x 16, busy
    c.now += 0.01
    pending = c.service.handle("POST", "/select_and_reserve", "", [("content-type", "application/json")],
                               b'{"model_name": "m", "token_ids": [1, 2, 3, 4, 5], "reservation_id": "q"}',
                               now=c.now)
    assert not hasattr(pending, "status")  # held in the queue
    c.ok("POST", "/kv_events", [stored(1, 2, [(100 + i, LOCAL[i]) for i in range(8)])])
    ready = []
    while (out := c.service.next_output()) is not None:
        ready += [out] if isinstance(out, SelectionReady) else []
    assert [r.response.status for r in ready] == [200]


class PrefillEndsMachine(RuleBasedStateMachine):
    """Two workers (one of two ranks) whose engines publish, bookings of prompts over a small
    alphabet, engines storing and evicting prompts' blocks, completions, frees, ticks. Whatever
    the order: the prefill counted is that of the bookings not done; a booking waits only while
    its rank does not hold its whole prompt; only frees and expiry drop a watched booking."""

    @initialize(seed=st.integers(0, 2**16))
    def start(self, seed: int) -> None:
        self.c = Client(SelectionService(Settings(kv_events="push", router_policy="ttft",
                                                  active_request_expiry_secs=5.0), random.Random(seed)))
        self.c.ok("POST", "/workers", worker(1), status=201)
        self.c.ok("POST", "/workers", worker(2, data_parallel_size=2), status=201)
        self.event_id = 0
        for wid, dp in ((1, 0), (2, 0), (2, 1)):
            self.store(wid, dp, [9, 9, 9, 9], None)
        self.prompts: dict[str, list[int]] = {}
        self.explicit: set[str] = set()  # bookings whose client called prefill_complete
        self.next_id = 0

    def pool(self) -> Pool:
        return self.c.service.pools[("m", "default")]

    def store(self, wid: int, dp: int, tokens: list[int], upto: int | None) -> None:
        local = block_hashes(tokens, 4)[:upto]
        blocks = [{"block_hash": h * 7 % 2**64, "tokens_hash": h} for h in local]
        self.event_id += 1
        self.c.ok("POST", "/kv_events", [{"worker_id": wid, "event": {"event_id": self.event_id, "dp_rank": dp, "data": {
            "stored": {"parent_hash": None, "blocks": blocks}}}}])

    @rule(tokens=st.lists(st.integers(0, 2), min_size=0, max_size=20))
    def book(self, tokens: list[int]) -> None:
        self.next_id += 1
        rid = f"r{self.next_id}"
        self.c.now += 0.1
        self.c.ok("POST", "/select_and_reserve", {"model_name": "m", "token_ids": tokens, "reservation_id": rid})
        self.prompts[rid] = tokens

    @rule(data=st.data(), upto=st.none() | st.integers(0, 5), elsewhere=st.booleans())
    def engine_stores(self, data: st.DataObject, upto: int | None, elsewhere: bool) -> None:
        """A booking's engine (or another rank) stores its prompt, or the first `upto` blocks."""
        live = sorted(self.pool().tracker.bookings)
        if not live:
            return
        booking = self.pool().tracker.bookings[data.draw(st.sampled_from(live))]
        rank = booking.rank
        if elsewhere:
            rank = data.draw(st.sampled_from([r for r in ((1, 0), (2, 0), (2, 1)) if r != rank]))
        self.store(rank[0], rank[1], self.prompts[booking.rid], upto)

    @rule(wid=st.sampled_from([1, 2]), dp=st.sampled_from([0, 1]), tokens=st.lists(st.integers(0, 2), max_size=20),
          keep=st.integers(0, 4))
    def engine_evicts(self, wid: int, dp: int, tokens: list[int], keep: int) -> None:
        """The tail of a prompt's blocks evicted, past the first `keep` (tail first, as engines do)."""
        if wid == 1:
            dp = 0
        hashes = [h * 7 % 2**64 for h in block_hashes(tokens, 4)[keep:]]
        held = self.pool().index.device.lookup.get((wid, dp), {})
        gone = [h for h in reversed(hashes) if h in held]
        if gone:
            self.event_id += 1
            self.c.ok("POST", "/kv_events", [{"worker_id": wid, "event": {"event_id": self.event_id, "dp_rank": dp, "data": {
                "removed": {"block_hashes": gone}}}}])

    @rule(data=st.data(), free=st.booleans())
    def client(self, data: st.DataObject, free: bool) -> None:
        live = sorted(self.pool().tracker.bookings)
        if not live:
            return
        rid = data.draw(st.sampled_from(live))
        if free:
            self.c.ok("DELETE", f"/reservations/{rid}")
        else:
            self.c.ok("POST", f"/reservations/{rid}/prefill_complete")
            self.explicit.add(rid)
            assert self.pool().tracker.bookings[rid].prefill_done

    @rule(dt=st.floats(0, 3))
    def tick(self, dt: float) -> None:
        self.c.now += dt
        self.c.service.tick(self.c.now)

    @invariant()
    def prefill_is_that_of_the_bookings_not_done(self) -> None:
        pool = self.pool()
        for rank, load in pool.tracker.loads.items():
            assert load.prefill_tokens == sum(b.prefill_tokens for b in pool.tracker.bookings.values()
                                              if b.rank == rank and not b.prefill_done)
            assert load.prefilling == sum(1 for b in pool.tracker.bookings.values()
                                          if b.rank == rank and not b.prefill_done)

    @invariant()
    def a_booking_waits_only_while_its_prompt_is_not_held(self) -> None:
        pool = self.pool()
        ends = pool.prefill_ends
        waiting = [b for b in pool.tracker.bookings.values() if b.awaits is not None]
        assert ends.waiting() == len(waiting)
        for booking in waiting:
            assert not booking.prefill_done and booking.rid not in self.explicit
            assert pool.index.device.find(booking.awaits)[0].get(booking.rank, 0) < len(booking.awaits)
        # The bookings in prefill here are those not done; each follower follows live ones, and
        # one whose prefills ahead all ended has been ended.
        assert len(ends) == sum(1 for b in pool.tracker.bookings.values() if not b.prefill_done and b.prefill_tokens)
        assert not ends.ready
        for follower in ends.following():
            assert pool.tracker.bookings.get(follower.rid) is follower and not follower.prefill_done
            ahead = [b for b in pool.tracker.bookings.values() if b.rank == follower.rank and b.prefill_tokens
                     and not b.prefill_done and b.booked_at <= follower.booked_at and b is not follower]
            assert ahead  # something booked before it is still in prefill


PrefillEndsMachine.TestCase.settings = settings(stateful_step_count=40)
TestPrefillEndsMachine = PrefillEndsMachine.TestCase


def test_a_shared_ledger_hears_the_prefill_an_event_ended() -> None:
    """With replicas (docs/REPLICATION.md), the replica that made the booking reads its end from
    the events and journals it as `prefill_complete` would: the others stop counting it too."""
    from selection_proto.core.fleet.journal import LedgerSettings
    from selection_proto.core.fleet.ledger_wire import LedgerSnapshot

    service = SelectionService(Settings(kv_events="push", router_policy="ttft"), random.Random(0))
    mirror = service.share(LedgerSettings(), "me")
    mirror.connected(True, 0.0)
    mirror.load(LedgerSnapshot("e", 0, b"0-0", {}, set(), {}, {}, {}, {}, {}), 0.0)
    c = Client(service)
    c.ok("POST", "/workers", worker(1), status=201)
    _engine_says_hello(c)
    _book(c, "a")
    mirror.journal.take(100)
    c.ok("POST", "/kv_events", [stored(1, 2, [(100 + i, LOCAL[i]) for i in range(8)])])
    assert [(op.kind, op.ident) for op in mirror.journal.take(100)] == [("prefill", "a")]
    assert _prefill(c) == 0


def test_many_followers_cost_each_booking_a_constant() -> None:
    """Bookings a client holds in prefill and prompts with nothing to store behind them: each is
    queued once and leaves once (scanning those ahead for each follower was quadratic: 40,000 of
    each would be 1.6e9 steps)."""
    import time

    from selection_proto.core.bookings.prefill_ends import PrefillEnds
    from selection_proto.core.bookings.tracker import Booking

    ends, rank = PrefillEnds(), (1, 0)
    held = [Booking(f"h{i}", rank, None, 100, None, 0.0) for i in range(40_000)]
    followers = [Booking(f"f{i}", rank, None, 3, None, 0.0) for i in range(40_000)]
    started = time.perf_counter()
    for booking in held:
        ends.booked(booking)
    for booking in followers:
        ends.booked(booking)
        assert ends.follow(booking)
    for booking in held:
        ends.ended(booking)
    assert ends.ready == followers[:1]  # the first follower is at the front; the rest follow it in turn
    for booking in followers:
        ends.ended(booking)
    assert len(ends) == 0 and not ends.following()
    assert time.perf_counter() - started < 5.0


def test_many_bookings_of_one_prompt_end_in_linear_time(make_client: Callable[..., Client]) -> None:
    """One prompt booked 3,000 times on one rank (a client's flood): each is watched, freed or
    ended once, without a pass over the others."""
    import time

    c = _client(make_client, max_reservations_per_key=10_000)
    _engine_says_hello(c)
    started = time.perf_counter()
    for i in range(3_000):
        _book(c, f"a{i}")
    for i in range(0, 3_000, 2):
        c.ok("DELETE", f"/reservations/a{i}")
    c.ok("POST", "/kv_events", [stored(1, 2, [(100 + i, LOCAL[i]) for i in range(8)])])
    assert _prefill(c) == 0 and _counted(c, "prefill_inferred") == 1_500
    assert time.perf_counter() - started < 20.0
