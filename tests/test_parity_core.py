"""Pending selections, output blocks and session affinity in the core (docs/DECISIONS.md), with a seeded
clock: the cache's limits, expiry and eviction order, replays, output-block weights, bindings."""

from __future__ import annotations

import random

import pytest

from selection_proto import SelectionService, Settings
from selection_proto.core.base.errors import BadRequest, Conflict, NotFound, NotReady
from selection_proto.core.base.types import (
    ReservationRequest,
    SelectAndReserveRequest,
    SelectRequest,
    WorkerRequest,
)
from selection_proto.core.bookings.prompt import PromptHashes
from selection_proto.core.fleet.pending import PendingSelection, PendingSelections

KEY = ("m", "default")


def entry(at: float, size: int = 10) -> PendingSelection:
    return PendingSelection((1, 0), PromptHashes([], None, 1), 0, True, True, None, None, at, size)


def test_inserts_sweep_expired_entries_and_evict_the_oldest() -> None:
    cache = PendingSelections(ttl=10.0, max_entries=3, max_bytes=1000)
    for i, at in enumerate((0.0, 1.0, 2.0)):
        cache.remember(KEY, f"s{i}", entry(at), at)
    assert cache.get(KEY, "s0", 10.0) is not None and cache.get(KEY, "s0", 10.5) is None  # strictly older
    assert len(cache) == 3  # a lookup never sweeps
    cache.remember(KEY, "s3", entry(10.5), 10.5)  # sweeps s0
    assert len(cache) == 3 and cache.bytes == 30
    cache.remember(KEY, "s4", entry(10.6), 10.6)  # four entries: the oldest, s1, goes
    assert [cache.get(KEY, f"s{i}", 10.6) is not None for i in range(5)] == [False, False, True, True, True]
    cache.remember(KEY, "s2", entry(10.7), 10.7)  # latest wins and moves to the young end
    cache.remember(KEY, "s5", entry(10.8), 10.8)
    assert cache.get(KEY, "s3", 10.8) is None and cache.get(KEY, "s2", 10.8) is not None


def test_bytes_bound_and_a_zero_ttl_keeps_nothing() -> None:
    cache = PendingSelections(ttl=10.0, max_entries=100, max_bytes=25)
    cache.remember(KEY, "a", entry(0.0, 17), 0.0)
    cache.remember(KEY, "b", entry(0.0, 9), 0.0)  # 26 bytes: the oldest goes
    assert cache.get(KEY, "a", 0.0) is None and cache.bytes == 9
    cache.remember(KEY, "c", entry(0.0, 26), 0.0)  # larger than the bound: everything goes, itself too
    assert len(cache) == 0 and cache.bytes == 0
    zero = PendingSelections(ttl=0.0, max_entries=100, max_bytes=100)
    zero.remember(KEY, "a", entry(0.0), 0.0)
    assert zero.get(KEY, "a", 0.0) is None


def service(**settings: object) -> SelectionService:
    s = SelectionService(Settings(kv_events="push", **settings), random.Random(0))  # type: ignore[arg-type]
    s.upsert_worker(WorkerRequest(worker_id=1, model_name="m", endpoint="http://w1", block_size=4), now=0.0)
    return s


def decode_blocks(s: SelectionService) -> int:
    return s.loads()[0].loads[0].potential_decode_blocks


