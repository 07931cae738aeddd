"""The core inside a trio application, with a nursery of concurrent requests."""

from __future__ import annotations

import random

import trio

from selection_proto import SelectAndReserveRequest, SelectionService, Settings, WorkerRequest


async def main() -> None:
    service = SelectionService(Settings(kv_events="push"), random.Random(2))
    for wid in (1, 2):
        service.upsert_worker(WorkerRequest(worker_id=wid, model_name="m", endpoint=f"http://w{wid}",
                                            block_size=16), now=trio.current_time())
    chosen: list[int] = []

    async def request(n: int) -> None:
        answer = service.select_and_reserve(
            SelectAndReserveRequest(model_name="m", token_ids=list(range(n, n + 64)), reservation_id=f"r{n}"),
            now=trio.current_time())
        chosen.append(answer.worker_id)
        await trio.sleep(0.01)
        service.free(f"r{n}", now=trio.current_time())

    async with trio.open_nursery() as nursery:
        for n in range(20):
            nursery.start_soon(request, n)
    assert sorted(set(chosen)) == [1, 2]
    print("chosen:", chosen.count(1), "on worker 1,", chosen.count(2), "on worker 2")


if __name__ == "__main__":
    trio.run(main)
