"""A Hypothesis state machine over catalog, events, bookings and selects, with the core.md §12 invariants."""

from __future__ import annotations

import json
import random
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from selection_proto import SelectionService, Settings

WORKERS = st.integers(1, 4)
TOKENS = st.lists(st.integers(0, 3), min_size=0, max_size=24)
ALLOWED = {200, 201, 400, 404, 405, 409, 413, 415, 422, 429, 503}


class ServiceMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**32 - 1))
    def start(self, seed: int) -> None:
        self.service = SelectionService(Settings(kv_events="push", max_reservations_per_key=8), random.Random(seed))
        self.now = 0.0
        self.bookings: set[str] = set()
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
                                                    "block_size": bs, "data_parallel_size": dp})
        assert status == 201
        # A worker that leaves or loses ranks drops their bookings (core.md §6.5).
        self.bookings = {b for b in self.bookings if self.live(b)}

    @rule(wid=WORKERS)
    def delete(self, wid: int) -> None:
        status, _ = self.call("DELETE", f"/workers/{wid}")
        assert status in (200, 404)
        self.bookings = {b for b in self.bookings if self.live(b)}

    def live(self, rid: str) -> bool:
        return any(rid in s.tracker.bookings for s in self.service._keys.values())

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

    @rule(tokens=TOKENS, reserve=st.booleans(), pin=st.none() | WORKERS)
    def select(self, tokens: list[int], reserve: bool, pin: int | None) -> None:
        body: dict[str, Any] = {"token_ids": tokens, "explain": True}
        if pin is not None:
            body["pinned_worker"] = {"worker_id": pin, "dp_rank": 0}
        if reserve:
            self.next_id += 1
            body["reservation_id"] = f"r{self.next_id}"
        before = self.snapshot()
        status, answer = self.call("POST", "/select_and_reserve" if reserve else "/select", body)
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

    @rule(raw=st.binary(max_size=40), path=st.sampled_from(["/select", "/workers", "/kv_events", "/reservations"]))
    def garbage(self, raw: bytes, path: str) -> None:
        before = self.snapshot()
        status, answer = self.call("POST", path, raw=raw)
        assert "error" in answer or status in (200, 201)
        if status >= 400:
            assert self.snapshot() == before

    def snapshot(self) -> tuple[Any, ...]:
        s = self.service
        return (json.dumps([r.to_json() for r in s.list_workers()]),
                json.dumps([m.to_json() for m in s.loads()]), json.dumps(s.dump()))

    @invariant()
    def loads_are_consistent(self) -> None:
        if not hasattr(self, "service"):
            return
        for state in self.service._keys.values():
            total = 0
            for load in state.tracker.loads.values():
                assert load.requests >= 0 and load.prefill_tokens >= 0
                assert all(c > 0 for c in load.unique.values())
                total += load.requests
            assert total == len(state.tracker.bookings)
        assert self.bookings == {b for b in self.bookings if self.live(b)}

    @invariant()
    def scores_are_prefix_consistent(self) -> None:
        if not hasattr(self, "service"):
            return
        from selection_proto import block_hashes

        q = block_hashes([0, 1, 2, 3, 0, 1, 2, 3], 2)
        for state in self.service._keys.values():
            full, _ = state.index.device.find(q)
            for k in range(len(q) + 1):
                part, _ = state.index.device.find(q[:k])
                for rank, score in full.items():
                    assert score <= len(q)
                    assert part.get(rank, 0) == min(score, k)

    def teardown(self) -> None:
        if not hasattr(self, "service"):
            return
        for rid in sorted(self.bookings):
            assert self.call("DELETE", f"/reservations/{rid}")[0] == 200
        for state in self.service._keys.values():
            for load in state.tracker.loads.values():
                assert (load.requests, load.prefill_tokens, len(load.unique)) == (0, 0, 0)


ServiceMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
TestServiceMachine = ServiceMachine.TestCase