def test_a_replay_books_the_selection_once_and_failures_keep_it() -> None:
    s = service(selection_cache_ttl_secs=5.0)
    s.select(SelectRequest(model_name="m", selection_id="x", token_ids=list(range(9))), now=1.0)
    assert s.loads()[0].loads[0].active_requests == 0  # a select books nothing
    s.reserve(ReservationRequest(model_name="m", selection_id="x", token_ids=list(range(99))), now=2.0)
    assert (s.loads()[0].loads[0].potential_prefill_tokens, decode_blocks(s)) == (9, 2)
    with pytest.raises(NotFound, match="no pending selection x for model=m routing_group=default"):
        s.reserve(ReservationRequest(model_name="m", selection_id="x"), now=2.0)
    s.select(SelectRequest(model_name="m", selection_id="x", token_ids=list(range(9))), now=3.0)
    with pytest.raises(Conflict, match="selection x is already reserved or being reserved"):
        s.reserve(ReservationRequest(model_name="m", selection_id="x"), now=3.0)
    s.free("x", now=3.0)
    s.delete_worker(1, now=3.0)
    with pytest.raises(NotReady):
        s.reserve(ReservationRequest(model_name="m", selection_id="x"), now=3.0)
    s.upsert_worker(WorkerRequest(worker_id=1, model_name="m", endpoint="http://w1", block_size=4), now=3.0)
    assert s.reserve(ReservationRequest(model_name="m", selection_id="x"), now=3.0).worker_id == 1
    s.select(SelectRequest(model_name="m", selection_id="late", token_ids=[1]), now=3.0)
    with pytest.raises(NotFound):
        s.reserve(ReservationRequest(model_name="m", selection_id="late"), now=8.5)  # past its TTL


def test_select_and_reserve_uses_the_selection_id_as_its_booking_id() -> None:
    s = service()
    answer = s.select_and_reserve(SelectAndReserveRequest(model_name="m", selection_id="b", token_ids=[1, 2]),
                                  now=1.0)
    assert (answer.selection_id, answer.reservation_id) == ("b", "b")  # type: ignore[union-attr]
    s.free("b", now=1.0)
    with pytest.raises(NotFound):  # and it leaves no pending selection
        s.reserve(ReservationRequest(model_name="m", selection_id="b"), now=1.0)


def test_output_blocks_and_decay_weigh_the_unshared_tail() -> None:
    s = service()
    s.select_and_reserve(SelectAndReserveRequest(model_name="m", selection_id="long", token_ids=list(range(12))),
                         now=1.0)
    s.select_and_reserve(SelectAndReserveRequest(model_name="m", selection_id="short", token_ids=list(range(4))),
                         now=1.0)
    assert decode_blocks(s) == 3  # the short prompt is the long one's first block
    s.output_block("long", now=1.0)
    assert decode_blocks(s) == 4
    s.output_block("long", 0.5, now=1.0)  # 1 shared + 2 x 0.5 unshared + 2 x 0.5 output
    assert decode_blocks(s) == 3
    s.output_block("long", 0.0, now=1.0)  # 1 + 0 + 0 (three outputs, all weighing 0)
    assert decode_blocks(s) == 1
    with pytest.raises(BadRequest, match="decay_fraction must be between 0.0 and 1.0"):
        s.output_block("nobody", 1.5, now=1.0)
    s.free("long", now=1.0)
    assert decode_blocks(s) == 1
    s.free("short", now=1.0)
    assert decode_blocks(s) == 0 and s.pools[("m", "default")].tracker.loads[(1, 0)].extra == 0.0


def two_workers(**settings: object) -> SelectionService:
    s = service(**settings)
    s.upsert_worker(WorkerRequest(worker_id=2, model_name="m", endpoint="http://w2", block_size=4), now=0.0)
    # Worker 1 is busier: an unbound selection goes to worker 2.
    s.select_and_reserve(SelectAndReserveRequest(model_name="m", reservation_id="load1", token_ids=list(range(40)),
                                                 pinned_worker={"worker_id": 1, "dp_rank": 0}), now=0.0)
    return s


def pick(s: SelectionService, now: float, **fields: object) -> int:
    answer = s.select(SelectRequest(model_name="m", token_ids=list(range(100, 109)), **fields), now=now)
    return answer.worker_id  # type: ignore[union-attr]


def book(s: SelectionService, rid: str, now: float, **fields: object) -> int:
    fields = {"token_ids": list(range(100, 109)), **fields}
    answer = s.select_and_reserve(SelectAndReserveRequest(model_name="m", reservation_id=rid, **fields), now=now)
    return answer.worker_id  # type: ignore[union-attr]


