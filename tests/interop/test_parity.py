"""Request parity with 1.6.1 (docs/DECISIONS.md), side by side: the same script in 1.6.1's dialect against
the reference service and ours, both started with the same cache limits, compared on statuses,
error texts, the chosen workers and `/loads`."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.interop.test_services import Http, free_port, start_reference
from tests.test_http import Server

WORKERS = (1,)  # one worker: both choose it (ties between idle workers are broken at random)


def start_both(reference_python: str, *flags: str, mode: str = "push"
               ) -> tuple[Http, Http, Server, subprocess.Popen[bytes]]:
    ref, ref_port = start_reference(reference_python, *flags)
    ours = Server(*flags, mode=mode)
    services = (Http(ours.port, "routing_group"), Http(ref_port, "routing_group"))
    for service in services:
        for wid in WORKERS:
            # The reference needs an event endpoint to call a worker schedulable; nothing publishes.
            status, _ = service.call("POST", "/workers", {
                "worker_id": wid, "model_name": "m", "endpoint": f"http://w{wid}:8000", "block_size": 4,
                "kv_events_endpoint": f"tcp://127.0.0.1:{free_port()}", "max_num_batched_tokens": 100})
            assert status == 201
    return services[0], services[1], ours, ref


@pytest.fixture
def pair(request: pytest.FixtureRequest, reference_python: str) -> Iterator[tuple[Http, Http]]:
    flags: tuple[str, ...] = getattr(request, "param", ())
    ours, ref, server, process = start_both(reference_python, *flags)
    try:
        yield ours, ref
    finally:
        server.stop()
        process.terminate()
        process.wait(timeout=30)


def loads(service: Http) -> list[tuple[int, int, int, int]]:
    status, body = service.call("GET", "/loads")
    assert status == 200
    return [(row["worker_id"], row["potential_prefill_tokens"], row["potential_decode_blocks"],
             row["active_requests"]) for key in body for row in key["loads"]]


SHAPE_PREFIX = "Failed to deserialize the JSON body into the target type: "


def comparable(answer: Any) -> Any:
    """What both must agree on: decoder details without serde's position (differences.md §2), and
    without the path serde loses in flattened members (we name it: api.md §2.3); the spec's
    `tenant=` labels read as 1.6.1's `routing_group=`."""
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        text = re.sub(r" at line \d+ column \d+$", "", answer["error"])
        if text.startswith(SHAPE_PREFIX):
            text = SHAPE_PREFIX + re.sub(r"^[A-Za-z_][\w.\[\]]*: (?=missing field|invalid)", "",
                                         text[len(SHAPE_PREFIX):])
        return {**answer, "error": text.replace(" tenant=", " routing_group=")}
    return answer


def same(ours: Http, ref: Http, method: str, path: str, body: Any = None,
         members: tuple[str, ...] = ("error", "worker_id", "dp_rank", "selection_id", "status")) -> int:
    """Send one call to both; their statuses and the named members must agree."""
    a, b = ours.call(method, path, body), ref.call(method, path, body)
    a, b = (a[0], comparable(a[1])), (b[0], comparable(b[1]))
    assert a[0] == b[0], (path, body, a, b)
    if isinstance(b[1], dict):
        assert {k: a[1].get(k) for k in members if k in b[1]} == {k: b[1][k] for k in members if k in b[1]}, (
            path, body, a, b)
    assert loads(ours) == loads(ref), (path, body)
    return a[0]


PROMPT = list(range(9))


def test_pending_selection_books_what_was_selected_once(pair: tuple[Http, Http]) -> None:
    ours, ref = pair
    same(ours, ref, "POST", "/select", {"model_name": "m", "selection_id": "s1", "token_ids": PROMPT,
                                        "expected_output_tokens": 5})
    # The replay books the select's prompt; other prompt members are ignored.
    assert same(ours, ref, "POST", "/reservations", {"model_name": "m", "selection_id": "s1",
                                                     "token_ids": list(range(40))}) == 201
    assert same(ours, ref, "POST", "/reservations", {"model_name": "m", "selection_id": "s1"}) == 404
    # Another model is a miss and leaves the entry; the latest select for an id wins.
    same(ours, ref, "POST", "/select", {"model_name": "m", "selection_id": "s2", "token_ids": PROMPT})
    same(ours, ref, "POST", "/select", {"model_name": "m", "selection_id": "s2", "token_ids": list(range(13))})
    assert same(ours, ref, "POST", "/reservations", {"model_name": "other", "selection_id": "s2"}) == 404
    assert same(ours, ref, "POST", "/reservations", {"model_name": "m", "selection_id": "s2"}) == 201
    # An id already booked: 409, and the entry stays for a retry after the free.
    same(ours, ref, "POST", "/select", {"model_name": "m", "selection_id": "s2", "token_ids": PROMPT})
    assert same(ours, ref, "POST", "/reservations", {"model_name": "m", "selection_id": "s2"}) == 409
    assert same(ours, ref, "DELETE", "/reservations/s2") == 200
    assert same(ours, ref, "POST", "/reservations", {"model_name": "m", "selection_id": "s2"}) == 201
    # The explicit form discards a pending selection of the same id.
    same(ours, ref, "POST", "/select", {"model_name": "m", "selection_id": "s3", "token_ids": PROMPT})
    assert same(ours, ref, "POST", "/reservations", {"model_name": "m", "selection_id": "s3", "worker_id": 99,
                                                     "token_ids": PROMPT}) == 404
    assert same(ours, ref, "POST", "/reservations", {"model_name": "m", "selection_id": "s3"}) == 404
    # select_and_reserve never leaves a pending selection.
    same(ours, ref, "POST", "/select_and_reserve", {"model_name": "m", "selection_id": "s4", "token_ids": PROMPT})
    assert same(ours, ref, "DELETE", "/reservations/s4") == 200
    assert same(ours, ref, "POST", "/reservations", {"model_name": "m", "selection_id": "s4"}) == 404


