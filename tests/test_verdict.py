"""The KV routing verdict (docs/VERDICT.md) in the core, driven through `handle` and the stream
entry points with explicit time: each state, what moves a worker between them, the observations'
body rules, restarts, and the replay order's restart rule. The same states on real engines:
tests/test_real_engines.py."""

from __future__ import annotations

import random
from typing import Any

import msgpack
from conftest import Client

from selection_proto import SelectionService, Settings
from selection_proto.adapters.jsonl import JsonRpcSession
from selection_proto.adapters.replay import SeqOrder
from selection_proto.core.base.outputs import SubscribeKvEvents

BS = 4


def store(hashes: list[int], tokens: list[int], parent: int | None = None, bs: int = BS) -> list[Any]:
    return ["BlockStored", hashes, parent, tokens, bs, None, "GPU", None, None, 0, None, None, None]


def batch(*events: Any) -> bytes:
    return msgpack.packb([1.0, list(events), 0])


class Fleet:
    """A service subscribed to worker 1's engine; `publish` feeds batches as the subscriber would."""

    def __init__(self, **settings: Any) -> None:
        self.service = SelectionService(Settings(kv_verdict_window_secs=10.0, **settings), random.Random(0))
        self.client = Client(self.service)
        self.client.now = 0.0
        self.client.ok("POST", "/workers", {"worker_id": 1, "model_name": "m", "block_size": BS,
                                            "endpoint": "http://e1", "kv_events_endpoint": "tcp://127.0.0.1:5557"},
                       status=201)
        outputs = []
        while (out := self.service.next_output()) is not None:
            outputs.append(out)
        self.stream = next(o.stream for o in outputs if isinstance(o, SubscribeKvEvents))
        self.service.subscription_state(self.stream, True, now=self.now)

    @property
    def now(self) -> float:  # the client's clock is the fleet's
        return float(self.client.now)

    @now.setter
    def now(self, value: float) -> None:
        self.client.now = value

    def publish(self, seq: int, *events: Any, at: float | None = None) -> None:
        self.now = self.now + 0.1 if at is None else at
        self.service.stream_message(self.stream, batch(*events), seq=seq, now=self.now)

    def state(self, at: float | None = None) -> str:
        self.now = self.now if at is None else at
        return str(self.service.kv_routing(1, now=self.now)["state"])

    def held(self, tokens: list[int]) -> int:
        rows = self.client.ok("POST", "/overlap_scores", {"model_name": "m", "token_ids": tokens})["workers"]
        return sum(r["device_blocks"] for r in rows)

    def book(self, rid: str, tokens: list[int]) -> dict[str, Any]:
        return self.client.ok("POST", "/select_and_reserve", {"model_name": "m", "token_ids": tokens,
                                                              "reservation_id": rid})  # type: ignore[no-any-return]


PROMPT = list(range(1, 13))  # three blocks


def test_a_new_worker_waits_then_is_ok_once_events_arrive() -> None:
    fleet = Fleet()
    verdict = fleet.client.ok("GET", "/workers/1")["kv_routing"]
    assert verdict == {"state": "waiting", "reasons": ["no KV event and no observed cached tokens yet"],
                       "events_total": 0, "last_event_age_secs": None, "engine_block_size": None, "restarts": 0,
                       "predicted_cached_tokens": 0, "observed_cached_tokens": 0, "observations": 0}
    fleet.publish(0, store([11, 12], PROMPT[:8]))
    verdict = fleet.client.ok("GET", "/workers")[0]["kv_routing"]
    assert verdict["state"] == "ok" and verdict["reasons"] == [] and verdict["events_total"] == 1
    assert verdict["engine_block_size"] == BS
    assert fleet.client.error("GET", "/workers/9") == (404, "worker 9 not found")
    assert fleet.client.error("GET", "/workers/x")[0] == 400