def test_a_session_binding_follows_its_rank_while_a_booking_holds_it() -> None:
    s = two_workers(session_affinity_ttl_secs=2.0)
    assert book(s, "a", 1.0, session_id="S") == 2
    book(s, "load2", 1.0, pinned_worker={"worker_id": 2, "dp_rank": 0}, token_ids=list(range(200)))
    assert pick(s, 1.0) == 1  # unbound: load decides
    assert pick(s, 1.0, session_id="S") == 2  # bound: the busier worker
    s.free("a", now=5.0)
    assert pick(s, 6.9, session_id="S") == 2  # within 2 s of the last release
    assert pick(s, 7.0, session_id="S") == 1  # expired


def test_a_booking_away_from_the_binding_is_400_and_drops_it() -> None:
    s = two_workers(session_affinity_ttl_secs=30.0)
    book(s, "a", 1.0, session_id="S")
    before = s.loads()
    with pytest.raises(BadRequest, match="session S is bound to worker 2, not 1"):
        book(s, "b", 1.0, session_id="S", allowed_worker_ids=[1])
    assert s.loads() == before
    book(s, "load2", 1.0, pinned_worker={"worker_id": 2, "dp_rank": 0}, token_ids=list(range(200)))
    assert pick(s, 1.0, session_id="S") == 1  # the binding is gone


def test_affinity_off_ignores_sessions_and_a_full_table_books_unbound() -> None:
    off = two_workers()
    book(off, "a", 1.0, session_id="x" * 300)  # not even checked
    book(off, "load2", 1.0, pinned_worker={"worker_id": 2, "dp_rank": 0}, token_ids=list(range(200)))
    assert pick(off, 1.0, session_id="x" * 300) == 1
    full = two_workers(session_affinity_ttl_secs=30.0, max_sessions_per_key=1)
    book(full, "a", 1.0, session_id="A")
    book(full, "b", 1.0, session_id="B")  # no room: booked, not bound
    book(full, "load2", 1.0, pinned_worker={"worker_id": 2, "dp_rank": 0}, token_ids=list(range(200)))
    assert (pick(full, 1.0, session_id="A"), pick(full, 1.0, session_id="B")) == (2, 1)
    with pytest.raises(BadRequest, match="must not exceed 256 bytes"):
        pick(full, 1.0, session_id="é" * 129)


def test_metrics_show_pending_selections_and_bindings() -> None:
    s = two_workers(session_affinity_ttl_secs=30.0)
    s.select(SelectRequest(model_name="m", selection_id="x", token_ids=list(range(9))), now=1.0)
    book(s, "a", 1.0, session_id="S")
    s.output_block("a", now=1.0)
    text = s.metrics_text(now=1.0)
    assert "selection_proto_pending_selections 1.0" in text
    assert "selection_proto_pending_selection_bytes 25.0" in text  # 2 hashes, "x", "m", "default"
    assert 'selection_proto_session_bindings{model_name="m",tenant_id="default"} 1.0' in text
    assert ('selection_proto_reservation_events_total{model_name="m",tenant_id="default",event="output_block"} 1.0'
            in text)