def test_a_vanished_worker_is_404_and_the_entry_stays(pair: tuple[Http, Http]) -> None:
    ours, ref = pair
    same(ours, ref, "POST", "/select", {"model_name": "m", "selection_id": "v", "token_ids": PROMPT})
    for wid in WORKERS:
        same(ours, ref, "DELETE", f"/workers/{wid}")
    assert same(ours, ref, "POST", "/reservations", {"model_name": "m", "selection_id": "v"}) == 503
    for wid in WORKERS:
        body = {"worker_id": wid, "model_name": "m", "endpoint": f"http://w{wid}:8000", "block_size": 4,
                "max_num_batched_tokens": 100}
        for service in (ours, ref):
            status, _ = service.call("POST", "/workers", {**body, "kv_events_endpoint": f"tcp://127.0.0.1:{free_port()}"})
            assert status == 201
    assert same(ours, ref, "POST", "/reservations", {"model_name": "m", "selection_id": "v"}) == 201


@pytest.mark.parametrize("pair", [("--selection-cache-max-entries", "3")], indirect=True)
def test_the_oldest_pending_selection_is_evicted_first(pair: tuple[Http, Http]) -> None:
    ours, ref = pair
    for sid in ("e1", "e2", "e3", "e4"):
        same(ours, ref, "POST", "/select", {"model_name": "m", "selection_id": sid, "token_ids": PROMPT})
    assert [same(ours, ref, "POST", "/reservations", {"model_name": "m", "selection_id": sid})
            for sid in ("e1", "e2", "e3", "e4")] == [404, 201, 201, 201]


@pytest.mark.parametrize("pair", [("--selection-cache-max-bytes", "24")], indirect=True)
def test_pending_selection_bytes_count_as_in_1_6_1(pair: tuple[Http, Http]) -> None:
    ours, ref = pair
    # id `a`, model `m`, group `default`: 9 bytes, plus 8 per sequence hash, lora and session.
    cases = [("a", list(range(5)), {}), ("b", list(range(9)), {}), ("c", list(range(5)), {"lora_name": "l" * 7}),
             ("d", list(range(5)), {"lora_name": "l" * 8})]
    statuses = []
    for sid, tokens, extra in cases:
        same(ours, ref, "POST", "/select", {"model_name": "m", "selection_id": sid, "token_ids": tokens, **extra})
        statuses.append(same(ours, ref, "POST", "/reservations", {"model_name": "m", "selection_id": sid}))
    assert statuses == [201, 404, 201, 404]


@pytest.mark.parametrize("pair", [("--selection-cache-ttl-secs", "0.5")], indirect=True)
def test_a_pending_selection_expires_after_its_ttl(pair: tuple[Http, Http]) -> None:
    ours, ref = pair
    same(ours, ref, "POST", "/select", {"model_name": "m", "selection_id": "t1", "token_ids": PROMPT})
    same(ours, ref, "POST", "/select", {"model_name": "m", "selection_id": "t2", "token_ids": PROMPT})
    assert same(ours, ref, "POST", "/reservations", {"model_name": "m", "selection_id": "t1"}) == 201
    time.sleep(0.8)
    assert same(ours, ref, "POST", "/reservations", {"model_name": "m", "selection_id": "t2"}) == 404