def test_stored_events_of_another_block_size_are_named() -> None:
    fleet = Fleet()
    fleet.publish(0, store([11], PROMPT[:8], bs=8))
    verdict = fleet.service.kv_routing(1, now=fleet.now)
    assert verdict["state"] == "block_size_mismatch" and verdict["engine_block_size"] == 8
    assert "register the worker with block_size 8" in verdict["reasons"][0]
    assert fleet.held(PROMPT) == 0  # dropped, as before


def test_bookings_that_must_bring_events_and_none_come_are_no_events() -> None:
    fleet = Fleet()
    fleet.book("r1", PROMPT)
    assert fleet.state(at=9.0) == "waiting"  # inside the window
    verdict = fleet.service.kv_routing(1, now=10.5)
    assert verdict["state"] == "no_events" and "1 bookings with new blocks" in verdict["reasons"][0]
    fleet.now = 10.5
    fleet.publish(0, store([11, 12, 13], PROMPT))
    assert fleet.state() == "ok"
    fleet.book("r2", PROMPT)  # all of it cached: the engine publishes nothing, and need not
    assert fleet.state(at=30.0) == "ok"


def test_observations_against_predictions_make_misses() -> None:
    fleet = Fleet()
    fleet.publish(0, store([11, 12, 13], PROMPT))
    prompt = PROMPT + [99]  # three cached blocks the engine can report whole
    for i in range(5):
        fleet.book(f"r{i}", prompt)
        body = {"cached_tokens": 12 if i < 2 else 0}
        fleet.client.ok("POST", f"/reservations/r{i}/prefill_complete", body)
        fleet.client.ok("DELETE", f"/reservations/r{i}", {"cached_tokens": 12})  # a second report: ignored
        assert fleet.state() == ("ok" if i < 4 else "misses")
    verdict = fleet.service.kv_routing(1, now=fleet.now)
    assert (verdict["observations"], verdict["predicted_cached_tokens"], verdict["observed_cached_tokens"]) == (5, 60, 24)
    assert "found 24 of 60 predicted cached tokens" in verdict["reasons"][0]
    metrics = fleet.client.call("GET", "/metrics")[1]
    labels = 'model_name="m",tenant_id="default",worker_id="1"'
    assert f"selection_proto_kv_observations_total{{{labels}}} 5.0" in metrics
    assert f"selection_proto_kv_observed_cached_tokens_total{{{labels}}} 24.0" in metrics
    assert f'selection_proto_kv_routing_state{{{labels},state="misses"}} 1.0' in metrics


def test_predictions_count_only_what_an_engine_can_report() -> None:
    fleet = Fleet()
    fleet.publish(0, store([11, 12, 13], PROMPT))
    fleet.book("whole", PROMPT)  # all 12 tokens cached: an engine computes the last block again
    fleet.client.ok("DELETE", "/reservations/whole", {"cached_tokens": 8})
    fleet.book("huge", PROMPT + [5])
    fleet.client.ok("DELETE", "/reservations/huge", {"cached_tokens": 10**15})  # capped at the prompt
    verdict = fleet.service.kv_routing(1, now=fleet.now)
    assert verdict["predicted_cached_tokens"] == 8 + 12 and verdict["observed_cached_tokens"] == 8 + 13


def test_observation_bodies_are_checked_and_other_bodies_ignored() -> None:
    fleet = Fleet()
    fleet.book("r", PROMPT)
    for body, detail in (({"cached_tokens": -1}, "cached_tokens"), ({"cached_tokens": "7"}, "cached_tokens"),
                         ({"cached_tokens": 2**64}, "cached_tokens"), ({"cached_tokens": 1.5}, "cached_tokens")):
        # The completion is applied; the bad value is said, counted and not observed (docs/DECISIONS.md).
        status, answer = fleet.client.call("POST", "/reservations/r/prefill_complete", body)
        assert status == 200 and any(detail in w for w in answer["warnings"]), answer
    assert fleet.service.kv_routing(1, now=1.0)["observations"] == 0
    assert fleet.client.call("POST", "/reservations/r/prefill_complete", raw=b"not json")[0] == 200
    assert fleet.client.call("DELETE", "/reservations/r", raw=b'{"other": 1}')[0] == 200
    assert fleet.client.error("DELETE", "/reservations/r", {"cached_tokens": 3}) == (404, "reservation r not found")
    assert fleet.service.kv_routing(1, now=1.0)["observations"] == 0


