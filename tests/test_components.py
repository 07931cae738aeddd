"""The core's components one at a time, beside the surface tests: catalog, admission queue,
freshness, state budget, tracker, route table."""

from __future__ import annotations

import gc
import json
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from selection_proto import WorkerRequest
from selection_proto.core.base import jsonio
from selection_proto.core.base.budget import BLOCK_BYTES, InsufficientStorage, StateBudget
from selection_proto.core.base.routes import ROUTES, allowed_methods, match, route_of
from selection_proto.core.base.types import SelectRequest, WorkerCatalogRecord
from selection_proto.core.bookings.prompt import PromptHashes
from selection_proto.core.bookings.tracker import Tracker
from selection_proto.core.cache.freshness import GAP, RESTART, REWIND, RankFreshness
from selection_proto.core.fleet.admission import FlowQueue, Lane, QueuedSelection, order_key
from selection_proto.core.fleet.catalog import LIFECYCLE, RECONCILE, Catalog


def record(wid: int, model: str = "m", lifecycle: str = "schedulable") -> WorkerCatalogRecord:
    req = WorkerRequest(worker_id=wid, model_name=model, endpoint="http://w", block_size=4)
    return WorkerCatalogRecord(request=req, lifecycle=lifecycle)  # type: ignore[arg-type]


def test_catalog_keeps_order_json_counts_and_tombstones() -> None:
    budget = StateBudget(1 << 40)
    catalog = Catalog(budget, max_tombstones=1)
    for wid, model in ((3, "b"), (1, "a"), (2, "b")):
        r = record(wid, model)
        catalog.store(r, jsonio.dumps(r.to_json()))
    assert [r.worker_id for r in catalog.sorted()] == [1, 2, 3]
    assert catalog.records_json("b") == [jsonio.dumps(catalog[2].to_json()), jsonio.dumps(catalog[3].to_json())]
    assert catalog.schedulable == 3 and catalog.others_in_key(("b", "default"), 2) == {3}
    moved = record(2, "a")
    catalog.store(moved, jsonio.dumps(moved.to_json()))
    assert catalog.others_in_key(("b", "default"), 3) == set() and [r.worker_id for r in catalog.sorted()] == [1, 2, 3]
    for wid in (1, 2):  # two deletes, one tombstone kept: the older is forgotten
        gone = WorkerCatalogRecord(request=catalog[wid].request, lifecycle="unschedulable")
        catalog.delete(gone, jsonio.dumps(gone.to_json()))
    assert catalog.get(1) is None and catalog[2].lifecycle == "unschedulable"
    assert catalog.schedulable == 1 and catalog.live_keys(0) == {("b", "default")}
    assert budget.record_bytes == sum(len(jsonio.dumps(r.to_json())) for r in catalog.values())


def test_lifecycle_and_reconcile_tables_cover_every_case() -> None:
    assert set(RECONCILE) == {(a, b, c) for a in (True, False) for b in (True, False) for c in (True, False)}
    assert RECONCILE[(True, True, True)] == ("update",) and RECONCILE[(True, True, False)] == ("leave", "join")
    assert all(LIFECYCLE[(state, "DELETE")] == "unschedulable" for state in ("incomplete", "schedulable",
                                                                           "unschedulable"))
    assert LIFECYCLE[(None, "PATCH")] is None


def test_admission_queue_runs_in_policy_order() -> None:
    assert order_key("fcfs", 0, age=5, isl=10, cached=0) > order_key("fcfs", 0, age=9, isl=10, cached=0)
    assert order_key("lcfs", 0, age=9, isl=10, cached=0) > order_key("lcfs", 0, age=5, isl=10, cached=0)
    assert order_key("wspt", 0, age=0, isl=10, cached=8) > order_key("wspt", 0, age=0, isl=10, cached=0)
    assert order_key("wspt", 0, age=0, isl=4, cached=9) == 1.0  # never divides by zero
    queue = FlowQueue()
    req = SelectRequest(token_ids=[1])
    lane = Lane(0, "default", "")
    entries = [QueuedSelection(t, order, req, None, PromptHashes([], None, 1), at, lane, 1, at + 9.0, float("inf"))
               for t, order, at in ((1, 0.0, 0.0), (2, 5.0, 1.0), (3, 0.0, 2.0))]
    for entry in entries:
        queue.push(entry)
    assert [e.ticket for e in queue] == [2, 1, 3]  # higher order first, then arrival
    assert queue.next(0.0, set()) is entries[1] and queue.next(0.0, {2}) is entries[0]
    assert [e.ticket for e in queue.late(now=10.5)] == [2, 1]
    assert queue.next_expiry() == 9.0 and queue.find(3) is entries[2]
    assert queue.remove(entries[2]) and not queue.remove(entries[2])
    assert [e.ticket for e in queue.take_all()] == [2, 1] and len(queue) == 0 and queue.next_expiry() is None