def test_output_blocks_weigh_as_in_1_6_1(pair: tuple[Http, Http]) -> None:
    ours, ref = pair
    same(ours, ref, "POST", "/select_and_reserve", {"model_name": "m", "selection_id": "o", "token_ids": list(range(8))})
    same(ours, ref, "POST", "/select_and_reserve", {"model_name": "m", "selection_id": "p", "token_ids": list(range(4))})
    for body in ({}, {"decay_fraction": 0.5}, {"decay_fraction": None}, {"foo": 1}, {"decay_fraction": 0.25},
                 {"decay_fraction": 0}):
        assert same(ours, ref, "POST", "/reservations/o/output_block", body) == 200
        assert same(ours, ref, "POST", "/reservations/p/output_block", body) == 200
    assert same(ours, ref, "POST", "/reservations/o/output_block", {"decay_fraction": 1.5}) == 400
    assert same(ours, ref, "POST", "/reservations/nope/output_block", {"decay_fraction": 1.5}) == 400
    assert same(ours, ref, "POST", "/reservations/nope/output_block", {}) == 404
    assert same(ours, ref, "POST", "/reservations/o/output_block", {"decay_fraction": "x"}) == 422
    assert same(ours, ref, "DELETE", "/reservations/o") == 200
    assert same(ours, ref, "POST", "/reservations/o/output_block", {}) == 404
    assert same(ours, ref, "DELETE", "/reservations/p") == 200


def two_workers(ours: Http, ref: Http) -> None:
    body = {"worker_id": 2, "model_name": "m", "endpoint": "http://w2:8000", "block_size": 4,
            "max_num_batched_tokens": 100}
    for service in (ours, ref):
        status, _ = service.call("POST", "/workers", {**body, "kv_events_endpoint": f"tcp://127.0.0.1:{free_port()}"})
        assert status == 201


def pinned(ours: Http, ref: Http, sid: str, worker: int, tokens: int) -> None:
    """A booking on `worker` that makes it the busier one (the same load on both services)."""
    assert same(ours, ref, "POST", "/select_and_reserve", {
        "model_name": "m", "selection_id": sid, "token_ids": list(range(1000, 1000 + tokens)),
        "pinned_worker": {"worker_id": worker, "dp_rank": 0}}) == 200


@pytest.mark.parametrize("pair", [("--session-affinity-ttl-secs", "2")], indirect=True)
def test_session_affinity_binds_on_booking_and_follows_1_6_1(pair: tuple[Http, Http]) -> None:
    ours, ref = pair
    two_workers(ours, ref)
    pinned(ours, ref, "load1", 1, 40)  # worker 1 is busier: an unbound choice is worker 2
    # A plain select only reads: no binding yet, so load decides.
    same(ours, ref, "POST", "/select", {"model_name": "m", "session_id": "S", "token_ids": PROMPT})
    # The booking binds S to worker 2; then worker 2 becomes the busier one and S still goes there.
    same(ours, ref, "POST", "/select_and_reserve", {"model_name": "m", "selection_id": "s1", "session_id": "S",
                                                    "token_ids": PROMPT})
    pinned(ours, ref, "load2", 2, 100)
    for path, sid in (("/select", None), ("/select_and_reserve", "s2")):
        same(ours, ref, "POST", path, {"model_name": "m", "selection_id": sid, "session_id": "S", "token_ids": PROMPT})
    same(ours, ref, "POST", "/select", {"model_name": "m", "token_ids": PROMPT})  # unbound: worker 1
    # session_context wins over session_id; a pinned worker neither reads nor binds.
    same(ours, ref, "POST", "/select", {"model_name": "m", "session_id": "S", "session_context": {"session_id": "Z"},
                                        "token_ids": PROMPT})
    same(ours, ref, "POST", "/select_and_reserve", {"model_name": "m", "selection_id": "p1", "session_id": "S",
                                                    "pinned_worker": {"worker_id": 1, "dp_rank": 0},
                                                    "token_ids": PROMPT})
    # A booking forced away from the binding: 400, nothing booked, and the binding is gone.
    assert same(ours, ref, "POST", "/select_and_reserve", {
        "model_name": "m", "selection_id": "s3", "session_id": "S", "allowed_worker_ids": [1],
        "token_ids": PROMPT}) == 400
    same(ours, ref, "POST", "/select", {"model_name": "m", "session_id": "S", "token_ids": PROMPT})
    # Over-long ids are refused; an empty one is a session.
    assert same(ours, ref, "POST", "/select", {"model_name": "m", "session_id": "x" * 257, "token_ids": PROMPT}) == 400
    assert same(ours, ref, "POST", "/select", {"model_name": "m", "session_id": "", "token_ids": PROMPT}) == 200
    assert same(ours, ref, "POST", "/select", {"model_name": "m", "session_context": {}, "token_ids": PROMPT}) == 422


