"""Pending selections and output blocks in the core (issue 14), with a seeded clock: the cache's
limits, expiry and eviction order, the replay's statuses, and the output-block weights."""

from __future__ import annotations

import random

import pytest

from selection_proto import SelectionService, Settings
from selection_proto.core.errors import BadRequest, Conflict, NotFound, NotReady
from selection_proto.core.pending import PendingSelection, PendingSelections
from selection_proto.core.prompt import PromptHashes
from selection_proto.core.types import (
    ReservationRequest,
    SelectAndReserveRequest,
    SelectRequest,
    WorkerRequest,
)

KEY = ("m", "default")


def entry(at: float, size: int = 10) -> PendingSelection:
    return PendingSelection((1, 0), PromptHashes([], None, 1), 0, True, True, None, at, size)


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