def test_json_rpc_takes_cached_tokens_as_a_parameter() -> None:
    fleet = Fleet()
    session = JsonRpcSession(fleet.service, lambda: 1.0)
    fleet.book("r", PROMPT + [5])
    session.receive_data(b'{"jsonrpc":"2.0","id":1,"method":"reservations.free",'
                         b'"params":{"reservation_id":"r","cached_tokens":0}}\n')
    assert b'"result":{"status":"ok"}' in session.data_to_send()
    assert fleet.service.kv_routing(1, now=1.0)["observations"] == 1


def test_an_engine_restart_drops_its_index_and_heals_with_the_next_batch() -> None:
    fleet = Fleet()
    for seq in range(3):
        fleet.publish(seq, store([11 + seq], PROMPT[4 * seq:4 * seq + 4], parent=None if seq == 0 else 10 + seq))
    assert fleet.held(PROMPT) == 3
    fleet.publish(0, store([21], [7, 7, 7, 7]))  # a new engine: numbers from 0, an empty cache
    assert fleet.held(PROMPT) == 0 and fleet.held([7, 7, 7, 7]) == 1
    verdict = fleet.service.kv_routing(1, now=fleet.now)
    assert verdict["state"] == "stale" and verdict["restarts"] == 1 and "restarted" in verdict["reasons"][0]
    fleet.publish(1, store([22], [8, 8, 8, 8]))
    assert fleet.state() == "ok"
    metrics = fleet.client.call("GET", "/metrics")[1]
    assert 'selection_proto_kv_restarts_total{model_name="m",tenant_id="default",worker_id="1",dp_rank="0"} 1.0' in metrics


def test_a_restart_seen_after_its_first_batch_stays_stale() -> None:
    fleet = Fleet()
    fleet.publish(0, store([11], PROMPT[:4]))
    fleet.publish(5, store([12], PROMPT[4:8], parent=11))  # a gap: 1-4 lost
    fleet.publish(2, store([21], [7, 7, 7, 7]))  # restarted, 0 and 1 not seen
    fleet.publish(3, store([22], [8, 8, 8, 8]))
    verdict = fleet.service.kv_routing(1, now=fleet.now)
    assert verdict["state"] == "stale" and "lost" in verdict["reasons"][0] and verdict["restarts"] == 1


def test_an_engine_that_goes_away_is_forgotten_then_no_events() -> None:
    fleet = Fleet()
    fleet.publish(0, store([11, 12, 13], PROMPT))
    fleet.service.subscription_state(fleet.stream, False, now=1.0, engine_gone=True)
    assert fleet.held(PROMPT) == 0 and fleet.state(at=1.0) == "stale"
    fleet.now = 1.0
    fleet.book("r", PROMPT)  # it never comes back: bookings bring nothing
    assert fleet.state(at=12.0) == "no_events"
    fleet.publish(1, store([31], [9, 9, 9, 9]), at=12.5)  # the same process, reconnected: in order
    assert fleet.state() == "ok"


def test_a_worker_not_schedulable_is_waiting() -> None:
    fleet = Fleet()
    fleet.client.ok("DELETE", "/workers/1")
    verdict = fleet.client.ok("GET", "/workers/1")["kv_routing"]
    assert verdict["state"] == "waiting" and "unschedulable" in verdict["reasons"][0]