@pytest.mark.parametrize("pair", [("--session-affinity-ttl-secs", "2")], indirect=True)
def test_a_binding_expires_ttl_after_its_last_booking_ends(pair: tuple[Http, Http]) -> None:
    ours, ref = pair
    two_workers(ours, ref)
    pinned(ours, ref, "load1", 1, 40)
    for sid in ("t1", "t2"):  # two bookings of T on worker 2: two leases
        same(ours, ref, "POST", "/select_and_reserve", {"model_name": "m", "selection_id": sid, "session_id": "T",
                                                        "token_ids": PROMPT})
    pinned(ours, ref, "load2", 2, 100)  # now unbound selections go to worker 1
    same(ours, ref, "DELETE", "/reservations/t1")
    time.sleep(2.5)
    same(ours, ref, "POST", "/select", {"model_name": "m", "session_id": "T", "token_ids": PROMPT})  # t2 holds it
    same(ours, ref, "DELETE", "/reservations/t2")
    time.sleep(1.0)
    same(ours, ref, "POST", "/select", {"model_name": "m", "session_id": "T", "token_ids": PROMPT})  # still bound
    time.sleep(1.6)
    same(ours, ref, "POST", "/select", {"model_name": "m", "session_id": "T", "token_ids": PROMPT})  # expired


@pytest.mark.parametrize("pair", [("--session-affinity-ttl-secs", "30")], indirect=True)
def test_a_replayed_selection_binds_its_session_and_a_departed_worker_rebinds(pair: tuple[Http, Http]) -> None:
    ours, ref = pair
    two_workers(ours, ref)
    pinned(ours, ref, "load1", 1, 40)
    same(ours, ref, "POST", "/select", {"model_name": "m", "selection_id": "v", "session_id": "V", "token_ids": PROMPT})
    assert same(ours, ref, "POST", "/reservations", {"model_name": "m", "selection_id": "v"}) == 201
    pinned(ours, ref, "load2", 2, 100)
    same(ours, ref, "POST", "/select", {"model_name": "m", "session_id": "V", "token_ids": PROMPT})  # bound: 2
    # A replay that would land away from the binding: 400, and the selection is used up.
    same(ours, ref, "POST", "/select", {"model_name": "m", "selection_id": "w", "session_id": "V",
                                        "allowed_worker_ids": [1], "token_ids": PROMPT})
    assert same(ours, ref, "POST", "/reservations", {"model_name": "m", "selection_id": "w"}) == 400
    assert same(ours, ref, "POST", "/reservations", {"model_name": "m", "selection_id": "w"}) == 404
    # A session bound to a worker that left books elsewhere and is bound there.
    same(ours, ref, "POST", "/select_and_reserve", {"model_name": "m", "selection_id": "u1", "session_id": "U",
                                                    "token_ids": PROMPT})
    same(ours, ref, "DELETE", "/workers/1")
    same(ours, ref, "POST", "/select_and_reserve", {"model_name": "m", "selection_id": "u2", "session_id": "U",
                                                    "token_ids": PROMPT})


KEY_FILE = os.path.join(os.path.dirname(__file__), "tracking_key.bin")  # 32 bytes of 0x5a


@pytest.mark.parametrize("pair", [("--router-tracking-hash", "keyed-xxh3-v1", "--router-tracking-key-file", KEY_FILE,
                                   "--router-tracking-key-id", "2026-01")], indirect=True)
def test_keyed_tracking_hashes_are_1_6_1s(pair: tuple[Http, Http]) -> None:
    ours, ref = pair
    members = ("selection_id", "sequence_hashes", "worker_id", "error")
    for sid, extra in (("k1", {}), ("k2", {"cache_salt": "cache-a", "lora_name": "adapter-a"}),
                       ("k3", {"routing_group": "default", "token_ids": list(range(5))})):
        body = {"model_name": "m", "selection_id": sid, "token_ids": list(range(12)), **extra}
        assert same(ours, ref, "POST", "/select_and_reserve", body, members) == 200
    # Sequence hashes a client sends are used as given.
    body = {"model_name": "m", "selection_id": "k4", "block_hashes": [1, 2], "sequence_hashes": [11, 12],
            "isl_tokens": 8}
    assert same(ours, ref, "POST", "/select_and_reserve", body, members) == 200


@pytest.mark.parametrize("pair", [("--no-router-assume-kv-reuse",)], indirect=True)
def test_without_kv_reuse_identical_bookings_count_twice(pair: tuple[Http, Http]) -> None:
    ours, ref = pair
    for sid in ("a", "b"):
        same(ours, ref, "POST", "/select_and_reserve", {"model_name": "m", "selection_id": sid,
                                                        "token_ids": list(range(8))})
    # The override brings the public hashes back for one booking.
    same(ours, ref, "POST", "/select_and_reserve", {"model_name": "m", "selection_id": "c", "token_ids": list(range(8)),
                                                    "router_config_override": {"assume_kv_reuse": True}})
    assert loads(ours)[0][2] == 6


