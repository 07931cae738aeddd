"""A Hypothesis state machine over the whole core: workers come and go and are patched, KV events
of both encodings (malformed ones too), selects, reservations, prefill completions, frees, ticks,
with queueing on or off, under either router policy (with ttft, engines' stored events also end
prefills). The invariants are those of docs/INVARIANTS.md, and the booked prefill is exactly that
of the bookings not done."""

from __future__ import annotations

import json
import random
from typing import Any

import msgpack
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from selection_proto import Pending, SelectionReady, SelectionService, Settings
from selection_proto.core.base import jsonio

WORKERS = st.integers(1, 4)
TOKENS = st.lists(st.integers(0, 3), min_size=0, max_size=24)
ALLOWED = {200, 201, 400, 404, 405, 409, 413, 415, 422, 429, 503, 529}


class ServiceMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**32 - 1), queueing=st.booleans(), policy=st.sampled_from(["dynamo", "ttft"]))
    def start(self, seed: int, queueing: bool, policy: str) -> None:
        # Queueing on: flow control too (classes with caps, fairness caps, promotion, 529 refusals).
        flow: dict[str, Any] = dict(flow_classes="gold:3:max_queued=2,bulk:1:queue_timeout_secs=0.5",
                                    fairness_max_queued=3, priority_promote_secs=0.2,
                                    overload_status_code=529) if queueing else {}
        # ttft: a booking's prefill also ends when its engine stores its prompt (prefill_ends.py).
        self.service = SelectionService(Settings(kv_events="push", max_reservations_per_key=8,
                                                 queue_threshold=1.0 if queueing else None,
                                                 router_policy=policy, **flow),
                                        random.Random(seed))
        self.tickets: set[int] = set()
        self.now = 0.0
        self.bookings: set[str] = set()
        self.prompts: dict[str, list[int]] = {}  # each booking's token ids
        self.policy = policy
        self.next_id = 0
        self.event_id = 0

    def call(self, method: str, path: str, body: Any = None, query: str = "", raw: bytes | None = None) -> tuple[int, Any]:
        self.now += 0.01
        data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
        status, headers, payload = self.service.handle(method, path, query, [("content-type", "application/json")],
                                                       data, now=self.now)
        assert status in ALLOWED or (status == 503 and path == "/ready"), (status, payload)
        assert dict(headers)["content-length"] == str(len(payload))
        return status, json.loads(payload)

    @rule(wid=WORKERS, dp=st.integers(1, 2), bs=st.sampled_from([2, 4]))
    def upsert(self, wid: int, dp: int, bs: int) -> None:
        status, _ = self.call("POST", "/workers", {"worker_id": wid, "endpoint": f"http://w{wid}",
                                                    "block_size": bs, "data_parallel_size": dp,
                                                    "max_num_batched_tokens": 8})
        assert status == 201
        if self.policy == "ttft":  # its engine publishes at once (rank 0): its bookings' prefill ends are read
            self.event_id += 1
            self.call("POST", "/kv_events", [{"worker_id": wid, "event": {"event_id": self.event_id, "dp_rank": 0,
                      "data": {"stored": {"parent_hash": None, "blocks": [{"block_hash": 5, "tokens_hash": 5}]}}}}])
        # A worker that leaves or loses ranks drops their bookings (core.md §6.5).
        self.bookings = {b for b in self.bookings if self.live(b)}

    @rule(wid=WORKERS, dp=st.none() | st.integers(1, 2), taint=st.booleans())
    def patch(self, wid: int, dp: int | None, taint: bool) -> None:
        body: dict[str, Any] = {"taints": ["t"] if taint else []}
        if dp is not None:
            body["data_parallel_size"] = dp
        status, _ = self.call("PATCH", f"/workers/{wid}", body)
        assert status in (200, 404)
        self.bookings = {b for b in self.bookings if self.live(b)}

    @rule(wid=WORKERS, tokens=TOKENS, parent=st.booleans(), cut=st.none() | st.integers(0, 80),
          medium=st.sampled_from([None, "GPU", "CPU", "DISK"]))
    def engine_batch(self, wid: int, tokens: list[int], parent: bool, cut: int | None, medium: str | None) -> None:
        hashes = [1000 + i for i in range(len(tokens) // 2)]
        payload = msgpack.packb([0.0, [["BlockStored", hashes, 999 if parent else None, tokens, 2, None, medium,
                                        None, None], ["BlockRemoved", hashes[:1]]], 0])
        if cut is not None:
            payload = payload[:cut]  # a truncated batch must change nothing
        before = self.snapshot()
        self.now += 0.01
        status, _, body = self.service.handle("POST", "/kv_events", f"worker_id={wid}",
                                              [("content-type", "application/msgpack")], payload, now=self.now)
        assert status in ALLOWED, body
        if status != 200:
            assert self.snapshot() == before

    @rule(dt=st.floats(0, 400))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.service.tick(self.now)
        self.bookings = {b for b in self.bookings if self.live(b)}

    @rule(wid=WORKERS)
    def delete(self, wid: int) -> None:
        status, _ = self.call("DELETE", f"/workers/{wid}")
        assert status in (200, 404)
        self.bookings = {b for b in self.bookings if self.live(b)}

    def live(self, rid: str) -> bool:
        return any(rid in s.tracker.bookings for s in self.service.pools.values())

    @rule(wid=WORKERS, tokens=TOKENS, dp=st.integers(0, 1), parent=st.booleans())
    def store(self, wid: int, tokens: list[int], dp: int, parent: bool) -> None:
        from selection_proto import block_hashes

        blocks = block_hashes(tokens, 2)
        self.event_id += 1
        data = {"stored": {"parent_hash": (blocks[0] * 7 % 2**64) if parent and blocks else None,
                           "blocks": [{"block_hash": h * 7 % 2**64, "tokens_hash": h} for h in blocks[parent:]]}}
        before = self.snapshot()
        status, _ = self.call("POST", "/kv_events", [{"worker_id": wid, "event": {
            "event_id": self.event_id, "dp_rank": dp, "data": data}}])
        if status != 200:
            assert self.snapshot() == before

    @rule(wid=WORKERS, tokens=TOKENS)
    def remove(self, wid: int, tokens: list[int]) -> None:
        from selection_proto import block_hashes

        self.event_id += 1
        hashes = [h * 7 % 2**64 for h in block_hashes(tokens, 2)]
        self.call("POST", "/kv_events", [{"worker_id": wid, "event": {
            "event_id": self.event_id, "data": {"removed": {"block_hashes": hashes}}}}])

    @rule(tokens=TOKENS, reserve=st.booleans(), pin=st.none() | WORKERS, flow=st.fixed_dictionaries({}, optional={
        "fairness_id": st.sampled_from(["a", "b", ""]), "priority": st.integers(-1, 2),
        "policy_class": st.sampled_from(["gold", "bulk", "nope"]), "deadline_ms": st.sampled_from([0.001, 50.0, 1e6]),
        "do_not_queue": st.booleans()}))
    def select(self, tokens: list[int], reserve: bool, pin: int | None, flow: dict[str, Any]) -> None:
        body: dict[str, Any] = {"token_ids": tokens, "explain": True, **flow}
        if pin is not None:
            body["pinned_worker"] = {"worker_id": pin, "dp_rank": 0}
        if reserve:
            self.next_id += 1
            body["reservation_id"] = f"r{self.next_id}"
            self.prompts[body["reservation_id"]] = tokens
        before = self.snapshot()
        self.now += 0.01
        result = self.service.handle("POST", "/select_and_reserve" if reserve else "/select", "",
                                     [("content-type", "application/json")], json.dumps(body).encode(),
                                     now=self.now)
        # A booking expires on any call that books (active_request_expiry_secs), not only on ticks.
        self.bookings = {b for b in self.bookings if self.live(b)}
        if isinstance(result, Pending):
            self.tickets.add(result.ticket)
            return
        status, answer = result.status, json.loads(result.body)
        assert status in ALLOWED
        if status == 200:
            if reserve:
                self.bookings.add(answer["reservation_id"])
            scores = [c["device_blocks"] for c in answer["candidates"]]
            assert all(0 <= s <= len(tokens) // 2 for s in scores)
        else:
            assert self.snapshot() == before

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        if not self.bookings:
            return
        rid = data.draw(st.sampled_from(sorted(self.bookings)))
        if data.draw(st.booleans()):
            assert self.call("POST", f"/reservations/{rid}/prefill_complete")[0] == 200
        else:
            assert self.call("DELETE", f"/reservations/{rid}")[0] == 200
            self.bookings.discard(rid)

    @rule(data=st.data(), upto=st.none() | st.integers(0, 12))
    def engine_stores_a_prompt(self, data: st.DataObject, upto: int | None) -> None:
        """A booking's engine stores its prompt's blocks (or the first `upto`): with ttft, a
        booking waiting for them has ended its prefill once all are stored."""
        from selection_proto import block_hashes

        if not self.bookings:
            return
        rid = data.draw(st.sampled_from(sorted(self.bookings)))
        pool = next(p for p in self.service.pools.values() if rid in p.tracker.bookings)
        booking = pool.tracker.bookings[rid]
        blocks = block_hashes(self.prompts[rid], pool.block_size)[:upto]
        waiting = booking.awaits is not None
        self.event_id += 1
        status, _ = self.call("POST", "/kv_events", [{"worker_id": booking.rank[0], "event": {
            "event_id": self.event_id, "dp_rank": booking.rank[1], "data": {"stored": {
                "parent_hash": None, "blocks": [{"block_hash": h * 7 % 2**64, "tokens_hash": h} for h in blocks]}}}}])
        if status == 200 and waiting and len(blocks) >= len(booking.awaits or blocks):
            assert booking.prefill_done and booking.awaits is None

    @rule(raw=st.binary(max_size=40), path=st.sampled_from(["/select", "/workers", "/kv_events", "/reservations"]))
    def garbage(self, raw: bytes, path: str) -> None:
        before = self.snapshot()
        status, answer = self.call("POST", path, raw=raw)
        assert "error" in answer or status in (200, 201)
        if status >= 400:
            assert self.snapshot() == before

    def drain(self) -> None:
        while (out := self.service.next_output()) is not None:
            if isinstance(out, SelectionReady):
                assert out.ticket in self.tickets, "a ticket answered twice or never issued"
                self.tickets.discard(out.ticket)
                if out.response.status == 200:
                    rid = json.loads(out.response.body).get("reservation_id")
                    if rid is not None:
                        self.bookings.add(rid)

    def snapshot(self) -> tuple[Any, ...]:
        s = self.service
        return (json.dumps([r.to_json() for r in s.list_workers()]),
                json.dumps([m.to_json() for m in s.loads()]), json.dumps(s.dump()))

    @invariant()
    def loads_are_consistent(self) -> None:
        if not hasattr(self, "service"):
            return
        self.drain()
        assert sum(m.pending_count for m in self.service.loads()) == len(self.tickets)
        for state in self.service.pools.values():
            total = 0
            for load in state.tracker.loads.values():
                assert load.requests >= 0 and load.prefill_tokens >= 0
                assert all(c > 0 for c in load.unique.values())
                total += load.requests
            assert total == len(state.tracker.bookings)
            for rank, load in state.tracker.loads.items():  # the prefill of bookings not done, exactly
                assert load.prefill_tokens == sum(b.prefill_tokens for b in state.tracker.bookings.values()
                                                  if b.rank == rank and not b.prefill_done)
            waiting = [b for b in state.tracker.bookings.values() if b.awaits is not None]
            assert state.prefill_ends.waiting() == len(waiting)  # the watch holds live bookings only
            assert all(not b.prefill_done for b in waiting)
        assert self.bookings == {b for b in self.bookings if self.live(b)}

    @invariant()
    def state_budget_counts_what_is_stored(self) -> None:
        """The O(1) budget counters equal a recount of the index, the bookings and the catalog."""
        if not hasattr(self, "service"):
            return
        s = self.service
        keys = s.pools.values()
        assert s.budget.index_blocks == sum(state.index.rank_size(r) for state in keys
                                            for r in {*state.index.device.lookup, *(
                                                r for t in state.index.lower.values() for r in t.owned)})
        assert s.budget.bookings == sum(len(state.tracker.bookings) for state in keys)
        assert s.budget.booked_blocks == sum(len(b.blocks or ()) for state in keys
                                             for b in state.tracker.bookings.values())
        assert s.budget.record_bytes == sum(len(jsonio.dumps(r.to_json())) for r in s.catalog.values())

    @invariant()
    def catalog_reads_match_the_records(self) -> None:
        """/ready and /workers, spliced from cached JSON, are the bytes the typed answers encode to."""
        if not hasattr(self, "service"):
            return
        s = self.service
        records = sorted(s.catalog.values(), key=lambda r: (*r.key, r.worker_id))  # recounted
        count = sum(1 for r in records if r.lifecycle == "schedulable")
        answer = s.handle("GET", "/ready", "", [], b"", now=self.now)
        assert answer.body == jsonio.dumps({"ready": count > 0, "schedulable_workers": count,
                                            "workers": [r.to_json() for r in records]})
        assert answer.status == (200 if count else 503)
        for query, model, tenant in (("", None, None), ("model_name=default", "default", None),
                                     ("model_name=default&tenant_id=t1", "default", "t1")):
            answer = s.handle("GET", "/workers", query, [], b"", now=self.now)
            assert answer.body == jsonio.dumps([{**r.to_json(), "kv_routing": s.kv_routing(r.worker_id, now=self.now)}
                                                for r in records if model in (None, r.key[0])
                                                and tenant in (None, r.key[1])])

    @invariant()
    def scores_are_prefix_consistent(self) -> None:
        if not hasattr(self, "service"):
            return
        from selection_proto import block_hashes

        q = block_hashes([0, 1, 2, 3, 0, 1, 2, 3], 2)
        for state in self.service.pools.values():
            full, _ = state.index.device.find(q)
            for k in range(len(q) + 1):
                part, _ = state.index.device.find(q[:k])
                for rank, score in full.items():
                    assert score <= len(q)
                    assert part.get(rank, 0) == min(score, k)

    def teardown(self) -> None:
        if not hasattr(self, "service"):
            return
        self.service.begin_shutdown(now=self.now)
        self.drain()
        assert not self.tickets, "every ticket gets exactly one answer"
        for rid in sorted(self.bookings):
            assert self.call("DELETE", f"/reservations/{rid}")[0] == 200
        for state in self.service.pools.values():
            for load in state.tracker.loads.values():
                assert (load.requests, load.prefill_tokens, len(load.unique)) == (0, 0, 0)


ServiceMachine.TestCase.settings = settings(stateful_step_count=30)
