"""`selection-proto relay`: forward one engine's ZMQ KV events to the service over one WebSocket
(transports.md §5). Messages go out in order, as 8 seq bytes + payload; nothing is dropped silently."""

from __future__ import annotations

import signal
import time
import traceback
from collections import deque
from urllib.parse import urlencode, urlsplit

import anyio
import anyio.abc

from ..adapters.ws import ForwardingClient
from .logs import log, log_internal_error
from .pump import flush, receive
from .subscriber import backoff_delays, connect
from .zmq_sub import zmq_batches

__all__ = ["Relay", "run_relay"]

MAX_BUFFER_BYTES = 64 * 1024 * 1024
REPORT_EVERY = 10.0


class Relay:
    """Buffer and counters; the ZMQ side appends, the WebSocket side drains."""

    def __init__(self, buffer_messages: int) -> None:
        self.buffer: deque[bytes] = deque()
        self.buffer_bytes = 0
        self.limit = buffer_messages
        self.counters = {"forwarded": 0, "acknowledged": 0, "dropped_overflow": 0,
                         "unacknowledged_at_disconnect": 0, "invalid_frames": 0, "reconnects": 0,
                         "internal_errors": 0}
        self.ready = anyio.Event()

    def offer(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counters["invalid_frames"] += 1
            return
        message = frames[1] + frames[2]
        self.buffer.append(message)
        self.buffer_bytes += len(message)
        while len(self.buffer) > self.limit or self.buffer_bytes > MAX_BUFFER_BYTES:
            dropped = self.buffer.popleft()
            self.buffer_bytes -= len(dropped)
            self.counters["dropped_overflow"] += 1
        self.ready.set()

    def take(self) -> bytes | None:
        if not self.buffer:
            return None
        message = self.buffer.popleft()
        self.buffer_bytes -= len(message)
        return message

    def report(self, event: str = "relay_counters") -> None:
        log("info", event, **self.counters)


async def _zmq_loop(relay: Relay, endpoint: str, topic: bytes) -> None:
    async for messages in zmq_batches(endpoint, topic):
        for frames in messages:
            relay.offer(frames)


async def _read(stream: anyio.abc.ByteStream, client: ForwardingClient, lock: anyio.Lock,
                scope: anyio.CancelScope) -> None:
    """Acks, pings and the close, from the service; ends the connection's task group."""
    while not client.closed:
        data = await receive(stream)
        assert data is not None  # no timeout
        client.receive_data(data)
        await flush(stream.send, client, lock)
    scope.cancel()


async def _ws_loop(relay: Relay, to: str, worker_id: int, dp_rank: int) -> None:
    parts = urlsplit(to)
    query = "&".join(q for q in (parts.query, urlencode({"worker_id": worker_id, "dp_rank": dp_rank,
                                                          "framing": "seq", "ack": "true"})) if q)
    target = (parts.path or "/") + "?" + query
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "wss" else 80)
    delays = backoff_delays()
    first = True
    while True:
        if not first:
            relay.counters["reconnects"] += 1
        first = False
        started = time.monotonic()
        sent = 0
        client = ForwardingClient(f"{host}:{port}", target)
        try:
            stream = await connect(host, port, tls=parts.scheme == "wss")
            lock = anyio.Lock()
            async with stream, anyio.create_task_group() as tg:
                await flush(stream.send, client)
                tg.start_soon(_read, stream, client, lock, tg.cancel_scope)
                while not client.accepted and not client.closed:
                    await anyio.sleep(0.01)
                if client.accepted:
                    log("info", "relay_connected", to=to)
                while not client.closed:
                    message = relay.take()
                    if message is None:
                        relay.ready = anyio.Event()
                        with anyio.move_on_after(0.5):
                            await relay.ready.wait()
                        continue
                    client.send_binary(message)
                    await flush(stream.send, client, lock)
                    sent += 1
                    relay.counters["forwarded"] += 1
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            log("warning", "relay_disconnected", to=to, detail=str(exc) or type(exc).__name__)
        except Exception as exc:  # noqa: BLE001 - confined to this connection; reconnect
            relay.counters["internal_errors"] += 1
            log_internal_error("relay", traceback.format_exc())
            log("warning", "relay_disconnected", to=to, detail=f"{type(exc).__name__}: {exc}")
        finally:  # a shutdown ends the connection too: its acks count in the final report
            relay.counters["acknowledged"] += client.acked
            relay.counters["unacknowledged_at_disconnect"] += max(0, sent - client.acked)
        if client.close_code is not None:
            log("warning", "relay_closed", code=client.close_code, reason=client.close_reason)
        if time.monotonic() - started >= 30.0:
            delays = backoff_delays()
        await anyio.sleep(delays())


async def run_relay(zmq_endpoint: str, to: str, worker_id: int, dp_rank: int, topic: str,
                    buffer_messages: int) -> None:
    relay = Relay(buffer_messages)
    log("info", "relay", zmq=zmq_endpoint, to=to, worker_id=worker_id, dp_rank=dp_rank)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_zmq_loop, relay, zmq_endpoint, topic.encode())
        tg.start_soon(_ws_loop, relay, to, worker_id, dp_rank)

        async def reporter() -> None:
            while True:
                await anyio.sleep(REPORT_EVERY)
                relay.report()

        tg.start_soon(reporter)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log("info", "shutdown", signal=signal.Signals(signum).name)
                break
        tg.cancel_scope.cancel()
    relay.report("relay_stopped")


