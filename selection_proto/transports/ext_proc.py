"""The endpoint picker's gRPC server: Envoy's `ExternalProcessor` service and gRPC health, over
HTTP/2 on anyio in `serve`'s own event loop (`adapters.grpc` frames the calls), so that it shares
the HTTP API's service, queue and ledger (docs/GATEWAY.md). Each `Process` call is an
`adapters.ext_proc.ExtProcStream`; this module only moves bytes and messages, and waits for queued
selections."""

from __future__ import annotations

import hmac
import json
import os
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Final, Protocol

import anyio
import anyio.abc
from anyio.streams.tls import TLSStream

from ..adapters.grpc import CallEnded, CallReset, CallStarted, GrpcServer, Message, Status
from ..core.metrics import LIMIT_REJECTIONS
from .logs import log

if TYPE_CHECKING:
    from ..adapters.inflight import InFlight
    from ..adapters.openai import ChatTokenizer
    from ..core.service import SelectionService
    from ..core.wire import Response
    from .config import ExtProcOptions, ServerConfig

__all__ = ["SERVICE_NAME", "ExtProcServer", "Host", "load_tokenizers"]

SERVICE_NAME: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS_PATH: Final = f"/{SERVICE_NAME}/Process"
CHECK_PATH: Final = "/grpc.health.v1.Health/Check"
HEALTH_NAMES: Final = ("", SERVICE_NAME, "liveness", "readiness")
MAX_MESSAGE_BYTES: Final = 16 << 20  # a chunk is at most Envoy's buffer; room for a whole 8 MiB body
INLINE_BODY_BYTES: Final = 64 * 1024  # ~10k token ids, or 64 KB of text: a few ms at most
_GONE: Final = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError, ssl.SSLError)


class Host(Protocol):
    """What the picker needs of the HTTP server it runs beside (server.py): the service, its
    settings and clock, the shared byte budget, and where queued answers are delivered."""

    service: SelectionService
    config: ServerConfig
    clock: Callable[[], float]
    in_flight: InFlight
    resolvers: dict[int, Callable[[Response], None]]

    async def pump(self, wake_timer: bool = True) -> None: ...


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
        self.picker = _Picker(server, options.tokenizers)
        self.connections: set[_Connection] = set()
        self.serving = True
        self.tls: ssl.SSLContext | None = None
        self.listener: anyio.abc.Listener[anyio.abc.SocketStream] | None = None

    async def start(self) -> None:
        options = self.options
        host = f"[{options.host}]" if ":" in options.host else options.host
        try:
            if options.tls_cert and options.tls_key:
                self.tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                self.tls.load_cert_chain(options.tls_cert, options.tls_key)
                self.tls.set_alpn_protocols(["h2"])
            # Shared by the processes of --processes; else a port in use must fail the start.
            self.listener = await anyio.create_tcp_listener(local_host=options.host, local_port=options.port,
                                                            reuse_port=self.server.config.reuse_port)
        except (OSError, ssl.SSLError) as exc:
            raise RuntimeError(f"cannot listen on {options.host}:{options.port} for ext_proc: "
                               f"{getattr(exc, 'strerror', None) or exc}") from exc
        port = self.listener.extra(anyio.abc.SocketAttribute.local_port)
        scheme = "grpcs" if self.tls is not None else "grpc"
        log("info", "ext_proc_listening", url=f"{scheme}://{host}:{port}", tokenizers=sorted(options.tokenizers))

    async def run(self, tg: anyio.abc.TaskGroup) -> None:
        """Accept and serve until cancelled."""
        self.picker.tg = tg
        assert self.listener is not None
        async with self.listener:
            await self.listener.serve(self._connection)

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

    async def _connection(self, stream: anyio.abc.ByteStream) -> None:
        config = self.server.config
        if len(self.connections) >= config.max_connections:
            self.server.service.observe(LIMIT_REJECTIONS, ("ext_proc_connections",), 1.0)
            await anyio.aclose_forcefully(stream)
            return
        conn = _Connection(self, stream)
        self.connections.add(conn)
        try:
            if self.tls is not None:
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

    async def health(self, call: _Call) -> None:
        from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

        payload = await call.read()
        from google.protobuf.message import DecodeError

        try:
            name = HealthCheckRequest.FromString(payload or b"").service
        except DecodeError:
            call.finish(Status.INVALID_ARGUMENT, "not a HealthCheckRequest")
            return
        if name not in HEALTH_NAMES:
            call.finish(Status.NOT_FOUND, f"unknown service {name!r}")
            return
        status = HealthCheckResponse.SERVING if self.serving else HealthCheckResponse.NOT_SERVING
        await call.write(HealthCheckResponse(status=status).SerializeToString())
        call.finish(Status.OK)