def test_recovering_a_1_6_1_index_checks_it_whole_first() -> None:
    from selection_proto.core.base.errors import Unprocessable

    stored = {"worker_id": 1, "event": {"event_id": 0, "dp_rank": 0, "data": {"stored": {
        "parent_hash": None, "blocks": [{"block_hash": 5, "tokens_hash": 55}]}}}}
    removed = {"worker_id": 1, "event": {"event_id": 1, "data": {"removed": {"block_hashes": [5]}}}}
    for bad, why in (({"m": {"block_size": 4, "events": []}}, "<model>:<group>"),
                     ({"m:g": {"block_size": 0, "events": []}}, "block_size"),
                     ({"m:g": {"block_size": 4, "events": [stored, removed]}}, "expected stored events")):
        fresh = SelectionService(Settings(kv_events="push"))
        with pytest.raises(Unprocessable, match=why):
            fresh.recover(bad, "http://peer", now=0.0)
        assert not fresh.pools and fresh.recovered_from is None  # nothing applied
    crowded = SelectionService(Settings(kv_events="push", max_keys=1))
    with pytest.raises(Conflict, match="key limit"):
        crowded.recover({"a:g": {"block_size": 4, "events": []}, "b:g": {"block_size": 4, "events": []}},
                        "http://peer", now=0.0)
    warm = SelectionService(Settings(kv_events="push"))
    warm.recover({"m:default": {"block_size": 4, "events": [stored]}}, "http://peer", now=0.0)
    assert warm.ready(now=0.0).to_json()["recovered_from"] == "http://peer"
    assert warm.dump()["events"] == []  # not ours to dump until worker 1 registers here
    warm.upsert_worker(WorkerRequest(worker_id=1, model_name="m", endpoint="http://w1", block_size=4), now=0.0)
    assert len(warm.dump()["events"]) == 1


def test_a_predicted_side_index_beside_real_events() -> None:
    """`predicted_ttl_secs` (1.6.1's `DYN_ROUTER_PREDICTED_TTL_SECS`): bookings predict into a side
    tree; a rank's prefix is the larger of the two; the side is not dumped and expires."""
    from selection_proto import OverlapScoresRequest, ReservationRequest
    from selection_proto.core.base.hashing import block_hashes
    from selection_proto.core.cache.events import decode_json_events

    s = SelectionService(Settings(kv_events="push", predicted_ttl_secs=3.0), random.Random(0))
    for wid in (1, 2):
        s.upsert_worker(WorkerRequest(worker_id=wid, model_name="m", endpoint=f"http://w{wid}", block_size=4),
                        now=0.0)
    tokens = list(range(12))
    first = block_hashes(tokens, 4)[0]
    s.apply_kv_events(decode_json_events({"worker_id": 1, "event": {"event_id": 1, "data": {"stored": {
        "parent_hash": None, "blocks": [{"block_hash": 77, "tokens_hash": first}]}}}}), now=0.0)

    def rows(now: float) -> dict[int, int]:
        answer = s.overlap_scores(OverlapScoresRequest(model_name="m", token_ids=tokens), now=now)
        return {row["worker_id"]: row["device_blocks"] for row in answer.workers if row["device_blocks"]}

    assert rows(0.0) == {1: 1}
    s.reserve(ReservationRequest(model_name="m", reservation_id="a", worker_id=1, token_ids=tokens), now=0.0)
    s.reserve(ReservationRequest(model_name="m", reservation_id="b", worker_id=2, token_ids=tokens[:8]), now=0.0)
    assert rows(0.0) == {1: 3, 2: 2}
    assert len(s.dump()["events"]) == 1  # the real block only
    assert s.next_deadline() == pytest.approx(3.0)
    s.tick(3.05)
    assert rows(3.05) == {1: 1}
    s.delete_worker(2, now=3.1)  # a rank leaving takes its predictions along
    assert s.budget.index_blocks == 1


def test_session_bindings_count_in_the_state_budget() -> None:
    from selection_proto.core.base.budget import SESSION_BYTES

    s = two_workers(session_affinity_ttl_secs=30.0)
    book(s, "a", 1.0, session_id="S")
    assert s.budget.session_bytes == SESSION_BYTES + 1
    s.free("a", now=1.0)
    assert pick(s, 40.0, session_id="S") in (1, 2)  # expired, and forgotten when read
    assert s.budget.session_bytes == 0
    book(s, "b", 41.0, session_id="T")
    for wid in (1, 2):
        s.delete_worker(wid, now=41.0)  # the pool goes, and its bindings with it
    assert s.budget.session_bytes == 0
