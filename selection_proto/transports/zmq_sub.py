"""ZMQ for subscriptions (transports.md §4): every SUB socket polled by one thread (`ZmqHub`), so
that both anyio backends work and a thousand engines cost one thread; an engine's replay socket
asked from a worker thread (`fetch_replay`)."""

from __future__ import annotations

import queue
import threading
from collections.abc import AsyncIterator
from typing import Any, Final

import anyio
import anyio.from_thread
import anyio.lowlevel

__all__ = ["CONNECTED", "DISCONNECTED", "REPLAY_TIMEOUT", "ZmqHub", "fetch_replay"]

# What `ZmqHub.batches` yields, beside lists of messages, when the engine's end has connected (its
# handshake done: from then on it sends us what it publishes) or gone.
CONNECTED: Final = "connected"
DISCONNECTED: Final = "disconnected"

REPLAY_TIMEOUT = 1.0  # seconds the engine may take for each replayed batch
MAX_REPLAYED = 100_000
# Replays asked for one gap: each asks again from the first batch the last lost. A round loses
# only what overflowed the engine's send queue (at most a fifth of 10,000 here), so a handful ends it.
MAX_REPLAY_ROUNDS = 8


def fetch_replay(endpoint: str, start: int, timeout: float = REPLAY_TIMEOUT) -> tuple[list[list[bytes]], bool]:
    """Ask the engine's ROUTER at `endpoint` for every batch from `start` on (blocking: run it in a
    worker thread). The frames received (those that do not parse first, then the batches in
    order, each once), and whether the replay ended as it should.

    vLLM's ROUTER sends its whole buffer at once at the default high-water mark (1,000 messages)
    and drops, silently, what its send queue cannot hold: 130-2,054 of 10,001 batches here,
    whatever our end's receive queue. What a round lost is asked for again (`replay_holes`)."""
    import zmq

    from ..adapters.replay import END, parse_replay_frames, replay_holes, replay_request

    bad: list[list[bytes]] = []
    batches: dict[int, list[bytes]] = {}
    ended, ask = False, start
    for _ in range(MAX_REPLAY_ROUNDS):
        socket: Any = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, MAX_REPLAYED + 1)  # never our end's queue that drops
        ended = False
        try:
            socket.connect(endpoint)
            socket.send_multipart(replay_request(ask))
            while len(batches) + len(bad) < MAX_REPLAYED and socket.poll(int(timeout * 1000)):
                frames = socket.recv_multipart()
                parsed = parse_replay_frames(frames)
                if parsed is None:
                    bad.append(frames)
                elif parsed[0] == END:
                    ended = True
                    break
                elif parsed[0] >= start:
                    batches[parsed[0]] = frames
        finally:
            socket.close(linger=0)
        again = replay_holes(sorted(batches), ended)
        if again is None or len(batches) + len(bad) >= MAX_REPLAYED:
            break
        ask = again
    return bad + [batches[seq] for seq in sorted(batches)], ended