class _Connection:
    """One HTTP/2 connection: reads frames, starts a task per call, writes what the calls send."""

    def __init__(self, owner: ExtProcServer, stream: anyio.abc.ByteStream) -> None:
        self.owner = owner
        self.stream = stream
        self.wire = GrpcServer(max_message_bytes=MAX_MESSAGE_BYTES,
                               max_calls=owner.server.config.max_connections + 1)  # past the cap: told, not held
        self.calls: dict[int, _Call] = {}
        self.lock = anyio.Lock(fast_acquire=True)
        self.progress = anyio.Event()  # set when the peer sent something: a window may have opened

    async def flush(self) -> None:
        async with self.lock:
            data = self.wire.data_to_send()
            if data:
                await self.stream.send(data)

    async def serve(self) -> None:
        timeout = self.owner.server.config.request_timeout_secs
        async with anyio.create_task_group() as group:
            try:
                await self.flush()  # our SETTINGS
                while not self.wire.closed:
                    data = b""
                    if self.wire.started:  # a known peer may idle
                        data = await self.stream.receive()
                    else:  # one that never says a word frees its slot in time
                        with anyio.move_on_after(timeout):
                            data = await self.stream.receive()
                    if not data:
                        break
                    for event in self.wire.receive(data):
                        self._dispatch(event, group)
                    await self.flush()
                    self.progress.set()
                    self.progress = anyio.Event()
            except _GONE:
                pass
            finally:
                group.cancel_scope.cancel()  # the connection is gone: so are its calls

    def _dispatch(self, event: CallStarted | Message | CallEnded | CallReset, group: anyio.abc.TaskGroup) -> None:
        if isinstance(event, CallStarted):
            handler: Callable[[_Call], Awaitable[None]] | None = {
                PROCESS_PATH: self.owner.picker.process, CHECK_PATH: self.owner.health}.get(event.path)
            if handler is None:
                self.wire.finish(event.stream_id, Status.UNIMPLEMENTED, f"unknown method {event.path}")
                return
            self.calls[event.stream_id] = _Call(self, event.stream_id, event.metadata)
            group.start_soon(self._run, self.calls[event.stream_id], handler)
            return
        call = self.calls.get(event.stream_id)
        if call is None:
            return
        if isinstance(event, Message):
            call.inbox.append(event)
        elif isinstance(event, CallEnded):
            call.ended = True
        else:
            call.scope.cancel()
        call.arrived.set()

    async def _run(self, call: _Call, handler: Callable[[_Call], Awaitable[None]]) -> None:
        try:
            with call.scope:
                try:
                    await handler(call)
                    call.finish(Status.OK)
                except _GONE:
                    raise
                except Exception:  # noqa: BLE001 - confined to this call
                    self.owner.server.service.internal_error("ext_proc")
                    call.finish(Status.INTERNAL, "internal error")
            await self.flush()
        except _GONE:
            pass  # the connection's reader sees it go
        finally:
            self.calls.pop(call.stream_id, None)


class _Call:
    """One gRPC call as its handler sees it: messages in, messages out, a status at the end."""

    def __init__(self, conn: _Connection, stream_id: int, metadata: dict[str, bytes]) -> None:
        self.conn, self.stream_id, self.metadata = conn, stream_id, metadata
        self.inbox: list[Message] = []
        self.ended = False
        self.arrived = anyio.Event()
        self.scope = anyio.CancelScope()

    async def read(self) -> bytes | None:
        """The next message, or None once the peer has sent its last."""
        while not self.inbox:
            if self.ended:
                return None
            await self.arrived.wait()
            self.arrived = anyio.Event()
        message = self.inbox.pop(0)
        self.conn.wire.consumed(message)
        return message.payload

    async def write(self, payload: bytes) -> None:
        """Send one message; waits while the peer's window has no room for it."""
        wire = self.conn.wire
        wire.send_message(self.stream_id, payload)
        await self.conn.flush()
        while wire.pending(self.stream_id) and not wire.closed:
            await self.conn.progress.wait()
            await self.conn.flush()

    def finish(self, code: int, text: str = "") -> None:
        self.conn.wire.finish(self.stream_id, code, text)


