"""The ledger's core side without a server: the journal a replica writes, the answers it holds and
the mirror it keeps, driven by hand with the replies and feed entries a ledger would send."""

from __future__ import annotations

import json
import random
from typing import Any

import msgpack
import pytest

from selection_proto import SelectionService, Settings
from selection_proto.core.base.outputs import SelectionReady
from selection_proto.core.base.responses import Pending
from selection_proto.core.fleet.journal import LedgerSettings
from selection_proto.core.fleet.ledger_wire import (
    AddRecord,
    LedgerSnapshot,
    LedgerWireError,
    Reply,
    decode_add,
    decode_entry,
    decode_progress,
    decode_replies,
    decode_snapshot,
    encode_add,
    encode_progress,
    rank_key,
)
from selection_proto.core.ledger import Ledger

HEADERS = [("content-type", "application/json")]
PROMPT = {"model_name": "m", "token_ids": list(range(16))}
EMPTY = LedgerSnapshot("e", 0, b"0-0", {}, set(), {}, {}, {}, {}, {})


def replica(**ledger: Any) -> tuple[SelectionService, Ledger]:
    service = SelectionService(Settings(kv_events="push"), random.Random(0))
    mirror = service.share(LedgerSettings(**ledger), "me")
    mirror.connected(True, 0.0)
    mirror.load(EMPTY, 0.0)
    for worker_id in (1, 2):
        send(service, "POST", "/workers", {"worker_id": worker_id, "model_name": "m", "endpoint": "e",
                                           "block_size": 4})
    mirror.journal.take(100)
    return service, mirror


def send(service: SelectionService, method: str, path: str, body: Any = None) -> Any:
    data = b"" if body is None else json.dumps(body).encode()
    return service.handle(method, path, "", HEADERS, data, now=1.0)


def answers(service: SelectionService) -> dict[int, tuple[int, Any]]:
    out = {}
    while (event := service.next_output()) is not None:
        if isinstance(event, SelectionReady):
            out[event.ticket] = (event.response.status, json.loads(event.response.body))
    return out


def active(service: SelectionService) -> dict[int, int]:
    return {rank[0]: load.requests for pool in service.pools.values() for rank, load in pool.tracker.loads.items()}


def entry(n: int, kind: str, ident: str, body: bytes = b"", origin: bytes = b"other") -> tuple[bytes, dict[bytes, bytes]]:
    return (f"{n}-0".encode(), {b"n": str(n).encode(), b"o": origin, b"k": kind.encode(), b"i": ident.encode(),
                                b"b": body})


def test_a_strict_booking_waits_for_the_ledger_and_a_conflict_selects_again() -> None:
    service, mirror = replica(admission="strict")
    held = send(service, "POST", "/select_and_reserve", {**PROMPT, "reservation_id": "s1"})
    assert isinstance(held, Pending)
    ops = mirror.journal.take(10)
    assert [(op.kind, op.count) for op in ops] == [("add", 0)]
    # Another replica booked that rank first (the ledger's n is 7): undone, then selected again
    # once the feed has brought that booking.
    first = decode_add(ops[0].body)
    mirror.results(ops, [Reply("conflict", 1)], 1.0)
    assert active(service) == {1: 0, 2: 0} and answers(service) == {}
    theirs = encode_add(AddRecord("m", "default", first.worker_id, 0, 16, None, [9, 10, 11, 12]))
    mirror.apply([entry(1, "add", "theirs", theirs)], 1.0)
    retry = mirror.journal.take(10)
    assert [(op.kind, op.count) for op in retry] == [("add", 0)]  # the other worker, unbooked
    assert decode_add(retry[0].body).worker_id != first.worker_id
    mirror.results(retry, [Reply("ok", 2)], 1.0)
    (status, body), = answers(service).values()
    assert status == 200 and body["worker_id"] != first.worker_id
    assert service.metrics.value("selection_proto_ledger_events_total", ("conflict",)) == 1


@pytest.mark.parametrize("workers", [2, 6])
def test_a_strict_booking_conflicts_once_a_rank_at_most_then_is_made_advisory(workers: int) -> None:
    """A burst selected on one view spreads one booking a rank each round (docs/REPLICATION.md,
    "Strict admission"): a booking is selected again as a strict one after as many conflicts as
    its pool has ranks (at least 3), and booked advisory after that, never held longer."""
    service, mirror = replica(admission="strict")
    for worker_id in range(3, workers + 1):
        send(service, "POST", "/workers", {"worker_id": worker_id, "model_name": "m", "endpoint": "e",
                                           "block_size": 4})
    mirror.journal.take(100)
    assert isinstance(send(service, "POST", "/select_and_reserve", {**PROMPT, "reservation_id": "s"}), Pending)
    for _ in range(max(3, workers)):
        ops = mirror.journal.take(10)
        assert [(op.kind, op.count is not None) for op in ops] == [("add", True)]
        assert answers(service) == {}
        mirror.results(ops, [Reply("conflict", 0)], 1.0)  # the feed is already there: at once again
    last = mirror.journal.take(10)
    assert [(op.kind, op.count) for op in last] == [("add", None)]
    assert [status for status, _ in answers(service).values()] == [200]


