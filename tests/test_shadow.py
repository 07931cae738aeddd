"""The shadow policy (docs/STATUS.md): a second `router_policy` scores every selection without acting.
The acting answers are byte-identical with and without it (the replay scripts, their draws from the
injected random generator included); `/metrics` and the status snapshot say how often it disagrees
and the predicted time to first token of both choices."""

from __future__ import annotations

import json
import random
from typing import Any

import attrs
import pytest
import test_replay
from conftest import Client, stored
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_outcomes import PROMPT, WORKER, metric

from selection_proto import SelectionService, Settings
from selection_proto.core.base.hashing import block_hashes
from selection_proto.core.fleet.outcomes import REASONS


@pytest.mark.parametrize("acting", ["dynamo", "ttft"])
@pytest.mark.parametrize("seed", range(0, 64, 5))
def test_the_acting_answers_are_byte_identical_with_and_without_a_shadow(
        monkeypatch: pytest.MonkeyPatch, seed: int, acting: str) -> None:
    other = "dynamo" if acting == "ttft" else "ttft"
    recorded = test_replay._settings
    # /metrics counts the shadow's work: everything else the scripts see must not change.
    monkeypatch.setattr(SelectionService, "metrics_text", lambda self, *, now: "")
    monkeypatch.setattr(test_replay, "_settings", lambda s: attrs.evolve(recorded(s), router_policy=acting))
    alone = test_replay.script_digest(seed)
    monkeypatch.setattr(test_replay, "_settings",
                        lambda s: attrs.evolve(recorded(s), router_policy=acting, shadow_policy=other))
    assert test_replay.script_digest(seed) == alone


def test_the_shadow_must_be_the_other_policy() -> None:
    with pytest.raises(ValueError, match="shadow_policy: must differ from router_policy"):
        Settings(router_policy="ttft", shadow_policy="ttft")
    with pytest.raises(ValueError, match="shadow_policy: must be one of dynamo, ttft"):
        Settings(shadow_policy="random")  # type: ignore[arg-type]


def _fleet(client: Client) -> None:
    for worker_id in (1, 2):
        client.ok("POST", "/workers", {"worker_id": worker_id, **WORKER}, status=201)
    hashes = block_hashes(PROMPT, 4)[:2]
    client.ok("POST", "/kv_events", [stored(2, 1, [(100 + i, h) for i, h in enumerate(hashes)])])


def test_a_ttft_shadow_counts_where_it_would_choose_otherwise(make_client: Any) -> None:
    client: Client = make_client(shadow_policy="ttft")
    _fleet(client)
    # Dynamo's cost: the cached blocks of worker 2 are worth less than the decode blocks booked
    # there; the predicted time to first token weighs the cache more.
    for n in range(3):
        client.ok("POST", "/reservations", {"reservation_id": f"decode-{n}", "model_name": "m", "worker_id": 2,
                                            "token_ids": list(range(5000 + 100 * n, 5012 + 100 * n))}, status=201)
        client.ok("POST", f"/reservations/decode-{n}/prefill_complete")
    picks = [client.ok("POST", "/select", {"model_name": "m", "token_ids": PROMPT}) for _ in range(4)]
    scored = metric(client, "selection_proto_shadow_selections_total", policy="ttft")
    disagreed = metric(client, "selection_proto_shadow_disagreements_total", policy="ttft")
    decisions = client.ok("GET", "/status/snapshot")["decisions"]
    assert scored == 4 and disagreed == sum(not d["shadow"]["agrees"] for d in decisions) > 0
    for d, pick in zip(decisions, reversed(picks), strict=True):
        assert d["worker_id"] == pick["worker_id"] and d["shadow"]["policy"] == "ttft"
        assert d["predicted_ttft_secs"] > 0 and d["shadow"]["predicted_ttft_secs"] > 0
        if not d["shadow"]["agrees"]:  # the shadow's own choice predicts no later a first token
            assert d["shadow"]["predicted_ttft_secs"] <= d["predicted_ttft_secs"]
    acting = metric(client, "selection_proto_shadow_predicted_ttft_seconds_total", choice="acting")
    shadow = metric(client, "selection_proto_shadow_predicted_ttft_seconds_total", choice="shadow")
    assert acting == pytest.approx(sum(d["predicted_ttft_secs"] for d in decisions), abs=1e-5)
    assert shadow == pytest.approx(sum(d["shadow"]["predicted_ttft_secs"] for d in decisions), abs=1e-5)
    summary = client.ok("GET", "/status/snapshot")["summary"]["shadow"]
    assert summary["scored"] == 4 and summary["disagreement_rate"] == disagreed / 4


def test_a_dynamo_shadow_under_ttft_disagrees_when_dynamos_cost_differs(make_client: Any) -> None:
    client: Client = make_client(router_policy="ttft", shadow_policy="dynamo")
    _fleet(client)
    for _ in range(5):
        client.ok("POST", "/select_and_reserve", {"model_name": "m", "token_ids": PROMPT})
    # The existing count of ttft choices Dynamo's cost would not have made is the same question asked
    # of the minimum cost: the shadow's disagreements are those.
    assert metric(client, "selection_proto_shadow_disagreements_total", policy="dynamo") == metric(
        client, "selection_proto_policy_disagreements_total")
    assert metric(client, "selection_proto_shadow_selections_total", policy="dynamo") == 5
    snapshot = client.ok("GET", "/status/snapshot")
    assert snapshot["shadow_policy"] == "dynamo" and snapshot["decisions"][0]["shadow"]["policy"] == "dynamo"


