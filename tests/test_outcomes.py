"""Achieved against achievable (docs/STATUS.md): each selection's cached tokens against the best-cached
rank's at the same moment, the reason when it got fewer, in `/metrics`, in the status snapshot's last
minute and in each decision; and the engines' own hit rate beside them."""

from __future__ import annotations

import json
import random
from typing import Any

from conftest import Client, stored
from hypothesis import given, settings
from hypothesis import strategies as st

from selection_proto import Pending, SelectionService, Settings
from selection_proto.core.base.hashing import block_hashes
from selection_proto.core.cache.engine_metrics import parse
from selection_proto.core.fleet.outcomes import BUCKET_SECS, ERRORS, REASONS, REFUSALS, WINDOW_SECS, Recent

WORKER = {"model_name": "m", "block_size": 4, "endpoint": "http://e"}
PROMPT = list(range(12))  # 3 blocks


def metric(client: Client, name: str, **labels: str) -> float:
    """The value of one sample of `/metrics` (0 when absent)."""
    text = client.ok("GET", "/metrics")
    want = ",".join(f'{k}="{v}"' for k, v in {"model_name": "m", "tenant_id": "default", **labels}.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def fleet(client: Client, workers: int = 2, holder: int = 2, blocks: int = 2, **extra: Any) -> None:
    """`workers` workers; `holder` holds the prompt's first `blocks` blocks."""
    for worker_id in range(1, workers + 1):
        client.ok("POST", "/workers", {"worker_id": worker_id, **WORKER, **extra}, status=201)
    hashes = block_hashes(PROMPT, 4)[:blocks]
    client.ok("POST", "/kv_events", [stored(holder, 1, [(100 + i, h) for i, h in enumerate(hashes)])])


def newest(client: Client) -> dict[str, Any]:
    return client.ok("GET", "/status/snapshot")["decisions"][0]  # type: ignore[no-any-return]


def test_a_selection_of_the_best_cached_rank_loses_nothing(make_client: Any) -> None:
    client: Client = make_client()
    fleet(client)
    answer = client.ok("POST", "/select", {"model_name": "m", "token_ids": PROMPT, "selection_id": "s-1"})
    assert (answer["worker_id"], answer["cached_tokens"]) == (2, 8)
    d = newest(client)
    assert (d["request_id"], d["cached_tokens"], d["achievable_cached_tokens"], d["loss_reason"]) == ("s-1", 8, 8, None)
    assert metric(client, "selection_proto_achieved_cached_tokens_total") == 8
    assert metric(client, "selection_proto_achievable_cached_tokens_total") == 8
    assert metric(client, "selection_proto_prompt_tokens_total") == 12
    assert all(metric(client, "selection_proto_cache_losses_total", reason=r) == 0 for r in REASONS)


def test_constraints_that_rule_the_cache_out_are_the_reason(make_client: Any) -> None:
    client: Client = make_client()
    fleet(client)
    client.ok("POST", "/select", {"model_name": "m", "token_ids": PROMPT, "allowed_worker_ids": [1]})
    d = newest(client)
    assert (d["worker_id"], d["cached_tokens"], d["achievable_cached_tokens"], d["loss_reason"]) == (1, 0, 8, "constraints")
    assert metric(client, "selection_proto_cache_losses_total", reason="constraints") == 1
    assert metric(client, "selection_proto_lost_cached_tokens_total", reason="constraints") == 8
    key = client.ok("GET", "/status/snapshot")["keys"][0]
    assert key["lost_cached_tokens"]["constraints"] == 8 and key["routing_efficiency"] == 0.0
    assert (key["achieved_hit_rate"], key["achievable_hit_rate"]) == (0.0, round(8 / 12, 4))


def test_a_session_bound_elsewhere_is_the_reason(make_client: Any) -> None:
    client: Client = make_client(session_affinity_ttl_secs=60)
    fleet(client, holder=2)
    first = client.ok("POST", "/select_and_reserve", {"model_name": "m", "token_ids": [99] * 12, "session_id": "s",
                                                     "allowed_worker_ids": [1]})
    assert first["worker_id"] == 1  # the session is bound to worker 1 now
    client.ok("POST", "/select_and_reserve", {"model_name": "m", "token_ids": PROMPT, "session_id": "s"})
    d = newest(client)
    assert (d["worker_id"], d["cached_tokens"], d["achievable_cached_tokens"], d["loss_reason"]) == (1, 0, 8, "affinity")
    assert metric(client, "selection_proto_cache_losses_total", reason="affinity") == 1


def test_load_that_outweighs_the_cache_is_the_reason(make_client: Any) -> None:
    client: Client = make_client()
    fleet(client)
    for n in range(4):  # a lot of prefill booked on the rank that holds the cache
        client.ok("POST", "/reservations", {"reservation_id": f"heavy-{n}", "model_name": "m", "worker_id": 2,
                                            "token_ids": list(range(1000, 1400))}, status=201)
    answer = client.ok("POST", "/select_and_reserve", {"model_name": "m", "token_ids": PROMPT, "reservation_id": "r"})
    assert answer["worker_id"] == 1
    d = newest(client)
    assert (d["request_id"], d["cached_tokens"], d["achievable_cached_tokens"], d["loss_reason"]) == ("r", 0, 8, "load")
    assert metric(client, "selection_proto_lost_cached_tokens_total", reason="load") == 8


def test_overloaded_workers_filtered_out_are_load(make_client: Any) -> None:
    client: Client = make_client(active_prefill_tokens_threshold=100)
    fleet(client)
    client.ok("POST", "/reservations", {"reservation_id": "heavy", "model_name": "m", "worker_id": 2,
                                        "token_ids": list(range(1000, 1400))}, status=201)
    client.ok("POST", "/select", {"model_name": "m", "token_ids": PROMPT})
    assert newest(client)["loss_reason"] == "load"


def test_a_draw_at_temperature_that_passes_the_cheaper_cache_is_sampling(make_client: Any) -> None:
    client: Client = make_client(temperature=50.0)
    fleet(client)
    picks = [client.ok("POST", "/select", {"model_name": "m", "token_ids": PROMPT})["worker_id"] for _ in range(40)]
    losses = picks.count(1)
    assert 0 < losses < 40
    assert metric(client, "selection_proto_cache_losses_total", reason="sampling") == losses
    assert metric(client, "selection_proto_lost_cached_tokens_total", reason="sampling") == 8 * losses


def test_a_queued_selection_that_lost_the_cache_says_queue(make_client: Any) -> None:
    client: Client = make_client(queue_threshold=0.5)
    fleet(client, max_num_batched_tokens=100)
    for worker_id in (1, 2):  # both busy: the next selection waits
        client.ok("POST", "/reservations", {"reservation_id": f"busy-{worker_id}", "model_name": "m",
                                            "worker_id": worker_id, "token_ids": list(range(2000, 2080))},
                  status=201)
    waiting = client.service.handle("POST", "/select", "", [("content-type", "application/json")],
                                    json.dumps({"model_name": "m", "token_ids": PROMPT}).encode(), now=client.now)
    assert isinstance(waiting, Pending) and len(client.service.pools[("m", "default")].queue) == 1
    client.now += 1
    client.ok("DELETE", "/reservations/busy-1")  # room on worker 1 only: it runs there
    while client.service.next_output() is not None:
        pass
    d = newest(client)
    assert (d["worker_id"], d["loss_reason"]) == (1, "queue")
    assert metric(client, "selection_proto_cache_losses_total", reason="queue") == 1


def test_the_engines_own_hit_rate_is_beside_it(make_client: Any) -> None:
    client: Client = make_client()
    fleet(client, metrics_endpoint="http://e/metrics")
    sample = parse(b"vllm:prefix_cache_hits_total 30\nvllm:prefix_cache_queries_total 120\n")
    client.service.engine_scraped(2, sample, None, now=client.now)
    assert metric(client, "selection_proto_engine_prefix_cache_hit_rate", worker_id="2") == 0.25
    summary = client.ok("GET", "/status/snapshot")["summary"]
    assert (summary["engine_hit_rate"], summary["engine_workers_reporting"]) == (0.25, 1)


def test_the_last_minute_forgets_what_is_older() -> None:
    recent = Recent(now=0.0)
    recent.selected(1.0, 12, 4, 8, "load")
    recent.ended(30.0, REFUSALS)
    recent.selected(30.0, 12, 8, 8, None)
    both = {"selections": 2.0, "refusals": 1.0, "prompt_tokens": 24.0, "achieved": 12.0, "achievable": 16.0,
            "lost:load": 4.0}
    assert recent.totals(31.0) == both and recent.span(31.0) == 31.0
    assert recent.totals(1.0 + WINDOW_SECS + BUCKET_SECS) == {"selections": 1.0, "refusals": 1.0, "prompt_tokens": 12.0,
                                                             "achieved": 8.0, "achievable": 8.0}
    assert recent.totals(30.0 + WINDOW_SECS + BUCKET_SECS) == {} and recent.span(500.0) == WINDOW_SECS
    recent.ended(10.0, ERRORS)  # a time that went backwards counts in the newest bucket
    assert recent.totals(30.0) == {**both, "errors": 1.0}


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4),
                                                                st.integers(0, 3)), min_size=1, max_size=40),
       temperature=st.sampled_from([0.0, 0.7]), policy=st.sampled_from(["dynamo", "ttft"]))
