"""`selection-proto relay`: forward one engine's ZMQ KV events to the service over one WebSocket
(transports.md §5). Messages go out in order, as 8 seq bytes + payload; nothing is dropped silently.

With the engine's replay socket (`--replay`), a connection resumes where the service's index
stands: the service says its last applied seq (`resume=true`), the relay asks the engine for
everything after it, and skips what the service already has, so that neither a relay restart nor a
lost connection loses batches the engine still keeps."""

from __future__ import annotations

import signal
import time
import traceback
from collections import deque
from urllib.parse import urlencode, urlsplit

import anyio
import anyio.abc

from ..adapters.replay import parse_replay_frames
from ..adapters.ws import ForwardingClient
from .logs import log, log_internal_error
from .pump import flush, receive
from .subscriber import backoff_delays, connect
from .zmq_sub import ZmqHub, fetch_replay

__all__ = ["Relay", "run_relay"]

MAX_BUFFER_BYTES = 64 * 1024 * 1024
REPORT_EVERY = 10.0
RESUME_TIMEOUT = 2.0  # how long to wait for the service's resume point (an older one sends none)


class _Replayed(bytes):
    """A message the engine replayed (its live copy, if one follows, is the duplicate)."""

    @property
    def data(self) -> bytes:
        return bytes(self)


class Relay:
    """Buffer and counters; the ZMQ side appends, the WebSocket side drains."""

    def __init__(self, buffer_messages: int) -> None:
        self.buffer: deque[bytes] = deque()
        self.buffer_bytes = 0
        self.limit = buffer_messages
        self.counters = {"forwarded": 0, "acknowledged": 0, "dropped_overflow": 0,
                         "unacknowledged_at_disconnect": 0, "invalid_frames": 0, "reconnects": 0,
                         "internal_errors": 0, "replayed": 0, "skipped_duplicates": 0}
        self.replayed: set[int] = set()  # seqs the last resume brought: their live copies are skipped
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
        """The next message to forward, skipping live copies of what a resume replayed."""
        while self.buffer:
            message, replayed = self.buffer.popleft(), False
            self.buffer_bytes -= len(message)
            if isinstance(message, _Replayed):
                message, replayed = message.data, True
            seq = int.from_bytes(message[:8], "big")
            if not replayed and seq in self.replayed:
                self.replayed.discard(seq)
                self.counters["skipped_duplicates"] += 1
                continue
            return message
        return None

    def resume(self, last: int | None, replayed: list[list[bytes]]) -> None:
        """A connection began where the service has `last` applied: buffered messages it already
        has go, and the engine's replay of what follows goes first, in order."""
        start = 0 if last is None else last + 1
        kept = [m for m in self.buffer if int.from_bytes(m[:8], "big") >= start]
        self.counters["skipped_duplicates"] += len(self.buffer) - len(kept)
        messages: list[bytes] = []
        for frames in replayed:
            parsed = parse_replay_frames(frames)
            if parsed is not None and parsed[0] >= start:
                messages.append(_Replayed(parsed[0].to_bytes(8, "big") + parsed[1]))
        self.replayed = {int.from_bytes(m[:8], "big") for m in messages}
        self.counters["replayed"] += len(messages)
        self.buffer = deque([*messages, *kept])
        self.buffer_bytes = sum(len(m) for m in self.buffer)

    def report_to(self, target: str, event: str = "relay_counters") -> None:
        log("info", event, to=target, **self.counters)


async def _zmq_loop(relays: list[Relay], endpoint: str, topic: bytes) -> None:
    hub = ZmqHub()
    try:
        async for messages in hub.batches(endpoint, topic):
            if isinstance(messages, str):
                continue  # the engine's end came or went: the service sees it in the seqs
            for frames in messages:
                for relay in relays:
                    relay.offer(frames)
    finally:
        hub.stop()


async def _read(stream: anyio.abc.ByteStream, client: ForwardingClient, lock: anyio.Lock,
                scope: anyio.CancelScope) -> None:
    """Acks, pings and the close, from the service; ends the connection's task group."""
    while not client.closed:
        data = await receive(stream)
        assert data is not None  # no timeout
        client.receive_data(data)
        await flush(stream.send, client, lock)
    scope.cancel()


async def _ws_loop(relay: Relay, to: str, worker_id: int, dp_rank: int, replay: str | None) -> None:
    parts = urlsplit(to)
    ours = {"worker_id": worker_id, "dp_rank": dp_rank, "framing": "seq", "ack": "true",
            **({"resume": "true"} if replay else {})}
    query = "&".join(q for q in (parts.query, urlencode(ours)) if q)
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
                if replay is not None and client.accepted:
                    with anyio.move_on_after(RESUME_TIMEOUT):
                        while not client.resumed and not client.closed:
                            await anyio.sleep(0.01)
                    if client.resumed:
                        start = 0 if client.resume is None else client.resume + 1
                        frames, _ = await anyio.to_thread.run_sync(fetch_replay, replay, start,
                                                                   abandon_on_cancel=True)
                        relay.resume(client.resume, frames)
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


async def run_relay(zmq_endpoint: str, to: str | list[str], worker_id: int, dp_rank: int, topic: str,
                    buffer_messages: int, replay: str | None = None) -> None:
    """Forward to each service of `to` (every replica of a fleet sharing a ledger needs the
    events): one buffer, connection and resume point each, so a slow one holds up no other."""
    targets = [to] if isinstance(to, str) else to
    relays = [Relay(buffer_messages) for _ in targets]
    log("info", "relay", zmq=zmq_endpoint, to=",".join(targets), worker_id=worker_id, dp_rank=dp_rank)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_zmq_loop, relays, zmq_endpoint, topic.encode())
        for relay, target in zip(relays, targets, strict=True):
            tg.start_soon(_ws_loop, relay, target, worker_id, dp_rank, replay)

        async def reporter() -> None:
            while True:
                await anyio.sleep(REPORT_EVERY)
                for relay, target in zip(relays, targets, strict=True):
                    relay.report_to(target)

        tg.start_soon(reporter)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log("info", "shutdown", signal=signal.Signals(signum).name)
                break
        tg.cancel_scope.cancel()
    for relay, target in zip(relays, targets, strict=True):
        relay.report_to(target, "relay_stopped")


