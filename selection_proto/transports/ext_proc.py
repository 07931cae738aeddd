"""The endpoint picker's gRPC server: Envoy's `ExternalProcessor` service and gRPC health, over
HTTP/2 on anyio in `serve`'s own event loop (`adapters.grpc` frames the calls), so that it shares
the HTTP API's service, queue and ledger (docs/GATEWAY.md). Each `Process` call is an
`adapters.ext_proc.ExtProcStream` (what each call does: transports/ext_proc_calls.py); this module
accepts and closes connections, moves bytes and messages, and waits for queued selections."""

from __future__ import annotations

import json
import os
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc
from anyio.streams.tls import TLSStream

from ..adapters.grpc import CallEnded, CallReset, CallStarted, GrpcServer, Message, Status, WindowOpened
from ..core.base.metrics import INTERNAL_ERRORS, LIMIT_REJECTIONS
from .accepting import Throttled, accept_forever
from .ext_proc_calls import (
    CHECK_PATH,
    PROCESS_PATH,
    SERVICE_NAME,
    Handler,
    HealthHandler,
    Host,
    Picker,
    ProcessHandler,
    bearer_matches,
)
from .logs import log
from .loop_stream import LoopListener, LoopStream, on_asyncio

if TYPE_CHECKING:
    from ..adapters.openai import ChatTokenizer
    from .config import ExtProcOptions

__all__ = ["SERVICE_NAME", "ExtProcServer", "Host", "load_tokenizers"]

MAX_MESSAGE_BYTES: Final = 16 << 20  # a chunk is at most Envoy's buffer; room for a whole 8 MiB body
_GONE: Final = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError, ssl.SSLError)


def load_tokenizers(pairs: tuple[tuple[str, str], ...]) -> dict[str, ChatTokenizer]:
    """`--tokenizer MODEL=PATH`: PATH is a `tokenizer.json` or the folder holding it (and its
    `tokenizer_config.json`, whose `chat_template` is used). Raises RuntimeError with the reason."""
    from ..adapters.openai import ChatTokenizer

    out = {}
    for model, path in pairs:
        folder, name = (path, "tokenizer.json") if os.path.isdir(path) else os.path.split(path)
        config: dict[str, Any] = {}
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as fh:
                text = fh.read()
            config_path = os.path.join(folder, "tokenizer_config.json")
            if os.path.exists(config_path):
                with open(config_path, encoding="utf-8") as fh:
                    config = json.load(fh)
            out[model] = ChatTokenizer(text, config)
        except (OSError, ValueError, Exception) as exc:  # noqa: BLE001 - the tokenizers wheel raises its own
            raise RuntimeError(f"--tokenizer {model}={path}: {exc}") from exc
    return out