def test_what_was_lost_adds_up_to_achievable_minus_achieved(seed: int, steps: list[tuple[int, int, int]],
                                                             temperature: float, policy: str) -> None:
    """Whatever the traffic, achieved never exceeds achievable and the losses by reason add up to
    the difference, in `/metrics` and in the last minute alike."""
    service = SelectionService(Settings(kv_events="push", temperature=temperature, router_policy=policy,
                                        session_affinity_ttl_secs=30, host_cache_hit_weight=0.5),
                               random.Random(seed))
    client = Client(service)
    for worker_id in range(1, 5):
        client.ok("POST", "/workers", {"worker_id": worker_id, **WORKER, "taints": ["a"] if worker_id % 2 else []},
                  status=201)
    rng = random.Random(seed)
    prompts = [[rng.randrange(50) for _ in range(16)] for _ in range(3)]
    for n, (kind, worker_id, which) in enumerate(steps):
        prompt = prompts[which % 3]
        client.now += 0.5
        if kind == 0:
            hashes = block_hashes(prompt, 4)[: rng.randint(1, 4)]
            tier = rng.choice([None, "host_pinned"])
            client.call("POST", "/kv_events", [stored(worker_id, n + 1, [(1000 * n + i, h) for i, h in enumerate(hashes)],
                                                      tier=tier)])
        elif kind == 1:
            client.call("POST", "/select_and_reserve", {"model_name": "m", "token_ids": prompt, "reservation_id": f"r{n}"})
        elif kind == 2:
            client.call("POST", "/select", {"model_name": "m", "token_ids": prompt,
                                            "allowed_worker_ids": [worker_id, (worker_id % 4) + 1]})
        elif kind == 3:
            client.call("POST", "/select_and_reserve", {"model_name": "m", "token_ids": prompt, "session_id": f"s{which}"})
        elif kind == 4:
            client.call("POST", "/select", {"model_name": "m", "token_ids": prompt,
                                            "routing_constraints": {"required_taints": ["a"]}})
        else:
            client.call("POST", "/reservations", {"reservation_id": f"x{n}", "model_name": "m", "worker_id": worker_id,
                                                  "token_ids": list(range(3000, 3000 + 40 * which))})
    achieved = metric(client, "selection_proto_achieved_cached_tokens_total")
    achievable = metric(client, "selection_proto_achievable_cached_tokens_total")
    lost = sum(metric(client, "selection_proto_lost_cached_tokens_total", reason=r) for r in REASONS)
    assert 0 <= achieved <= achievable and lost == achievable - achieved
    key = client.ok("GET", "/status/snapshot")["keys"][0]
    assert (key["achieved_cached_tokens"], key["achievable_cached_tokens"]) == (achieved, achievable)
    assert sum(key["lost_cached_tokens"].values()) == lost
    for d in client.ok("GET", "/status/snapshot")["decisions"]:
        assert d["cached_tokens"] <= d["achievable_cached_tokens"]
        assert (d["loss_reason"] is None) == (d["cached_tokens"] == d["achievable_cached_tokens"])
