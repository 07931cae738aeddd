"""The index replays Dynamo's RadixTree answers: directly, and through handle() end to end."""

from __future__ import annotations

import gc
from functools import partial
from typing import Any
from unittest.mock import patch

from conftest import Client, load_vectors, worker
from hypothesis import given, settings
from hypothesis import strategies as st

import selection_proto.core.cache.edges as edges_module
import selection_proto.core.cache.index as index_module
from selection_proto.core.cache.events import decode_json_events
from selection_proto.core.cache.index import DeviceTree, IndexEventError
from selection_proto.core.cache.tiers import KeyIndex


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


def _tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


def test_evicted_prefixes_leave_nothing_behind() -> None:
    """Unique prompts stored and evicted, over and over: the tree returns to empty, with no garbage
    left for the cyclic collector (every unlink breaks the child's back-reference)."""
    tree = DeviceTree()
    r, other = (1, 0), (2, 0)
    before = _tracked()
    for round_ in range(3):
        base = round_ * 10**6
        chains = [[(base + 1000 * c + i, base + 1000 * c + i) for i in range(4)] for c in range(500)]
        for c, chain in enumerate(chains):
            tree.store(r, None, chain[:2])
            tree.store(r, chain[1][0], chain[2:])  # an appended edge
            tree.store(other, None, [*chain[:2], (base + 1000 * c + 9, 9)])  # splits it
        tree.remove(r, [h for chain in chains for h, _ in chain])
        tree.clear(other)
        assert tree.root.children == {} and tree.total_size() == 0
        assert tree.find([base + 1, base + 2])[0] == {}
        del chains, chain
    gc.disable()
    try:
        assert gc.collect() == 0  # nothing cyclic was left to collect
    finally:
        gc.enable()
    assert _tracked() - before < 50


def test_a_one_block_node_is_one_object_for_the_collector() -> None:
    """The cyclic collector's full pass walks every tracked object; the index adds one per node
    (docs/INVARIANTS.md: the stall a large index caused)."""
    tree = DeviceTree()
    before = _tracked()
    for i in range(10_000):
        tree.store((1, 0), None, [(i, i)])
    assert _tracked() - before < 10_000 + 50
    assert tree.find([5])[0] == {(1, 0): 1}


def test_a_dropped_subtree_is_freed_without_the_cyclic_collector() -> None:
    tree = DeviceTree()
    r = (1, 0)
    tree.store(r, None, [(1, 1), (2, 2), (3, 3), (4, 4)])
    tree.store(r, 2, [(5, 5)])  # splits after block 2
    tree.store(r, 3, [(6, 6)])  # splits the tail after block 3: a subtree two levels deep
    gc.collect()
    gc.disable()
    try:
        tree.remove(r, [1])  # the root's edge loses its only rank: its subtree goes
        assert tree.find([1, 2, 3])[0] == {}
        tree.remove(r, [3, 4, 5, 6])
        assert tree.total_size() == 0 and tree.root.children == {}
        assert gc.collect() == 0
    finally:
        gc.enable()


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_a_removal_in_runs_answers_as_block_by_block(data: st.DataObject) -> None:
    """Removals of long runs are handled in C when the hashes follow their edge in order; the
    tree, its lookup tables and the error raised are those of the block-by-block loop."""
    trees = (DeviceTree(), DeviceTree())
    chains: list[list[int]] = []
    for _ in range(data.draw(st.integers(1, 4))):
        length = data.draw(st.integers(1, 120))
        if chains and data.draw(st.booleans()):  # a branch off an earlier chain
            base = data.draw(st.sampled_from(chains))
            chain = base[:data.draw(st.integers(0, len(base)))] + [data.draw(st.integers(1, 1 << 20)) for _ in range(length)]
        else:
            chain = [data.draw(st.integers(1, 1 << 20)) for _ in range(length)]
        chains.append(chain)
    ranks = [(1, 0), (2, 0)]
    for chain in chains:
        rank = data.draw(st.sampled_from(ranks))
        for tree in trees:
            try:
                tree.store(rank, None, [(h, h) for h in chain])
            except IndexEventError:
                pass
    for _ in range(data.draw(st.integers(1, 3))):
        chain = data.draw(st.sampled_from(chains))
        start = data.draw(st.integers(0, len(chain) - 1))
        hashes = chain[start:data.draw(st.integers(start + 1, len(chain)))]
        if data.draw(st.booleans()):
            hashes = hashes + [data.draw(st.integers(1, 1 << 20))]  # an unknown one after the run
        rank = data.draw(st.sampled_from(ranks))
        outcomes = []
        for bulk, tree in zip((True, False), trees, strict=True):
            with patch.object(index_module, "_RUN", 32 if bulk else 1 << 30):
                try:
                    tree.remove(rank, hashes)
                    outcomes.append("ok")
                except IndexEventError as exc:
                    outcomes.append(exc.text)
        assert outcomes[0] == outcomes[1]
        assert trees[0].dump() == trees[1].dump()
        assert {r: dict(t) for r, t in trees[0].lookup.items()}.keys() == trees[1].lookup.keys()
        for r in trees[0].lookup:
            assert trees[0].lookup[r].keys() == trees[1].lookup[r].keys()
        for chain in chains:
            assert trees[0].find(chain) == trees[1].find(chain)


