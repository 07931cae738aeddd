"""The index replays Dynamo's RadixTree answers: directly, and through handle() end to end."""

from __future__ import annotations

from typing import Any

from conftest import Client, load_vectors, worker

from selection_proto.core.events import decode_json_events
from selection_proto.core.index import DeviceTree, IndexEventError
from selection_proto.core.tiers import KeyIndex


def _apply(tree: DeviceTree, event: Any) -> bool | str:
    (decoded,) = decode_json_events(event)
    rank = (decoded.worker_id, decoded.dp_rank or 0)
    try:
        if decoded.kind == "stored":
            tree.store(rank, decoded.parent_hash, decoded.blocks)
        elif decoded.kind == "removed":
            tree.remove(rank, decoded.block_hashes)
        else:
            tree.clear(rank)
    except IndexEventError as exc:
        return exc.text
    return True


def test_every_radix_vector_directly() -> None:
    cases = load_vectors("radix.jsonl")
    assert len(cases) == 150
    for n, case in enumerate(cases):
        tree = DeviceTree()
        for event in case["events"]:
            assert _apply(tree, {"worker_id": event["worker_id"], "event": event["event"]}) == event["applied"], n
        for query in case["queries"]:
            scores, _ = tree.find(query["block_hashes"])
            got = sorted([w, r, s] for (w, r), s in scores.items() if s > 0)
            assert got == query["scores"], (n, query)


def test_every_radix_vector_through_handle(make_client: Any) -> None:
    for n, case in enumerate(load_vectors("radix.jsonl")):
        client: Client = make_client()
        for wid in sorted({e["worker_id"] for e in case["events"]}):
            client.ok("POST", "/workers", worker(wid, data_parallel_size=2), status=201)
        for event in case["events"]:
            report = client.ok("POST", "/kv_events", [{"worker_id": event["worker_id"], "event": event["event"]}])
            expected = [] if event["applied"] is True else [{"index": 0, "error": event["applied"]}]
            assert report["failures"] == expected, n
        for query in case["queries"]:
            q = query["block_hashes"]
            answer = client.ok("POST", "/overlap_scores", {
                "model_name": "m", "block_hashes": q, "sequence_hashes": q, "isl_tokens": 4 * max(1, len(q))})
            got = sorted([row["worker_id"], row["dp_rank"], row["device_blocks"]] for row in answer["workers"])
            assert got == query["scores"], (n, query)


def test_prefix_consistency_and_lower_tiers() -> None:
    index = KeyIndex()
    a, b = (1, 0), (2, 0)
    # b stores first, so the shared first position records b's engine hash 21, which is where b's
    # host-tier continuation hangs (the engine hashes of a node are its creator's, core.md §7.1).
    index.device.store(b, None, [(21, 1)])
    index.device.store(a, None, [(11, 1), (12, 2), (13, 3)])
    index.lower["host_pinned"].store(b, 21, [(22, 2)])
    index.lower["disk"].store(b, 22, [(23, 3)])
    index.lower["external"].store((3, 0), None, [(31, 1)])
    q = [1, 2, 3, 4]
    device, hits = index.tiered(q)
    assert device == {a: 3, b: 1}
    assert hits["host_pinned"] == {b: 1}
    assert hits["disk"] == {b: 1}
    assert hits["external"] == {(3, 0): 1}
    full, _ = index.device.find(q)
    for k in range(len(q) + 1):
        part, _ = index.device.find(q[:k])
        for rank, score in full.items():
            assert part.get(rank, 0) == min(score, k)
    index.drop_rank(b)
    device, hits = index.tiered(q)
    assert device == {a: 3} and hits["host_pinned"] == {} and hits["disk"] == {}


def test_dump_rebuilds_the_same_answers() -> None:
    for case in load_vectors("radix.jsonl")[:60]:
        tree = DeviceTree()
        for event in case["events"]:
            _apply(tree, {"worker_id": event["worker_id"], "event": event["event"]})
        rebuilt = DeviceTree()
        for rank, parent, blocks in tree.dump():
            rebuilt.store(rank, parent, blocks)
        for query in case["queries"]:
            assert rebuilt.find(query["block_hashes"])[0] == {
                r: s for r, s in tree.find(query["block_hashes"])[0].items()}