def test_freshness_continuity_step() -> None:
    fresh = RankFreshness()
    assert fresh.note_event_id(5, now=1.0) is None  # the first sets the baseline
    assert fresh.note_event_id(None, now=2.0) is None and fresh.last_event_id == 6
    assert fresh.note_event_id(9, now=3.0) == (GAP, 2) and fresh.stale and fresh.missing_events == 2
    fresh.mark_cleared()
    assert not fresh.stale
    # A seq that goes back is an engine restart; seen mid-way (not from 0), events are missing.
    assert fresh.note_seq(4) is None and fresh.note_seq(3) == (RESTART, 0) and fresh.rewinds == 1
    assert fresh.restarts == 1 and fresh.stale and not fresh.recovering
    fresh.loss_pending = True
    assert fresh.note_seq(4) is None and not fresh.loss_pending and fresh.age(5.0) == 2.0
    assert fresh.stale  # in order again, but what was missed is still missed
    # Seen from its first batch, the next batch in order proves the (dropped) index whole again.
    assert fresh.note_seq(0) == (RESTART, 0) and fresh.recovering and fresh.restarts == 2
    assert fresh.note_seq(1) is None and not fresh.stale and not fresh.recovering
    assert fresh.note_seq(1) == (REWIND, 0) and fresh.restarts == 2  # a repeat is no restart
    assert fresh.note_seq(0) == (RESTART, 0) and fresh.restarts == 3  # but 0 again is a new engine
    assert fresh.note_seq(0) == (RESTART, 0) and fresh.restarts == 4  # (that published one batch)
    fresh.mark_cleared()
    assert fresh.note_seq(0) == (RESTART, 0) and fresh.recovering
    fresh.mark_stale()  # any other loss voids the recovery
    assert fresh.note_seq(1) is None and fresh.stale


def test_state_budget_refuses_once_used_up() -> None:
    budget = StateBudget(limit=10 * BLOCK_BYTES)
    budget.check("x")
    budget.index_blocks = 10
    assert budget.exhausted and budget.used == 10 * BLOCK_BYTES
    with pytest.raises(InsufficientStorage) as info:
        budget.check("booking r1")
    assert info.value.status == 507 and info.value.message.startswith("state budget exhausted: booking r1 refused")


def test_tracker_drops_ranks_and_their_bookings_in_one_pass() -> None:
    budget = StateBudget(1 << 40)
    tracker = Tracker(100, "model=m tenant=default", budget)
    for dp in range(4):
        tracker.add_rank((1, dp))
    for i in range(8):
        tracker.book(f"r{i}", (1, i % 4), [i, i + 100], 5, None, now=0.0)
    assert (budget.bookings, budget.booked_blocks) == (8, 16)
    assert sorted(b.rid for b in tracker.drop_ranks({(1, 0), (1, 1)})) == ["r0", "r1", "r4", "r5"]
    assert (budget.bookings, budget.booked_blocks) == (4, 8) and set(tracker.loads) == {(1, 2), (1, 3)}


def test_the_route_table_is_consistent() -> None:
    assert len({(r.method, r.template) for r in ROUTES}) == len(ROUTES)
    assert len({r.operation for r in ROUTES}) == len(ROUTES)
    rpc = [r.rpc for r in ROUTES if r.rpc is not None]
    assert len(set(rpc)) == len(rpc)
    assert allowed_methods("/kv_events") == ("POST", "GET") and route_of("GET", "/select") is None
    assert match("/reservations/a%2Fb/prefill_complete") == ("/reservations/{reservation_id}/prefill_complete", "a%2Fb")
    assert match("/workers/7") == ("/workers/{worker_id}", "7") and match("/nope") is None
    assert all(r.body_type is None or r.body for r in ROUTES)


@pytest.mark.parametrize("text", [
    '"\\ud800"', '{"a": ["\\udc00"]}', '{"\\ud800": 1}', '"\\ud83d\\u0041"', '"\\ud83d\\ude00"', '"\\\\ud800"',
    "[" * 65 + "]" * 65, "[" * 64 + "]" * 64, "1" * 5000, "NaN", "[1e400]", "[18446744073709551616]",
    '{"a": 1, "a": 2}', "[1,]", '"\\u00e9"'])
def test_both_json_readers_agree(text: str) -> None:
    """orjson (`loads`) and the stdlib (`loads_exact`, the fallback) accept and refuse the same
    texts with the same detail; they differ only in that orjson reads integers beyond 64 bits
    as floats (the exact re-read exists for those)."""
    outcomes = []
    for reader in (jsonio.loads, jsonio.loads_exact):
        try:
            value = reader(text)
            outcomes.append(("ok", json_repr(value)))
        except jsonio.JSONSyntaxError as exc:
            outcomes.append(("error", exc.detail if "surrogate" in exc.detail or "deep" in exc.detail
                             or "digits" in exc.detail else "invalid"))
    assert outcomes[0] == outcomes[1], outcomes


@pytest.mark.parametrize("raw", [b'["\xff"]', b'["\xed\xa0\x80"]', b'{"a": "\xc3"}'])
def test_both_json_readers_name_invalid_utf8_as_such(raw: bytes) -> None:
    # orjson calls a surrogate encoded in UTF-8 bytes a "surrogate" too: it is not an escape.
    details = []
    for reader in (jsonio.loads, jsonio.loads_exact):
        with pytest.raises(jsonio.JSONSyntaxError) as caught:
            reader(raw)
        details.append(caught.value.detail)
    assert details[0] == details[1] and details[0].startswith("invalid UTF-8 at byte"), details


