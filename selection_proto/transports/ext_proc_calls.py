"""What each gRPC call of the endpoint picker does with its messages, without I/O of its own
(transports/ext_proc.py moves the bytes): `Process`, one request through the gateway as an
`adapters.ext_proc.ExtProcStream`, and gRPC health; the picker's shared state; and what they
need of the HTTP server they run beside."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Final, Protocol

import anyio

from ..adapters.grpc import Status
from ..core.base.metrics import LIMIT_REJECTIONS

if TYPE_CHECKING:
    from ..adapters.ext_proc import ExtProcStream
    from ..adapters.inflight import InFlight
    from ..adapters.openai import ChatTokenizer
    from ..core.base.wire import Response
    from ..core.service import SelectionService
    from .config import ServerConfig

__all__ = ["CHECK_PATH", "HEALTH_NAMES", "INLINE_BODY_BYTES", "PROCESS_PATH", "SERVICE_NAME", "Handler", "HealthHandler",
           "Host", "Picker", "ProcessHandler", "bearer_matches"]

SERVICE_NAME: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS_PATH: Final = f"/{SERVICE_NAME}/Process"
CHECK_PATH: Final = "/grpc.health.v1.Health/Check"
HEALTH_NAMES: Final = ("", SERVICE_NAME, "liveness", "readiness")
INLINE_BODY_BYTES: Final = 64 * 1024  # ~10k token ids, or 64 KB of text: a few ms at most


class Host(Protocol):
    """What the picker needs of the HTTP server it runs beside (server.py): the service, its
    settings and clock, the shared byte and connection budgets, and where queued answers are
    delivered."""

    service: SelectionService
    config: ServerConfig
    clock: Callable[[], float]
    in_flight: InFlight
    resolvers: dict[int, Callable[[Response], None]]
    connection_budget: float  # connections the descriptor limit leaves room for, HTTP's and the picker's

    def connections_open(self) -> int: ...

    async def pump(self, wake_timer: bool = True) -> None: ...


class Handler:
    """What a call does with its messages, without I/O: `message` takes one (returning a
    coroutine function when it must wait for something first), `replies` says what to send,
    `outcome` how the call ends once they are sent."""

    outcome: tuple[int, str] | None = None
    deadline = float("inf")
    awaiting_body = False  # its request's headers came and its body is not whole: `deadline` applies
    may_await_body = False  # ... or it may still come to that

    def message(self, payload: bytes) -> Callable[[], Awaitable[None]] | None:
        raise NotImplementedError

    def replies(self) -> list[bytes]:
        return []

    def written(self) -> None:
        """The replies taken so far are sent (or queued in the wire's window)."""

    def ended(self) -> None:
        """The peer has sent its last message."""
        self.outcome = (Status.OK, "")

    def expire(self) -> None:
        """Its deadline passed while it waited for a body."""

    def close(self) -> None:
        """The call is over, however it ended."""


class HealthHandler(Handler):
    """`grpc.health.v1.Health/Check`: SERVING until the server drains."""

    def __init__(self, serving: bool) -> None:
        self.serving = serving
        self.answer: list[bytes] = []

    def message(self, payload: bytes) -> None:
        from google.protobuf.message import DecodeError
        from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

        try:
            name = HealthCheckRequest.FromString(payload).service
        except DecodeError:
            self.outcome = (Status.INVALID_ARGUMENT, "not a HealthCheckRequest")
            return None
        if name not in HEALTH_NAMES:
            self.outcome = (Status.NOT_FOUND, f"unknown service {name!r}")
            return None
        status = HealthCheckResponse.SERVING if self.serving else HealthCheckResponse.NOT_SERVING
        self.answer = [HealthCheckResponse(status=status).SerializeToString()]
        self.outcome = (Status.OK, "")
        return None

    def replies(self) -> list[bytes]:
        answer, self.answer = self.answer, []
        return answer

    def ended(self) -> None:
        if self.outcome is None:
            self.message(b"")  # no request message: the default service


class ProcessHandler(Handler):
    """`ExternalProcessor/Process`: one request through the gateway, an `ExtProcStream`."""

    def __init__(self, picker: Picker, metadata: Mapping[str, bytes]) -> None:
        self.picker = picker
        server = picker.server
        self.stream: ExtProcStream | None = None
        self.deadline = server.clock() + server.config.request_timeout_secs
        token = server.config.auth_token
        if token is not None and not bearer_matches(metadata, token):
            # --auth-token-file guards the picker as it guards the HTTP API: Envoy sends the token
            # as gRPC metadata (`initial_metadata` of the ext_proc filter's grpc_service).
            self.outcome = (Status.UNAUTHENTICATED, "missing or wrong bearer token")
        elif picker.streams >= server.config.max_connections:
            server.service.observe(LIMIT_REJECTIONS, ("ext_proc_streams",), 1.0)
            self.outcome = (Status.RESOURCE_EXHAUSTED,
                            f"too many streams: at most {server.config.max_connections} (--max-connections)")
        else:
            picker.streams += 1
            self.stream = picker.stream_type(server.service, picker.tokenizers, in_flight=server.in_flight,
                                        defer_parse=True)

    @property
    def awaiting_body(self) -> bool:  # type: ignore[override]
        # A body that never completes would hold its bytes of the shared budget for ever: it has
        # `--request-timeout-secs` from the stream's start, as an HTTP request has.
        return self.stream is not None and self.stream.awaiting_body

    @property
    def may_await_body(self) -> bool:  # type: ignore[override]
        return self.stream is not None and not self.stream.past_body

    def message(self, payload: bytes) -> Callable[[], Awaitable[None]] | None:
        picker, stream = self.picker, self.stream
        server = picker.server
        assert stream is not None
        try:
            message = picker.read_request(payload)
        except picker.decode_error:
            self.outcome = (Status.INVALID_ARGUMENT, "not a ProcessingRequest")
            return None
        now = server.clock()
        stream.receive(message, now)
        if stream.body_ready:
            body = stream.take_body()
            if len(body) > INLINE_BODY_BYTES:
                return partial(self._prepare_off_loop, body)
            # A small body is parsed, tokenized and hashed here (a thread's round trip is most of
            # its cost); a large one off the loop, as HTTP's are.
            stream.route_prepared(picker.prepare_body(body, picker.tokenizers, server.service.pools), now)
        return self._wait if stream.pending_ticket is not None else None

    async def _prepare_off_loop(self, body: bytes) -> None:
        from ..core.base.routes import ParsedBody

        picker, stream = self.picker, self.stream
        server = picker.server
        assert stream is not None
        prepared = await anyio.to_thread.run_sync(picker.prepare_body, body, picker.tokenizers, server.service.pools)
        stream.route_prepared(prepared, server.clock())
        if isinstance(prepared, ParsedBody):
            await anyio.to_thread.run_sync(prepared.release)
        if stream.pending_ticket is not None:
            await self._wait()

    async def _wait(self) -> None:
        """Until the queued selection is answered (`_Server._deliver` calls the resolver)."""
        server, stream = self.picker.server, self.stream
        assert stream is not None and stream.pending_ticket is not None
        answered = anyio.Event()

        def resolve(response: Response) -> None:
            stream.resolve(response, server.clock())
            answered.set()

        server.resolvers[stream.pending_ticket] = resolve
        await server.pump()
        await answered.wait()

    def replies(self) -> list[bytes]:
        stream = self.stream
        return [] if stream is None else [reply.SerializeToString() for reply in stream.replies()]

    def written(self) -> None:
        if self.stream is not None:
            self.stream.replies_written()
            if self.stream.finished and self.outcome is None:
                self.outcome = (Status.OK, "")

    def expire(self) -> None:
        if self.stream is not None and self.stream.awaiting_body:
            self.stream.expire(self.picker.server.config.request_timeout_secs)

    def close(self) -> None:
        stream, server = self.stream, self.picker.server
        if stream is None:
            return
        self.stream = None
        self.picker.streams -= 1
        if stream.pending_ticket is not None:
            server.resolvers.pop(stream.pending_ticket, None)
        stream.close(server.clock())  # frees the booking if the response's end did not


class Picker:
    """The `ExternalProcessor` service's shared state: the tokenizers, the count of streams, and
    the `gateway` extra's parts (imported once: an import per message is a cost)."""

    def __init__(self, server: Host, tokenizers: Mapping[str, ChatTokenizer]) -> None:
        from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
        from google.protobuf.message import DecodeError

        from ..adapters.ext_proc import ExtProcStream, prepare_body

        self.read_request = ProcessingRequest.FromString
        self.decode_error = DecodeError
        self.stream_type, self.prepare_body = ExtProcStream, prepare_body
        self.server = server
        self.tokenizers = tokenizers
        self.streams = 0  # open now: at most `--max-connections`, as HTTP connections are


def bearer_matches(metadata: Mapping[str, bytes], token: bytes) -> bool:
    """The call's `authorization` metadata is `Bearer <token>` (compared in constant time)."""
    return hmac.compare_digest(metadata.get("authorization", b""), b"Bearer " + token)