def test_approximate_mode_judges_by_observations_alone() -> None:
    service = SelectionService(Settings(kv_events="approximate", kv_verdict_window_secs=1.0), random.Random(0))
    client = Client(service)
    client.ok("POST", "/workers", {"worker_id": 1, "model_name": "m", "block_size": BS, "endpoint": "http://e1"},
              status=201)
    client.ok("POST", "/select_and_reserve", {"model_name": "m", "token_ids": PROMPT, "reservation_id": "a"})
    assert service.kv_routing(1, now=100.0)["state"] == "waiting"  # no events expected, none missed
    client.ok("DELETE", "/reservations/a", {"cached_tokens": 0})
    assert service.kv_routing(1, now=100.0)["state"] == "ok"


def test_replay_order_hands_a_restarted_engine_on() -> None:
    order = SeqOrder()
    for seq in range(4):
        order.live(seq, b"old")
    assert [s for s, _ in order.ready()] == [0, 1, 2, 3]
    order.live(0, b"new")  # below what is expected, and no replay brought it: a restart
    assert order.ready() == [(0, b"new")] and order.restarts == 1
    order.live(3, b"new3")  # 1 and 2 were missed: asked for from the new engine
    assert order.want == 1
    order.want = None
    order.replayed(1, b"new1")
    order.replayed(2, b"new2")
    order.replayed(3, b"new3")
    order.replay_done()
    assert [s for s, _ in order.ready()] == [1, 2, 3]
    order.live(2, b"new2")  # the live copy of a replayed batch: a duplicate, not a restart
    order.live(3, b"new3")
    assert order.ready() == [] and order.restarts == 1
    order.live(4, b"new4")
    order.live(0, b"newer")  # past the replayed range's copies: a restart again
    assert [s for s, _ in order.ready()] == [4, 0] and order.restarts == 2


def test_the_decision_header_says_a_tie_and_the_unit_of_its_margin() -> None:
    service = SelectionService(Settings(kv_events="push", explain_header=True, router_policy="ttft"), random.Random(0))
    client = Client(service)
    for wid in (1, 2):
        client.ok("POST", "/workers", {"worker_id": wid, "model_name": "m", "block_size": BS,
                                       "endpoint": f"http://e{wid}"}, status=201)
    response = service.handle("POST", "/select", "", [("content-type", "application/json")],
                              b'{"model_name": "m", "token_ids": [1, 2, 3, 4, 5, 6]}', now=1.0)
    fields = dict(part.split("=", 1) for part in dict(response.headers)["x-selection-decision"].split(";"))
    assert (fields["margin"], fields["margin_unit"], fields["tie"]) == ("0", "seconds", "true")


def test_the_decision_header_says_why_when_asked() -> None:
    """With `explain_header` (docs/VERDICT.md) each selection's answer carries `x-selection-decision`
    (the chosen rank, its cached tokens, the runner-up and the margin); off by default."""
    for on in (False, True):
        service = SelectionService(Settings(kv_events="push", explain_header=on), random.Random(0))
        client = Client(service)
        for wid in (1, 2):
            client.ok("POST", "/workers", {"worker_id": wid, "model_name": "m", "block_size": BS,
                                           "endpoint": f"http://e{wid}"}, status=201)
        client.ok("POST", "/kv_events", [{"worker_id": 2, "event": {"event_id": 1, "data": {"stored": {
            "parent_hash": None, "blocks": [{"block_hash": 5, "tokens_hash": 14643705804678351452}]}}}}])
        for path in ("/select", "/select_and_reserve"):
            response = service.handle("POST", path, "", [("content-type", "application/json")],
                                      b'{"model_name": "m", "token_ids": [1, 2, 3, 4, 5, 6]}', now=1.0)
            header = dict(response.headers).get("x-selection-decision")
            if not on:
                assert header is None
                continue
            assert header is not None and header.startswith("worker=2;dp_rank=0;cached=4;isl=6;candidates=2;")
            fields = dict(part.split("=", 1) for part in header.split(";"))
            assert fields["policy"] == "dynamo" and fields["runner_up"] == "1:0" and float(fields["margin"]) > 0
            assert fields["margin_unit"] == "blocks" and "tie" not in fields
