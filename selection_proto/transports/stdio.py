"""`selection-proto stdio`: JSON-RPC 2.0 lines on stdin/stdout (transports.md §6.5)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import BinaryIO

import anyio
import anyio.from_thread
import anyio.lowlevel

from ..adapters.jsonl import JsonRpcSession
from ..core.base.metrics import CONNECTIONS
from ..core.base.outputs import InternalError, Notice, SelectionReady
from ..core.service import SelectionService
from .logs import log, log_internal_error
from .subscriber import Subscriptions

__all__ = ["serve_stdio"]


def _write_all(out: BinaryIO, data: bytes) -> None:
    """An unbuffered write to a pipe may take only part of a large answer."""
    view = memoryview(data)
    while view:
        written = out.write(view)
        view = view[written or 0:]


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
        while True:
            while (event := service.next_output()) is not None:
                try:
                    if isinstance(event, Notice):
                        log(event.level, event.event, **dict(event.fields))
                    elif isinstance(event, InternalError):
                        log_internal_error(event.where, event.detail)
                    elif isinstance(event, SelectionReady):
                        session.deliver(event)
                    elif subscriptions:
                        subscriptions[0].route(event)
                except Exception:  # noqa: BLE001 - confined to this output
                    service.internal_error("pump")
            data = session.data_to_send()
            if data:
                try:
                    await anyio.to_thread.run_sync(_write_all, out, data)
                except OSError as exc:  # the reader closed our stdout: nobody is left to answer
                    log("warning", "stdout_closed", detail=exc.strerror or str(exc))
                    done.set()
            if not service.deferred:
                return
            service.deferred.run()  # what the answers just written left for later (core/base/deferred.py)

    async def read() -> None:
        token = anyio.lowlevel.current_token()
        send, receive = anyio.create_memory_object_stream[bytes](1)

        def read_stdin() -> None:
            # A daemon thread: a read blocked on a stdin that never closes must not hold the
            # process open once it has stopped (a worker-pool thread would be joined at exit).
            try:
                while True:
                    chunk = os.read(in_fd, 65536)
                    anyio.from_thread.run(send.send, chunk, token=token)
                    if not chunk:
                        return
            except (OSError, RuntimeError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # the loop or the stream is gone: the session has ended

        threading.Thread(target=read_stdin, name="stdin", daemon=True).start()
        async with receive:
            async for chunk in receive:
                if not chunk:
                    session.end_of_input()
                    break
                session.receive_data(chunk)
                await flush()
                if session.shutdown_requested:
                    break
        done.set()

    async def timer() -> None:
        while True:
            deadline = service.next_deadline()
            now = anyio.current_time()
            await anyio.sleep(1.0 if deadline is None else min(1.0, max(0.0, deadline - now)))
            try:
                service.tick(anyio.current_time())
            except Exception:  # noqa: BLE001 - the timer keeps running; a second look waits 1 s
                service.internal_error("timer")
                await anyio.sleep(1.0)
            await flush()

    async def signals() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            async for signum in received:
                log("info", "shutdown", signal=signal.Signals(signum).name)
                done.set()
                return

    log("info", "stdio", pid=os.getpid())
    service.observe(CONNECTIONS, ("stdio",), 1.0)
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
