"""A TCP listener whose connections are byte streams on asyncio's own transports: the picker's
port when `serve` runs on asyncio or uvloop. anyio's stream layer resumed and paused the
transport's reader on every read and yielded to the loop once more after every write: a fifth of
a picker call's CPU (docs/PERFORMANCE.md). On trio the picker keeps anyio's listener.

A stream here reads ahead up to `READ_AHEAD` bytes, then pauses its transport until they are
taken; a write waits while the transport's buffer is over its high-water mark. TLS, when asked,
is asyncio's, with the handshake bounded by `handshake_timeout`."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any, Final, cast

import anyio
import anyio.abc

from .accepting import accept_forever

__all__ = ["LoopListener", "LoopStream", "on_asyncio"]

READ_AHEAD: Final = 1 << 20


def on_asyncio() -> bool:
    """The running event loop is asyncio's (or uvloop's), not trio's."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class LoopListener:
    """Accepts once `serve` runs; each connection is handed to `handler` in a task of its own,
    cancelled with `serve`. Accepting is ours (`accepting.accept_forever`), not asyncio's server,
    whose loop logged a traceback for every retry once descriptors ran out."""

    def __init__(self, listener: anyio.abc.Listener[anyio.abc.SocketStream], tls: ssl.SSLContext | None,
                 handshake_timeout: float) -> None:
        self._listener = listener  # anyio's: it binds (every address of the host) and closes
        self._sockets = [one.extra(anyio.abc.SocketAttribute.raw_socket) for one in _each(listener)]
        self._tls, self._handshake_timeout = tls, handshake_timeout

    @classmethod
    async def bind(cls, host: str, port: int, *, reuse_port: bool, tls: ssl.SSLContext | None,
                   handshake_timeout: float) -> LoopListener:
        """Listening at once (a port in use raises OSError here), accepting from `serve` on."""
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=reuse_port)
        return cls(listener, tls, handshake_timeout)

    @property
    def port(self) -> int:
        return int(self._sockets[0].getsockname()[1])

    async def serve(self, handler: Callable[[anyio.abc.ByteStream], Coroutine[Any, Any, None]],
                    failed: Callable[[OSError], None], admit: Callable[[], bool],
                    release: Callable[[], None]) -> None:
        """Until cancelled. `failed` counts each accept that failed (it is retried, backing off);
        a connection `admit` refuses is closed at once, in the accept's own turn (so that a flood
        cannot accept faster than it is closed); one admitted whose TLS handshake fails is
        `release`d (the handler releases the others)."""
        loop = asyncio.get_running_loop()
        try:
            async with anyio.create_task_group() as group:
                def started(stream: LoopStream) -> None:
                    group.start_soon(handler, stream)

                def accepted(connection: tuple[socket.socket, Any]) -> None:
                    if admit():
                        group.start_soon(self._open, connection[0], started, release)
                    else:
                        connection[0].close()

                for listening in self._sockets:
                    group.start_soon(accept_forever, partial(loop.sock_accept, listening), accepted, failed,
                                     "ext_proc")
        finally:
            await self._listener.aclose()

    async def _open(self, connection: socket.socket, started: Callable[[LoopStream], None],
                    release: Callable[[], None]) -> None:
        """The connection's transport (after its TLS handshake, when there is TLS); its stream
        then starts its handler."""
        tls = self._tls
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: _Protocol(started), connection, ssl=tls,
                ssl_handshake_timeout=self._handshake_timeout if tls is not None else None)
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError):
            connection.close()  # (the handshake failed or timed out: asyncio closed its transport)
            release()


def _each(listener: anyio.abc.Listener[anyio.abc.SocketStream]) -> list[anyio.abc.SocketListener]:
    """The socket listeners of what `anyio.create_tcp_listener` returned (one per address)."""
    if isinstance(listener, anyio.abc.SocketListener):
        return [listener]
    return [one for one in getattr(listener, "listeners", ()) if isinstance(one, anyio.abc.SocketListener)]


class _Protocol(asyncio.Protocol):
    def __init__(self, started: Callable[[LoopStream], None]) -> None:
        self._started = started
        self.stream: LoopStream | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.stream = LoopStream(cast(asyncio.Transport, transport))  # (uvloop's are not subclasses)
        self._started(self.stream)

    def data_received(self, data: bytes) -> None:
        assert self.stream is not None
        self.stream.arrived(data)

    def eof_received(self) -> bool:
        assert self.stream is not None
        self.stream.ended(None)
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        if self.stream is not None:
            self.stream.ended(exc)
            self.stream.writable()

    def pause_writing(self) -> None:
        assert self.stream is not None
        self.stream.paused = True

    def resume_writing(self) -> None:
        assert self.stream is not None
        self.stream.writable()


class LoopStream(anyio.abc.ByteStream):
    """anyio's byte-stream interface (EndOfStream at the end, BrokenResourceError when the peer
    broke off) over one asyncio transport."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._reading = True
        self._ended = False
        self._broken: str | None = None  # why the connection broke, if it did
        self._readable: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self.paused = False  # the transport's write buffer is over its high-water mark

    def arrived(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > READ_AHEAD and self._reading:
            self._reading = False
            self._transport.pause_reading()
        self._wake(self._readable)

    def ended(self, exc: Exception | None) -> None:
        if not self._ended:
            self._ended, self._broken = True, None if exc is None else str(exc)
        self._wake(self._readable)

    def writable(self) -> None:
        self.paused = False
        self._wake(self._drained)

    @staticmethod
    def _wake(waiter: asyncio.Future[None] | None) -> None:
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def receive(self, max_bytes: int = 65536) -> bytes:
        while not self._chunks:
            if self._ended:
                raise anyio.EndOfStream if self._broken is None else anyio.BrokenResourceError(self._broken)
            self._readable = asyncio.get_running_loop().create_future()
            try:
                await self._readable
            finally:
                self._readable = None
        chunk = self._chunks.popleft()
        if len(chunk) > max_bytes:
            chunk, rest = chunk[:max_bytes], chunk[max_bytes:]
            self._chunks.appendleft(rest)
        self._buffered -= len(chunk)
        if not self._reading and self._buffered <= READ_AHEAD // 2:
            self._reading = True
            self._transport.resume_reading()
        return chunk

    async def receive_within(self, timeout: float, max_bytes: int = 65536) -> bytes | None:
        """`receive`, or None once `timeout` seconds passed without bytes (or the end). A timer on
        the loop instead of an anyio cancel scope around `receive`: the picker waits so before each
        of Envoy's messages, and the scope's entry and exit cost a third of reading one."""
        if not self._chunks and not self._ended:
            loop = asyncio.get_running_loop()
            self._readable = waiter = loop.create_future()
            timer = loop.call_later(max(0.0, timeout), self._wake, waiter) if timeout < float("inf") else None
            try:
                await waiter
            finally:
                self._readable = None
                if timer is not None:
                    timer.cancel()
            if not self._chunks and not self._ended:
                return None
        return await self.receive(max_bytes)  # (bytes are there, or the end: no wait)

    async def send(self, item: bytes) -> None:
        if self._transport.is_closing():
            raise anyio.BrokenResourceError("the connection is closed")
        self._transport.write(item)
        while self.paused and not self._transport.is_closing():
            self._drained = asyncio.get_running_loop().create_future()
            try:
                await self._drained
            finally:
                self._drained = None

    async def send_eof(self) -> None:
        self._transport.write_eof()

    async def aclose(self) -> None:
        self._transport.close()
