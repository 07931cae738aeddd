"""The TCP server: anyio (asyncio or trio) around one `HttpConnection` per client (transports.md §2, §9)."""

from __future__ import annotations

import os
import signal
import ssl
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import attrs
from anyio.streams.tls import TLSStream

from .._version import __version__
from ..adapters.http import HttpConnection
from ..adapters.inflight import InFlight
from ..adapters.ws import PushSession
from ..core.ahead import prepare_ahead
from ..core.base.metrics import CONNECTIONS, INTERNAL_ERRORS, LIMIT_REJECTIONS
from ..core.base.outputs import CloseEventStream, InternalError, Notice, OutputEvent, SelectionReady
from ..core.base.routes import media_type
from ..core.base.wire import Response, error_response
from ..core.service import SelectionService
from .accepting import accept_forever, connection_budget
from .config import LedgerOptions, ServerConfig, advertised_url
from .ledger import LedgerLink, SettingsRefused
from .logs import log, log_internal_error
from .peers import recover_from_peers
from .process import ProcessMetrics
from .pump import CHUNK, flush
from .push_streams import GONE, PushStreams
from .scrape import scrape_engines
from .snapshots import Snapshots, dump_in_child
from .status import StatusFeeds
from .subscriber import Subscriptions

if TYPE_CHECKING:
    from .ext_proc import ExtProcServer

__all__ = ["LedgerOptions", "ServerConfig", "serve"]

_GONE = GONE
MAX_PENDING_BUFFER = 65536  # read on while a request is queued (pipelined ones), then wait for it
# After answering a request whose body was not read (413, a refused upgrade...), read and
# discard for this long before closing, so that the client is not reset before it reads it.
LINGER_SECS = 2.0
SEND_CHUNK = 1 << 20


GIL_SWITCH_INTERVAL_SECS = 0.001


def _access_log(method: str, path: str, status: int, seconds: float) -> None:
    log("info", "access", method=method, path=path, status=status, ms=round(seconds * 1000, 3))