@pytest.mark.parametrize("failure", ["open", "closed"])
def test_held_strict_bookings_when_the_ledger_goes_away(failure: str) -> None:
    service, mirror = replica(admission="strict", failure=failure)
    assert isinstance(send(service, "POST", "/select_and_reserve", {**PROMPT, "reservation_id": "h"}), Pending)
    mirror.connected(False, 2.0)
    (status, body), = answers(service).values()
    if failure == "closed":
        assert (status, body) == (503, {"error": "ledger unavailable"})
        assert sum(active(service).values()) == 0 and not mirror.journal.ops
    else:
        assert status == 200 and sum(active(service).values()) == 1
        assert [(op.kind, op.count, op.hold) for op in mirror.journal.ops] == [("add", None, None)]
    ready = service.ready(now=2.0)
    assert (ready.ready, ready.details) == (failure == "open", ("ledger: disconnected",))


def test_a_full_outbox_refuses_bookings_and_changes_nothing() -> None:
    service, mirror = replica(outbox_max=2)
    mirror.connected(False, 1.0)
    for i in range(2):
        assert send(service, "POST", "/select_and_reserve", {**PROMPT, "reservation_id": f"o{i}"}).status == 200
    before = active(service)
    refused = send(service, "POST", "/select_and_reserve", {**PROMPT, "reservation_id": "o2"})
    assert (refused.status, json.loads(refused.body)) == (503, {"error": "ledger outbox full"})
    assert active(service) == before and len(mirror.journal.ops) == 2


def test_a_snapshot_replaces_the_mirror_but_keeps_what_is_queued() -> None:
    service, mirror = replica()
    own = json.loads(send(service, "POST", "/select_and_reserve", {**PROMPT, "reservation_id": "queued"}).body)
    mirror.apply([entry(1, "add", "gone", encode_add(AddRecord("m", "default", 1, 0, 4, None, None)))], 2.0)
    assert active(service)[1] == 1 + (own["worker_id"] == 1)
    snapshot = LedgerSnapshot(
        "e", 40, b"40-0",
        {"x": encode_add(AddRecord("m", "default", 2, 0, 8, None, [1, 2])),
         "y": encode_add(AddRecord("m", "default", 1, 0, 8, None, None))},
        {"x"}, {"y": b"{\"other\": 2}"}, {rank_key("m", "default", 2, 0): 5},
        {"3": b"not json"}, {"x": "other", "y": "other"}, {})
    mirror.load(snapshot, 3.0)
    loads = {rank[0]: (load.requests, load.prefill_tokens, load.decode_blocks())
             for pool in service.pools.values() for rank, load in pool.tracker.loads.items()}
    mine = own["worker_id"]
    expected = {1: (1, 8, 2), 2: (1, 0, 2)}  # y with its two output blocks; x prefilled
    expected[mine] = (expected[mine][0] + 1, expected[mine][1] + 16, expected[mine][2] + 4)
    assert loads == expected  # "gone" went (not in the ledger), "queued" stayed (on its way)
    assert mirror.n == 40 and mirror.cursor == b"40-0" and mirror.synced
    assert mirror.journal.adds == {rank_key("m", "default", 2, 0): 5}
    assert service.metrics.value("selection_proto_ledger_events_total", ("bad_entry",)) == 1
    seeded = [(op.kind, op.ident) for op in mirror.journal.ops]
    assert seeded == [("add", "queued"), ("worker", "1"), ("worker", "2")]  # the ledger lacked them


def test_a_deleted_worker_in_a_snapshot_is_deleted_here_and_a_reset_gives_back_own_state() -> None:
    service, mirror = replica()
    assert send(service, "POST", "/reservations", {**PROMPT, "worker_id": 2, "reservation_id": "r"}).status == 201
    assert send(service, "POST", "/reservations/r/prefill_complete").status == 200
    mirror.journal.take(10)
    mirror.apply([entry(1, "add", "theirs", encode_add(AddRecord("m", "default", 2, 0, 4, None, None)))], 2.0)
    mirror.reseed()
    assert [(op.kind, op.ident) for op in mirror.journal.ops] == [
        ("worker", "1"), ("worker", "2"), ("add", "r"), ("prefill", "r")]  # not theirs
    assert mirror.needs_snapshot and mirror.epoch is None
    mirror.load(LedgerSnapshot("e2", 0, b"0-0", {}, set(), {}, {}, {"1": b""}, {}, {}), 3.0)
    assert service.catalog.get(1).lifecycle == "unschedulable"
    assert active(service) == {2: 1}  # its own booking, on its way again; theirs is not in the ledger


