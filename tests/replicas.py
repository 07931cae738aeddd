"""In-process replicas for the ledger tests: each a `SelectionService` with its own `LedgerLink` to
a real Valkey/Redis server, all in one anyio loop (cheap, because the core is Sans-IO)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio

from selection_proto import SelectionService, Settings
from selection_proto.core.base.outputs import SelectionReady
from selection_proto.core.base.responses import Pending
from selection_proto.core.fleet.journal import LedgerSettings
from selection_proto.transports.ledger import LedgerLink

WORKER = {"model_name": "m", "endpoint": "http://w", "block_size": 4}


class Replica:
    def __init__(self, name: str, url: str, scope: str, ledger: LedgerSettings, **settings: Any) -> None:
        settings.setdefault("kv_events", "push")
        self.service = SelectionService(Settings(**settings), random.Random(name))
        self.ledger = self.service.share(ledger, f"{name}/{random.getrandbits(32)}")
        self.link = LedgerLink(self.service, self.ledger, url, scope,
                               lease_secs=self.service.settings.active_request_expiry_secs,
                               on_change=self._drain)
        self.answers: dict[int, tuple[int, Any]] = {}
        self.scope = anyio.CancelScope()
        self.changed = anyio.Event()  # set each time the link reported a change

    async def _drain(self) -> None:
        while (out := self.service.next_output()) is not None:
            if isinstance(out, SelectionReady):
                status, _, body = out.response
                self.answers[out.ticket] = (status, json.loads(body) if body else None)
        self.changed.set()
        self.changed = anyio.Event()

    async def wait(self, condition: Callable[[], bool], timeout: float = 5.0) -> None:
        """Until `condition` holds, looking again at each change the link reports (no polling)."""
        with anyio.fail_after(timeout):
            while not condition():
                await self.changed.wait()

    def send(self, method: str, path: str, body: Any = None) -> tuple[int, Any] | int:
        """The answer, or the ticket of an answer held for the ledger."""
        data = b"" if body is None else json.dumps(body).encode()
        result = self.service.handle(method, path, "", [("content-type", "application/json")], data,
                                     now=time.monotonic())
        self.link.poke()
        if isinstance(result, Pending):
            return result.ticket
        status, _, payload = result
        return status, json.loads(payload) if payload else None

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        answer = self.send(method, path, body)
        if isinstance(answer, int):
            return await self.answer(answer)
        return answer

    async def answer(self, ticket: int, timeout: float = 5.0) -> tuple[int, Any]:
        await self.wait(lambda: ticket in self.answers, timeout)
        return self.answers.pop(ticket)

    async def ok(self, method: str, path: str, body: Any = None, status: int = 200) -> Any:
        got, payload = await self.call(method, path, body)
        assert got == status, payload
        return payload

    def loads(self) -> dict[int, tuple[int, int, int]]:
        """worker -> (active requests, prefill tokens, decode blocks) of model m."""
        return {rank[0]: (load.requests, load.prefill_tokens, load.decode_blocks())
                for key, pool in self.service.pools.items() if key == ("m", "default")
                for rank, load in pool.tracker.loads.items()}

    def synced(self) -> bool:
        journal = self.ledger.journal
        return self.ledger.synced and not journal.ops and not self.link.writing and journal.connected

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        self.scope = anyio.CancelScope()

        async def run() -> None:
            with self.scope:
                await self.link.run()

        tg.start_soon(run)

    def halt(self) -> None:
        """Stop this replica's link, as if its process froze (its state stays)."""
        self.scope.cancel()


async def park(group: list[Replica], via: Replica) -> None:
    """Stop the group's readers at a known place: a catalog write by `via` ends the read each
    is blocked in, then each waits with the feed unread."""
    for replica in group:
        replica.link.held_reads = True
    await via.ok("POST", "/workers", {**WORKER, "worker_id": 1}, status=201)
    await until(lambda: all(r.link.parked for r in group))


def unpark(group: list[Replica]) -> None:
    for replica in group:
        replica.link.held_reads = False


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the replicas"
        await anyio.sleep(0.005)


@asynccontextmanager
async def replicas(count: int, url: str, scope: str = "t", ledger: LedgerSettings | None = None,
                   **settings: Any) -> AsyncIterator[list[Replica]]:
    # A short grace for frees of unknown ids: the tests make many; production keeps 2 s.
    group = [Replica(chr(ord("a") + i), url, scope, ledger or LedgerSettings(free_grace_secs=0.3), **settings)
             for i in range(count)]
    async with anyio.create_task_group() as tg:
        for replica in group:
            replica.start(tg)
        await until(lambda: all(r.synced() for r in group))
        yield group
        tg.cancel_scope.cancel()


async def settled(group: list[Replica], timeout: float = 5.0) -> None:
    """Every journal written and every mirror at the ledger's last entry."""
    client = None
    for replica in group:
        await until(lambda r=replica: r.synced(), timeout)  # type: ignore[misc]
    import redis

    for replica in group:
        client = client or redis.Redis.from_url(replica.link.url)
        last = int(client.get(replica.link.keys[8]) or 0)
        await until(lambda r=replica, n=last: r.ledger.n >= n, timeout)  # type: ignore[misc]
    if client is not None:
        client.close()
