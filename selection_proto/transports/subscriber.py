"""Outbound KV-event subscriptions: `ws://` / `wss://` (wsproto client) and `tcp://` / `ipc://`
(pyzmq SUB, extra `zmq`), driven by the core's Subscribe/Unsubscribe outputs (transports.md §4)."""

from __future__ import annotations

import ssl
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import anyio
import anyio.abc

from ..adapters.replay import SeqOrder, parse_replay_frames
from ..adapters.ws import SubscriptionSession
from ..core.base.metrics import KV_REPLAYS, SUBSCRIPTION_FAILURES
from ..core.base.outputs import OutputEvent, SubscribeKvEvents, UnsubscribeKvEvents
from ..core.service import SelectionService
from .logs import log
from .pump import TURN_BYTES, TURN_SECS, apply_large, flush, receive
from .zmq_sub import DISCONNECTED, ZmqHub, fetch_replay

__all__ = ["BACKOFF_MAX", "BACKOFF_START", "Subscriptions", "backoff_delays", "connect"]

BACKOFF_START = 0.5
BACKOFF_MAX = 30.0
STABLE_AFTER = 30.0  # a connection that lasted this long resets the backoff
CONNECT_TIMEOUT = 10.0
HANDSHAKE_TIMEOUT = 10.0


async def connect(host: str, port: int, *, tls: bool) -> anyio.abc.ByteStream:
    """A TCP connection, TLS-wrapped for `wss://` (certificates checked with the system's roots)."""
    if tls:
        return await anyio.connect_tcp(host, port, ssl_context=ssl.create_default_context(),
                                       tls_standard_compatible=False)
    return await anyio.connect_tcp(host, port)


def backoff_delays(start: float = BACKOFF_START, cap: float = BACKOFF_MAX) -> Callable[[], float]:
    """0.5 s, doubling, at most 30 s."""
    state = {"next": start}

    def delay() -> float:
        value = state["next"]
        state["next"] = min(cap, value * 2)
        return value

    return delay