def json_repr(value: object) -> object:
    if isinstance(value, float) and value.is_integer():
        return int(value)  # orjson's float for an integer beyond 64 bits
    if isinstance(value, list):
        return [json_repr(v) for v in value]
    if isinstance(value, dict):
        return {k: json_repr(v) for k, v in value.items()}
    return value


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(st.sampled_from('atf"\\[]{} 1\u00e9'), max_size=6),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text("tf\"[{a", max_size=4), inner, max_size=4),
    max_leaves=40)


@given(_JSON_VALUES, st.sampled_from([(",", ":"), (", ", ": ")]))
def test_the_quick_structure_look_answers_as_the_full_passes(value: object, separators: tuple[str, str]) -> None:
    """The memchr look at a body (few strings, few brackets) and the filtering passes over all of
    it give the same hints, also where the quick look hands over (escapes, many strings, deep
    nesting)."""
    for depth in (0, 40, 70):  # nested in arrays: 64 openers is where the quick look gives up
        raw = ("[" * depth + json.dumps(value, separators=separators) + "]" * depth).encode()
        assert jsonio._structure_hints_quick(raw) == jsonio._structure_hints_full(raw)
        assert jsonio.structure_hints(raw) == jsonio._structure_hints_full(raw)


def test_the_quick_structure_look_on_request_bodies() -> None:
    body = json.dumps({"model_name": "m", "token_ids": list(range(20000))}).encode()
    assert jsonio.structure_hints(body) == (False, False)
    assert jsonio.structure_hints(body.replace(b"[0,", b"[true,")) == (False, True)
    for look in (jsonio._structure_hints_quick, jsonio.structure_hints):  # small ones get the full passes
        assert look(b'{"t": "f", "x": [[[]]]}') == (False, False)
        assert look(b"[" * 65 + b"]" * 65) == (True, False)
        many = json.dumps({f"k{i}": "v" for i in range(40)} | {"z": False}).encode()  # past the quick look
        assert look(many) == (False, True)


@pytest.mark.parametrize("text", [
    "[]", " [ 1 , {\"a\": [true, null]} , \"x\" ] ", '[{"a": 1, "a": 2}]', "[1e400]", "[18446744073709551616]",
    '["\\ud800"]', '["\\ud83d\\ude00"]', "[" * 66 + "]" * 66, "[1,]", "[1 2]", "{}", '"x"', "[1]]", "[NaN]",
    '[{"event_id": 1, "data": "cleared"}]', '[0.1, -0.0, 1E5, "\\u00e9\\n"]'])
def test_the_stepwise_array_reader_answers_as_loads(text: str) -> None:
    def outcome(reader: object) -> object:
        try:
            return reader(text)  # type: ignore[operator]
        except jsonio.JSONSyntaxError as exc:
            return ("error", exc.detail)
    assert outcome(jsonio.loads_array_stepwise) == outcome(jsonio.loads_with_hints)


def test_stream_table_moves_sources_and_their_ranks() -> None:
    """`STREAM`: a push stream counts as open from the start; a subscription when it connects; a
    loss marks what it fed `loss_pending`; `ended` forgets without a loss and tells the transport."""
    from collections import deque

    from selection_proto.core.base.outputs import CloseEventStream, SubscribeKvEvents, UnsubscribeKvEvents
    from selection_proto.core.base.settings import Settings
    from selection_proto.core.fleet.pool import Pool
    from selection_proto.core.intake.streams import STREAM, Streams

    key = ("m", "t")
    pool = Pool(key, 4, 0.0, Settings(), StateBudget(1 << 40))
    pool.set_worker(1, ((1, 0), (1, 1)), frozenset())
    pool.add_rank((1, 0))
    pool.add_rank((1, 1))
    outbox: deque[object] = deque()
    streams = Streams({key: pool}, outbox)  # type: ignore[arg-type]
    push = streams.open_push((1, 0), key)
    assert pool.fresh[(1, 0)].open_streams == 1
    source = streams.get(push)
    assert source is not None and source.state == "connected"
    source.delivered.add((1, 0))
    streams.move(source, "closed")
    assert streams.get(push) is None
    assert pool.fresh[(1, 0)].loss_pending and pool.fresh[(1, 0)].open_streams == 0

    streams.subscribe((1, 1), key, "tcp://127.0.0.1:5557")
    assert isinstance(outbox[-1], SubscribeKvEvents) and streams.subscriptions_except(2) == 1
    sub = streams.get(outbox[-1].stream)
    assert sub is not None and sub.state == "waiting" and pool.fresh[(1, 1)].open_streams == 0
    streams.move(sub, "lost")  # lost before it connected: nothing to lose
    assert not pool.fresh[(1, 1)].loss_pending
    streams.move(sub, "connected")
    assert pool.fresh[(1, 1)].open_streams == 1 and sub.first
    sub.delivered.add((1, 1))
    streams.move(sub, "ended")
    assert isinstance(outbox[-1], UnsubscribeKvEvents) and streams.get(sub.sid) is None
    assert not pool.fresh[(1, 1)].loss_pending  # ended: the rank is being reset or dropped

    again = streams.open_push((1, 1), key)
    streams.end_pushes(1, "worker left")
    assert outbox[-1] == CloseEventStream(again, 1001, "worker left")
    assert set(STREAM.values()) == {"connected", "waiting", "gone"}


