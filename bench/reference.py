"""Runs inside the reference's virtualenv (ai-dynamo-runtime 1.6.1); prints one JSON line of rates."""

from __future__ import annotations

import asyncio
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from workload import BLOCK_SIZE, WORKERS, best_rate, prompts  # noqa: E402


async def main() -> None:
    from dynamo.llm import SelectionService, compute_block_hash_for_seq

    results: dict[str, object] = {}
    for n in (1024, 16384, 131072):
        tokens = prompts(n, 1)[0]
        results[f"hash_{n}"] = best_rate(lambda t: compute_block_hash_for_seq(t, BLOCK_SIZE), [tokens] * 20)
    service = SelectionService()
    for w in range(WORKERS):
        await service.upsert_worker({"worker_id": w, "model_name": "m", "endpoint": f"http://w{w}",
                                     "block_size": BLOCK_SIZE, "kv_events_endpoint": f"tcp://127.0.0.1:{40000 + w}"})
    loop = asyncio.get_running_loop()
    for n, count in ((1024, 400), (16384, 60)):
        items = [{"model_name": "m", "token_ids": p} for p in prompts(n, count)]
        rates = []
        for _ in range(5):
            start = loop.time()
            for item in items:
                await service.select(item)
            rates.append(len(items) / (loop.time() - start))
        rates.sort()
        results[f"select_{n}"] = (rates[2], rates[-1] - rates[0])
    items = [{"model_name": "m", "token_ids": p} for p in prompts(1024, 400)]
    rates = []
    for _ in range(5):
        start = loop.time()
        for item in items:
            answer = await service.select_and_reserve(item)
            await service.free_reservation(answer["selection_id"])
        rates.append(len(items) / (loop.time() - start))
    rates.sort()
    results["reserve_free_1024"] = (rates[2], rates[-1] - rates[0])
    service.shutdown()
    print(json.dumps(results))


if __name__ == "__main__":
    asyncio.run(main())