class Subscriptions:
    """One task per subscribed rank; `route` takes the core's subscription outputs."""

    def __init__(self, service: SelectionService, tg: anyio.abc.TaskGroup,
                 changed: Callable[[], Awaitable[None]]) -> None:
        self.service = service
        self.tg = tg
        self.changed = changed
        self.scopes: dict[int, anyio.CancelScope] = {}
        self.hub: ZmqHub | None = None  # started with the first ZMQ subscription

    def route(self, out: OutputEvent) -> bool:
        if isinstance(out, SubscribeKvEvents):
            scope = anyio.CancelScope()
            self.scopes[out.stream] = scope
            self.tg.start_soon(self._run, out, scope)
            return True
        if isinstance(out, UnsubscribeKvEvents):
            cancelled = self.scopes.pop(out.stream, None)
            if cancelled is not None:
                cancelled.cancel()
            return True
        return False

    def close_all(self) -> None:
        for scope in self.scopes.values():
            scope.cancel()
        self.scopes.clear()
        if self.hub is not None:
            self.hub.stop()
            self.hub = None

    def _failed(self, scheme: str, reason: str, sub: SubscribeKvEvents, detail: str) -> None:
        self.service.observe(SUBSCRIPTION_FAILURES, (scheme, reason), 1.0)
        log("warning", "kv_subscription_failed", worker_id=sub.worker_id, dp_rank=sub.dp_rank,
            endpoint=sub.endpoint, reason=reason, detail=detail)

    async def _run(self, sub: SubscribeKvEvents, scope: anyio.CancelScope) -> None:
        """Until unsubscribed. Whatever ends a subscription (an address the socket layer refuses,
        a failure of ours) is counted, marks the rank stale and is retried with backoff: it never
        reaches the server's task group."""
        scheme = sub.endpoint.partition("://")[0]
        delays = backoff_delays()
        with scope:
            while True:
                started = time.monotonic()
                try:
                    if scheme in ("ws", "wss"):
                        await self._websocket(sub, scheme)
                    else:
                        await self._zmq(sub, scheme)
                    return
                except Exception as exc:  # noqa: BLE001 - confined to this subscription
                    self.service.internal_error("subscription")
                    self._failed(scheme, "error", sub, f"{type(exc).__name__}: {exc}")
                    self.service.subscription_failed(sub.stream, now=anyio.current_time())
                    await self.changed()
                if time.monotonic() - started >= STABLE_AFTER:
                    delays = backoff_delays()
                await anyio.sleep(delays())

    async def _websocket(self, sub: SubscribeKvEvents, scheme: str) -> None:
        parts = urlsplit(sub.endpoint)
        host = parts.hostname or ""
        port = parts.port or (443 if scheme == "wss" else 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        delays = backoff_delays()
        while True:
            started = time.monotonic()
            reason, detail = await self._ws_once(sub, scheme, host, port, target)
            self._failed(scheme, reason, sub, detail)
            self.service.subscription_failed(sub.stream, now=anyio.current_time())
            if time.monotonic() - started >= STABLE_AFTER:
                delays = backoff_delays()
            await anyio.sleep(delays())

    async def _ws_once(self, sub: SubscribeKvEvents, scheme: str, host: str, port: int,
                       target: str) -> tuple[str, str]:
        """One connection's life; returns why it ended as (reason label, detail)."""
        try:
            with anyio.fail_after(CONNECT_TIMEOUT):
                stream = await connect(host, port, tls=scheme == "wss")
        except ssl.SSLError as exc:
            return "tls", str(exc)
        except (OSError, TimeoutError) as exc:
            return "connect", str(exc) or type(exc).__name__
        except UnicodeError as exc:  # a host name IDNA cannot encode
            return "connect", f"invalid host name: {exc}"
        session = SubscriptionSession(self.service, anyio.current_time, sub.stream,
                                      f"{host}:{port}", target)
        try:
            async with stream:

                async def between_turns() -> None:  # also between the slices of a large message
                    await flush(stream.send, session)
                    await self.changed()

                await flush(stream.send, session)
                while not session.closed:
                    if session.backlog:  # the last turn ran out: others first, then the rest
                        await anyio.sleep(0)
                        session.resume(anyio.current_time() + TURN_SECS)
                    else:
                        # A peer that never completes the handshake is given up on like a refused one.
                        timeout = float("inf") if session.accepted else HANDSHAKE_TIMEOUT
                        data = await receive(stream, timeout, TURN_BYTES)
                        if data is None:
                            return "handshake", f"no handshake answer within {HANDSHAKE_TIMEOUT:g} s"
                        session.receive_data(data, anyio.current_time() + TURN_SECS)
                    await apply_large(session, between_turns)
                    await between_turns()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            session.connection_lost()
            return "closed", str(exc) or type(exc).__name__
        finally:
            session.connection_lost()
        if not session.accepted:
            return "handshake", session.rejected or "connection closed during the handshake"
        return "closed", f"closed with code {session.close_code}"

    async def _zmq(self, sub: SubscribeKvEvents, scheme: str) -> None:
        try:
            import zmq  # noqa: F401
        except ImportError:
            self._failed(scheme, "zmq_unavailable", sub, "pyzmq is not installed")
            return
        order = SeqOrder()  # connected once the engine's handshake is done (ZmqHub's CONNECTED)
        try:
            if self.hub is None:
                self.hub = ZmqHub()
            async for messages in self.hub.batches(sub.endpoint):
                if isinstance(messages, str):
                    self.service.subscription_state(sub.stream, messages != DISCONNECTED, now=anyio.current_time(),
                                                    engine_gone=messages == DISCONNECTED)
                    await self.changed()
                    continue
                until = anyio.current_time() + TURN_SECS  # up to 256 messages came at once
                for frames in messages:
                    if len(frames) != 3 or len(frames[1]) != 8:  # [topic, 8-byte seq, payload]
                        self.service.stream_dropped(sub.stream, "bad_zmq_frames")
                        continue
                    order.live(int.from_bytes(frames[1], "big"), frames[2], sub.replay_endpoint is not None)
                    if order.want is not None and sub.replay_endpoint is not None:
                        await self._replay(sub, sub.replay_endpoint, order, order.want)
                    until = await self._apply(sub, order.ready(), until)
                if messages:
                    await self.changed()
        finally:
            self.service.subscription_state(sub.stream, False, now=anyio.current_time())

    async def _apply(self, sub: SubscribeKvEvents, ready: list[tuple[int, bytes]], until: float) -> float:
        """Batches in order, the loop's other work run whenever the clock passes `until` (a turn
        of `TURN_SECS`, as for a WebSocket read; a 10,000-batch replay applied whole held `/health`
        for seconds); returns the end of the turn now running."""
        for seq, payload in ready:
            self.service.stream_message(sub.stream, payload, seq=seq, now=anyio.current_time())
            if anyio.current_time() >= until:
                await self.changed()
                await anyio.sleep(0)
                until = anyio.current_time() + TURN_SECS
        return until

    async def _replay(self, sub: SubscribeKvEvents, endpoint: str, order: SeqOrder, start: int) -> None:
        """Fill a gap from the engine's replay socket (docs/DECISIONS.md); live batches wait in the SUB
        socket meanwhile, and those the replay already brought are dropped as duplicates."""
        order.want = None
        before = (order.recovered, order.unrecovered, order.passed_over)
        frames_list, ended = await anyio.to_thread.run_sync(fetch_replay, endpoint, start,
                                                            abandon_on_cancel=True)
        batches = []
        for frames in frames_list:
            parsed = parse_replay_frames(frames)
            if parsed is None:
                self.service.stream_dropped(sub.stream, "bad_zmq_frames")
                continue
            batches.append(parsed)
        order.replay(batches)
        order.replay_done()
        self.service.observe(KV_REPLAYS, ("requested",), 1.0)
        self.service.observe(KV_REPLAYS, ("recovered",), float(order.recovered - before[0]))
        self.service.observe(KV_REPLAYS, ("unrecovered",), float(order.unrecovered - before[1]))
        if order.passed_over > before[2]:
            self.service.observe(KV_REPLAYS, ("passed_over",), float(order.passed_over - before[2]))
        if not ended:
            self.service.observe(KV_REPLAYS, ("failed",), 1.0)
            log("warning", "kv_replay_failed", worker_id=sub.worker_id, dp_rank=sub.dp_rank,
                endpoint=endpoint, start=start)