class _Server(PushStreams):
    def __init__(self, service: SelectionService, config: ServerConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.service = service
        self.config = config
        self.clock = clock
        self.connections: set[HttpConnection] = set()
        self.draining = False
        self.idle = anyio.Event()
        self.waits: dict[HttpConnection, anyio.CancelScope] = {}  # idle receives, cut by shutdown
        self.waiting: dict[int, tuple[HttpConnection, anyio.abc.ByteStream, anyio.Lock]] = {}
        self.resolvers: dict[int, Callable[[Response], None]] = {}  # other queued selections' takers
        self.woken: set[HttpConnection] = set()  # readers cancelled by `pump`, not by a deadline
        self.wake = anyio.Event()
        self.timer_target = float("inf")
        self.settling: anyio.Event | None = None  # set when the task running deferred work is done
        self.snapshots = Snapshots(service, config.snapshot, config.snapshot_interval_secs) \
            if config.snapshot is not None else None
        self.ws_sessions: dict[int, tuple[PushSession, anyio.abc.ByteStream, anyio.Lock]] = {}
        self.handshakes = 0  # TLS handshakes under way (they count against max_connections)
        self.ws_count = 0
        self.subscriptions: Subscriptions | None = None
        self.ledger_link: LedgerLink | None = None
        self.in_flight = InFlight(config.max_buffer_bytes)
        self.status_feeds = StatusFeeds(service, clock)
        self.ext_proc: ExtProcServer | None = None
        # The descriptors left for connections once subscriptions have theirs (cli fits
        # `max_subscriptions` to the limit): HTTP and the picker share them.
        self.connection_budget = connection_budget(
            service.settings.max_subscriptions if service.settings.kv_events == "subscribe" else 0)

    def _report_connections(self) -> None:
        self.service.observe(CONNECTIONS, ("http",), float(len(self.connections)))

    async def client(self, stream: anyio.abc.ByteStream) -> None:
        if self.config.tls is not None:
            if len(self.connections) + self.ws_count + self.handshakes >= self.config.max_connections \
                    or self.connections_open() >= self.connection_budget:
                self.service.observe(LIMIT_REJECTIONS, ("connections",), 1.0)
                await anyio.aclose_forcefully(stream)  # no plain-text answer on a TLS port
                return
            self.handshakes += 1
            try:  # a peer that never completes its TLS handshake is dropped like a silent one
                with anyio.fail_after(self.config.request_timeout_secs):
                    stream = await TLSStream.wrap(stream, server_side=True, ssl_context=self.config.tls,
                                                  standard_compatible=False)
            except (TimeoutError, ssl.SSLError, anyio.EndOfStream, *_GONE):
                self.service.observe(LIMIT_REJECTIONS, ("tls_handshake",), 1.0)
                await anyio.aclose_forcefully(stream)
                return
            finally:
                self.handshakes -= 1
        async with stream:
            open_now = len(self.connections) + self.ws_count
            if open_now >= self.config.max_connections or self.draining \
                    or self.connections_open() >= self.connection_budget:
                self.service.observe(LIMIT_REJECTIONS, ("connections",), 1.0)
                response = error_response(503, "too many connections", (("connection", "close"),))
                head = b"HTTP/1.1 503 Service Unavailable\r\n" + b"".join(
                    f"{n}: {v}\r\n".encode("latin-1") for n, v in response.headers)
                try:
                    await stream.send(head + b"\r\n" + response.body)
                except _GONE:
                    pass
                return
            conn = HttpConnection(self.service, self.clock, defer_large=True, auth_token=self.config.auth_token,
                                  access=_access_log if self.config.access_log else None, in_flight=self.in_flight,
                                  feeds=True)
            lock = anyio.Lock(fast_acquire=True)
            self.connections.add(conn)
            self._report_connections()
            try:
                await self._serve(stream, conn, lock)
            except _GONE:
                pass
            except Exception:  # noqa: BLE001 - one connection's failure is confined to it
                self.service.internal_error("http")
                await self._last_words(stream, conn, lock)
            finally:
                if conn.pending_ticket is not None:
                    # The client went away while its selection was queued.
                    self.waiting.pop(conn.pending_ticket, None)
                    self.service.cancel(conn.pending_ticket, now=self.clock())
                conn.release()
                self.waits.pop(conn, None)
                self.woken.discard(conn)
                self.connections.discard(conn)
                self._report_connections()
                if self.draining and not self.connections:
                    self.idle.set()
                with anyio.move_on_after(1.0, shield=True):  # log what this connection queued
                    await self.pump()

    async def _last_words(self, stream: anyio.abc.ByteStream, conn: HttpConnection,
                          lock: anyio.Lock) -> None:
        """A 500 when the connection can still answer, then the close."""
        try:
            conn.internal_error()
            with anyio.move_on_after(1.0):
                await flush(stream.send, conn, lock)
        except Exception:  # noqa: BLE001, S110 - nothing more can be said on this connection
            pass

    async def accept_loop(self, listener: anyio.abc.SocketListener,
                          tg: anyio.abc.TaskGroup) -> None:
        """Accept until cancelled, backing off while descriptors or buffers run out
        (`accepting.accept_forever`); each failure is counted with the internal errors."""
        def failed(exc: OSError) -> None:
            self.service.observe(INTERNAL_ERRORS, ("accept",), 1.0)

        def accepted(stream: anyio.abc.SocketStream) -> None:
            tg.start_soon(self.client, stream)

        await accept_forever(listener.accept, accepted, failed, "http")

    def connections_open(self) -> int:
        """HTTP's (WebSockets, TLS handshakes) and the picker's: what `connection_budget` bounds."""
        return len(self.connections) + self.ws_count + self.handshakes + (self.ext_proc.admitted if self.ext_proc else 0)

    async def send(self, stream: anyio.abc.ByteStream, data: bytes) -> None:
        """A send that does not complete within request_timeout_secs aborts the connection."""
        with anyio.move_on_after(self.config.request_timeout_secs) as scope:
            if len(data) <= SEND_CHUNK:
                await stream.send(data)
            else:  # a 44 MB answer in 1 MiB pieces: the event loop runs between them
                for start in range(0, len(data), SEND_CHUNK):
                    await stream.send(data[start:start + SEND_CHUNK])
        if scope.cancelled_caught:
            await anyio.aclose_forcefully(stream)
            raise anyio.BrokenResourceError("send timed out")

    async def settle(self) -> None:
        """Run the deferred work a piece at a time, other clients served between pieces (a huge
        booking's are many); a request that comes meanwhile waits for the rest (deferred.py).
        One task runs the pieces and the others wait for it: two running them in turns would
        make a client wait two pieces where one is enough."""
        while self.service.deferred:
            if self.settling is not None:
                await self.settling.wait()
                continue
            self.settling = done = anyio.Event()
            try:
                while self.service.deferred:
                    self.service.deferred.run(limit=1)
                    if self.service.deferred:
                        await anyio.sleep(0)
            finally:
                self.settling = None
                done.set()

    async def pump(self, wake_timer: bool = True) -> None:
        """Deliver the core's outputs: answers of queued selections to their connections,
        subscription changes to the subscriber, closes to their WebSocket sessions, internal
        errors to the log. A failure delivering one output is confined to it. While the core has
        work deferred until answers were written (callers pump after writing), the timer runs it
        a piece at a time and then delivers: reading outputs would run it at once (deferred.py),
        and the caller goes on with its connection meanwhile (a huge booking's pieces take
        seconds)."""
        if self.service.deferred:
            self.wake.set()
            return
        while (out := self.service.next_output()) is not None:
            try:
                await self._deliver(out)
            except Exception:  # noqa: BLE001
                self.service.internal_error("pump")
        if self.ledger_link is not None:
            self.ledger_link.poke()
        if wake_timer:
            deadline = self.service.next_deadline()
            if deadline is not None and deadline < self.timer_target:
                self.wake.set()  # something is due before the timer would look again

    async def _deliver(self, out: OutputEvent) -> None:
        if isinstance(out, Notice):
            log(out.level, out.event, **dict(out.fields))
        elif isinstance(out, InternalError):
            log_internal_error(out.where, out.detail)
        elif isinstance(out, SelectionReady):
            waiter = self.waiting.pop(out.ticket, None)
            if waiter is None:
                if (resolver := self.resolvers.pop(out.ticket, None)) is not None:
                    resolver(out.response)  # an ext_proc stream's (transports/ext_proc.py)
                return
            conn, stream, lock = waiter
            conn.resolve(out.response)
            try:
                await flush(partial(self.send, stream), conn, lock)
            except _GONE:
                conn.closed = True
            if conn.pending_ticket is not None:
                self.waiting[conn.pending_ticket] = (conn, stream, lock)
            # Wake the connection's reader: it may have stopped reading while it waited.
            scope = self.waits.pop(conn, None)
            if scope is not None:
                self.woken.add(conn)
                scope.cancel()
        elif self.subscriptions is not None and self.subscriptions.route(out):
            pass
        elif isinstance(out, CloseEventStream):
            entry = self.ws_sessions.pop(out.stream, None)
            if entry is not None:
                session, stream, lock = entry
                session.stream = None  # the core already forgot it
                session.close(out.code, out.reason)
                try:
                    await flush(partial(self.send, stream), session, lock)
                    await stream.aclose()
                except _GONE:
                    pass

    async def timer(self) -> None:
        """Tick the core at its next deadline (booking expiry, queue timeout), and run the work
        it deferred as soon as there is some (`pump` wakes it); report the process's own
        figures about once a second."""
        process = ProcessMetrics(self.service)
        reported = -1.0
        while True:
            if self.clock() - reported >= 1.0:
                process.report()
                supervisor = self.config.supervisor_pid
                if supervisor is not None and os.getppid() != supervisor:
                    log("warning", "supervisor_gone", pid=supervisor)
                    os.kill(os.getpid(), signal.SIGTERM)  # the graceful path, as an operator's signal
                    self.config.supervisor_pid = None
                if self.snapshots is not None:
                    self.snapshots.tick()
                reported = self.clock()
            await self.settle()
            deadline = self.service.next_deadline()
            delay = 1.0 if deadline is None else min(1.0, max(0.0, deadline - self.clock()))
            self.timer_target = self.clock() + delay
            with anyio.move_on_after(delay):
                await self.wake.wait()
            self.wake = anyio.Event()
            await self.settle()
            try:
                self.service.tick(self.clock())
            except Exception:  # noqa: BLE001 - the timer keeps running; a second look waits 1 s
                self.service.internal_error("timer")
                await anyio.sleep(1.0)
            await self.pump(wake_timer=False)

    async def _serve(self, stream: anyio.abc.ByteStream, conn: HttpConnection,
                     lock: anyio.Lock) -> None:
        request_started: float | None = None
        while not conn.closed:
            if conn.pending_ticket is not None:
                timeout = float("inf")  # the queue's own timeout bounds the wait
            elif conn.busy:
                # One deadline per request: a client trickling bytes cannot extend it.
                if request_started is None:
                    request_started = self.clock()
                timeout = max(0.0, request_started + self.config.request_timeout_secs - self.clock())
            else:
                request_started = None
                timeout = self.config.keep_alive_timeout_secs
            data = None
            with anyio.move_on_after(timeout) as scope:
                self.waits[conn] = scope
                if conn.pending_ticket is not None and conn.buffered_bytes >= MAX_PENDING_BUFFER:
                    await anyio.sleep_forever()  # until `pump` delivers the answer
                try:
                    data = await stream.receive(CHUNK)
                except anyio.EndOfStream:
                    data = b""
            self.waits.pop(conn, None)
            if data is not None:
                self.woken.discard(conn)
            else:
                if conn.closed:
                    break
                if conn in self.woken:  # the queued answer went out: look again
                    self.woken.discard(conn)
                    continue
                if conn.busy:
                    conn.timeout_response()
                    await flush(partial(self.send, stream), conn)
                break
            if not data and conn.pending_ticket is not None:
                return  # the client left while its selection waited: `client` cancels the ticket
            conn.receive_data(data)
            while True:
                # One answer at a time: pipelined requests are read only as answers go out.
                await flush(partial(self.send, stream), conn, lock)
                if conn.large_request is None:
                    break
                # A dump is written by a child; megabytes of JSON parsed (and freed) in a thread.
                await self.settle()
                if (large := conn.large_request).path == "/dump":
                    conn.answer_with(await dump_in_child(self.service, large, self.clock))
                    continue
                if not large.parse:
                    conn.complete_large(None)
                    continue
                parsed = await anyio.to_thread.run_sync(
                    prepare_ahead, self.service.pools, large.path, large.body, media_type(large.headers))
                await self.settle()  # pieces deferred by requests answered while it was parsed
                conn.complete_large(parsed)
                if parsed is not None:
                    await anyio.to_thread.run_sync(parsed.release)
            if conn.feed_requested:
                await self.status_feeds.serve(conn, stream, partial(self.send, stream), lambda: self.draining)
                return
            if conn.pending_ticket is not None:
                self.waiting[conn.pending_ticket] = (conn, stream, lock)
            if conn.upgrade is not None:
                await self.push_stream(stream, conn, lock)
                return
            await self.pump()
            if self.draining and not conn.busy:
                return
        if conn.linger:
            await self._linger(stream)

    async def _linger(self, stream: anyio.abc.ByteStream) -> None:
        """Half-close, then read and drop what the client still sends (bounded in time), so
        that closing with unread bytes does not reset the connection before the answer is read."""
        try:
            await stream.send_eof()
            with anyio.move_on_after(LINGER_SECS):
                while True:
                    await stream.receive(CHUNK)
        except (anyio.EndOfStream, *_GONE):
            pass


LEDGER_START_WAIT_SECS = 10.0  # how long connections wait at start for the ledger to be joined


async def serve(service: SelectionService, config: ServerConfig,
                ready: Callable[[str, int], None] | None = None) -> None:
    """Listen until SIGTERM or SIGINT, then drain (transports.md §9)."""
    server = _Server(service, config)
    # Large bodies are decoded in worker threads; a thread in C code keeps the GIL for up to the
    # switch interval (5 ms by default) each time the loop wants it back, several times per answer.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_SECS)
    try:
        listener = await anyio.create_tcp_listener(local_host=config.host, local_port=config.port,
                                                   reuse_port=config.reuse_port)
    except OSError as exc:
        raise RuntimeError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from exc
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    host = f"[{config.host}]" if ":" in config.host else config.host  # an IPv6 address
    scheme = "https" if config.tls is not None else "http"
    log("info", "listening", url=f"{scheme}://{host}:{port}", version=__version__,
        settings=attrs.asdict(service.settings))
    ext_proc: ExtProcServer | None = None
    if config.ext_proc is not None:
        # The picker's HTTP/2 and protobuf come with the `gateway` extra: a bare install serves
        # the HTTP API without importing them (config.py refuses --ext-proc-port without it).
        from .ext_proc import ExtProcServer

        ext_proc = server.ext_proc = ExtProcServer(server, config.ext_proc)
        await ext_proc.start()  # a port in use ends serve here, as the HTTP port's does above
    if ready is not None:
        ready(config.host, port)
    async with anyio.create_task_group() as tg:
        accept_scope = anyio.CancelScope()

        async def run_accept() -> None:
            if service.ledger is not None and config.reuse_port:
                # Taken once they can be served: with --processes a connection may reach any
                # process, and one whose ledger is not joined yet would answer catalog writes 503
                # while its siblings could serve them. Meanwhile connections wait in the backlog
                # (a single process answers at once: 503s and /ready say what is missing).
                with anyio.move_on_after(LEDGER_START_WAIT_SECS):
                    while not service.ledger.joined():
                        await anyio.sleep(0.02)
                if not service.ledger.joined():
                    log("warning", "ledger_not_ready", detail=f"serving after {LEDGER_START_WAIT_SECS:g} s "
                                                              "without the ledger")
            with accept_scope:
                async with listener, anyio.create_task_group() as accepting:
                    for one in listener.listeners:
                        assert isinstance(one, anyio.abc.SocketListener)
                        # Clients run in the outer group so that stopping the accept loop spares them.
                        accepting.start_soon(server.accept_loop, one, tg)

        tg.start_soon(run_accept)
        tg.start_soon(server.timer)
        tg.start_soon(scrape_engines, service, config.engine_metrics_interval_secs)
        if ext_proc is not None:
            tg.start_soon(ext_proc.run)
        server.subscriptions = Subscriptions(service, tg, server.pump)
        if config.ledger is not None and service.ledger is not None:
            options = config.ledger
            server.ledger_link = LedgerLink(service, service.ledger, options.url, options.scope,
                                            lease_secs=service.settings.active_request_expiry_secs,
                                            batch=options.batch, feed_max=options.feed_max,
                                            on_change=server.pump)
            server.ledger_link.advertise = advertised_url(config.host, port, config.tls is not None,
                                                          options.advertise_url)
            tg.start_soon(_join_ledger, service, server.ledger_link, options, tg.cancel_scope)
        await server.pump()  # subscriptions of workers restored before the start
        forced = False
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log("info", "shutdown", signal=signal.Signals(signum).name)
                break

            async def second_signal() -> None:
                nonlocal forced
                async for again in signals:
                    log("warning", "shutdown_forced", signal=signal.Signals(again).name)
                    forced = True
                    tg.cancel_scope.cancel()
                    return

            # The watcher must end inside this block: trio refuses a receiver used after it.
            async with anyio.create_task_group() as watch:
                watch.start_soon(second_signal)
                if config.drain_delay_secs > 0:  # a load balancer's time to see /readyz fail
                    service.begin_drain(now=time.monotonic())
                    log("info", "draining", seconds=config.drain_delay_secs)
                    await anyio.sleep(config.drain_delay_secs)
                await _drain(server, service, config, accept_scope)
                if ext_proc is not None:
                    await ext_proc.drain(config.shutdown_timeout_secs)
                if server.ledger_link is not None:  # the last frees, written before we go
                    await server.ledger_link.settle(config.shutdown_timeout_secs)
                    await server.ledger_link.unregister()
                watch.cancel_scope.cancel()
        tg.cancel_scope.cancel()
    if forced:
        raise RuntimeError("a second signal arrived during the graceful shutdown")
    if server.ledger_link is not None and server.ledger_link.refused is not None:
        raise RuntimeError(server.ledger_link.refused)  # fail closed: drift is worse than no replica
    if server.snapshots is not None:
        server.snapshots.final()
    log("info", "stopped")


async def _join_ledger(service: SelectionService, link: LedgerLink, options: LedgerOptions,
                       serving: anyio.CancelScope) -> None:
    """Fill the index from a peer (while `/ready` says `index: warming`), then follow the ledger.
    Nothing can change the catalog meanwhile: catalog writes wait for the ledger."""
    ledger = link.ledger
    if options.warm_from:
        ledger.warming = ledger.journal.muted = True  # the peer's catalog is the ledger's already
        try:
            await recover_from_peers(service, options.warm_from, options.warm_timeout_secs)
        finally:
            ledger.warming = ledger.journal.muted = False
    try:
        await link.run()
    except SettingsRefused:
        serving.cancel()  # `serve` ends and names the settings (link.refused)


async def _drain(server: _Server, service: SelectionService, config: ServerConfig,
                 accept_scope: anyio.CancelScope) -> None:
    """Stop accepting, answer what is in flight, close idle connections (transports.md §9)."""
    server.draining = True
    accept_scope.cancel()
    service.begin_shutdown(now=time.monotonic())
    await server.pump()
    if server.subscriptions is not None:
        server.subscriptions.close_all()
    for conn in list(server.connections):
        conn.shutdown()
        if not conn.busy:
            server.waits.pop(conn, anyio.CancelScope()).cancel()
    if server.connections:
        with anyio.move_on_after(config.shutdown_timeout_secs):
            await server.idle.wait()

