"""The core inside an asyncio application: the app owns the loop and the clock, the core owns state.

Runs a small producer/consumer: requests arrive on an asyncio.Queue, each is routed, "served" for
a moment, and its booking freed; a timer task ticks the core at its next deadline.
"""

from __future__ import annotations

import asyncio
import random

from selection_proto import SelectAndReserveRequest, SelectionService, Settings, WorkerRequest


async def main() -> None:
    loop = asyncio.get_running_loop()
    service = SelectionService(Settings(kv_events="push"), random.Random(1))
    for wid in range(1, 4):
        service.upsert_worker(WorkerRequest(worker_id=wid, model_name="m", endpoint=f"http://w{wid}",
                                            block_size=16), now=loop.time())
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    served: dict[int, int] = {}

    async def serve_one(prompt: list[int], n: int) -> None:
        answer = service.select_and_reserve(
            SelectAndReserveRequest(model_name="m", token_ids=prompt, reservation_id=f"r{n}"), now=loop.time())
        served[answer.worker_id] = served.get(answer.worker_id, 0) + 1
        await asyncio.sleep(0.01)  # the worker computes the prefill ...
        service.prefill_complete(f"r{n}", now=loop.time())
        await asyncio.sleep(0.01)  # ... and decodes
        service.free(f"r{n}", now=loop.time())

    async def consumer() -> None:
        n = 0
        tasks = []
        while (prompt := await queue.get()) != []:
            n += 1
            tasks.append(asyncio.create_task(serve_one(prompt, n)))
        await asyncio.gather(*tasks)

    async def timer() -> None:
        while True:
            deadline = service.next_deadline()
            await asyncio.sleep(1.0 if deadline is None else max(0.0, deadline - loop.time()))
            service.tick(loop.time())

    ticking = asyncio.create_task(timer())
    for i in range(30):
        queue.put_nowait([i % 5] * 64)
    queue.put_nowait([])
    await consumer()
    ticking.cancel()
    loads = service.loads()[0].loads
    assert all(p.active_requests == 0 for p in loads)
    print("requests per worker:", dict(sorted(served.items())))


if __name__ == "__main__":
    asyncio.run(main())