class ExtProcServer:
    """The gRPC server, listening once `start` returns (so that a port in use fails `serve` at
    its start, with one line), serving until `run` is cancelled; `drain` before that lets the
    calls under way end."""

    def __init__(self, server: Host, options: ExtProcOptions) -> None:
        self.server, self.options = server, options
        self.picker = Picker(server, options.tokenizers)
        self.connections: set[_Connection] = set()
        self.serving = True
        self.tls: ssl.SSLContext | None = None
        self.listener: anyio.abc.Listener[anyio.abc.SocketStream] | LoopListener | None = None
        self.refused = Throttled("ext_proc_connections_refused")
        self.admitted = 0  # connections accepted and not closed yet (in a TLS handshake, or served)

    async def start(self) -> None:
        options = self.options
        host = f"[{options.host}]" if ":" in options.host else options.host
        try:
            if options.tls_cert and options.tls_key:
                self.tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                self.tls.load_cert_chain(options.tls_cert, options.tls_key)
                self.tls.set_alpn_protocols(["h2"])
            # Shared by the processes of --processes; else a port in use must fail the start.
            reuse_port = self.server.config.reuse_port
            if on_asyncio():  # (uvloop's loop too) its own streams
                self.listener = await LoopListener.bind(options.host, options.port, reuse_port=reuse_port, tls=self.tls,
                                                        handshake_timeout=self.server.config.request_timeout_secs)
            else:
                self.listener = await anyio.create_tcp_listener(local_host=options.host, local_port=options.port,
                                                                reuse_port=reuse_port)
        except (OSError, ssl.SSLError) as exc:
            raise RuntimeError(f"cannot listen on {options.host}:{options.port} for ext_proc: "
                               f"{getattr(exc, 'strerror', None) or exc}") from exc
        port = self.listener.port if isinstance(self.listener, LoopListener) else \
            self.listener.extra(anyio.abc.SocketAttribute.local_port)
        scheme = "grpcs" if self.tls is not None else "grpc"
        log("info", "ext_proc_listening", url=f"{scheme}://{host}:{port}", tokenizers=sorted(options.tokenizers))

    async def run(self) -> None:
        """Accept and serve until cancelled, backing off while descriptors run out."""
        listener = self.listener
        assert listener is not None

        def failed(exc: OSError) -> None:
            self.server.service.observe(INTERNAL_ERRORS, ("accept",), 1.0)

        if isinstance(listener, LoopListener):
            await listener.serve(self._connection, failed, self.admit, self.release)
            return
        async with listener, anyio.create_task_group() as group:
            def accepted(stream: anyio.abc.SocketStream) -> None:
                if self.admit():
                    group.start_soon(self._connection, stream)
                else:
                    group.start_soon(anyio.aclose_forcefully, stream)

            for one in getattr(listener, "listeners", [listener]):
                group.start_soon(accept_forever, one.accept, accepted, failed, "ext_proc")

    async def drain(self, timeout: float) -> None:
        """Health says NOT_SERVING, no new calls are taken (GOAWAY), and those under way have
        `timeout` to end."""
        self.serving = False
        for conn in list(self.connections):
            conn.wire.go_away()
            await conn.flush()
        with anyio.move_on_after(timeout):
            while any(conn.wire.calls for conn in self.connections):
                await anyio.sleep(0.01)

    def admit(self) -> bool:
        """Whether a connection just accepted may stay (else it is closed at once, before anything
        is read or allocated for it). The picker's connections share the descriptors left for
        connections with the HTTP API's, and take at most half of them, so that a flood of either
        leaves the other room (docs/DECISIONS.md, "Bounds"). Once admitted, `release` follows."""
        server = self.server
        config, budget = server.config, server.connection_budget
        if self.admitted >= config.max_connections or self.admitted >= budget / 2 \
                or server.connections_open() >= budget:
            server.service.observe(LIMIT_REJECTIONS, ("ext_proc_connections",), 1.0)
            self.refused(open=self.admitted, max_connections=config.max_connections, descriptor_budget=budget)
            return False
        self.admitted += 1
        return True

    def release(self) -> None:
        """An admitted connection is closed."""
        self.admitted -= 1

    async def _connection(self, stream: anyio.abc.ByteStream) -> None:
        """Serve one admitted connection until it ends, then `release` it."""
        try:
            await self._serve_connection(stream)
        finally:
            self.release()

    async def _serve_connection(self, stream: anyio.abc.ByteStream) -> None:
        config = self.server.config
        conn = _Connection(self, stream)
        self.connections.add(conn)
        try:
            if self.tls is not None and not isinstance(self.listener, LoopListener):  # (that one's TLS is asyncio's)
                with anyio.move_on_after(config.request_timeout_secs):
                    conn.stream = await TLSStream.wrap(stream, server_side=True, ssl_context=self.tls,
                                                       standard_compatible=False)
                if conn.stream is stream:
                    return
            await conn.serve()
        except _GONE:
            pass
        except Exception:  # noqa: BLE001 - one connection's failure is confined to it
            self.server.service.internal_error("ext_proc")
        finally:
            self.connections.discard(conn)
            await anyio.aclose_forcefully(conn.stream)