LONG_EDGE = {"_TABLE_MAX": 4, "_TABLE_STEP": 3, "_WINDOW": 2}  # every edge past 4 blocks is "long"
WHOLE_TABLES = {"_TABLE_MAX": 1 << 30}  # each edge's position table built at once, as before


def _with(constants: dict[str, int], work: Any) -> str:
    with patch.multiple(edges_module, **constants):
        try:
            work()
            return "ok"
        except IndexEventError as exc:
            return exc.text


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_long_edge_searched_a_step_at_a_time_answers_as_its_whole_table(data: st.DataObject) -> None:
    """A long edge finds a hash's place by searching its packed bytes from the end back and builds
    its position table a step at a time (a million-block edge's table is never built at once,
    docs/INVARIANTS.md "Round three"); stores after a block mid-edge, removals, splits, appends and
    engine hashes repeated on one edge answer as with the whole table built at first use."""
    trees = (DeviceTree(), DeviceTree())
    hashes = st.integers(1, 12)  # few values: an edge repeats engine hashes, as only an attacker's would
    ranks = st.sampled_from([(1, 0), (2, 0)])
    stored: list[int] = []
    for _ in range(data.draw(st.integers(1, 12))):
        rank = data.draw(ranks)
        if data.draw(st.booleans()):
            blocks = [(data.draw(hashes), data.draw(st.integers(1, 40))) for _ in range(data.draw(st.integers(1, 30)))]
            parent = data.draw(st.sampled_from(stored)) if stored and data.draw(st.booleans()) else None
            outcomes = [_with(c, partial(t.store, rank, parent, blocks)) for c, t in zip((LONG_EDGE, WHOLE_TABLES), trees, strict=True)]
            stored.extend(b[0] for b in blocks)
        else:
            gone = [data.draw(hashes) for _ in range(data.draw(st.integers(1, 6)))]
            outcomes = [_with(c, partial(t.remove, rank, gone)) for c, t in zip((LONG_EDGE, WHOLE_TABLES), trees, strict=True)]
        assert outcomes[0] == outcomes[1]
        assert trees[0].dump() == trees[1].dump()
        assert {r: dict(t) for r, t in trees[0].lookup.items()}.keys() == trees[1].lookup.keys()
        for r in trees[0].lookup:
            assert [(h, trees[0].lookup[r][h].position(h)) for h in sorted(trees[0].lookup[r])] == \
                [(h, trees[1].lookup[r][h].position(h)) for h in sorted(trees[1].lookup[r])]


def test_a_million_block_edge_is_searched_not_tabled_at_once() -> None:
    """Booking a 1,048,576-block prompt again asks for places deep inside its one edge, a piece at
    a time: no piece builds a position table of more than a step (it took ~240 ms in one piece)."""
    tree = DeviceTree()
    blocks = [(h, h) for h in range(1, (1 << 20) + 1)]
    tree.store((1, 0), None, blocks)
    edge = tree.lookup[(1, 0)][1]
    piece, tabled = 16384, 0
    for start in range(piece, 1 << 20, piece):
        tree.store((1, 0), blocks[start - 1][0], blocks[start:start + piece])
        assert edge.pos is not None and len(edge.pos) <= tabled + 16384
        tabled = len(edge.pos)
    assert tree.find([b[1] for b in blocks])[0] == {(1, 0): 1 << 20}
    assert edge.position(5) == 4 and edge.position(1 << 20) == (1 << 20) - 1 and edge.position(-1) is None
