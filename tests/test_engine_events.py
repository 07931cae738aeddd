"""Engine msgpack batches (events.md §3, §4), encoded exactly as vLLM (array-like) and SGLang (maps) do."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from conftest import Client, worker

from selection_proto import StreamError, block_hashes
from selection_proto.core.cache.engine import InvalidBatch, decode_batch

SPEC_BATCH = bytes.fromhex(
    "93cb41d954fc40200000" "93" "99ab426c6f636b53746f726564" "92ce075bcd15fe" "c0" "980102030405060708" "04"
    "c0" "a3475055" "c0c0" "93ac426c6f636b52656d6f766564" "91ce075bcd15" "a3475055"
    "91b0416c6c426c6f636b73436c6561726564" "00")
PROMPT = list(range(1, 13))


def stored(hashes: list[Any], tokens: list[Any], parent: Any = None, *, bs: int = 4, medium: str | None = None,
           lora: str | None = None, extra: Any = None, group: int | None = None, locality: str | None = None) -> list[Any]:
    return ["BlockStored", hashes, parent, tokens, bs, None, medium, lora, extra, group, None, None, locality]


def batch(*events: Any, rank: int | None = 0) -> bytes:
    return msgpack.packb([1700000000.5, list(events), rank])


def post(c: Client, payload: bytes, query: str = "worker_id=1") -> tuple[int, Any]:
    return c.call("POST", "/kv_events", query=query, raw=payload, content_type="application/msgpack")


def overlap(c: Client, tokens: list[int] = PROMPT, **extra: Any) -> list[dict[str, Any]]:
    rows = c.ok("POST", "/overlap_scores", {"model_name": "m", "token_ids": tokens, **extra})["workers"]
    return [{k: r[k] for k in ("worker_id", "device_blocks", "host_pinned_extension_blocks", "disk_extension_blocks")}
            for r in rows]


@pytest.fixture
def c(client: Client) -> Client:
    client.ok("POST", "/workers", worker(1), status=201)
    client.ok("POST", "/workers", worker(2, data_parallel_size=2), status=201)
    return client


def test_spec_byte_example(c: Client) -> None:
    assert len(SPEC_BATCH) == 92
    decoded = decode_batch(SPEC_BATCH)
    assert [e.tag for e in decoded.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert decoded.events[0].block_hashes == (123456789, 18446744073709551614)
    status, report = post(c, SPEC_BATCH)
    assert status == 200 and report == {"received": 3, "applied": 3, "failed": 0, "dropped": 0, "failures": []}
    status, report = post(c, batch(stored([123456789, -2], list(range(1, 9)))))
    assert overlap(c) == [{"worker_id": 1, "device_blocks": 2, "host_pinned_extension_blocks": 0,
                           "disk_extension_blocks": 0}]


def test_map_form_lora_and_tiers(c: Client) -> None:
    sglang = msgpack.packb([1700000000.5, [{"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
                                            "token_ids": [1, 2, 3, 4], "block_size": 4, "medium": "CPU_PINNED",
                                            "lora_name": "sql-lora"}], None])
    assert len(sglang) == 128
    assert post(c, sglang)[1]["applied"] == 1
    assert overlap(c, [1, 2, 3, 4], lora_name="sql-lora") == [
        {"worker_id": 1, "device_blocks": 0, "host_pinned_extension_blocks": 1, "disk_extension_blocks": 0}]
    assert overlap(c, [1, 2, 3, 4]) == []  # the LoRA salts the local hash
    post(c, batch(stored([11], [1, 2, 3, 4], medium="GPU"), stored([12], [5, 6, 7, 8], 11, medium=" NVME "),
                  stored([13], [9, 10, 11, 12], 12, medium="SHARED")))
    assert overlap(c) == [{"worker_id": 1, "device_blocks": 1, "host_pinned_extension_blocks": 0,
                           "disk_extension_blocks": 2}]


def test_bigram_eagle_tokens_and_byte_hashes(c: Client) -> None:
    pairs = [[i, i + 1] for i in range(1, 9)]  # tokens 1..9, eagle windows of bs + 1
    assert post(c, batch(stored([b"\x01" * 32, b"\x02" * 32], pairs)))[1]["applied"] == 1
    tree = c.service.pools[("m", "default")].index.device
    expected = block_hashes(list(range(1, 10)), 4, is_eagle=True)
    nodes = {id(n): n for n in tree.lookup[(1, 0)].values()}.values()
    assert sorted(h for n in nodes for h in n.local_hashes()) == sorted(expected)


def test_dropped_events_are_counted_by_reason(c: Client) -> None:
    status, report = post(c, batch(
        ["Ignored", 1, 2],
        stored([1], [1, 2, 3, 4], locality="REMOTE"),
        stored([2], [1, 2, 3, 4], group=1),
        stored([3, 3], [1, 2, 3, 4, 5, 6, 7, 8]),
        stored([4], [1, 2, 3, 4], 4),
        stored([5], [1, 2, 3, 4, 5, 6, 7, 8], bs=8),
        stored([6], [1, 2, 3]),
        stored([7], [1, 2, 3, 4], locality="LOCAL"),
    ))
    assert status == 200 and report["dropped"] == 7 and report["applied"] == 1
    text = c.call("GET", "/metrics")[1]
    for reason in ("ignored", "remote_locality", "non_main_group", "duplicate_hash", "block_size_mismatch",
                   "no_complete_blocks"):
        assert f'selection_proto_kv_events_dropped_total{{model_name="m",tenant_id="default",reason="{reason}"}} ' \
               in text, reason
    # dropped events get no event id: the one applied event is id 1
    assert c.ok("POST", "/overlap_scores", {"model_name": "m", "token_ids": PROMPT})["freshness"][0][
        "last_event_id"] == 1


def test_cache_salt_namespace_memory_and_ambiguity(c: Client) -> None:
    salted = msgpack.packb([0, [{"type": "BlockStored", "block_hashes": [21], "parent_block_hash": None,
                                 "token_ids": [1, 2, 3, 4], "block_size": 4, "cache_salt": "tenant-a"}], 0])
    post(c, salted)
    post(c, batch(stored([22], [5, 6, 7, 8], 21)))  # the child inherits the parent's namespace
    assert overlap(c, list(range(1, 9)), cache_namespace="tenant-a")[0]["device_blocks"] == 2
    assert overlap(c, list(range(1, 9))) == []
    post(c, batch(stored([31], [1, 2, 3, 4], extra=[["dynamo-cache-salt:tenant-b"]])))
    assert overlap(c, [1, 2, 3, 4], cache_namespace="tenant-b")[0]["device_blocks"] == 1
    post(c, batch(stored([21], [1, 2, 3, 4])))  # 21 stored again without a salt: ambiguous now
    status, report = post(c, batch(stored([23], [9, 10, 11, 12], 21)))
    assert report["dropped"] == 1
    assert "ambiguous_namespace" in c.call("GET", "/metrics")[1]


def test_multimodal_extra_keys_change_local_hashes(c: Client) -> None:
    image = "ab" * 32
    post(c, batch(stored([41], [1, 2, 3, 4], extra=[[image]])))
    assert overlap(c, [1, 2, 3, 4]) == []
    post(c, batch(stored([42], [1, 2, 3, 4], extra=[None])))
    assert overlap(c, [1, 2, 3, 4])[0]["device_blocks"] == 1


def test_batch_rank_and_binding(c: Client) -> None:
    assert post(c, batch(stored([51], [1, 2, 3, 4]), rank=1), "worker_id=2")[1]["applied"] == 1
    assert post(c, batch(stored([52], [1, 2, 3, 4]), rank=None), "worker_id=2&dp_rank=1")[1]["applied"] == 1
    assert post(c, batch(stored([53], [1, 2, 3, 4]), rank=5), "worker_id=2") == (
        400, {"error": "dp_rank 5 is not a rank of worker 2 (ranks 0..1)"})
    assert post(c, batch(), "") == (400, {"error": "worker_id is required for events without worker_id"})
    old_engine = msgpack.packb([1.0, [stored([54], [1, 2, 3, 4])]])  # 2-member batch, no rank
    assert post(c, old_engine)[1]["applied"] == 1


@pytest.mark.parametrize(("payload", "detail"), [
    (SPEC_BATCH[:40], "not one complete msgpack value"),
    (SPEC_BATCH + b"\x00", "trailing bytes after the batch"),
    (msgpack.packb("x"), "a batch is an array or a map"),
    (msgpack.packb([1, 2, 3, 4]), "a batch has 2 or 3 members, not 4"),
    (batch(["Frobbed", 1]), "events[0]: unknown event tag `Frobbed`"),
    (batch(stored([1], [1, 2, 3, 4], bs=0)), "events[0].block_size: expected a positive integer"),
    (batch(["Ignored"], ["Ignored"], stored(["x"], [1, 2, 3, 4])), "events[2].block_hashes: expected an array of integers"),
    (batch(["Ignored"], stored([1], [1, -2, 3, 4])), "events[1].token_ids: expected u32 values or [u32, u32] pairs"),
    (batch(stored([1], [1, [2, 3]])), "events[0].token_ids: expected u32 values or [u32, u32] pairs"),
    (batch(stored([1.5], [1, 2, 3, 4])), "events[0].block_hashes: expected an array of integers"),
    (batch(5), "events[0]: expected an array or a map"),
])
def test_malformed_batches_change_nothing(c: Client, payload: bytes, detail: str) -> None:
    before = c.ok("GET", "/dump")
    status, body = post(c, payload)
    assert status == 422 and body["error"].startswith(f"invalid engine batch: {detail}")
    assert c.ok("GET", "/dump") == before


def test_huge_arrays_are_bounded_by_the_payload(c: Client) -> None:
    # A header claiming 2^32-1 elements with no bytes behind it is an incomplete value, not a hang.
    assert post(c, b"\x93\x00\xdd\xff\xff\xff\xff")[0] == 422
    with pytest.raises(InvalidBatch):
        decode_batch(b"\xdd\xff\xff\xff\xff")


def test_push_stream_seq_gaps_rewinds_and_reconnects(make_client: Any) -> None:
    c = make_client()
    c.ok("POST", "/workers", worker(1), status=201)
    svc = c.service
    stream = svc.open_event_stream(1, 0, now=1.0)
    assert svc.stream_message(stream, batch(stored([1], [1, 2, 3, 4])), seq=10, now=1.0).applied == 1
    svc.stream_message(stream, batch(stored([2], [5, 6, 7, 8], 1)), seq=11, now=1.1)
    fresh = c.ok("POST", "/overlap_scores", {"model_name": "m", "token_ids": PROMPT})["freshness"][0]
    assert (fresh["stale"], fresh["event_gaps"], fresh["open_streams"], fresh["last_event_id"]) == (False, 0, 1, 2)
    svc.stream_message(stream, batch(stored([3], [9, 10, 11, 12], 2)), seq=15, now=1.2)
    fresh = c.ok("POST", "/overlap_scores", {"model_name": "m", "token_ids": PROMPT})["freshness"][0]
    assert (fresh["stale"], fresh["event_gaps"], fresh["missing_events"]) == (True, 1, 3)
    svc.stream_message(stream, batch(["AllBlocksCleared"]), seq=16, now=1.3)
    svc.stream_message(stream, batch(), seq=16, now=1.3)
    fresh = c.ok("POST", "/overlap_scores", {"model_name": "m", "token_ids": PROMPT})["freshness"][0]
    assert (fresh["stale"], fresh["rewinds"]) == (True, 1)
    svc.stream_message(stream, batch(["AllBlocksCleared"]), now=1.4)
    svc.close_event_stream(stream, now=1.5)
    again = svc.open_event_stream(1, 0, now=2.0)
    svc.stream_message(again, batch(stored([1], [1, 2, 3, 4])), now=2.0)  # no seq after a loss
    fresh = c.ok("POST", "/overlap_scores", {"model_name": "m", "token_ids": PROMPT})["freshness"][0]
    assert fresh["stale"] is True and fresh["open_streams"] == 1


def test_stream_errors_close_with_codes(make_client: Any) -> None:
    c = make_client()
    c.ok("POST", "/workers", worker(1), status=201)
    c.ok("POST", "/workers", worker(2), status=201)
    svc = c.service
    stream = svc.open_event_stream(1, 0, now=1.0)
    with pytest.raises(StreamError) as info:
        svc.stream_message(stream, b"\xc1", now=1.0)
    assert info.value.code == 1007 and info.value.reason.startswith("invalid engine batch: ")
    with pytest.raises(StreamError) as info:
        svc.stream_message(stream, '{"worker_id": 2, "event": {"event_id": 1, "data": "cleared"}}', now=1.0)
    assert (info.value.code, info.value.reason) == (1008, "event worker_id 2 does not match stream worker_id 1")
    with pytest.raises(StreamError) as info:
        svc.stream_message(stream, '[{"event_id": 1, "data": "x"}]', now=1.0)
    assert info.value.code == 1007 and info.value.reason == (
        "invalid kv event: [0].data: unknown variant `x`, expected one of `stored`, `removed`, `cleared`")
    report = svc.stream_message(stream, '{"event_id": 1, "data": "cleared"}', now=1.0)
    assert report.applied == 1
    c.ok("DELETE", "/workers/1")
    outputs = []
    while (out := svc.next_output()) is not None:
        outputs.append(out)
    assert any(getattr(o, "code", None) == 1001 and o.reason == "worker 1 is no longer schedulable"
               for o in outputs)
    with pytest.raises(Exception) as refused:
        svc.open_event_stream(9, 0, now=1.0)
    assert str(refused.value) == "worker 9 not found"


def test_subscription_streams_drop_bad_messages(make_client: Any) -> None:
    c = make_client(kv_events="subscribe")
    c.ok("POST", "/workers", worker(1, kv_events_endpoint="ws://engine:1/events"), status=201)
    sub = c.service.next_output()
    assert sub is not None
    svc = c.service
    svc.subscription_state(sub.stream, True, now=1.0)  # type: ignore[union-attr]
    assert svc.stream_message(sub.stream, b"garbage", now=1.0).dropped == 1  # type: ignore[union-attr]
    assert svc.stream_message(sub.stream, batch(stored([1], [1, 2, 3, 4])), now=1.0).applied == 1  # type: ignore[union-attr]
    svc.subscription_state(sub.stream, False, now=2.0)  # type: ignore[union-attr]
    svc.subscription_state(sub.stream, True, now=3.0)  # type: ignore[union-attr]
    svc.stream_message(sub.stream, batch(stored([2], [5, 6, 7, 8], 1)), now=3.0)  # type: ignore[union-attr]
    fresh = c.ok("POST", "/overlap_scores", {"model_name": "m", "token_ids": PROMPT})["freshness"][0]
    assert fresh["stale"] is True and fresh["open_streams"] == 1
    assert 'reason="invalid_message"' in c.call("GET", "/metrics")[1]
