"""The admission queue (core.md §10): order per policy, dispatch, timeouts, cancellation, shutdown."""

from __future__ import annotations

import json
import random
from typing import Any

from conftest import Client, worker
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from selection_proto import (
    Pending,
    SelectionReady,
    SelectionService,
    SelectRequest,
    Settings,
    WorkerRequest,
)


def busy_client(make_client: Any, workers: int = 1, **settings: Any) -> Client:
    c: Client = make_client(queue_threshold=1.0, **settings)
    for wid in range(1, workers + 1):
        c.ok("POST", "/workers", worker(wid, max_num_batched_tokens=10), status=201)
        c.ok("POST", "/reservations", {"model_name": "m", "reservation_id": f"hold{wid}", "worker_id": wid,
                                       "token_ids": list(range(16))}, status=201)
    return c


def submit(c: Client, body: dict[str, Any], path: str = "/select") -> Any:
    result = c.service.handle("POST", path, "", [("content-type", "application/json")],
                              json.dumps({"model_name": "m", "token_ids": [1, 2, 3, 4], **body}).encode(),
                              now=c.now)
    return result


def drain(c: Client) -> list[SelectionReady]:
    out = []
    while (event := c.service.next_output()) is not None:
        if isinstance(event, SelectionReady):
            out.append(event)
    return out


def test_queue_holds_until_load_frees(make_client: Any) -> None:
    c = busy_client(make_client)
    pending = submit(c, {"selection_id": "a"})
    assert isinstance(pending, Pending)
    loads = c.ok("GET", "/loads")[0]
    assert (loads["pending_count"], loads["pending_isl_tokens"]) == (1, 4)
    assert drain(c) == []
    c.ok("DELETE", "/reservations/hold1")
    (ready,) = drain(c)
    assert ready.ticket == pending.ticket and ready.response.status == 200
    assert json.loads(ready.response.body)["selection_id"] == "a"
    assert c.ok("GET", "/loads")[0]["pending_count"] == 0


def test_allowed_worker_ids_bypass_the_queue(make_client: Any) -> None:
    c = busy_client(make_client)
    assert c.ok("POST", "/select", {"model_name": "m", "token_ids": [1], "allowed_worker_ids": [1]})["worker_id"] == 1


def _order(make_client: Any, policy: str) -> list[str]:
    c = busy_client(make_client, queue_policy=policy)
    submit(c, {"selection_id": "first", "token_ids": list(range(40))})
    c.now += 5
    submit(c, {"selection_id": "second", "token_ids": list(range(8))})
    c.now += 5
    submit(c, {"selection_id": "jumper", "token_ids": list(range(40)), "priority_jump": 50})
    # Each dispatched select books nothing, so freeing once dispatches every request in order.
    c.ok("DELETE", "/reservations/hold1")
    return [json.loads(r.response.body)["selection_id"] for r in drain(c)]


def test_fcfs_lcfs_wspt_orders(make_client: Any) -> None:
    assert _order(make_client, "fcfs") == ["jumper", "first", "second"]
    assert _order(make_client, "lcfs") == ["jumper", "second", "first"]
    # wspt: (1 + j) / max(1, isl - cached): jumper 51/40, second 1/8, first 1/40
    assert _order(make_client, "wspt") == ["jumper", "second", "first"]


def test_dispatch_rebooks_and_keeps_others_waiting(make_client: Any) -> None:
    c = busy_client(make_client)
    first = submit(c, {"reservation_id": "x", "token_ids": list(range(16))}, "/select_and_reserve")
    second = submit(c, {"reservation_id": "y", "token_ids": list(range(16))}, "/select_and_reserve")
    c.ok("DELETE", "/reservations/hold1")
    (ready,) = drain(c)  # x booked 16 prefill tokens: the rank is busy again, y keeps waiting
    assert ready.ticket == first.ticket and json.loads(ready.response.body)["reservation_id"] == "x"
    c.ok("POST", "/reservations/x/prefill_complete")
    (ready,) = drain(c)
    assert ready.ticket == second.ticket and ready.response.status == 200


def test_timeout_cancel_full_shutdown_and_key_removal(make_client: Any) -> None:
    c = busy_client(make_client, queue_timeout_secs=2.5, queue_max_pending=2)
    a = submit(c, {})
    b = submit(c, {})
    assert c.error("POST", "/select", {"model_name": "m", "token_ids": [1]}) == (
        429, "queue is full for model=m tenant=default: 2 requests pending")
    assert c.service.cancel(b.ticket, now=c.now) is True
    assert c.service.cancel(b.ticket, now=c.now) is False
    assert c.service.next_deadline() == c.now + 2.5
    c.service.tick(c.now + 2.5)
    (ready,) = drain(c)
    assert ready.ticket == a.ticket and ready.response.status == 503
    assert json.loads(ready.response.body) == {
        "error": "timed out after 2.5 s waiting in the queue for model=m tenant=default"}
    d = submit(c, {})
    c.ok("DELETE", "/workers/1")
    (ready,) = drain(c)
    assert ready.ticket == d.ticket
    assert json.loads(ready.response.body) == {"error": "no schedulable workers for model=m tenant=default"}
    c2 = busy_client(make_client)
    e = submit(c2, {})
    c2.service.begin_shutdown(now=c2.now)
    (ready,) = drain(c2)
    assert ready.ticket == e.ticket
    assert json.loads(ready.response.body) == {"error": "selection service is shutting down"}