def test_advisory_selections_and_eagle_prompts(pair: tuple[Http, Http]) -> None:
    ours, ref = pair
    status, _ = ours.call("PATCH", "/workers/1", {"total_kv_blocks": 50})
    assert status == 200
    status, _ = ref.call("PATCH", "/workers/1", {"total_kv_blocks": 50})
    assert status == 200
    members = ("worker_id", "worker_load", "potential_decode_blocks", "sequence_hashes", "error")
    same(ours, ref, "POST", "/select_and_reserve", {"model_name": "m", "selection_id": "a", "token_ids": list(range(30))},
         members)
    for body in ({"advisory": True}, {"advisory": False}, {"advisory": None}, {"advisory": "x"},
                 {"is_eagle": True}, {"is_eagle": True, "advisory": True}):
        same(ours, ref, "POST", "/select", {"model_name": "m", "token_ids": list(range(9)), **body}, members)
    for sid, body in (("b", {"advisory": True}), ("e", {"is_eagle": True})):
        same(ours, ref, "POST", "/select_and_reserve", {"model_name": "m", "selection_id": sid,
                                                        "token_ids": list(range(9)), **body}, members)


def mm(*hashes: int) -> dict[str, Any]:
    return {"mm_objects": [{"mm_hash": h, "offsets": [[0, 1]]} for h in hashes]}


def test_multimodal_prompts_hash_as_1_6_1(pair: tuple[Http, Http]) -> None:
    """`mm_routing_info` and `block_mm_infos`, compared through the booked sequence hashes
    (the chain of the block hashes), the input length, the potential loads and the 422s."""
    ours, ref = pair
    members = ("sequence_hashes", "isl_tokens", "effective_prefill_tokens", "potential_decode_blocks", "error")
    routing = list(range(10, 18))
    bodies: list[dict[str, Any]] = [
        {"mm_routing_info": {"routing_token_ids": routing, "block_mm_infos": [mm(42)]}},
        {"mm_routing_info": {"routing_token_ids": routing, "block_mm_infos": [mm(42, 7, 42)]}},
        {"token_ids": routing, "block_mm_infos": [None, mm(42)]},
        {"token_ids": routing, "mm_routing_info": {"routing_token_ids": routing + [1, 2, 3, 4, 5]}},
        {"token_ids": [1, 2, 3, 4], "mm_routing_info": {"routing_token_ids": []}},
        {"token_ids": routing, "block_mm_infos": [{"mm_objects": []}, mm(18446744073709551615), mm(1), mm(2)]},
        {"token_ids": routing, "is_eagle": True, "block_mm_infos": [mm(9)], "lora_name": "l", "cache_salt": "s"},
        {"mm_routing_info": {"block_mm_infos": []}, "token_ids": [1]},
        {"token_ids": [1], "block_mm_infos": [{"mm_objects": [{"mm_hash": 1}]}]},
        {"token_ids": [1], "block_mm_infos": [{"mm_objects": [{"mm_hash": -1, "offsets": []}]}]},
    ]
    for i, body in enumerate(bodies):
        same(ours, ref, "POST", "/select_and_reserve", {"model_name": "m", "selection_id": f"mm{i}", **body}, members)
        same(ours, ref, "POST", "/potential_loads", {"model_name": "m", **body}, members)


def test_start_warm_from_a_1_6_1_peer(reference_python: str) -> None:
    """`--indexer-peers` pointed at 1.6.1 takes its index before our workers register;
    a worker of that partition must then use the recovered block size."""
    import msgpack
    import zmq

    pub = zmq.Context.instance().socket(zmq.PUB)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub.bind(endpoint)
    ref, ref_port = start_reference(reference_python)
    try:
        reference = Http(ref_port, "routing_group")
        worker = {"worker_id": 1, "model_name": "m", "endpoint": "http://w1:8000", "block_size": 4}
        assert reference.call("POST", "/workers", {**worker, "kv_events_endpoint": endpoint})[0] == 201
        prompt = {"model_name": "m", "token_ids": list(range(1, 13))}
        batch = msgpack.packb([time.time(), [["BlockStored", [101, 102, 103], None, list(range(1, 13)), 4,
                                              None, "GPU", None, None]], 0])
        for seq in range(1, 200):  # ZMQ PUB drops what is sent before the subscriber joined
            pub.send_multipart([b"", seq.to_bytes(8, "big"), batch])
            rows = reference.call("POST", "/overlap_scores", prompt)[1]["workers"]
            if rows and rows[0]["device_blocks"] == 3:
                break
            time.sleep(0.1)
        ours = Server("--indexer-peers", f"http://127.0.0.1:{ref_port}")
        try:
            service = Http(ours.port, "routing_group")
            assert service.call("GET", "/ready")[1]["recovered_from"] == f"http://127.0.0.1:{ref_port}"
            assert service.call("GET", "/loads")[1] == []  # an index awaiting its workers
            # Before any worker of the partition registers, its recovered block size stands.
            other = service.call("POST", "/workers", {**worker, "worker_id": 2, "block_size": 8})[1]
            assert other["not_schedulable_reasons"] == [
                "reconciliation failed: block_size mismatch for model=m tenant=default: existing=4 requested=8"]
            assert service.call("POST", "/workers", worker)[1]["lifecycle"] == "schedulable"
            assert service.call("POST", "/overlap_scores", prompt)[1]["workers"][0]["device_blocks"] == 3
        finally:
            ours.stop()
    finally:
        ref.terminate()
        ref.wait(timeout=30)
        pub.close(linger=0)


