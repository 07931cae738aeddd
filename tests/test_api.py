"""Every route through handle(): statuses, bodies and the exact texts of api.md."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import Client, stored, worker

from selection_proto import (
    Notice,
    SelectionService,
    SelectRequest,
    Settings,
    SubscribeKvEvents,
    Unprocessable,
    UnsubscribeKvEvents,
)

PROMPT = list(range(1, 13))
B1, B2 = 14643705804678351452, 16777012769546811212


def scenario(client: Client) -> None:
    """api.md §4.7 / §4.15: worker 1 holds tokens 1-8 on device; worker 2 1-4 on device, 5-8 on host."""
    client.ok("POST", "/workers", worker(1), status=201)
    client.ok("POST", "/workers", worker(2), status=201)
    report = client.ok("POST", "/kv_events", [
        stored(1, 1, [(101, B1), (102, B2)]),
        stored(2, 1, [(101, B1)]),
        stored(2, 2, [(102, B2)], parent=101, tier="host_pinned"),
    ])
    assert report == {"received": 3, "applied": 3, "failed": 0, "dropped": 0, "failures": []}


def test_select_example_with_explain(client: Client) -> None:
    scenario(client)
    status, headers, body = client.service.handle(
        "POST", "/select", "", [("content-type", "application/json")],
        json.dumps({"model_name": "m", "token_ids": PROMPT, "selection_id": "s-1", "explain": True}).encode(),
        now=1.0)
    assert status == 200
    assert body == (
        b'{"selection_id":"s-1","model_name":"m","tenant_id":"default","routing_group":"default",'
        b'"worker_id":1,"dp_rank":0,'
        b'"endpoint":"http://w1:8000","effective_overlap_blocks":2.0,"cached_tokens":8,"block_size":4,'
        b'"overlap":{"longest_matched":8,"gpu":8,"dp":{"0":8},"cpu":8,"disk":8},'
        b'"effective_prefill_tokens":4,"potential_decode_blocks":3,'
        b'"candidates":[{"worker_id":1,"dp_rank":0,"logit":4.0,"potential_prefill_tokens":4,'
        b'"potential_decode_blocks":3,"device_blocks":2,"host_pinned_blocks":2,"disk_blocks":2,'
        b'"cached_tokens":8},{"worker_id":2,"dp_rank":0,"logit":4.25,"potential_prefill_tokens":5,'
        b'"potential_decode_blocks":3,"device_blocks":1,"host_pinned_blocks":2,"disk_blocks":2,'
        b'"cached_tokens":7}],"excluded":[]}')
    assert ("content-type", "application/json") in headers


def test_hash_path_is_the_same_prompt(client: Client) -> None:
    scenario(client)
    by_tokens = client.ok("POST", "/select", {"model_name": "m", "token_ids": PROMPT})
    by_hashes = client.ok("POST", "/select", {
        "model_name": "m", "block_hashes": [-3803038269031200164, -1669731304162740404, 483935686894639516],
        "sequence_hashes": [-3803038269031200164, 4945711292740353085, -5863151826378895484],
        "isl_tokens": 12})
    assert by_tokens == by_hashes
    assert by_tokens["worker_id"] == 1 and by_tokens["cached_tokens"] == 8


def test_overlap_scores_example(client: Client) -> None:
    scenario(client)
    client.now += 0.5
    answer = client.ok("POST", "/overlap_scores", {"model_name": "m", "token_ids": PROMPT})
    assert answer["num_blocks"] == 3
    assert answer["workers"] == [
        {"worker_id": 1, "dp_rank": 0, "device_blocks": 2, "host_pinned_extension_blocks": 0,
         "disk_extension_blocks": 0, "router_credit_blocks": 2.0, "last_event_id": 1,
         "last_event_age_secs": 0.5, "stale": False},
        {"worker_id": 2, "dp_rank": 0, "device_blocks": 1, "host_pinned_extension_blocks": 1,
         "disk_extension_blocks": 0, "router_credit_blocks": 1.75, "last_event_id": 2,
         "last_event_age_secs": 0.5, "stale": False}]
    assert [f["event_gaps"] for f in answer["freshness"]] == [0, 0]


def test_worker_lifecycle_and_reasons(make_client: Any) -> None:
    sub = make_client(kv_events="subscribe")
    record = sub.ok("POST", "/workers", {"worker_id": 1, "model_name": "m", "endpoint": "http://w1:8000",
                                         "block_size": 4}, status=201)
    assert record["lifecycle"] == "incomplete"
    assert record["not_schedulable_reasons"] == ["kv_events endpoint is required for dp_rank 0"]
    record = sub.ok("POST", "/workers", {"worker_id": 7, "kv_events_endpoints": {
        "0": "tcp://127.0.0.1:5557", "1": "not-a-zmq-endpoint"}, "endpoint": "e", "block_size": 4,
        "data_parallel_size": 2}, status=201)
    assert record["not_schedulable_reasons"] == [
        "reconciliation failed: invalid kv_events endpoint for worker 7 dp_rank 1: "
        "invalid ZMQ endpoint `not-a-zmq-endpoint`: missing scheme"]
    assert sub.ok("POST", "/workers", {"worker_id": 2}, status=201)["not_schedulable_reasons"] == [
        "endpoint is required", "block_size must be greater than 0",
        "kv_events endpoint is required for dp_rank 0"]
    record = sub.ok("PATCH", "/workers/1", {"kv_events_endpoint": "ws://engine:9000/events"})
    assert record["lifecycle"] == "schedulable" and "not_schedulable_reasons" not in record
    def drained() -> list[Any]:
        outputs = []
        while (out := sub.service.next_output()) is not None:
            outputs.append(out)
        return outputs

    outputs = drained()
    assert [o for o in outputs if not isinstance(o, Notice)] == [
        SubscribeKvEvents(1, 1, 0, "ws://engine:9000/events", "m", "default")]
    # Each change is a notice for the log: worker 1 went from incomplete to schedulable.
    replaced = [o for o in outputs if isinstance(o, Notice) and o.event == "worker_replaced"][-1]
    assert dict(replaced.fields)["lifecycle"] == "schedulable" and dict(replaced.fields)["was"] == "incomplete"
    sub.ok("DELETE", "/workers/1")
    outputs = drained()
    assert [o for o in outputs if not isinstance(o, Notice)] == [UnsubscribeKvEvents(1)]
    assert [o.event for o in outputs if isinstance(o, Notice)] == ["kv_stream_closed", "worker_removed"]


@pytest.mark.parametrize(("endpoint", "text"), [
    ("tcp://host", "missing TCP port"),
    ("tcp://:5557", "missing TCP host"),
    ("tcp://[::1:5557", "missing closing `]`"),
    ("tcp://a:b:5557", "missing TCP port"),
    ("tcp://host:", "invalid TCP port: cannot parse integer from empty string"),
    ("tcp://host:x1", "invalid TCP port: invalid digit found in string"),
    ("tcp://host:70000", "invalid TCP port: number too large to fit in target type"),
    ("inproc://x", "unsupported scheme `inproc`"),
    ("tcp://", "missing address"),
    # What ZMQ would refuse on every retry: refused at registration instead.
    ("tcp://a b:1", "invalid TCP host"),
    ("tcp://*:5557", "invalid TCP host"),
    ("ipc:///tmp/" + "x" * 200, "ipc path longer than 107 bytes"),
])
def test_endpoint_validation_texts(make_client: Any, endpoint: str, text: str) -> None:
    sub = make_client(kv_events="subscribe")
    record = sub.ok("POST", "/workers", {"worker_id": 3, "endpoint": "e", "block_size": 4,
                                         "kv_events_endpoint": endpoint}, status=201)
    assert record["not_schedulable_reasons"] == [
        f"reconciliation failed: invalid kv_events endpoint for worker 3 dp_rank 0: "
        f"invalid ZMQ endpoint `{endpoint}`: {text}"]


def test_ws_endpoint_rules_and_zmq_extra(make_client: Any) -> None:
    sub = make_client(kv_events="subscribe", zmq_endpoints=False)
    reasons = sub.ok("POST", "/workers", {"worker_id": 3, "endpoint": "e", "block_size": 4,
                                          "kv_events_endpoint": "tcp://h:1"}, status=201)["not_schedulable_reasons"]
    assert reasons[0].endswith("ZMQ endpoints need the optional extra `zmq`")
    for endpoint, text in (("ws:///x", "missing host"), ("ws://h:99999", "invalid port")):
        reasons = sub.ok("POST", "/workers", {"worker_id": 3, "endpoint": "e", "block_size": 4,
                                              "kv_events_endpoint": endpoint}, status=201)["not_schedulable_reasons"]
        assert reasons == [f"reconciliation failed: invalid kv_events endpoint for worker 3 dp_rank 0: "
                           f"invalid WebSocket endpoint `{endpoint}`: {text}"]


def test_update_without_routing_change_keeps_index_and_bookings(client: Client) -> None:
    scenario(client)
    client.ok("POST", "/select_and_reserve", {"model_name": "m", "token_ids": PROMPT, "reservation_id": "r",
                                              "pinned_worker": {"worker_id": 2, "dp_rank": 0}})
    client.ok("POST", "/workers", worker(2, taints=["gpu=a100"], total_kv_blocks=100), status=201)
    loads = client.ok("GET", "/loads")[0]["loads"]
    assert loads[1]["active_requests"] == 1
    assert client.ok("POST", "/overlap_scores", {"model_name": "m", "token_ids": PROMPT})["workers"][1][
        "device_blocks"] == 1
    # A block size change is routing-relevant: the worker leaves and rejoins empty.
    client.ok("PATCH", "/workers/2", {"block_size": 4, "data_parallel_size": 2})
    assert [ld["active_requests"] for ld in client.ok("GET", "/loads")[0]["loads"]] == [0, 1, 0]


def test_block_size_mismatch_and_key_removal(client: Client) -> None:
    client.ok("POST", "/workers", worker(1), status=201)
    record = client.ok("POST", "/workers", worker(2, block_size=8), status=201)
    assert record["not_schedulable_reasons"] == [
        "reconciliation failed: block_size mismatch for model=m tenant=default: existing=4 requested=8"]
    client.ok("DELETE", "/workers/1")
    assert client.ok("GET", "/loads") == []
    assert client.ok("PATCH", "/workers/2", {})["lifecycle"] == "schedulable"
    assert client.ok("GET", "/loads")[0]["loads"][0]["worker_id"] == 2


def test_delete_tombstones_and_limits(make_client: Any) -> None:
    c = make_client(max_tombstones=1, max_workers_per_key=2, max_keys=2, max_dp_size=4)
    c.ok("POST", "/workers", worker(1), status=201)
    c.ok("POST", "/workers", worker(2), status=201)
    assert c.error("POST", "/workers", worker(3)) == (
        409, "worker limit reached for model=m tenant=default: at most 2 workers")
    c.ok("POST", "/workers", worker(3, model="n"), status=201)
    assert c.error("POST", "/workers", worker(4, model="o")) == (
        409, "key limit reached: at most 2 model/tenant keys")
    assert c.error("POST", "/workers", worker(4, data_parallel_size=5)) == (
        400, "data_parallel_size 5 exceeds the limit of 4")
    assert c.error("POST", "/workers", worker(4, taints=["dynamo.topology/rack=1"])) == (
        400, "taint `dynamo.topology/rack=1` uses the reserved prefix dynamo.topology/; use topology_domains instead")
    assert c.ok("DELETE", "/workers/1")["lifecycle"] == "unschedulable"
    assert c.ok("DELETE", "/workers/1")["lifecycle"] == "unschedulable"
    c.ok("DELETE", "/workers/2")
    assert [w["worker_id"] for w in c.ok("GET", "/workers")] == [2, 3]  # tombstone of 1 evicted
    assert c.error("DELETE", "/workers/1") == (404, "worker 1 not found")
    assert c.error("PATCH", "/workers/9", {}) == (404, "worker 9 not found")
    assert c.error("POST", "/workers", worker(5, model="x" * 257)) == (
        400, "model_name must be at most 256 characters")


def test_readiness_gates(client: Client) -> None:
    status, body = client.call("GET", "/ready")
    assert status == 503 and body == {"ready": False, "schedulable_workers": 0, "workers": []}
    assert client.error("POST", "/select", {"token_ids": [1]}) == (503, "no schedulable workers are available")
    client.ok("POST", "/workers", worker(1), status=201)
    assert client.error("POST", "/select", {"model_name": "z", "token_ids": [1]}) == (
        503, "no schedulable workers for model=z tenant=default")
    client.service.begin_shutdown(now=client.now)
    assert client.error("POST", "/select", {"model_name": "m", "token_ids": [1]}) == (
        503, "selection service is shutting down")
    assert client.call("GET", "/ready")[0] == 503
    assert client.ok("GET", "/health") == {"status": "ok"}


def test_prompt_validation_messages(client: Client) -> None:
    client.ok("POST", "/workers", worker(1), status=201)
    base = {"model_name": "m"}
    cases = [
        ({}, "block_hashes is required without token_ids"),
        ({"block_hashes": []}, "sequence_hashes is required without token_ids"),
        ({"block_hashes": [], "sequence_hashes": []}, "isl_tokens is required without token_ids"),
        ({"block_hashes": [], "sequence_hashes": [], "isl_tokens": 0}, "isl_tokens must be greater than 0"),
        ({"block_hashes": [1], "sequence_hashes": [], "isl_tokens": 4},
         "block_hashes length 1 must match sequence_hashes length 0"),
        ({"token_ids": [1], "selection_id": "s" * 257}, "selection_id must be at most 256 characters"),
        ({"token_ids": [1], "pinned_worker": {"worker_id": 1, "dp_rank": 0}, "allowed_worker_ids": [2]},
         "pinned worker 1 is not in allowed worker set"),
    ]
    for extra, message in cases:
        assert client.error("POST", "/select", {**base, **extra}) == (400, message)
    assert client.error("POST", "/select", {**base, "token_ids": [1], "allowed_worker_ids": [5]}) == (
        503, "no endpoints available to route work")
    assert client.error("POST", "/select", {**base, "token_ids": [1],
                                             "pinned_worker": {"worker_id": 1, "dp_rank": 3}}) == (
        503, "no endpoints available to route work")


def test_prompt_length_limit(make_client: Any) -> None:
    c = make_client(max_prompt_tokens=8)
    c.ok("POST", "/workers", worker(1), status=201)
    assert c.error("POST", "/select", {"model_name": "m", "token_ids": list(range(9))}) == (
        400, "token_ids has 9 entries; the limit is 8")


def test_decode_errors(client: Client) -> None:
    assert client.error("POST", "/select", raw=b"{") [0] == 400
    assert client.error("POST", "/select", raw=b"{")[1].startswith("Failed to parse the request body as JSON: ")
    assert client.error("POST", "/select", raw=b"[" * 65 + b"]" * 65)[1] == (
        "Failed to parse the request body as JSON: nesting too deep")
    assert client.error("POST", "/select", raw=b"{}", content_type="text/plain") == (
        415, "Expected request with `Content-Type: application/json`")
    assert client.call("POST", "/select", raw=b"{}", content_type="application/vnd.x+json; charset=utf-8")[0] == 503
    prefix = "Failed to deserialize the JSON body into the target type: "
    cases = [
        ("/workers", {}, "missing field `worker_id`"),
        ("/workers", {"worker_id": "7"}, 'worker_id: invalid type: string "7", expected u64'),
        ("/workers", {"worker_id": 1.0}, "worker_id: invalid type: floating point `1.0`, expected u64"),
        ("/workers", {"worker_id": 18446744073709551616}, "worker_id: invalid value: integer `18446744073709551616`, expected u64"),
        ("/workers", {"worker_id": 1, "model_name": None}, "model_name: invalid type: null, expected a string"),
        ("/workers", {"worker_id": 1, "kv_transfer_enforcement": "x"},
         "kv_transfer_enforcement: unknown variant `x`, expected `required` or `preferred`"),
        ("/workers", {"worker_id": 1, "kv_events_endpoints": {"abc": "ws://h"}},
         'kv_events_endpoints.abc: invalid value: string "abc", expected a dp_rank (u32)'),
        ("/workers", {"worker_id": 1, "tenant_id": "a", "routing_group": "b"}, "routing_group: conflicts with tenant_id"),
        ("/select", {"token_ids": [1, -5]}, "token_ids[1]: invalid value: integer `-5`, expected u32"),
        ("/select", {"token_ids": [1, True]}, "token_ids[1]: invalid type: boolean `true`, expected u32"),
        ("/select", {"pinned_worker": {"worker_id": 1}}, "pinned_worker: missing field `dp_rank`"),
        ("/select", {"router_config_override": {"overlap_score_credit": 2}},
         "router_config_override.overlap_score_credit: must be in [0, 1]; to weight prefill load more, raise prefill_load_scale instead"),
        ("/select", {"router_config_override": {"prefill_load_scale": -1}},
         "router_config_override.prefill_load_scale: must be a finite number >= 0"),
        ("/select", [], "invalid type: sequence, expected a map"),
        ("/kv_events", [{"worker_id": 1, "event": {"event_id": 1, "data": "x"}}],
         "[0].event.data: unknown variant `x`, expected one of `stored`, `removed`, `cleared`"),
    ]
    for path, body, reason in cases:
        assert client.error("POST", path, body) == (422, prefix + reason), body
    with pytest.raises(Unprocessable) as info:
        SelectRequest(token_ids=[1, -5])
    assert info.value.message == prefix + "token_ids[1]: invalid value: integer `-5`, expected u32"


def test_routes_methods_and_paths(client: Client) -> None:
    assert client.error("GET", "/nope") == (404, "route not found")
    assert client.error("GET", "/select/") == (404, "route not found")
    status, headers, _ = client.service.handle("GET", "/select", "", [], b"", now=1.0)
    assert status == 405 and ("allow", "POST") in headers
    assert client.error("DELETE", "/workers/abc") == (400, "Invalid URL: Cannot parse `abc` to a `u64`")
    assert client.error("DELETE", "/workers/18446744073709551616")[0] == 400
    assert client.error("DELETE", "/reservations/%zz") == (400, "Invalid URL: invalid percent-encoding")
    assert client.error("DELETE", "/reservations/a%2Fb") == (404, "reservation a/b not found")
    assert client.error("GET", "/kv_events") == (426, "this endpoint requires a WebSocket upgrade")
    assert client.error("GET", "/workers", query="model_name=a&model_name=b") == (
        400, "Failed to deserialize query string: duplicate field `model_name`")
    assert client.error("GET", "/loads", query="tenant_id=a&routing_group=b") == (
        400, "Failed to deserialize query string: routing_group conflicts with tenant_id")
    assert client.error("POST", "/kv_events", [], query="worker_id=x") == (
        400, "Failed to deserialize query string: worker_id: invalid digit found in string")
    big = b"[" + b"1," * (4 * 1024 * 1024) + b"1]"
    assert client.error("POST", "/select", raw=big) == (413, "Failed to buffer the request body: length limit exceeded")
    status, headers, body = client.service.handle("HEAD", "/health", "", [], b"", now=1.0)
    assert status == 200 and body == b"" and dict(headers)["content-length"] == "15"


def test_reservations(client: Client) -> None:
    scenario(client)
    body = {"model_name": "m", "reservation_id": "r1", "worker_id": 2, "token_ids": PROMPT}
    assert client.ok("POST", "/reservations", body, status=201) == {
        "reservation_id": "r1", "selection_id": "r1", "model_name": "m", "tenant_id": "default",
        "routing_group": "default", "worker_id": 2, "dp_rank": 0, "endpoint": "http://w2:8000"}
    load = client.ok("GET", "/loads")[0]["loads"][1]
    assert load == {"worker_id": 2, "dp_rank": 0, "potential_prefill_tokens": 5, "potential_decode_blocks": 3,
                    "active_requests": 1}
    assert client.error("POST", "/reservations", body) == (
        409, "Request r1 already exists (assigned to worker WorkerWithDpRank { worker_id: 2, dp_rank: 0 })")
    assert client.error("POST", "/reservations", {**body, "reservation_id": "r2", "worker_id": 9}) == (
        404, "schedulable worker 9 not found for model=m routing_group=default")
    assert client.error("POST", "/reservations", {**body, "reservation_id": "r2", "dp_rank": 1}) == (
        404, "Worker WorkerWithDpRank { worker_id: 2, dp_rank: 1 } not found")
    assert client.error("POST", "/reservations", {"model_name": "m", "reservation_id": "r2", "worker_id": 2}) == (
        400, "sequence_hashes is required without token_ids")
    client.ok("POST", "/reservations/r1/prefill_complete")
    client.ok("POST", "/reservations/r1/prefill_complete")
    assert client.ok("GET", "/loads")[0]["loads"][1]["potential_prefill_tokens"] == 0
    assert client.error("POST", "/reservations/r1/prefill_complete", query="model_name=other") == (
        404, "reservation r1 not found")
    client.ok("DELETE", "/reservations/r1")
    assert client.error("DELETE", "/reservations/r1") == (404, "reservation r1 not found")
    assert client.ok("GET", "/loads")[0]["loads"][1]["active_requests"] == 0


def test_select_and_reserve_ids_are_seeded_uuids(make_client: Any) -> None:
    ids = []
    for _ in range(2):
        c = make_client(seed=42)
        c.ok("POST", "/workers", worker(1), status=201)
        ids.append(c.ok("POST", "/select_and_reserve", {"model_name": "m", "token_ids": PROMPT})["reservation_id"])
    assert ids[0] == ids[1] and len(ids[0]) == 36 and ids[0][14] == "4"


def test_reservation_limit_and_expiry(make_client: Any) -> None:
    c = make_client(max_reservations_per_key=1, active_request_expiry_secs=10)
    c.ok("POST", "/workers", worker(1), status=201)
    c.ok("POST", "/select_and_reserve", {"model_name": "m", "token_ids": PROMPT, "reservation_id": "a"})
    assert c.error("POST", "/select_and_reserve", {"model_name": "m", "token_ids": PROMPT, "reservation_id": "b"}) == (
        429, "reservation limit reached for model=m tenant=default: at most 1 active")
    assert c.ok("GET", "/loads")[0]["loads"][0]["active_requests"] == 1
    c.now += 10
    c.service.tick(c.now)
    assert c.ok("GET", "/loads")[0]["loads"][0]["active_requests"] == 0
    assert c.error("DELETE", "/reservations/a") == (404, "reservation a not found")


def test_load_spreads_without_overlap(client: Client) -> None:
    for wid in (1, 2, 3):
        client.ok("POST", "/workers", worker(wid), status=201)
    chosen = [client.ok("POST", "/select_and_reserve", {"model_name": "m", "token_ids": list(range(i, i + 16))})[
        "worker_id"] for i in range(3)]
    assert sorted(chosen) == [1, 2, 3]


def test_potential_loads_and_constraints(client: Client) -> None:
    scenario(client)
    client.ok("POST", "/workers", worker(3, taints=["gpu=h100"], topology_domains={"rack": "r1"}), status=201)
    loads = client.ok("POST", "/potential_loads", {"model_name": "m", "token_ids": PROMPT})
    assert [(x["worker_id"], x["potential_prefill_tokens"], x["potential_decode_blocks"]) for x in loads] == [
        (1, 4, 3), (2, 5, 3), (3, 12, 3)]
    answer = client.ok("POST", "/select", {"model_name": "m", "token_ids": PROMPT, "explain": True,
                                           "routing_constraints": {"required_taints": ["dynamo.topology/rack=r1"]}})
    assert answer["worker_id"] == 3
    assert answer["excluded"] == [{"worker_id": 1, "dp_rank": 0, "reason": "missing_required_taint"},
                                  {"worker_id": 2, "dp_rank": 0, "reason": "missing_required_taint"}]
    preferred = client.ok("POST", "/select", {"model_name": "m", "token_ids": PROMPT, "explain": True,
                                              "routing_constraints": {"preferred_taints": {"gpu=h100": 10}}})
    assert preferred["worker_id"] == 3  # 15 * exp(-tanh(10)) < 4


def test_overload_thresholds(make_client: Any) -> None:
    c = make_client(active_prefill_tokens_threshold=10)
    c.ok("POST", "/workers", worker(1), status=201)
    c.ok("POST", "/select_and_reserve", {"model_name": "m", "token_ids": list(range(16))})
    assert c.error("POST", "/select", {"model_name": "m", "token_ids": [1]}) == (
        429, "all eligible workers are overloaded")
    assert c.error("POST", "/select", {"model_name": "m", "token_ids": [1],
                                       "pinned_worker": {"worker_id": 1, "dp_rank": 0}}) == (
        429, "pinned worker 1 is overloaded")


def test_temperature_is_reproducible_and_follows_softmax(make_client: Any) -> None:
    picks = []
    for _seed in range(2):
        c = make_client(seed=7, temperature=1.0)
        scenario(c)
        picks.append([c.ok("POST", "/select", {"model_name": "m", "token_ids": PROMPT})["worker_id"]
                      for _ in range(50)])
    assert picks[0] == picks[1]
    c = make_client(seed=3, temperature=1.0)
    scenario(c)
    ones = sum(c.ok("POST", "/select", {"model_name": "m", "token_ids": PROMPT})["worker_id"] == 1
               for _ in range(2000))
    # logits 4.0 and 4.25: p(1) = 1 / (1 + e^-1) = 0.731
    assert abs(ones / 2000 - 0.731) < 0.04


def test_tie_break_prefers_smaller_tree_then_seeded_draw(make_client: Any) -> None:
    c = make_client()
    for wid in (1, 2, 3):
        c.ok("POST", "/workers", worker(wid), status=201)
    c.ok("POST", "/kv_events", [stored(1, 1, [(5, 99)])])  # worker 1 holds an unrelated block
    chosen = {c.ok("POST", "/select", {"model_name": "m", "token_ids": PROMPT})["worker_id"] for _ in range(40)}
    assert chosen == {2, 3}


def test_kv_event_binding_and_modes(make_client: Any, client: Client) -> None:
    scenario(client)
    assert client.error("POST", "/kv_events", {"event_id": 3, "data": "cleared"}) == (
        400, "worker_id is required for events without worker_id")
    assert client.error("POST", "/kv_events", [stored(9, 1, [(1, 1)])]) == (404, "worker 9 not found")
    assert client.error("POST", "/kv_events", [stored(1, 1, [(1, 1)], dp_rank=3)]) == (
        400, "dp_rank 3 is not a rank of worker 1 (ranks 0..0)")
    assert client.error("POST", "/kv_events", [stored(1, 2, [(1, 1)])], query="model_name=x") == (
        409, "worker 1 belongs to model=m tenant=default")
    # one bad event rejects the whole message
    assert client.error("POST", "/kv_events", [stored(1, 2, [(7, 7)]), stored(9, 1, [(1, 1)])])[0] == 404
    assert client.ok("POST", "/overlap_scores", {"model_name": "m", "token_ids": PROMPT})["freshness"][0][
        "last_event_id"] == 1
    report = client.ok("POST", "/kv_events", {"event_id": 5, "data": {"removed": {"block_hashes": [999]}}},
                       query="worker_id=1")
    assert report["failures"] == [{"index": 0, "error": "Failed to apply event: Failed to find block"}]
    fresh = client.ok("POST", "/overlap_scores", {"model_name": "m", "token_ids": PROMPT})["freshness"][0]
    assert (fresh["event_gaps"], fresh["missing_events"], fresh["stale"]) == (1, 3, True)
    client.ok("POST", "/kv_events", {"event_id": 6, "data": "cleared"}, query="worker_id=1")
    fresh = client.ok("POST", "/overlap_scores", {"model_name": "m", "token_ids": PROMPT})["freshness"][0]
    assert fresh["stale"] is False
    for mode, text in (("subscribe", "kv events are pushed only when kv_events=push (this service runs kv_events=subscribe)"),
                       ("off", "kv events are disabled (kv_events=off)")):
        assert make_client(kv_events=mode).error("POST", "/kv_events", []) == (409, text)


def test_metrics_and_dump(client: Client) -> None:
    scenario(client)
    client.ok("POST", "/select", {"model_name": "m", "token_ids": PROMPT})
    client.error("POST", "/select", {"model_name": "zz", "token_ids": PROMPT})
    status, text = client.call("GET", "/metrics")
    assert status == 200
    assert 'selection_proto_requests_total{method="POST",route="/select",status="200"} 1.0' in text
    assert 'selection_proto_selections_total{model_name="zz",tenant_id="default",route="select",status="503"} 1.0' in text
    assert 'selection_proto_index_blocks{model_name="m",tenant_id="default",tier="device"} 3.0' in text
    assert 'selection_proto_workers{lifecycle="schedulable"} 2.0' in text
    assert 'selection_proto_predicted_hit_ratio_bucket{model_name="m",tenant_id="default",le="0.7"} 1.0' in text
    dump = client.ok("GET", "/dump")
    fresh = Client(SelectionService(Settings(kv_events="push")))
    for record in dump["workers"]:
        fresh.ok("POST", "/workers", record, status=201)
    fresh.ok("POST", "/kv_events", dump["events"])
    query = {"model_name": "m", "token_ids": PROMPT}
    strip = [{k: v for k, v in row.items() if not k.startswith("last_event")} for row in
             client.ok("POST", "/overlap_scores", query)["workers"]]
    assert strip == [{k: v for k, v in row.items() if not k.startswith("last_event")} for row in
                     fresh.ok("POST", "/overlap_scores", query)["workers"]]


def test_restore_replays_a_dump_and_validates_first(client: Client) -> None:
    scenario(client)
    dump = client.ok("GET", "/dump")
    fresh = Client(SelectionService(Settings(kv_events="push")))
    fresh.service.restore(dump, now=1.0)
    query = {"model_name": "m", "token_ids": PROMPT}
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("last_event")} for r in rows]  # noqa: E731
    assert strip(fresh.ok("POST", "/overlap_scores", query)["workers"]) == strip(
        client.ok("POST", "/overlap_scores", query)["workers"])
    # The catalog is restored; the verdict is evidence gathered live, not part of a dump.
    records = lambda rows: [{k: v for k, v in r.items() if k != "kv_routing"} for r in rows]  # noqa: E731
    assert records(fresh.ok("GET", "/workers")) == records(client.ok("GET", "/workers"))
    with pytest.raises(Exception) as busy:
        fresh.service.restore(dump, now=2.0)
    assert str(busy.value) == "restore needs an empty catalog"
    empty = SelectionService(Settings(kv_events="push"))
    bad = {**dump, "events": [*dump["events"], {"worker_id": 9, "event": {"event_id": 9, "data": "cleared"}}]}
    with pytest.raises(Unprocessable) as info:
        empty.restore(bad, now=1.0)
    assert info.value.message == "invalid dump: events[3].worker_id: worker 9 is not in the dump"
    assert empty.list_workers() == []  # nothing was applied
    with pytest.raises(Unprocessable) as info:
        empty.restore({**dump, "workers": [{"worker_id": "x"}]}, now=1.0)
    assert info.value.message == 'invalid dump: workers[0]: worker_id: invalid type: string "x", expected u64'


def test_openapi_documents_every_route_method_status_and_member(client: Client) -> None:
    from openapi_spec_validator import validate

    from selection_proto.core.base.routes import ROUTES

    doc = client.ok("GET", "/openapi.json")
    validate(doc)  # a valid OpenAPI 3.1 document (a nullable enum once made it invalid)
    assert doc["openapi"] == "3.1.0" and doc["info"]["version"] == "0.1.0"
    for route in ROUTES:
        op = doc["paths"][route.template][route.method.lower()]
        assert op["operationId"] == route.operation and op["responses"] and op["summary"]
        for status, response in op["responses"].items():
            assert status.startswith(("1", "4", "5")) or response["content"], (route.template, status)
        assert [p["name"] for p in op["parameters"] if p["in"] == "query"] == list(route.query)
    assert set(doc["paths"]["/select"]["post"]["responses"]) == {"200", "400", "413", "415", "422", "429", "503"}
    schemas = doc["components"]["schemas"]
    import attrs

    from selection_proto import SelectRequest, WorkerRequest

    for cls in (WorkerRequest, SelectRequest):
        assert set(schemas[cls.__name__]["properties"]) == {f.name for f in attrs.fields(cls)}
    assert schemas["WorkerRequest"]["required"] == ["worker_id"]
    assert schemas["WorkerRequest"]["properties"]["worker_id"]["format"] == "uint64"
    assert schemas["SelectRequest"]["properties"]["token_ids"]["type"] == ["array", "null"]


def test_decode_block_estimates_count_only_blocks_a_rank_does_not_hold(client: Client) -> None:
    """Sequence hashes are computed lazily (DECISIONS.md); the counts must not change: a rank with
    active blocks counts the prompt's blocks it lacks, an idle rank counts all of them, and
    client-sent sequence hashes count once each."""
    for wid in (1, 2):
        client.ok("POST", "/workers", worker(wid), status=201)
    booked = list(range(100, 108))  # 2 blocks of 4
    client.ok("POST", "/reservations", {"model_name": "m", "worker_id": 1, "reservation_id": "r",
                                        "token_ids": booked}, status=201)
    prompt = booked[:4] + [7, 7, 7, 7, 8, 8, 8, 8]  # shares the first block, then 2 new blocks
    loads = client.ok("POST", "/potential_loads", {"model_name": "m", "token_ids": prompt})
    assert [(x["worker_id"], x["potential_decode_blocks"]) for x in loads] == [(1, 2 + 2), (2, 3)]
    answer = client.ok("POST", "/select", {"model_name": "m", "token_ids": prompt, "explain": True})
    assert sorted((c["worker_id"], c["potential_decode_blocks"]) for c in answer["candidates"]) == [
        (1, 4), (2, 3)]
    given = client.ok("POST", "/potential_loads", {"model_name": "m", "block_hashes": [1, 2, 3],
                                                   "sequence_hashes": [5, 5, 6], "isl_tokens": 12})
    assert [(x["worker_id"], x["potential_decode_blocks"]) for x in given] == [(1, 2 + 2), (2, 2)]