def test_without_a_shadow_nothing_is_scored_twice(make_client: Any) -> None:
    client: Client = make_client()
    _fleet(client)
    client.ok("POST", "/select", {"model_name": "m", "token_ids": PROMPT})
    assert metric(client, "selection_proto_shadow_selections_total", policy="ttft") == 0
    snapshot = client.ok("GET", "/status/snapshot")
    assert snapshot["decisions"][0]["shadow"] is None and snapshot["summary"]["shadow"] is None
    assert snapshot["decisions"][0]["predicted_ttft_secs"] is None  # Dynamo's cost predicts no seconds


class TwinMachine(RuleBasedStateMachine):
    """Two services fed the same calls, one with a shadow policy: every answer and every output is
    the same; and in the shadowed one, what was lost by reason adds up to achievable minus achieved."""

    @initialize(seed=st.integers(0, 2**16), acting=st.sampled_from(["dynamo", "ttft"]),
                temperature=st.sampled_from([0.0, 0.5]))
    def start(self, seed: int, acting: str, temperature: float) -> None:
        common = {"kv_events": "push", "router_policy": acting, "temperature": temperature, "queue_threshold": 1.0,
                  "queue_timeout_secs": 5.0, "session_affinity_ttl_secs": 30.0}
        other = "dynamo" if acting == "ttft" else "ttft"
        self.twins = [Client(SelectionService(Settings(**common), random.Random(seed))),  # type: ignore[arg-type]
                      Client(SelectionService(Settings(**common, shadow_policy=other), random.Random(seed)))]  # type: ignore[arg-type]
        self.n = 0
        self.bookings: list[str] = []
        for worker_id in (1, 2, 3):
            self.both("POST", "/workers", {"worker_id": worker_id, **WORKER, "max_num_batched_tokens": 64,
                                           "taints": ["a"] if worker_id != 2 else []})

    def both(self, method: str, path: str, body: Any = None) -> Any:
        answers = []
        for twin in self.twins:
            result = twin.service.handle(method, path, "", [("content-type", "application/json")],
                                         b"" if body is None else json.dumps(body).encode(), now=twin.now)
            outputs = []
            while (out := twin.service.next_output()) is not None:
                outputs.append(repr(out))
            answers.append((repr(result), outputs))
        assert answers[0] == answers[1]
        return answers[0][0]

    def advance(self, dt: float) -> None:
        for twin in self.twins:
            twin.now += dt

    @rule(which=st.integers(0, 3), blocks=st.integers(1, 4), worker_id=st.integers(1, 3))
    def events(self, which: int, blocks: int, worker_id: int) -> None:
        self.n += 1
        hashes = block_hashes([which] * 16, 4)[:blocks]
        self.both("POST", "/kv_events", [stored(worker_id, self.n, [(1000 * self.n + i, h) for i, h in enumerate(hashes)])])

    @rule(which=st.integers(0, 3), kind=st.sampled_from(["plain", "allowed", "taint", "session", "book"]))
    def select(self, which: int, kind: str) -> None:
        self.n += 1
        self.advance(0.3)
        body: dict[str, Any] = {"model_name": "m", "token_ids": [which] * 16}
        path = "/select"
        if kind == "allowed":
            body["allowed_worker_ids"] = [which % 3 + 1]
        elif kind == "taint":
            body["routing_constraints"] = {"required_taints": ["a"]}
        elif kind in ("session", "book"):
            path, body["reservation_id"] = "/select_and_reserve", f"r{self.n}"
            self.bookings.append(f"r{self.n}")
            if kind == "session":
                body["session_id"] = f"s{which}"
        self.both("POST", path, body)

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        if self.bookings:
            rid = data.draw(st.sampled_from(self.bookings))
            self.advance(0.2)
            if data.draw(st.booleans()):
                self.both("POST", f"/reservations/{rid}/prefill_complete", {"cached_tokens": data.draw(st.integers(0, 16))})
            else:
                self.both("DELETE", f"/reservations/{rid}")
                self.bookings.remove(rid)

    @rule(dt=st.floats(0, 4))
    def tick(self, dt: float) -> None:
        self.advance(dt)
        for twin in self.twins:
            twin.service.tick(twin.now)
        self.both("GET", "/loads")

    @invariant()
    def losses_add_up(self) -> None:
        if hasattr(self, "twins"):
            shadowed = self.twins[1]
            achieved = metric(shadowed, "selection_proto_achieved_cached_tokens_total")
            achievable = metric(shadowed, "selection_proto_achievable_cached_tokens_total")
            lost = sum(metric(shadowed, "selection_proto_lost_cached_tokens_total", reason=r) for r in REASONS)
            assert 0 <= achieved <= achievable and lost == achievable - achieved


TwinMachine.TestCase.settings = settings(stateful_step_count=30, max_examples=40, deadline=None)
TestTwinMachine = TwinMachine.TestCase