def test_a_written_through_free_answers_200_when_the_ledger_had_the_booking() -> None:
    service, mirror = replica()
    held = send(service, "DELETE", "/reservations/elsewhere")
    assert isinstance(held, Pending)
    ops = mirror.journal.take(10)
    assert [(op.kind, op.ident) for op in ops] == [("free", "elsewhere")]
    mirror.results(ops, [Reply("ok", 3)], 1.0)
    assert answers(service) == {held.ticket: (200, {"status": "ok"})}
    mirror.connected(False, 2.0)
    away = send(service, "DELETE", "/reservations/nowhere")  # another replica may hold it: retry later
    assert (away.status, json.loads(away.body)) == (
        503, {"error": "ledger unavailable: reservation nowhere may be booked on another replica"})


def test_a_written_through_free_answers_404_after_the_grace() -> None:
    service, mirror = replica(free_grace_secs=0.5)
    held = send(service, "DELETE", "/reservations/unknown")
    ops = mirror.journal.take(10)
    mirror.results(ops, [Reply("tombstoned", 0)], 1.0)
    assert answers(service) == {} and mirror.next_deadline() == 1.5
    mirror.tick(1.4)
    assert answers(service) == {}
    mirror.tick(1.5)
    assert answers(service) == {held.ticket: (404, {"error": "reservation unknown not found"})}
    assert mirror.next_deadline() is None


def test_the_codec_reads_what_it_writes_and_refuses_the_rest() -> None:
    record = AddRecord("m", "t", 7, 3, 100, 20, [0, 1, (1 << 64) - 1])
    assert decode_add(encode_add(record)) == record
    assert decode_progress(encode_progress(3, 0.5)) == (3, 0.5)
    for bad in (b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb(["m", "t", 7, 3, 1, None, b"abc"])):
        with pytest.raises(LedgerWireError):
            decode_add(bad)
    with pytest.raises(LedgerWireError):
        decode_progress(msgpack.packb([0, None]))
    assert decode_replies([b"epoch"], 3) is None
    assert decode_replies([b"ok 5", b"conflict 9", b"tombstoned"], 3) == [
        Reply("ok", 5), Reply("conflict", 9), Reply("tombstoned", 0)]
    for raw in ([b"ok"], [b"nope"], "x", [b"ok x"]):
        with pytest.raises(LedgerWireError):
            decode_replies(raw, 1 if isinstance(raw, list) and raw != [b"ok"] else 2)
    with pytest.raises(LedgerWireError):
        decode_entry(b"1-0", {b"n": b"1", b"o": b"o", b"k": b"zap", b"i": b"x", b"b": b""})
    with pytest.raises(LedgerWireError):
        decode_entry(b"1-0", {b"n": b"-1", b"o": b"o", b"k": b"free", b"i": b"x", b"b": b""})
    snap = decode_snapshot([b"e", None, None, [], [], [], [], [], [b"r", b"a"], [b"r", b"b"], [b"g", b"7"]])
    assert (snap.owners, snap.waiting, snap.ended) == ({"r": "a"}, {"r": "b"}, {"g": 7})
    with pytest.raises(LedgerWireError):
        decode_snapshot([b"e", b"1", b"1-0", [b"odd"], [], [], [], [], [], [], []])
    with pytest.raises(LedgerWireError):
        decode_snapshot([b"e", b"1", b"1-0", [], [], [], [], [], [], [], [b"g", b"-1"]])
    with pytest.raises(LedgerWireError):
        decode_snapshot([b"e", b"1", b"1-0", [], [], [], [], [], [], []])  # an older script's ten parts


def test_a_refused_bookings_free_from_the_feed_before_the_reply_still_answers_200() -> None:
    """The feed and the replies come on two connections: the free that a refused booking's
    replica caused can be applied before the reply that told this replica to wait for it."""
    service, mirror = replica()
    held = send(service, "DELETE", "/reservations/raced")
    ops = mirror.journal.take(10)
    mirror.apply([entry(1, "free", "raced", origin=b"the-booking-replica")], 1.0)
    mirror.results(ops, [Reply("tombstoned", 0)], 1.0)
    assert answers(service) == {held.ticket: (200, {"status": "ok"})}


def test_a_ledger_input_runs_the_deferred_work_first() -> None:
    """Work a call left until its answer was written (the picker's free as a response passes)
    comes before anything the ledger brings, as it comes before any service call."""
    service, mirror = replica()
    assert send(service, "POST", "/select_and_reserve", {**PROMPT, "reservation_id": "b1"}).status == 200
    mirror.journal.take(10)
    service.deferred.add(lambda: service.free("b1", now=1.0))
    mirror.apply([], 1.0)
    assert [(op.kind, op.ident) for op in mirror.journal.take(10)] == [("free", "b1")]
    assert not service.deferred
