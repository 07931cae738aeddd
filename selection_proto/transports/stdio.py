"""`selection-proto stdio`: JSON-RPC 2.0 lines on stdin/stdout (transports.md §6.5)."""

from __future__ import annotations

import os
import signal
import sys

import anyio

from ..adapters.jsonl import JsonRpcSession
from ..core.outputs import SelectionReady
from ..core.service import SelectionService
from .logs import log
from .subscriber import Subscriptions

__all__ = ["serve_stdio"]


async def serve_stdio(service: SelectionService) -> None:
    # Point fd 1 at stderr so that stray prints cannot corrupt the protocol; answers go to a
    # private copy of the original stdout.
    sys.stdout.flush()
    out_fd = os.dup(1)
    os.dup2(2, 1)
    out = os.fdopen(out_fd, "wb", buffering=0)
    session = JsonRpcSession(service, anyio.current_time)
    in_fd = sys.stdin.fileno()
    done = anyio.Event()

    subscriptions: list[Subscriptions] = []

    async def flush() -> None:
        while (event := service.next_output()) is not None:
            if isinstance(event, SelectionReady):
                session.deliver(event)
            elif subscriptions:
                subscriptions[0].route(event)
        data = session.data_to_send()
        if data:
            await anyio.to_thread.run_sync(out.write, data)

    async def read() -> None:
        while not session.shutdown_requested:
            # Abandoned on cancel: a blocked read must not hold up a signal-driven shutdown.
            chunk = await anyio.to_thread.run_sync(os.read, in_fd, 65536, abandon_on_cancel=True)
            if not chunk:
                session.end_of_input()
                break
            session.receive_data(chunk)
            await flush()
        done.set()

    async def timer() -> None:
        while True:
            deadline = service.next_deadline()
            now = anyio.current_time()
            await anyio.sleep(1.0 if deadline is None else min(1.0, max(0.0, deadline - now)))
            service.tick(anyio.current_time())
            await flush()

    async def signals() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            async for signum in received:
                log("info", "shutdown", signal=signal.Signals(signum).name)
                done.set()
                return

    log("info", "stdio", pid=os.getpid())
    service.observe("selection_proto_connections", ("stdio",), 1.0)
    async with anyio.create_task_group() as tg:
        subscriptions.append(Subscriptions(service, tg, flush))
        tg.start_soon(read)
        tg.start_soon(timer)
        tg.start_soon(signals)
        await done.wait()
        service.begin_shutdown(now=anyio.current_time())
        await flush()
        subscriptions[0].close_all()
        tg.cancel_scope.cancel()
    out.close()
    log("info", "stopped")