class ZmqHub:
    """Every SUB socket of one event loop's subscriptions, polled by one daemon thread: a thousand
    subscriptions cost one poll, not a thousand threads waking to poll (which also took every
    token of anyio's default thread limiter, queueing every other `to_thread` call behind them).

    Sockets are made, connected and closed on the poller thread only (ZMQ sockets are not
    thread-safe); the loop asks for them through a command queue and a wake-up socket. Batches go
    to each subscription's memory stream, waiting while it is full (backpressure, as before: the
    SUB socket buffers up to its high-water mark meanwhile)."""

    def __init__(self) -> None:
        import zmq

        # A context of its own: ZMQ's default of 1,023 sockets would refuse the 1,024th engine
        # (the descriptors themselves are bounded by `max_subscriptions`, cli._fit_descriptors).
        self._context: Any = zmq.Context()
        self._context.set(zmq.MAX_SOCKETS, 1 << 16)
        self._address = f"inproc://selection-proto-hub-{id(self)}"
        self._wake = self._context.socket(zmq.PAIR)  # the loop's end: one byte per command
        self._wake.bind(self._address)
        # The poller's end, connected before its thread starts (handed over by the start): a wake-up
        # sent before it connected would be dropped, and the first command never seen.
        self._woken = self._context.socket(zmq.PAIR)
        self._woken.connect(self._address)
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._poll, name="zmq-hub", daemon=True)
        self._thread.start()

    def _command(self, *command: Any) -> None:
        import zmq

        self._commands.put(command)
        with self._lock:  # the loop's end of the pair, shared by every task (and `stop`)
            try:
                self._wake.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a wake-up is already waiting: the poller drains every command at once

    def stop(self) -> None:
        self._command("stop")

    async def batches(self, endpoint: str, topic: bytes = b"") -> AsyncIterator[list[list[bytes]] | str]:
        """Lists of multipart messages from `endpoint` as they arrive, and `CONNECTED` or
        `DISCONNECTED` as the engine's end comes and goes. Raises what connecting raised (an
        address ZMQ refuses)."""
        send, receive = anyio.create_memory_object_stream[Any](4)
        key = object()
        self._command("add", key, endpoint, topic, send, anyio.lowlevel.current_token())
        try:
            async with receive:
                async for batch in receive:
                    if isinstance(batch, BaseException):
                        raise batch
                    yield batch
        finally:
            self._command("remove", key)

    def _poll(self) -> None:  # the poller thread
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        wake = self._woken
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        subscribers: dict[Any, tuple[Any, Any, Any]] = {}  # socket -> (key, stream, loop token)
        by_key: dict[object, Any] = {}
        monitors: dict[Any, Any] = {}  # monitor socket -> its SUB socket
        monitor_of: dict[Any, Any] = {}

        def drop(socket: Any) -> None:
            key, _, _ = subscribers.pop(socket)
            by_key.pop(key, None)
            poller.unregister(socket)
            monitor = monitor_of.pop(socket, None)
            if monitor is not None:  # stopped before either closes, as libzmq wants it
                socket.disable_monitor()
                monitors.pop(monitor, None)
                poller.unregister(monitor)
                monitor.close(linger=0)
            socket.close(linger=0)

        try:
            while True:
                for socket, _ in poller.poll():
                    if socket is wake:
                        while True:
                            try:
                                wake.recv(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                        while not self._commands.empty():
                            command = self._commands.get()
                            if command[0] == "stop":
                                return
                            if command[0] == "remove":
                                if command[1] in by_key:
                                    drop(by_key[command[1]])
                                continue
                            _, key, endpoint, topic, stream, token = command
                            sub = self._context.socket(zmq.SUB)
                            sub.setsockopt(zmq.LINGER, 0)
                            # The engine's side of the connection, watched before it is made (a
                            # handshake on loopback can beat a later watch): its process going
                            # away takes its cache along (DISCONNECTED below).
                            monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                                             | zmq.EVENT_DISCONNECTED)
                            try:
                                sub.setsockopt(zmq.SUBSCRIBE, topic)
                                sub.connect(endpoint)
                            except zmq.ZMQError as exc:
                                sub.disable_monitor()
                                monitor.close(linger=0)
                                sub.close(linger=0)
                                _deliver(stream, token, exc)
                                continue
                            subscribers[sub] = (key, stream, token)
                            by_key[key] = sub
                            poller.register(sub, zmq.POLLIN)
                            monitors[monitor] = sub
                            monitor_of[sub] = monitor
                            poller.register(monitor, zmq.POLLIN)
                        continue
                    if socket in monitors:
                        sub = monitors[socket]
                        while True:
                            try:
                                event = recv_monitor_message(socket, zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            _, stream, token = subscribers[sub]
                            state = CONNECTED if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED else DISCONNECTED
                            if not _deliver(stream, token, state):
                                drop(sub)
                                break
                        continue
                    if socket not in subscribers:
                        continue
                    messages: list[list[bytes]] = []
                    while len(messages) < 256:
                        try:
                            messages.append(socket.recv_multipart(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                    _, stream, token = subscribers[socket]
                    if messages and not _deliver(stream, token, messages):
                        drop(socket)  # its subscription, or the loop, has gone
        finally:
            for socket in list(subscribers):
                socket.disable_monitor()
            for socket in list(monitors):
                socket.close(linger=0)
            for socket in list(subscribers):
                socket.close(linger=0)
            wake.close(linger=0)
            with self._lock:
                self._wake.close(linger=0)
            self._context.term()


def _deliver(stream: Any, token: Any, item: Any) -> bool:
    """Hand `item` to the loop's task, waiting while its stream is full; False when it is gone."""
    try:
        try:  # a call on the loop, no task (the stream has room but while the loop lags behind)
            anyio.from_thread.run_sync(stream.send_nowait, item, token=token)
        except anyio.WouldBlock:
            anyio.from_thread.run(stream.send, item, token=token)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, RuntimeError):
        return False
    return True