def device_rows(service: Http, tokens: list[int]) -> dict[int, int]:
    answer = service.call("POST", "/overlap_scores", {"model_name": "m", "token_ids": tokens})[1]
    return {row["worker_id"]: row["device_blocks"] for row in answer["workers"] if row["device_blocks"]}


def test_approximate_mode_predicts_from_bookings_as_1_6_1(reference_python: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With `DYN_ROUTER_USE_KV_EVENTS=false` (both read it) bookings predict the cache for
    `DYN_ROUTER_TTL_SECS`, refreshed by each booking; a plain select records nothing."""
    monkeypatch.setenv("DYN_ROUTER_USE_KV_EVENTS", "false")
    monkeypatch.setenv("DYN_ROUTER_TTL_SECS", "3")
    ours, ref, server, process = start_both(reference_python, mode="approximate")
    try:
        two_workers(ours, ref)
        q, p = list(range(12)), list(range(8))
        started = time.monotonic()
        pin = {"pinned_worker": {"worker_id": 1, "dp_rank": 0}}
        steps: list[tuple[str, str, Any]] = [
            ("POST", "/select", {"model_name": "m", "token_ids": q}),
            ("POST", "/select_and_reserve", {"model_name": "m", "selection_id": "a", "token_ids": q, **pin}),
            ("POST", "/select", {"model_name": "m", "selection_id": "v", "token_ids": list(range(100, 108)), **pin}),
            ("POST", "/reservations", {"model_name": "m", "selection_id": "v"}),
            ("POST", "/reservations", {"model_name": "m", "selection_id": "e", "worker_id": 2,
                                       "block_hashes": [1, 2], "sequence_hashes": [1, 5], "isl_tokens": 8}),
            ("POST", "/reservations", {"model_name": "m", "selection_id": "f", "worker_id": 2,
                                       "sequence_hashes": [7], "isl_tokens": 4}),
            ("DELETE", "/reservations/a", None),  # a free keeps the prediction
        ]
        # Statuses, chosen workers and predictions are compared, not loads: an explicit booking's
        # prefill load differs (1.6.1 books none without its `effective_prefill_tokens` hint; we
        # book the uncached tokens, as the spec says).
        def both(method: str, path: str, body: Any) -> None:
            a, b = ours.call(method, path, body), ref.call(method, path, body)
            assert a[0] == b[0], (a, b)
            if (body or {}).get("pinned_worker") or path != "/select":  # two idle workers tie at random
                assert (a[1] or {}).get("worker_id") == (b[1] or {}).get("worker_id"), (a, b)

        for method, path, body in steps:
            both(method, path, body)
            for tokens in (q, list(range(100, 108))):
                assert device_rows(ours, tokens) == device_rows(ref, tokens), (path, body)
        time.sleep(max(0.0, 2.0 - (time.monotonic() - started)))
        both("POST", "/select_and_reserve", {"model_name": "m", "selection_id": "b", "token_ids": p, **pin})
        time.sleep(max(0.0, 3.8 - (time.monotonic() - started)))
        assert device_rows(ours, q) == device_rows(ref, q) == {1: 2}  # q's third block expired
        time.sleep(max(0.0, 5.5 - (time.monotonic() - started)))
        assert device_rows(ours, q) == device_rows(ref, q) == {}
    finally:
        server.stop()
        process.terminate()
        process.wait(timeout=30)


def test_a_predicted_side_index_beside_real_events_as_1_6_1(reference_python: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`DYN_ROUTER_PREDICTED_TTL_SECS` (both read it): a real block plus bookings' predicted
    blocks, the larger prefix per worker, not dumped, gone after the TTL."""
    import msgpack
    import zmq

    monkeypatch.setenv("DYN_ROUTER_PREDICTED_TTL_SECS", "3")
    pubs = {wid: zmq.Context.instance().socket(zmq.PUB) for wid in (1, 2)}
    endpoints = {}
    for wid, pub in pubs.items():
        endpoints[wid] = f"tcp://127.0.0.1:{free_port()}"
        pub.bind(endpoints[wid])
    ref, ref_port = start_reference(reference_python)
    server = Server()
    try:
        ours, reference = Http(server.port, "routing_group"), Http(ref_port, "routing_group")
        for wid in (1, 2):
            worker = {"worker_id": wid, "model_name": "m", "endpoint": f"http://w{wid}:8000", "block_size": 4,
                      "kv_events_endpoint": endpoints[wid]}
            assert ours.call("POST", "/workers", worker)[0] == reference.call("POST", "/workers", worker)[0] == 201
        tokens = list(range(1, 13))
        batch = msgpack.packb([time.time(), [["BlockStored", [501], None, tokens[:4], 4, None, "GPU", None, None]], 0])
        import urllib.request

        request = urllib.request.Request(f"http://127.0.0.1:{server.port}/kv_events?worker_id=1", data=batch,
                                         method="POST", headers={"content-type": "application/msgpack"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200
        for seq in range(1, 200):  # ZMQ PUB drops what is sent before the subscriber joined
            pubs[1].send_multipart([b"", seq.to_bytes(8, "big"), batch])
            if device_rows(reference, tokens) == {1: 1}:
                break
            time.sleep(0.1)
        assert device_rows(ours, tokens) == device_rows(reference, tokens) == {1: 1}
        started = time.monotonic()
        for sid, wid, n in (("a", 1, 12), ("b", 2, 8)):
            body = {"model_name": "m", "selection_id": sid, "worker_id": wid, "token_ids": tokens[:n]}
            assert ours.call("POST", "/reservations", body)[0] == reference.call("POST", "/reservations", body)[0]
        assert device_rows(ours, tokens) == device_rows(reference, tokens) == {1: 3, 2: 2}
        events = [e for key in reference.call("GET", "/dump")[1].values() for e in key["events"]]
        assert len(events) == len(ours.call("GET", "/dump")[1]["events"]) == 1  # the real block only
        time.sleep(max(0.0, 3.3 - (time.monotonic() - started)))
        assert device_rows(ours, tokens) == device_rows(reference, tokens) == {1: 1}
    finally:
        server.stop()
        ref.terminate()
        ref.wait(timeout=30)
        for pub in pubs.values():
            pub.close(linger=0)


@pytest.mark.parametrize("keep", [10, 3])
def test_engine_replay_recovers_as_1_6_1(reference_python: str, keep: int) -> None:
    """One engine stand-in (PUB + ROUTER, vLLM framing) feeds both services; batches 1-4
    are lost on the wire. With the engine keeping 10 batches both recover them all; keeping 3,
    both apply what it still has (3-5) and go on without 1 and 2."""
    from tests.test_engine_replay import Engine

    engine = Engine(keep=keep)
    ref, ref_port = start_reference(reference_python)
    server = Server(mode="subscribe")
    try:
        services = (Http(server.port, "routing_group"), Http(ref_port, "routing_group"))
        for service in services:
            assert service.call("POST", "/workers", {
                "worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4,
                "kv_events_endpoint": engine.endpoint, "replay_endpoint": engine.replay_endpoint})[0] == 201

        def held(service: Http) -> list[int]:
            return [seq for seq in range(6) if device_rows(service, list(range(4 * seq, 4 * seq + 4)))]

        engine.publish(0, send=False)
        deadline = time.monotonic() + 30
        while not all(held(s) == [0] for s in services):  # ZMQ's slow joiners: resend 0 until both have it
            assert time.monotonic() < deadline, [held(s) for s in services]
            engine.pub.send_multipart([b"", (0).to_bytes(8, "big"), engine.buffer[-1][1]])
            time.sleep(0.1)
        for seq in range(1, 5):
            engine.publish(seq, send=False)
        engine.publish(5)
        expected = [0, 1, 2, 3, 4, 5] if keep == 10 else [0, 3, 4, 5]
        deadline = time.monotonic() + 30
        while not all(held(s) == expected for s in services):
            assert time.monotonic() < deadline, [held(s) for s in services]
            time.sleep(0.1)
    finally:
        server.stop()
        ref.terminate()
        ref.wait(timeout=30)
        engine.close()


def test_every_answer_names_the_routing_group_and_workers_carry_is_eagle_as_1_6_1(pair: tuple[Http, Http]) -> None:
    """A 1.6.1 client reads `routing_group` wherever we answer `tenant_id`, and a worker's
    `is_eagle`: echoed, agreed on by a key's workers, and the key's default for prompts."""
    ours, ref = pair

    def groups(answer: Any) -> list[Any]:
        """Every `routing_group` beside a `tenant_id`, at any depth (ours has both; 1.6.1 one)."""
        if isinstance(answer, list):
            return [g for item in answer for g in groups(item)]
        if not isinstance(answer, dict):
            return []
        own = [answer.get("routing_group")] if "tenant_id" in answer or "routing_group" in answer else []
        assert answer.get("tenant_id", answer.get("routing_group")) == answer.get("routing_group"), answer
        return own + [g for value in answer.values() for g in groups(value)]

    eagle = {"worker_id": 7, "model_name": "e", "endpoint": "http://w7:8000", "block_size": 4,
             "kv_events_endpoint": f"tcp://127.0.0.1:{free_port()}", "is_eagle": True}
    calls = [("POST", "/workers", eagle), ("GET", "/workers", None),
             ("GET", "/loads", None),
             ("POST", "/select", {"model_name": "e", "token_ids": PROMPT}),
             ("POST", "/select_and_reserve", {"model_name": "e", "token_ids": PROMPT, "selection_id": "e1"}),
             ("POST", "/select_and_reserve", {"model_name": "e", "token_ids": PROMPT, "selection_id": "e2",
                                              "is_eagle": False}),
             ("POST", "/reservations", {"model_name": "m", "token_ids": PROMPT, "worker_id": 1,
                                        "selection_id": "r"}),
             ("POST", "/workers", {**eagle, "worker_id": 8, "is_eagle": None}),
             ("DELETE", "/workers/7", None)]
    for method, path, body in calls:
        (a_status, a), (b_status, b) = ours.call(method, path, body), ref.call(method, path, body)
        assert a_status == b_status, (path, a, b)
        assert groups(a) == groups(b) and groups(b), (path, a, b)
        for record in (a, b) if path.startswith("/workers") else ():
            for one in record if isinstance(record, list) else [record]:
                assert "is_eagle" in one, one
        if path == "/workers" and method == "POST":
            reasons = [r.replace(" tenant=", " routing_group=") for r in a.get("not_schedulable_reasons", [])]
            assert (a["is_eagle"], a["lifecycle"], reasons) == (
                b["is_eagle"], b["lifecycle"], b.get("not_schedulable_reasons", [])), (a, b)
        if "sequence_hashes" in b:
            assert a["sequence_hashes"] == b["sequence_hashes"], (path, body)
    status, dump = ours.call("GET", "/dump")
    assert status == 200 and all(k["routing_group"] == k["tenant_id"] for k in dump["keys"])
    assert all(w["routing_group"] == w["tenant_id"] for w in dump["workers"])


def test_overlap_counts_the_allowed_workers_and_an_unknown_worker_names_the_group(
        reference_python: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `allowed_worker_ids`, `overlap.longest_matched` counts the allowed workers only
    (a prompt cached on worker 2 alone, selected among [1], matched 0 tokens), also when booked as
    the same selection; an explicit booking on an unknown worker names `routing_group=`."""
    monkeypatch.setenv("DYN_ROUTER_USE_KV_EVENTS", "false")  # bookings predict the cache, in both
    ours, ref, server, process = start_both(reference_python, mode="approximate")
    try:
        two_workers(ours, ref)
        prompt = list(range(8))
        pin = {"pinned_worker": {"worker_id": 2, "dp_rank": 0}}
        for service in (ours, ref):
            assert service.call("POST", "/select_and_reserve", {"model_name": "m", "token_ids": prompt,
                                                                "reservation_id": "warm", **pin})[0] == 200
        for body in ({"model_name": "m", "token_ids": prompt, "allowed_worker_ids": [1]},
                     {"model_name": "m", "token_ids": prompt, "allowed_worker_ids": [1], "selection_id": "s"},
                     {"model_name": "m", "token_ids": prompt, "allowed_worker_ids": [1, 2]}):
            for path in ("/select", "/select_and_reserve"):
                a, b = ours.call("POST", path, body), ref.call("POST", path, body)
                assert a[0] == b[0] == 200, (a, b)
                assert a[1]["overlap"]["longest_matched"] == b[1]["overlap"]["longest_matched"], (path, body, a, b)
                if body["allowed_worker_ids"] == [1]:  # between two workers, ties break at random
                    assert a[1]["worker_id"] == b[1]["worker_id"] == 1, (path, body, a, b)
        unknown = {"model_name": "m", "token_ids": prompt, "worker_id": 99, "selection_id": "u"}
        a, b = ours.call("POST", "/reservations", unknown), ref.call("POST", "/reservations", unknown)
        assert a == b == (404, {"error": "schedulable worker 99 not found for model=m routing_group=default"})
    finally:
        server.stop()
        process.terminate()
        process.wait(timeout=30)
