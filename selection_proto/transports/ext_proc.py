"""The endpoint picker's gRPC server: Envoy's `ExternalProcessor` service and gRPC health, on
grpc.aio in `serve`'s own asyncio event loop, so that it shares the HTTP API's service, queue and
ledger (docs/GATEWAY.md). Each stream is an `adapters.ext_proc.ExtProcStream`; this module only
moves its messages and waits for its queued selections."""

from __future__ import annotations

import hmac
import json
import math
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final, Protocol

import anyio
import anyio.abc

from ..core.metrics import LIMIT_REJECTIONS
from .logs import log

# `serve` forks children to write dumps and snapshots. gRPC's fork handlers, on by default, made
# such a child abort (SIGABRT) when gRPC's threads were busy at the fork; the children never use
# gRPC, so its handlers are turned off, before gRPC is first imported (importing this module).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

if TYPE_CHECKING:
    from ..adapters.inflight import InFlight
    from ..adapters.openai import ChatTokenizer
    from ..core.service import SelectionService
    from ..core.wire import Response
    from .config import ExtProcOptions, ServerConfig

__all__ = ["SERVICE_NAME", "ExtProcServer", "Host", "load_tokenizers"]

SERVICE_NAME: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_NAMES: Final = ("", SERVICE_NAME, "liveness", "readiness")
MAX_MESSAGE_BYTES: Final = 16 << 20  # a chunk is at most Envoy's buffer; room for a whole 8 MiB body
STOP_GRACE_SECS: Final = 5.0
INLINE_BODY_BYTES: Final = 64 * 1024  # ~10k token ids, or 64 KB of text: a few ms at most


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
    its start, with one line), serving until `run` is cancelled."""

    def __init__(self, server: Host, options: ExtProcOptions) -> None:
        self.server, self.options = server, options
        self.picker = _Picker(server, options.tokenizers)

    async def start(self) -> None:
        import grpc
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as rpc
        from grpc_health.v1 import health, health_pb2_grpc

        options = self.options
        self.grpc = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                             ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                             # each a descriptor, as HTTP's: the same cap
                                             ("grpc.max_allowed_incoming_connections",
                                              self.server.config.max_connections),
                                             # a peer that never says a word frees its slot in time
                                             ("grpc.server_handshake_timeout_ms",
                                              int(1000 * self.server.config.request_timeout_secs)),
                                             # shared by the processes of --processes; else a
                                             # port in use must fail the start
                                             ("grpc.so_reuseport", 1 if self.server.config.reuse_port else 0)])
        rpc.add_ExternalProcessorServicer_to_server(self.picker, self.grpc)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        host = f"[{options.host}]" if ":" in options.host else options.host
        try:
            address = f"{host}:{options.port}"
            if options.tls_cert and options.tls_key:
                with open(options.tls_key, "rb") as key, open(options.tls_cert, "rb") as chain:
                    credentials = grpc.ssl_server_credentials([(key.read(), chain.read())])
                port = self.grpc.add_secure_port(address, credentials)
            else:
                port = self.grpc.add_insecure_port(address)
        except (RuntimeError, OSError) as exc:
            raise RuntimeError(f"cannot listen on {options.host}:{options.port} for ext_proc: {exc}") from exc
        await self.grpc.start()
        await self._serving(True)
        scheme = "grpcs" if options.tls_cert and options.tls_key else "grpc"
        log("info", "ext_proc_listening", url=f"{scheme}://{host}:{port}", tokenizers=sorted(options.tokenizers))

    async def _serving(self, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in HEALTH_NAMES:
            await self.health.set(name, status)

    async def run(self, tg: anyio.abc.TaskGroup) -> None:
        """Serve until cancelled, then stop within STOP_GRACE_SECS."""
        self.picker.tg = tg
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await self._serving(False)
                await self.grpc.stop(STOP_GRACE_SECS)


class _Picker:
    """The `ExternalProcessor` servicer: one `ExtProcStream` per gRPC stream."""

    def __init__(self, server: Host, tokenizers: Mapping[str, ChatTokenizer]) -> None:
        self.server = server
        self.tokenizers = tokenizers
        self.tg: anyio.abc.TaskGroup | None = None  # serve's, once running
        self.streams = 0  # open now: at most `--max-connections`, as HTTP connections are

    async def Process(self, request_iterator: Any, context: Any) -> None:  # noqa: N802 - gRPC's name
        import grpc

        from ..adapters.ext_proc import ExtProcStream, prepare_body
        from ..core.routes import ParsedBody

        server = self.server
        token = server.config.auth_token
        if token is not None and not _bearer_matches(context.invocation_metadata(), token):
            # --auth-token-file guards the picker as it guards the HTTP API: Envoy sends the token
            # as gRPC metadata (`initial_metadata` of the ext_proc filter's grpc_service).
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        if self.streams >= server.config.max_connections:
            server.service.observe(LIMIT_REJECTIONS, ("ext_proc_streams",), 1.0)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many streams: at most {server.config.max_connections} (--max-connections)")
        self.streams += 1
        stream = ExtProcStream(server.service, self.tokenizers, in_flight=server.in_flight, defer_parse=True)
        timeout = server.config.request_timeout_secs
        deadline = server.clock() + timeout
        try:
            while True:
                # A body that never completes would hold its bytes of the shared budget for ever:
                # it has `--request-timeout-secs` from the stream's start, as an HTTP request has.
                message = None
                with anyio.move_on_after(deadline - server.clock() if stream.awaiting_body else math.inf):
                    message = await context.read()
                if message is None:
                    stream.expire(timeout)
                    for reply in stream.replies():
                        await context.write(reply)
                    return
                if message is grpc.aio.EOF:
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
                    await context.write(reply)  # waits while the peer reads nothing
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


def _bearer_matches(metadata: Any, token: bytes) -> bool:
    """The call's `authorization` metadata is `Bearer <token>` (compared in constant time)."""
    expected = b"Bearer " + token
    for key, value in metadata or ():
        if key == "authorization":
            given = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else bytes(value)
            return hmac.compare_digest(given, expected)
    return False