class _Connection:
    """One HTTP/2 connection: reads frames and runs each call's messages through its handler in
    place, in the reader's own turn (no task, no lock, one write per read: the picker's latency is
    its CPU). A call that must wait (a queued selection, a large body read off the loop) waits in a
    task of its own; one whose peer reads nothing is held with its messages unread, so that the
    peer's window closes, and goes on when the window opens."""

    def __init__(self, owner: ExtProcServer, stream: anyio.abc.ByteStream) -> None:
        self.owner = owner
        self.stream = stream
        self.wire = GrpcServer(max_message_bytes=MAX_MESSAGE_BYTES,
                               max_calls=owner.server.config.max_connections + 1)  # past the cap: told, not held
        self.calls: dict[int, _Call] = {}
        self.deadlines: deque[tuple[float, _Call]] = deque()  # in start order, so in deadline order
        self.blocked: set[_Call] = set()  # replies waiting for the peer's window
        self.outbox = bytearray()
        self.writing = False
        self.group: anyio.abc.TaskGroup | None = None
        self.opened = self.last_heard = owner.server.clock()
        self.authenticated = owner.server.config.auth_token is None  # a call has carried the token

    async def flush(self) -> None:
        """Write what the wire has to say. One writer at a time, without a lock (its cost was a
        tenth of a call): a caller that finds another writing leaves its bytes to that one, which
        sends them, in order, before it stops."""
        self.outbox += self.wire.data_to_send()
        if self.writing:
            return
        self.writing = True
        try:
            while self.outbox:
                data = bytes(self.outbox)
                self.outbox.clear()
                await self.stream.send(data)
        finally:
            self.writing = False

    async def serve(self) -> None:
        server = self.owner.server
        try:
            async with anyio.create_task_group() as group:
                self.group = group
                try:
                    await self.flush()  # our SETTINGS
                    while not self.wire.closed:
                        data = await self._receive()
                        if data is None:
                            continue  # a deadline passed: `_receive` answered it
                        if not data:
                            break
                        self.last_heard = server.clock()
                        for event in self.wire.receive(data):
                            self._dispatch(event)
                        await self.flush()
                        await server.pump()
                except _GONE:
                    pass
                finally:
                    group.cancel_scope.cancel()  # the connection is gone: so are its calls
        finally:
            for call in list(self.calls.values()):
                self._end(call, None)
            await server.pump()  # what their ends freed may start queued selections

    def _closing_time(self) -> tuple[float, str | None]:
        """When this connection is closed unless the peer does something first, and the limit
        that closes it (None: it idled). A peer must send its preface and SETTINGS, and, with
        `--auth-token-file`, start a call carrying the token, within `--keep-alive-timeout-secs` of
        connecting; a connection with no call open closes after as long without a byte
        (docs/GATEWAY.md, "Transport"): a slot is never held by a peer that only connected, and one
        whose last call ended closes within twice that."""
        timeout = self.owner.server.config.keep_alive_timeout_secs
        if not self.wire.started:
            return self.opened + timeout, "ext_proc_handshake"
        if not self.authenticated:
            return self.opened + timeout, "ext_proc_unauthenticated"
        if self.calls or self.wire.calls:  # looked at again then: a call may end in a task of its own
            return self.owner.server.clock() + timeout, None
        return self.last_heard + timeout, None

    async def _receive(self) -> bytes | None:
        """The peer's next bytes (b"" once it has gone, or once this side closes the connection);
        None when a body's deadline passed first."""
        clock = self.owner.server.clock
        while self.deadlines and not self.deadlines[0][1].handler.may_await_body:
            self.deadlines.popleft()
        closing, limit = self._closing_time()
        body_deadline = self.deadlines[0][0] if self.deadlines else float("inf")
        timeout = min(closing, body_deadline) - clock()
        if isinstance(self.stream, LoopStream):
            if (data := await self.stream.receive_within(timeout)) is not None:
                return data
        else:
            with anyio.move_on_after(timeout):
                return await self.stream.receive()
        now = clock()
        closing, limit = self._closing_time()  # (what the deadline's wait spanned may have moved it)
        if now >= closing:
            if limit is not None:
                self.owner.server.service.observe(LIMIT_REJECTIONS, (limit,), 1.0)
            self.wire.go_away()  # no call is lost: those under way (an unauthenticated one's) end with it
            await self.flush()
            return b""
        while self.deadlines and self.deadlines[0][0] <= now:
            call = self.deadlines.popleft()[1]
            if call.handler.awaiting_body:  # one whose headers come later is checked then (`_advance`)
                call.handler.expire()
                self._advance(call)
        await self.flush()
        await self.owner.server.pump()
        return None

    def _dispatch(self, event: CallStarted | Message | CallEnded | CallReset | WindowOpened) -> None:
        if isinstance(event, WindowOpened):  # only then can a call held back by its replies go on
            for held in [c for c in self.blocked if event.stream_id in (0, c.stream_id)]:
                self._advance(held)
            return
        if isinstance(event, CallStarted):
            owner = self.owner
            token = owner.server.config.auth_token
            if not self.authenticated and token is not None and bearer_matches(event.metadata, token):
                self.authenticated = True
            handler: Handler
            if event.path == PROCESS_PATH:
                handler = ProcessHandler(owner.picker, event.metadata)
            elif event.path == CHECK_PATH:
                handler = HealthHandler(owner.serving)
            else:
                self.wire.finish(event.stream_id, Status.UNIMPLEMENTED, f"unknown method {event.path}")
                return
            started = self.calls[event.stream_id] = _Call(event.stream_id, handler)
            if handler.may_await_body:
                self.deadlines.append((handler.deadline, started))
            self._advance(started)
            return
        call = self.calls.get(event.stream_id)
        if call is None:
            return
        if isinstance(event, Message):
            call.inbox.append(event)
        elif isinstance(event, CallEnded):
            call.ended = True
        else:
            self._end(call, None)
            return
        self._advance(call)

    def _advance(self, call: _Call) -> None:
        """Run the call's unread messages through its handler until it must wait or ends."""
        wire, handler = self.wire, call.handler
        try:
            while call.task is None and not call.stale:
                for reply in handler.replies():
                    wire.send_message(call.stream_id, reply)
                if wire.pending(call.stream_id):
                    self.blocked.add(call)  # its messages stay unread: the peer's window closes
                    return
                self.blocked.discard(call)
                handler.written()
                if handler.outcome is not None:
                    self._end(call, handler.outcome)
                    return
                if not call.inbox:
                    if call.ended:
                        handler.ended()
                        continue
                    if handler.awaiting_body and self.owner.server.clock() >= handler.deadline:
                        handler.expire()  # its headers came after its time
                        continue
                    return
                message = call.inbox.popleft()
                wire.consumed(message)
                wait = handler.message(message.payload)
                if wait is not None:
                    call.task = anyio.CancelScope()
                    assert self.group is not None
                    self.group.start_soon(self._wait, call, wait)
        except Exception:  # noqa: BLE001 - confined to this call
            self.owner.server.service.internal_error("ext_proc")
            self._end(call, (Status.INTERNAL, "internal error"))

    async def _wait(self, call: _Call, wait: Callable[[], Awaitable[None]]) -> None:
        assert call.task is not None
        with call.task:  # cancelled by `_end`: the peer reset the call
            try:
                await wait()
            except Exception:  # noqa: BLE001 - confined to this call
                self.owner.server.service.internal_error("ext_proc")
                self._end(call, (Status.INTERNAL, "internal error"))
        call.task = None
        self._advance(call)
        try:
            await self.flush()
        except _GONE:
            pass  # the connection's reader sees it go
        await self.owner.server.pump()

    def _end(self, call: _Call, outcome: tuple[int, str] | None) -> None:
        """The call is over: its status sent (None: the peer reset it), its handler closed."""
        if call.stale:
            return
        call.stale = True
        del self.calls[call.stream_id]
        self.blocked.discard(call)
        if call.task is not None:
            call.task.cancel()
        if outcome is not None:
            self.wire.finish(call.stream_id, *outcome)
        call.handler.close()


class _Call:
    """One gRPC call: its handler, the messages it has not taken, and what it waits for."""

    __slots__ = ("stream_id", "handler", "inbox", "ended", "stale", "task")

    def __init__(self, stream_id: int, handler: Handler) -> None:
        self.stream_id, self.handler = stream_id, handler
        self.inbox: deque[Message] = deque()
        self.ended = False  # the peer sent its last message
        self.stale = False  # over: answered, or reset
        self.task: anyio.CancelScope | None = None  # set while it waits in a task of its own