def test_tickets_are_global_and_end_once() -> None:
    from selection_proto.core.fleet.admission import Tickets

    tickets = Tickets()
    first, second = tickets.issue(("m", "t")), tickets.issue(None)
    assert (first, second) == (1, 2)
    assert tickets.end(first) == ("m", "t") and tickets.end(first) is None
    assert tickets.end(second) is None  # a request applied in steps is not cancellable


def test_cost_prefers_cache_then_load_and_rounds_half_up() -> None:
    """`cost`: a rank holding the prompt's prefix costs less; extra load costs more; the cached
    tokens round half up; temperature 0 picks the minimum (ties: fewer cached blocks)."""
    import random

    from selection_proto.core.base.hashing import block_hashes
    from selection_proto.core.base.settings import Settings
    from selection_proto.core.fleet.pool import Pool
    from selection_proto.core.routing.cost import cached_tokens, choose, estimates, score

    settings = Settings(host_cache_hit_weight=0.5)
    pool = Pool(("m", "t"), 4, 0.0, settings, StateBudget(1 << 40))
    pool.set_worker(1, ((1, 0),), frozenset())
    pool.set_worker(2, ((2, 0),), frozenset())
    pool.add_rank((1, 0))
    pool.add_rank((2, 0))
    tokens = list(range(16))
    blocks = block_hashes(tokens, 4)
    pool.index.device.store((1, 0), None, [(b, b) for b in blocks[:2]])
    prompt = PromptHashes(blocks, None, len(tokens))
    found = estimates(pool, blocks)
    assert found[0] == {(1, 0): 2}
    assert cached_tokens((1, 0), found, 4, settings) == 8
    assert cached_tokens((1, 0), ({}, {(1, 0): 1}, {}), 3, settings) == 2  # 1.5 rounds up
    req = SelectRequest(model_name="m", tenant_id="t", token_ids=tuple(tokens))
    scored, by_cost = score(req, pool, prompt, [(1, 0), (2, 0)], found, settings, 0.0)
    assert scored[0].logit < scored[1].logit and by_cost is None  # the default policy
    assert choose(pool, scored, 0.0, random.Random(0)).rank == (1, 0)
    pool.tracker.book("r", (1, 0), None, 10_000, None, 0.0)  # far more queued prefill on rank 1
    busy, _ = score(req, pool, prompt, [(1, 0), (2, 0)], found, settings, 0.0)
    assert choose(pool, busy, 0.0, random.Random(0)).rank == (2, 0)


def test_limits_refuse_and_count_under_their_label() -> None:
    from selection_proto.core.base.errors import BadRequest, Conflict
    from selection_proto.core.base.metrics import LIMIT_REJECTIONS, Metrics
    from selection_proto.core.base.settings import Settings
    from selection_proto.core.fleet.limits import Limits

    metrics = Metrics()
    budget = StateBudget(0)
    limits = Limits(Settings(max_id_length=3, max_keys=1), metrics, budget)
    limits.id_length("model_name", "abc")
    with pytest.raises(BadRequest, match="model_name must be at most 3 characters"):
        limits.id_length("model_name", "abcd")
    limits.keys(1)
    with pytest.raises(Conflict, match="at most 1 model/tenant keys"):
        limits.keys(2)
    budget.bookings += 1
    with pytest.raises(InsufficientStorage):
        limits.state_budget("booking r")
    assert {label: metrics.value(LIMIT_REJECTIONS, (label,))
            for label in ("id_length", "keys", "state_bytes")} == {
        "id_length": 1.0, "keys": 1.0, "state_bytes": 1.0}


def test_a_slice_ends_at_its_event_or_block_budget() -> None:
    """`slice_end`: a large message is applied in slices bounded by events and by blocks (a remove
    of a hundred hashes is a hundred lookups), and a slice always makes progress."""
    from selection_proto.core.cache.events import KvEvent
    from selection_proto.core.intake.streams import slice_end

    removes = [KvEvent(worker_id=None, dp_rank=None, tier="device", event_id=None, kind="removed", block_hashes=tuple(range(100))) for _ in range(50)]
    assert slice_end(removes, 0, 1024, 250) == 2  # 100 + 100, the third would pass 250
    assert slice_end(removes, 49, 1024, 250) == 50
    assert slice_end(removes, 0, 3, 10_000) == 3
    huge = [KvEvent(worker_id=None, dp_rank=None, tier="device", event_id=None, kind="removed", block_hashes=tuple(range(1000)))]
    assert slice_end(huge, 0, 1024, 250) == 1  # one event over the budget still goes alone