def test_pinned_request_does_not_block_others(make_client: Any) -> None:
    c = busy_client(make_client, workers=2)
    pinned = submit(c, {"pinned_worker": {"worker_id": 1, "dp_rank": 0}})
    other = submit(c, {})
    c.ok("DELETE", "/reservations/hold2")
    (ready,) = drain(c)
    assert ready.ticket == other.ticket and json.loads(ready.response.body)["worker_id"] == 2
    c.ok("DELETE", "/reservations/hold1")
    (ready,) = drain(c)
    assert ready.ticket == pinned.ticket and json.loads(ready.response.body)["worker_id"] == 1


def test_metadata_rule_while_queueing(make_client: Any) -> None:
    c = make_client(queue_threshold=1.0)
    assert c.ok("POST", "/workers", worker(1), status=201)["not_schedulable_reasons"] == [
        "max_num_batched_tokens is required while queueing is enabled"]


class QueueMachine(RuleBasedStateMachine):
    """Selects, bookings, frees and ticks interleave: every ticket is answered exactly once unless
    cancelled, every booked load is freed exactly once, pending counts match."""

    @initialize(seed=st.integers(0, 2**16))
    def start(self, seed: int) -> None:
        self.service = SelectionService(Settings(kv_events="push", queue_threshold=1.0, queue_timeout_secs=5.0),
                                        random.Random(seed))
        for wid in (1, 2):
            self.service.upsert_worker(WorkerRequest(
                worker_id=wid, model_name="m", endpoint="e", block_size=4, max_num_batched_tokens=8), now=0.0)
        self.now = 0.0
        self.open: set[int] = set()
        self.answered: set[int] = set()
        self.cancelled: set[int] = set()
        self.bookings: set[str] = set()
        self.n = 0

    def collect(self) -> None:
        while (event := self.service.next_output()) is not None:
            if isinstance(event, SelectionReady):
                assert event.ticket in self.open and event.ticket not in self.answered
                self.open.discard(event.ticket)
                self.answered.add(event.ticket)
                if event.response.status == 200:
                    rid = json.loads(event.response.body).get("reservation_id")
                    if rid is not None:
                        self.bookings.add(rid)

    @rule(tokens=st.integers(0, 24), reserve=st.booleans())
    def select(self, tokens: int, reserve: bool) -> None:
        from selection_proto import SelectAndReserveRequest

        self.n += 1
        self.now += 0.5
        if reserve:
            result = self.service.select_and_reserve(SelectAndReserveRequest(
                model_name="m", token_ids=list(range(tokens)), reservation_id=f"r{self.n}"), now=self.now)
        else:
            result = self.service.select(SelectRequest(model_name="m", token_ids=list(range(tokens))), now=self.now)
        if isinstance(result, Pending):
            self.open.add(result.ticket)
        elif reserve:
            self.bookings.add(f"r{self.n}")
        self.collect()

    @rule(data=st.data())
    def free_or_prefill(self, data: st.DataObject) -> None:
        if not self.bookings:
            return
        rid = data.draw(st.sampled_from(sorted(self.bookings)))
        self.now += 0.5
        if data.draw(st.booleans()):
            self.service.prefill_complete(rid, now=self.now)
        else:
            self.service.free(rid, now=self.now)
            self.bookings.discard(rid)
        self.collect()

    @rule(dt=st.floats(0, 6))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.service.tick(self.now)
        self.collect()

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        if self.open:
            ticket = data.draw(st.sampled_from(sorted(self.open)))
            assert self.service.cancel(ticket, now=self.now)
            self.open.discard(ticket)
            self.cancelled.add(ticket)

    @invariant()
    def pending_matches(self) -> None:
        if hasattr(self, "service"):
            loads = self.service.loads()
            assert sum(m.pending_count for m in loads) == len(self.open)

    def teardown(self) -> None:
        if not hasattr(self, "service"):
            return
        self.service.begin_shutdown(now=self.now)
        self.collect()
        assert not self.open
        for rid in sorted(self.bookings):
            self.service.free(rid, now=self.now)
        for load in self.service.loads():
            assert all(p.active_requests == 0 and p.potential_prefill_tokens == 0 for p in load.loads)


QueueMachine.TestCase.settings = settings(stateful_step_count=40)
TestQueueMachine = QueueMachine.TestCase
