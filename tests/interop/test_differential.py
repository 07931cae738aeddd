"""Randomized differential tests (fixed seeds) against Dynamo's own code: block hashes and the radix tree."""

from __future__ import annotations

import json
import random
from typing import Any

from selection_proto import block_hashes
from selection_proto.core.cache.index import DeviceTree, IndexEventError

from .conftest import run_reference

HASH_SCRIPT = """
import json, sys
from dynamo.llm import compute_block_hash_for_seq
out = []
for c in json.load(sys.stdin):
    out.append(compute_block_hash_for_seq(c["tokens"], c["bs"], lora_name=c["lora"], is_eagle=c["eagle"],
                                          cache_namespace=c["ns"]))
print(json.dumps(out))
"""

RADIX_SCRIPT = """
import json, sys
from dynamo.llm import RadixTree
answers = []
for case in json.load(sys.stdin):
    tree = RadixTree()
    applied = []
    for wid, event in case["events"]:
        try:
            tree.apply_event(wid, json.dumps(event).encode())
            applied.append(True)
        except Exception as exc:
            applied.append(str(exc))
    scores = []
    for q in case["queries"]:
        found = tree.find_matches(q).scores
        scores.append(sorted([w, r, s] for (w, r), s in found.items() if s > 0))
    answers.append({"applied": applied, "scores": scores})
print(json.dumps(answers))
"""


def test_block_hashes_for_random_prompts(reference_python: str) -> None:
    rng = random.Random(20261202)
    cases = []
    for _ in range(300):
        cases.append({
            "tokens": [rng.choice([rng.randrange(16), rng.randrange(2**32)]) for _ in range(rng.randrange(0, 300))],
            "bs": rng.choice([1, 2, 3, 4, 8, 16, 17, 32, 64]),
            "lora": rng.choice([None, "", "sql-lora", "adapter-é", "日本"]),
            "ns": rng.choice([None, "", "tenant-a"]),
            "eagle": rng.random() < 0.2,
        })
    theirs = run_reference(reference_python, HASH_SCRIPT, cases)
    for case, expected in zip(cases, theirs, strict=True):
        ours = block_hashes(case["tokens"], case["bs"], case["lora"], case["ns"], case["eagle"])
        assert ours == expected, case


def _random_case(rng: random.Random) -> dict[str, Any]:
    """Streams over a small alphabet so that prefixes collide, parents are reused and removes hit."""
    events: list[Any] = []
    known: dict[tuple[int, int], list[int]] = {}
    for event_id in range(1, rng.randrange(4, 40)):
        wid, rank = rng.choice([1, 2, 3]), rng.choice([0, 1])
        mine = known.setdefault((wid, rank), [])
        kind = rng.random()
        if kind < 0.6:
            parent = rng.choice(mine) if mine and rng.random() < 0.6 else (
                rng.randrange(1, 50) if rng.random() < 0.1 else None)
            blocks = []
            for _ in range(rng.randrange(1, 5)):
                local = rng.randrange(1, 6)
                engine = local * 1000 + wid * 10 + rank if rng.random() < 0.8 else rng.randrange(1, 10**6)
                blocks.append({"block_hash": engine, "tokens_hash": local})
                mine.append(engine)
            data: Any = {"stored": {"parent_hash": parent, "blocks": blocks}}
        elif kind < 0.9:
            pool = mine + [rng.randrange(1, 10**6)]
            data = {"removed": {"block_hashes": [rng.choice(pool) for _ in range(rng.randrange(1, 4))]}}
        else:
            data = "cleared"
        events.append([wid, {"event_id": event_id, "dp_rank": rank, "data": data}])
    queries = [[rng.randrange(1, 6) for _ in range(rng.randrange(1, 8))] for _ in range(8)]
    return {"events": events, "queries": queries}


def _ours(case: dict[str, Any]) -> dict[str, Any]:
    tree = DeviceTree()
    applied: list[Any] = []
    for wid, event in case["events"]:
        rank = (wid, event["dp_rank"])
        data = event["data"]
        try:
            if data == "cleared":
                tree.clear(rank)
            elif "stored" in data:
                tree.store(rank, data["stored"]["parent_hash"],
                           [(b["block_hash"], b["tokens_hash"]) for b in data["stored"]["blocks"]])
            else:
                tree.remove(rank, data["removed"]["block_hashes"])
            applied.append(True)
        except IndexEventError as exc:
            applied.append(exc.text)
    scores = [sorted([w, r, s] for (w, r), s in tree.find(q)[0].items() if s > 0) for q in case["queries"]]
    return {"applied": applied, "scores": scores}


def test_radix_tree_on_random_event_streams(reference_python: str) -> None:
    rng = random.Random(7)
    cases = [_random_case(rng) for _ in range(300)]
    theirs = run_reference(reference_python, RADIX_SCRIPT, cases)
    mismatches = []
    for n, (case, expected) in enumerate(zip(cases, theirs, strict=True)):
        mine = _ours(case)
        # Failures carry the same texts as the reference's exceptions.
        if mine["applied"] != expected["applied"] or \
                mine["scores"] != expected["scores"]:
            mismatches.append((n, json.dumps(case)[:300], mine, expected))
    assert not mismatches, mismatches[:2]