def test_a_value_built_with_the_collector_paused_skips_the_young_passes() -> None:
    """Otherwise the first young collection after the pause walks all of it while holding the GIL
    (85 ms for 8 MB of events: docs/INVARIANTS.md); a deployer's own `gc.freeze()` stays."""
    gc.collect()
    with jsonio.gc_paused():
        built = [[i] for i in range(50_000)]
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert any(o is built for o in gc.get_objects(generation=2))
    kept = [[i] for i in range(1_000)]
    gc.freeze()
    try:
        with jsonio.gc_paused():
            built = [[i] for i in range(1_000)]
        assert gc.get_freeze_count() >= len(kept)
    finally:
        gc.unfreeze()


def test_ready_and_workers_bodies_are_kept_until_the_catalog_changes() -> None:
    import random

    from selection_proto import SelectionService, Settings

    service = SelectionService(Settings(kv_events="push"), random.Random(0))
    service.upsert_worker(WorkerRequest(worker_id=1, endpoint="http://w1", block_size=4), now=1.0)
    first = service.handle("GET", "/ready", "", [], b"", now=2.0).body
    assert service.handle("GET", "/ready", "", [], b"", now=3.0).body is first  # no fresh copy
    workers = service.handle("GET", "/workers", "", [], b"", now=3.0).body
    assert service.handle("GET", "/ready", "", [], b"", now=3.0).body is first  # both kept
    service.upsert_worker(WorkerRequest(worker_id=2, endpoint="http://w2", block_size=4), now=4.0)
    again = service.handle("GET", "/ready", "", [], b"", now=5.0).body
    assert again != first and b'"worker_id":2' in again
    listed = service.handle("GET", "/workers", "", [], b"", now=5.0).body
    assert listed != workers and b'"worker_id":2' in listed
    service.delete_worker(2, now=6.0)
    assert b'"unschedulable"' in service.handle("GET", "/ready", "", [], b"", now=7.0).body


_U64S = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([-1, 2**64, True, 1.0, None, "7"]))
_BLOCK = st.dictionaries(st.sampled_from(["block_hash", "tokens_hash", "mm_extra_info"]), _U64S)
_VALID_BLOCK = st.fixed_dictionaries({"block_hash": st.integers(0, 2**64 - 1), "tokens_hash": st.integers(0, 2**64 - 1)},
                                     optional={"mm_extra_info": _U64S})
_STORED = st.one_of(
    st.fixed_dictionaries({"blocks": st.lists(st.one_of(_VALID_BLOCK, _VALID_BLOCK, _VALID_BLOCK, _BLOCK, _U64S),
                                              max_size=4)},
                          optional={"parent_hash": _U64S, "start_position": _U64S, "other": _U64S}),
    st.dictionaries(st.sampled_from(["parent_hash", "start_position", "blocks", "other"]),
                    st.one_of(_U64S, st.lists(st.one_of(_BLOCK, _U64S), max_size=4))))


@given(_STORED)
def test_the_quick_read_of_a_store_is_the_typed_read(inner: dict[str, Any]) -> None:
    """`POST /kv_events` reads the usual store without a typed object per block; where it cannot,
    the typed path answers. Both must give the same event, and every error stays the typed one's."""
    from selection_proto.core.base.errors import SelectionError
    from selection_proto.core.cache.events import KvEvent, decode_json_events
    from selection_proto.core.cache.events import _stored_fast as quick

    event = {"event_id": 1, "data": {"stored": inner}}
    try:
        typed = decode_json_events(event)
    except SelectionError:
        assert quick(inner) is None
        return
    fast = quick(inner)
    assert fast is None or [KvEvent(worker_id=None, dp_rank=None, tier="device", event_id=1, kind="stored",
                                    parent_hash=fast[0], blocks=fast[1])] == typed


_HEAD_VALUES = st.one_of(_U64S, st.sampled_from([2**64 - 1, 2**32 - 1, 2**32, -0.0]), st.just("cleared"))


@given(st.one_of(st.fixed_dictionaries({"data": st.just("cleared")}, optional={
    "event_id": _HEAD_VALUES, "dp_rank": _HEAD_VALUES, "other": _HEAD_VALUES}),
    st.dictionaries(st.sampled_from(["event_id", "dp_rank", "data"]), _HEAD_VALUES)))
@example({"event_id": 2**64, "data": "cleared"})
@example({"event_id": 2**64 - 1, "dp_rank": 2**32, "data": "cleared"})
@example({"event_id": True, "dp_rank": 1.0, "data": "cleared"})
def test_the_quick_read_of_an_events_head_is_the_typed_read(event: dict[str, Any]) -> None:
    """An event's `event_id` and `dp_rank` are read without a typed object where they are the
    usual u64 and u32 (or null); the event, or the error and its text, is the typed path's."""
    from selection_proto.core.base.errors import SelectionError
    from selection_proto.core.cache import events

    def read() -> list[events.KvEvent] | str:
        try:
            return events.decode_json_events(event)
        except SelectionError as exc:
            return exc.message

    quick = read()
    original = events._head_fast
    events._head_fast = lambda obj: None  # type: ignore[assignment]
    try:
        assert quick == read()
    finally:
        events._head_fast = original


