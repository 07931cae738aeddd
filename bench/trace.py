"""Trace replay: a Mooncake-style JSONL trace (`timestamp` ms, `hash_ids`, `input_length`,
`output_length`) routed by the core over simulated workers whose caches hold what they served
(with LRU eviction reported as KV events). Reports the cache-hit rate and the load balance the
selection achieves, next to random routing on the same trace.

    python bench/trace.py [--requests 2000] [--workers 8] [--trace FILE]   (no FILE: a synthetic one)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from selection_proto import SelectAndReserveRequest, SelectionService, Settings, WorkerRequest  # noqa: E402
from selection_proto.core.events import decode_json_events  # noqa: E402
from selection_proto.core.hashing import block_hashes  # noqa: E402

BLOCK = 16  # tokens per block; one trace hash id = one block here
CAPACITY = 1500  # blocks each simulated worker keeps


def synthetic_trace(n: int, seed: int = 3) -> list[dict[str, object]]:
    """Requests that share system prompts and conversation prefixes, arriving ~50/s."""
    rng = random.Random(seed)
    prefixes = [list(range(p * 1000, p * 1000 + rng.randrange(8, 64))) for p in range(200)]
    next_id = 10**6
    out = []
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(50.0) * 1000
        base = prefixes[min(int(rng.paretovariate(0.6)) - 1, len(prefixes) - 1)]
        extra = rng.randrange(4, 40)
        ids = base + list(range(next_id, next_id + extra))
        next_id += extra
        out.append({"timestamp": int(t), "hash_ids": ids, "input_length": len(ids) * BLOCK,
                    "output_length": rng.randrange(20, 400)})
    return out


def tokens_of(hash_ids: list[int]) -> list[int]:
    return [(h * 7919 + i) % 100_000 for h in hash_ids for i in range(BLOCK)]


def replay(trace: list[dict[str, object]], workers: int, policy: str) -> dict[str, float]:
    service = SelectionService(Settings(kv_events="push"), random.Random(0))
    for w in range(workers):
        service.upsert_worker(WorkerRequest(worker_id=w, model_name="m", endpoint=f"w{w}", block_size=BLOCK), now=0.0)
    caches = [OrderedDict[int, None]() for _ in range(workers)]
    rng = random.Random(1)
    ends: list[tuple[float, str]] = []
    hits = inputs = 0
    served = [0] * workers
    event_id = 0
    for n, req in enumerate(trace):
        now = float(req["timestamp"]) / 1000  # type: ignore[arg-type]
        for _, rid in [e for e in ends if e[0] <= now]:
            service.free(rid, now=now)
        ends = [e for e in ends if e[0] > now]
        tokens = tokens_of(req["hash_ids"])  # type: ignore[arg-type]
        rid = f"r{n}"
        if policy == "kv":
            answer = service.select_and_reserve(SelectAndReserveRequest(model_name="m", token_ids=tokens,
                                                                        reservation_id=rid), now=now)
            worker = answer.worker_id  # type: ignore[union-attr]
        else:
            worker = rng.randrange(workers)
        locals_ = block_hashes(tokens, BLOCK)
        cache = caches[worker]
        cached = 0
        for h in locals_:  # the engine's real prefix hit on that worker
            if h not in cache:
                break
            cached += 1
        hits += cached * BLOCK
        inputs += len(tokens)
        served[worker] += 1
        # The worker now holds the whole prompt: report the stored blocks, evict beyond capacity.
        events = []
        parent = None
        new = [h for h in locals_ if h not in cache]
        for h in locals_:
            cache[h] = None
            cache.move_to_end(h)
        if new:
            event_id += 1
            start = locals_.index(new[0])
            parent = locals_[start - 1] if start else None
            events.append({"worker_id": worker, "event": {"event_id": event_id, "data": {"stored": {
                "parent_hash": parent, "blocks": [{"block_hash": h, "tokens_hash": h} for h in locals_[start:]]}}}})
        evicted = []
        while len(cache) > CAPACITY:
            evicted.append(cache.popitem(last=False)[0])
        if evicted:
            event_id += 1
            events.append({"worker_id": worker, "event": {"event_id": event_id, "data": {"removed": {
                "block_hashes": evicted}}}})
        if events:
            service.apply_kv_events(decode_json_events(events), now=now)
        if policy == "kv":
            service.prefill_complete(rid, now=now)
            ends.append((now + int(req["output_length"]) * 0.02, rid))  # type: ignore[arg-type]
    mean = sum(served) / workers
    return {"hit_rate": hits / inputs, "max_over_mean_load": max(served) / mean, "requests": len(trace)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--trace", default=None)
    args = parser.parse_args()
    if args.trace:
        with open(args.trace) as fh:
            trace = [json.loads(line) for line in fh if line.strip()]
    else:
        trace = synthetic_trace(args.requests)
    for policy in ("kv", "random"):
        result = replay(trace, args.workers, policy)
        print(f"{policy:>7}: cache-hit rate {result['hit_rate']:.3f}, max/mean requests per worker "
              f"{result['max_over_mean_load']:.2f} over {result['requests']} requests")


if __name__ == "__main__":
    main()