class _Picker:
    """The `ExternalProcessor` service: one `ExtProcStream` per call."""

    def __init__(self, server: Host, tokenizers: Mapping[str, ChatTokenizer]) -> None:
        self.server = server
        self.tokenizers = tokenizers
        self.tg: anyio.abc.TaskGroup | None = None  # serve's, once running
        self.streams = 0  # open now: at most `--max-connections`, as HTTP connections are

    async def process(self, call: _Call) -> None:
        from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
        from google.protobuf.message import DecodeError

        from ..adapters.ext_proc import ExtProcStream, prepare_body
        from ..core.routes import ParsedBody

        server = self.server
        token = server.config.auth_token
        if token is not None and not _bearer_matches(call.metadata, token):
            # --auth-token-file guards the picker as it guards the HTTP API: Envoy sends the token
            # as gRPC metadata (`initial_metadata` of the ext_proc filter's grpc_service).
            call.finish(Status.UNAUTHENTICATED, "missing or wrong bearer token")
            return
        if self.streams >= server.config.max_connections:
            server.service.observe(LIMIT_REJECTIONS, ("ext_proc_streams",), 1.0)
            call.finish(Status.RESOURCE_EXHAUSTED,
                        f"too many streams: at most {server.config.max_connections} (--max-connections)")
            return
        self.streams += 1
        stream = ExtProcStream(server.service, self.tokenizers, in_flight=server.in_flight, defer_parse=True)
        timeout = server.config.request_timeout_secs
        deadline = server.clock() + timeout
        try:
            while True:
                # A body that never completes would hold its bytes of the shared budget for ever:
                # it has `--request-timeout-secs` from the stream's start, as an HTTP request has.
                payload, expired = None, True
                if not stream.awaiting_body:  # a cancel scope per message costs: only when needed
                    payload, expired = await call.read(), False
                else:
                    with anyio.move_on_after(deadline - server.clock()):
                        payload, expired = await call.read(), False
                if expired:
                    stream.expire(timeout)
                    for reply in stream.replies():
                        await call.write(reply.SerializeToString())
                    return
                if payload is None:
                    return
                try:
                    message = ProcessingRequest.FromString(payload)
                except DecodeError:
                    call.finish(Status.INVALID_ARGUMENT, "not a ProcessingRequest")
                    return
                try:
                    stream.receive(message, server.clock())
                    if stream.body_ready:
                        body = stream.take_body()
                        # A large body is parsed, tokenized and hashed off the loop, as HTTP's
                        # are; a small one here (a thread's round trip is most of its cost).
                        if len(body) <= INLINE_BODY_BYTES:
                            prepared = prepare_body(body, self.tokenizers, server.service.pools)
                            stream.route_prepared(prepared, server.clock())
                        else:
                            prepared = await anyio.to_thread.run_sync(
                                prepare_body, body, self.tokenizers, server.service.pools)
                            stream.route_prepared(prepared, server.clock())
                            if isinstance(prepared, ParsedBody):
                                await anyio.to_thread.run_sync(prepared.release)
                except Exception:  # noqa: BLE001 - confined to this stream: Envoy sees it end
                    server.service.internal_error("ext_proc")
                    return
                if stream.pending_ticket is not None:
                    await self._wait(stream)
                for reply in stream.replies():
                    await call.write(reply.SerializeToString())  # waits while the peer reads nothing
                stream.replies_written()
                await server.pump()
                if stream.finished:
                    return
        finally:
            self.streams -= 1
            if stream.pending_ticket is not None:
                server.resolvers.pop(stream.pending_ticket, None)
            stream.close(server.clock())  # frees the booking if the response's end did not
            if self.tg is not None:
                self.tg.start_soon(server.pump)  # not awaited: this task may be cancelled

    async def _wait(self, stream: Any) -> None:
        """Until the queued selection is answered (`_Server._deliver` calls the resolver)."""
        answered = anyio.Event()
        ticket = stream.pending_ticket

        def resolve(response: Any) -> None:
            stream.resolve(response, self.server.clock())
            answered.set()

        self.server.resolvers[ticket] = resolve
        await self.server.pump()
        await answered.wait()


def _bearer_matches(metadata: Mapping[str, bytes], token: bytes) -> bool:
    """The call's `authorization` metadata is `Bearer <token>` (compared in constant time)."""
    return hmac.compare_digest(metadata.get("authorization", b""), b"Bearer " + token)