def test_a_prompt_hashed_and_counted_ahead_selects_exactly_as_one_hashed_on_the_spot(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ahead.prepare_ahead` hashes a huge prompt, and counts its new blocks on
    each booked rank, in a worker thread; the answers are the same, a rank changed since is
    counted again, and a body of other tokens never borrows them."""
    import random

    from selection_proto.core.ahead import prepare_ahead
    from selection_proto.core.base.hashing import block_hashes
    from selection_proto.core.base.settings import Settings
    from selection_proto.core.bookings import prompt as prompt_module
    from selection_proto.core.service import SelectionService

    monkeypatch.setattr(prompt_module, "PREHASH_SLICE_BLOCKS", 3)  # slices cut inside the prompt
    tokens = list(range(40))
    JSON = [("content-type", "application/json")]

    def fleet() -> SelectionService:
        service = SelectionService(Settings(kv_events="push"), random.Random(7))
        for wid in (1, 2):
            worker = {"worker_id": wid, "model_name": "m", "endpoint": f"http://w{wid}", "block_size": 2}
            assert service.handle("POST", "/workers", "", JSON, json.dumps(worker).encode(), now=0.0).status == 201
        booking = {"reservation_id": "a", "worker_id": 1, "model_name": "m", "token_ids": tokens[:30]}
        assert service.handle("POST", "/reservations", "", JSON, json.dumps(booking).encode(), now=0.0).status == 201
        return service

    def select(service: SelectionService, body: Any) -> Any:
        response = service.handle("POST", "/select", "", JSON, body, now=1.0)
        assert response.status == 200
        return json.loads(response.body)

    raw = json.dumps({"model_name": "m", "token_ids": tokens, "explain": True}).encode()
    plain, ahead = fleet(), fleet()
    prepared = prepare_ahead(ahead.pools, "/select", raw)
    assert prepared is not None and prepared.prehashed is not None
    (hashes,) = prepared.prehashed.by_key.values()
    assert hashes.blocks == block_hashes(tokens, 2) and len(hashes.counted) == 1
    assert select(ahead, prepared) == select(plain, raw)
    # Worker 1 books the whole prompt after the count: it is counted again, on the spot.
    later = {"reservation_id": "b", "worker_id": 1, "model_name": "m", "token_ids": tokens}
    for service in (plain, ahead):
        service.handle("POST", "/reservations", "", JSON, json.dumps(later).encode(), now=1.0)
    assert select(ahead, prepared) == select(plain, raw)
    # A body of other tokens borrows nothing from a prehashed one of the same length.
    other = json.dumps({"model_name": "m", "token_ids": tokens[::-1], "explain": True}).encode()
    prepared.value["token_ids"] = tokens[::-1]
    assert select(ahead, prepared) == select(plain, other)


def test_predictions_expire_per_booking_and_a_rebooked_prefix_moves_with_its_new_booking() -> None:
    """A booking's predicted blocks leave the tree together at its expiry; blocks booked again
    later (a shared prefix) stay until the later booking's expiry; `next_expiry` names each time."""
    from selection_proto.core.cache.index import DeviceTree
    from selection_proto.core.cache.predictions import Predictions

    tree, budget = DeviceTree(), StateBudget(1 << 40)
    predictions = Predictions(tree, 10.0, budget)
    first = list(range(1, 2001))
    shared_then_own = first[:1500] + list(range(5001, 5101))
    predictions.record((1, 0), first, now=0.0)
    predictions.record((1, 0), shared_then_own, now=4.0)
    assert predictions.next_expiry() == 10.0 and budget.index_blocks == 2100
    predictions.expire(10.0)  # the first booking's own tail goes; the re-booked prefix stays
    assert tree.find(first)[0] == {(1, 0): 1500} and budget.index_blocks == 1600
    assert predictions.next_expiry() == 14.0
    predictions.record((1, 0), first[:1500], now=5.0)  # the prefix again: its expiry moves to 15
    assert predictions.next_expiry() == 14.0  # the second booking's own tail is still due at 14
    predictions.expire(14.0)  # the second booking's own 100 go
    assert tree.find(first)[0] == {(1, 0): 1500} and budget.index_blocks == 1500
    assert predictions.next_expiry() == 15.0
    predictions.expire(15.0)
    assert tree.find(first)[0] == {} and budget.index_blocks == 0 and predictions.next_expiry() is None


def test_a_batch_booked_again_whole_is_read_a_slice_a_call() -> None:
    """`next_expiry` reads a batch whose blocks were all booked again later (a million stale
    ones held the loop 225 ms) a slice a call: until read through it names the old time, an
    early wake at which `expire` takes nothing; then the new one (docs/INVARIANTS.md)."""
    from unittest.mock import patch

    import selection_proto.core.cache.predictions as predictions_module
    from selection_proto.core.cache.index import DeviceTree
    from selection_proto.core.cache.predictions import Predictions

    tree, budget = DeviceTree(), StateBudget(1 << 40)
    predictions = Predictions(tree, 10.0, budget)
    prompt = list(range(1, 1001))
    with patch.object(predictions_module, "_SLICE", 100):
        predictions.record((1, 0), prompt, now=0.0)
        predictions.record((1, 0), prompt, now=4.0)
        times = [predictions.next_expiry() for _ in range(11)]
        assert times == [10.0] * 9 + [14.0] * 2  # the tenth call of 100 reads the stale 1,000 through
        predictions.expire(10.0)
        assert tree.find(prompt)[0] == {(1, 0): 1000} and budget.index_blocks == 1000
        predictions.expire(14.0)
        assert tree.find(prompt)[0] == {} and budget.index_blocks == 0 and predictions.next_expiry() is None


def test_a_long_prediction_expires_tail_first_a_slice_a_tick() -> None:
    """A booking longer than one slice leaves the tree tail first over several `expire` calls
    (a million-block one held the loop 1.2 s of CPU in one), `next_expiry` naming the same time
    until the last slice is out (docs/INVARIANTS.md)."""
    from unittest.mock import patch

    import selection_proto.core.cache.predictions as predictions_module
    from selection_proto.core.cache.index import DeviceTree
    from selection_proto.core.cache.predictions import Predictions

    tree, budget = DeviceTree(), StateBudget(1 << 40)
    predictions = Predictions(tree, 10.0, budget)
    prompt, other = list(range(1, 1001)), list(range(5001, 5051))
    with patch.object(predictions_module, "_EXPIRE_SLICE", 300):
        predictions.record((1, 0), prompt, now=0.0)
        predictions.record((2, 0), other, now=0.0)
        held = []
        while predictions.next_expiry() == 10.0:
            predictions.expire(10.0)
            held.append((tree.find(prompt)[0].get((1, 0), 0), tree.find(other)[0].get((2, 0), 0)))
        assert held == [(700, 50), (400, 50), (100, 50), (0, 0)]  # the first booking's tail first
        assert predictions.next_expiry() is None and budget.index_blocks == 0


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 40), st.integers(1, 2), st.integers(0, 30)),
                max_size=12), st.integers(1, 25))
def test_expiring_in_slices_leaves_the_tree_as_expiring_at_once(
        bookings: list[tuple[int, int, int, int]], expire_slice: int) -> None:
    """Bookings of prefixes of three prompts on two ranks at various times, each expired at every
    time in turn: in slices of `expire_slice` blocks, called until the time is done, the tree,
    the budget and the next expiry are as with one slice for everything."""
    from unittest.mock import patch

    import selection_proto.core.cache.predictions as predictions_module
    from selection_proto.core.cache.index import DeviceTree
    from selection_proto.core.cache.predictions import Predictions

    prompts = [list(range(1000 * p + 1, 1000 * p + 41)) for p in range(3)]

    def replay(size: int) -> list[Any]:
        tree, budget = DeviceTree(), StateBudget(1 << 40)
        predictions, seen = Predictions(tree, 5.0, budget), []

        def expire_until(end: float) -> None:
            while (due := predictions.next_expiry()) is not None and due <= end:
                while predictions.next_expiry() == due:  # the time done, slice by slice
                    predictions.expire(due)
                seen.append([due, predictions.next_expiry(), budget.index_blocks, *(tree.find(p)[0] for p in prompts)])

        with patch.object(predictions_module, "_EXPIRE_SLICE", size):
            for prompt, length, rank, at in sorted(bookings, key=lambda b: b[3]):
                expire_until(at)
                predictions.record((rank, 0), prompts[prompt][:length], now=float(at))
            expire_until(float("inf"))
        return seen

    assert replay(expire_slice) == replay(1 << 30)


STEPS = ("book", "book", "book", "free", "prefill", "free_later", "free_later", "tick", "overlap", "loads", "dump",
         "deadline", "outputs", "outputs")  # bookings, deferred frees and drained outputs the most often


@settings(max_examples=max(2_000, settings().max_examples))  # ~2 ms each
@example(steps=[("book", 0)] * 6 + [("book", 1), ("book", 0), ("book", 0), ("free_later", 0), ("free_later", 0),
                ("book", 0)])  # what a deferred free's dispatch deferred ran after the next free: out of order
@given(st.lists(st.tuples(st.sampled_from(STEPS), st.integers(0, 2)), max_size=40))
def test_deferred_work_is_invisible_to_every_call(steps: list[tuple[str, int]]) -> None:
    """Work left until an answer is written (a booking's predicted blocks; a free deferred as the
    picker defers one) changes no answer: a service whose deferred work is never run by its
    caller answers every call as a twin that runs it after each."""
    import random
    from functools import partial

    from selection_proto.core.base.errors import SelectionError
    from selection_proto.core.base.outputs import SelectionReady
    from selection_proto.core.base.responses import Pending
    from selection_proto.core.base.settings import Settings
    from selection_proto.core.base.types import OverlapScoresRequest, SelectAndReserveRequest
    from selection_proto.core.service import SelectionService

    def fleet() -> SelectionService:
        service = SelectionService(Settings(kv_events="approximate", router_ttl_secs=5.0, queue_threshold=0.5,
                                            queue_timeout_secs=3.0), random.Random(3))
        for wid in (1, 2):  # a 12-token prompt's prefill keeps its worker busy: the third queues
            service.upsert_worker(WorkerRequest(worker_id=wid, model_name="m", block_size=2, endpoint=f"http://w{wid}",
                                                max_num_batched_tokens=16), now=0.0)
        assert service.catalog.schedulable == 2
        return service

    def free_quietly(service: SelectionService, rid: str, now: float) -> None:
        try:
            service.free(rid, now=now)
        except SelectionError:
            pass  # freed already, or never booked: the picker's free is as quiet

    def step(service: SelectionService, kind: str, n: int, now: float) -> Any:
        prompt = list(range(n, n + 12))
        rid = f"r{n}"
        try:
            if kind == "book":
                answer = service.select_and_reserve(SelectAndReserveRequest(
                    model_name="m", token_ids=prompt, reservation_id=rid), now=now)
                return answer if isinstance(answer, Pending) else answer.worker_id
            if kind == "outputs":  # queued selections a free let run, among others
                return [(out.ticket, out.response.status, out.response.body) if isinstance(out, SelectionReady)
                        else type(out).__name__ for out in iter(service.next_output, None)]
            if kind in ("free", "prefill"):
                return (service.free if kind == "free" else service.prefill_complete)(rid, now=now)
            if kind == "free_later":  # as the picker frees once its echo is written
                service.deferred.add(partial(free_quietly, service, rid, now))
                return None
            if kind == "tick":
                service.tick(now)
                return None
            if kind == "overlap":
                return service.overlap_scores(OverlapScoresRequest(model_name="m", token_ids=prompt), now=now).to_json()
            if kind == "loads":
                return [load.to_json() for load in service.loads()]
            if kind == "dump":
                return service.dump()
            return service.next_deadline()
        except SelectionError as exc:
            return exc.status, exc.message

    lazy, eager = fleet(), fleet()
    for i, (kind, n) in enumerate(steps):
        now = 1.0 + i * 0.7
        assert step(lazy, kind, n, now) == step(eager, kind, n, now), (i, kind)
        eager.deferred.run()
    assert "selection_proto_internal_errors_total{" not in lazy.metrics_text(now=100.0)


def test_deferred_work_runs_in_order_once_and_confines_a_failure() -> None:
    from selection_proto.core.base.deferred import Deferred

    errors: list[str] = []
    done: list[str] = []
    deferred = Deferred(errors.append)

    def nested() -> None:
        done.append("nested")
        deferred.run()  # a piece that calls the service settles nothing nested...
        deferred.add(lambda: done.append("added"))  # ...and what it defers runs right after it

    def fails() -> None:
        raise RuntimeError("a piece's own fault")

    for piece in (nested, fails, lambda: done.append("last")):
        deferred.add(piece)
    assert deferred
    deferred.run()
    assert done == ["nested", "added", "last"] and errors == ["deferred"] and not deferred


def test_a_dispatched_selections_predictions_are_in_the_tree_before_the_next_one_runs() -> None:
    """Only a call's own answer goes out before its work is done: a queued selection that a free
    lets run books its predicted blocks at once, so that the next one dispatched sees them."""
    import random

    from selection_proto.core.base.hashing import block_hashes
    from selection_proto.core.base.responses import Pending
    from selection_proto.core.base.settings import Settings
    from selection_proto.core.base.types import SelectAndReserveRequest
    from selection_proto.core.service import SelectionService

    service = SelectionService(Settings(kv_events="approximate", queue_threshold=0.5), random.Random(3))
    service.upsert_worker(WorkerRequest(worker_id=1, model_name="m", block_size=2, endpoint="http://w1",
                                        max_num_batched_tokens=16), now=0.0)

    def book(rid: str, first: int) -> Any:
        return service.select_and_reserve(SelectAndReserveRequest(
            model_name="m", token_ids=list(range(first, first + 12)), reservation_id=rid), now=1.0)

    assert book("a", 100).worker_id == 1  # its 12 prefill tokens make the worker busy
    assert service.deferred  # a's predicted blocks: after its answer
    assert isinstance(book("queued", 200), Pending) and not service.deferred
    service.free("a", now=2.0)  # "queued" runs inside the free
    pool = next(iter(service.pools.values()))
    assert "queued" in pool.tracker.bookings and not service.deferred
    assert pool.index.device.find(block_hashes(list(range(200, 212)), 2))[0] == {(1, 0): 6}
    # A huge prompt's predictions wait for its answer too, in pieces that a transport runs one
    # at a time with other clients served between them; the next call runs what is left first.
    from selection_proto.core.bookings.tracker import PIECE_BLOCKS

    service.free("queued", now=3.0)
    tokens = list(range(1000, 1000 + 2 * (PIECE_BLOCKS + 1)))
    huge = SelectAndReserveRequest(model_name="m", token_ids=tokens, reservation_id="h2")
    service.select_and_reserve(huge, now=4.0)
    seen = []
    while pool.index.device.find(block_hashes(tokens, 2))[0] != {(1, 0): PIECE_BLOCKS}:
        assert service.deferred, seen
        service.deferred.run(limit=1)  # the booking's load first, then its predictions
        seen.append(pool.index.device.find(block_hashes(tokens, 2))[0])
    assert service.deferred  # the second piece is still to come
    service.loads()  # any call: the rest first
    assert not service.deferred
    assert pool.index.device.find(block_hashes(tokens, 2))[0] == {(1, 0): PIECE_BLOCKS + 1}
