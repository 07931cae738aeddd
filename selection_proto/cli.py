"""`selection-proto` command line: the `serve`, `stdio` and `relay` commands and their flags; where
each setting comes from is `config.py` (transports.md §7)."""

from __future__ import annotations

import argparse
import math
import os
import random
import secrets
import socket
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, NoReturn

import attrs

from ._version import __version__
from .config import (
    DYNAMO_ENV,
    DYNAMO_FLAGS,
    SETTING_FIELDS,
    SETTING_HELP,
    TRANSPORT,
    UsageError,
    env_name,
    ext_proc_options,
    flag_name,
    flag_on,
    kind_of,
    print_config,
    require_extra,
    settings_from,
    transport_value,
    warn_unknown_env,
)
from .core.base.routes import MAX_BODY
from .core.base.settings import Settings
from .core.service import SelectionService
from .transports.supervisor import PROCESS_INDEX, SUPERVISOR

if TYPE_CHECKING:
    from .transports.config import LedgerOptions

__all__ = ["main"]

PROG = "selection-proto"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _add_settings(command: argparse.ArgumentParser) -> None:
    command.add_argument("--backend", default=None, help="asyncio (default), uvloop or trio; env SELECTION_PROTO_BACKEND")
    command.add_argument("--log-level", default=None, help="debug, info (default), warning, error; "
                                                           "env SELECTION_PROTO_LOG_LEVEL")
    command.add_argument("--log-format", default=None, help="json (default: one object a line) or text; "
                                                            "env SELECTION_PROTO_LOG_FORMAT")
    command.add_argument("--random-state", default=None, help="seed of the random generator (default: "
                                                              "fresh); env SELECTION_PROTO_RANDOM_STATE")
    command.add_argument("--config", default=None, help="TOML file of settings; env SELECTION_PROTO_CONFIG")
    command.add_argument("--restore", default=None, metavar="PATH",
                         help="replay a /dump file at start; env SELECTION_PROTO_RESTORE")
    command.add_argument("--print-config", action="store_true",
                         help="print the effective settings with where each came from, and exit")
    command.add_argument("--router-tracking-key-file", default=None, metavar="PATH",
                         help="32 raw bytes: the key of router_tracking_hash=keyed-xxh3-v1; env "
                              "SELECTION_PROTO_ROUTER_TRACKING_KEY_FILE, DYN_ROUTER_TRACKING_KEY_FILE")
    command.add_argument("--threads", default=None, metavar="N",
                         help="accepted for Dynamo's CLI and ignored: one event loop serves all")
    for field in SETTING_FIELDS:
        kind, choices = kind_of(field)
        names = [flag_name(field.name), *([DYNAMO_FLAGS[field.name]] if field.name in DYNAMO_FLAGS else [])]
        envs = ", ".join((env_name(field.name), *DYNAMO_ENV.get(field.name, ())))
        default = "none" if field.default is None else str(field.default).lower() if kind == "bool" \
            else str(field.default)
        listed = f"; one of {', '.join(choices)}" if choices else ""
        help_text = f"{SETTING_HELP[field.name]} (default {default}{listed}; env {envs})"
        if kind == "bool":
            command.add_argument(*names, dest=field.name, default=None, help=help_text,
                                 action=argparse.BooleanOptionalAction)
        else:
            command.add_argument(*names, dest=field.name, default=None, metavar="VALUE", help=help_text)


# `serve`'s own options: (setting, metavar, what it does); the default and the variable are added.
_SERVE_OPTIONS: Final = (
    ("host", "ADDRESS", "listen address"),
    ("port", "PORT", "listen port, 1-65535 (0: any free port)"),
    ("max_connections", "N", "open connections at most, WebSockets included"),
    ("max_buffer_bytes", "BYTES", "request bodies and WebSocket messages being received, summed over "
                                  "every connection; past it new bytes get 503 (WebSocket: close 1013)"),
    ("keep_alive_timeout_secs", "SECONDS", "close a connection idle this long"),
    ("request_timeout_secs", "SECONDS", "a request must arrive, and its answer leave, within this"),
    ("shutdown_timeout_secs", "SECONDS", "on SIGTERM, wait this long for answers in flight"),
    ("ws_ping_interval_secs", "SECONDS", "ping idle WebSockets this often"),
    ("indexer_peers", "URL[,URL...]", "start from the first of these peers whose /dump restores "
                                      "(1.6.1's format too)"),
    ("indexer_peer_timeout_secs", "SECONDS", "how long one peer may take to answer"),
    ("auth_token_file", "PATH", "every route but /health, /ready, /readyz, /metrics and /openapi.json "
                                "then needs 'Authorization: Bearer <the file's token>'"),
    ("tls_cert", "PATH", "serve HTTPS and wss:// with this certificate chain (PEM), with --tls-key"),
    ("tls_key", "PATH", "the private key of --tls-cert (PEM)"),
    ("access_log", None, "log every answer: method, path, status, milliseconds"),
    ("snapshot", "PATH", "restore this /dump file at start when it exists, and write it atomically "
                         "every --snapshot-interval-secs and at shutdown"),
    ("snapshot_interval_secs", "SECONDS", "seconds between snapshots, written by a forked child "
                                          "(0: only at shutdown)"),
    ("engine_metrics_interval_secs", "SECONDS", "seconds between scrapes of workers' metrics_endpoint"),
    ("drain_delay_secs", "SECONDS", "on SIGTERM, keep serving this long with /ready and /readyz "
                                    "answering 503 (a load balancer's time to stop sending), then drain"),
    ("ledger", "URL", "share bookings and the catalog with other replicas through this Valkey/Redis: "
                      "redis://HOST:PORT/DB, rediss://..., unix:///PATH?db=N (docs/REPLICATION.md)"),
    ("ledger_scope", "NAME", "replicas with the same ledger and scope share state"),
    ("admission", "MODE", "advisory: book locally, write to the ledger after answering; strict: answer a "
                          "booking once the ledger confirms no replica booked that rank meanwhile"),
    ("ledger_failure", "MODE", "while the ledger is unreachable, open: serve from local state (catalog "
                               "writes 503); closed: bookings and /ready 503"),
    ("ledger_batch", "N", "changes written to the ledger in one script call, at most"),
    ("ledger_outbox_max", "N", "own changes queued while the ledger is unreachable; then bookings 503"),
    ("ledger_feed_max", "N", "entries the ledger's feed keeps (approximately); a reader further behind "
                             "loads a snapshot"),
    ("ledger_free_grace_secs", "SECONDS", "a free of an id no replica has written yet waits this long "
                                          "for its booking (200 when it comes), then answers 404"),
    ("processes", "N", "serve from N processes on one port (SO_REUSEPORT); N > 1 needs --ledger"),
    ("advertise_url", "URL", "where peers reach this replica for /dump at their start (registered in "
                             "the ledger; default: the listening address unless it is a wildcard)"),
    ("ext_proc_port", "PORT", "also be Envoy's endpoint picker: its ext_proc gRPC service on this port"),
    ("ext_proc_host", "ADDRESS", "the ext_proc listen address (default: --host)"),
    ("tokenizer", "MODEL=PATH[,...]", "tokenize MODEL's text prompts and chats with this tokenizer.json "
                                      "(or its folder, with tokenizer_config.json's chat template)"),
)


def _build_parser() -> _Parser:
    parser = _Parser(prog=PROG, description="KV-cache-aware worker selection service.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    serve = sub.add_parser("serve", help="HTTP API on host:port")
    for name, metavar, text in _SERVE_OPTIONS:
        default = TRANSPORT[name]
        shown = "none" if default is None else str(default).lower() if isinstance(default, bool) else default
        extra: dict[str, Any] = {"action": "store_const", "const": "true"} if name == "access_log" else {
            "metavar": metavar}
        serve.add_argument(flag_name(name), default=None, dest=name, **extra,
                           help=f"{text} (default {shown}; env {env_name(name)})")
    _add_settings(serve)
    stdio = sub.add_parser("stdio", help="JSON-RPC 2.0 lines on stdin/stdout")
    _add_settings(stdio)
    relay = sub.add_parser("relay", help="forward an engine's ZMQ KV events over one WebSocket")
    relay.add_argument("--zmq", required=True, help="the engine's ZMQ PUB endpoint (tcp:// or ipc://)")
    relay.add_argument("--to", required=True, action="append",
                       help="ws://SELECTOR:8092/kv_events; once per replica to feed each (--ledger)")
    relay.add_argument("--worker-id", required=True, type=int)
    relay.add_argument("--dp-rank", default=0, type=int)
    relay.add_argument("--topic", default="", help="ZMQ topic prefix (default: all)")
    relay.add_argument("--buffer", default=1024, type=int, help="messages buffered while disconnected")
    relay.add_argument("--replay", default=None, metavar="ENDPOINT",
                       help="the engine's replay (ROUTER) endpoint: resume where the service stands")
    relay.add_argument("--backend", default=None, help="asyncio (default), uvloop or trio")
    relay.add_argument("--log-level", default=None, help="debug, info, warning, error")
    relay.add_argument("--log-format", default=None, help="json (default: one object a line) or text")
    from .sim.command import add_parser

    add_parser(sub)
    return parser


def _relay(args: argparse.Namespace, env: Mapping[str, str]) -> int:

    from .transports.logs import LEVELS, set_log_level

    level = transport_value(args, env, "log_level", TRANSPORT["log_level"], str)
    if level not in LEVELS:
        raise UsageError(f"--log-level: invalid choice {level!r} (choose from debug, info, warning, error)")
    set_log_level(level)
    _set_log_format(args, env)
    backend = transport_value(args, env, "backend", TRANSPORT["backend"], str)
    _check_backend(backend)
    if not args.zmq.startswith(("tcp://", "ipc://")):
        raise UsageError(f"--zmq: expected a tcp:// or ipc:// endpoint, not {args.zmq!r}")
    for to in args.to:
        if not to.startswith(("ws://", "wss://")):
            raise UsageError(f"--to: expected a ws:// or wss:// URL, not {to!r}")
    if args.buffer < 1:
        raise UsageError("--buffer: must be at least 1")
    try:
        import zmq  # noqa: F401
    except ImportError:
        print(f"{PROG}: error: relay needs pyzmq (pip install pyzmq)",
              file=sys.stderr)
        return 1
    from .transports.relay import run_relay

    if args.replay is not None and not args.replay.startswith(("tcp://", "ipc://")):
        raise UsageError(f"--replay: expected a tcp:// or ipc:// endpoint, not {args.replay!r}")
    _run(backend, run_relay, args.zmq, args.to, args.worker_id, args.dp_rank, args.topic, args.buffer, args.replay)
    return 0


def _set_log_format(args: argparse.Namespace, env: Mapping[str, str]) -> None:
    from .transports.logs import FORMATS, set_log_format

    name = transport_value(args, env, "log_format", TRANSPORT["log_format"], str)
    if name not in FORMATS:
        raise UsageError(f"--log-format: invalid choice {name!r} (choose from json, text)")
    set_log_format(name)


def _check_backend(backend: str) -> None:
    if backend not in ("asyncio", "uvloop", "trio"):
        raise UsageError(f"--backend: invalid choice {backend!r} (choose from asyncio, uvloop, trio)")
    if backend != "asyncio":
        require_extra(f"--backend {backend}", backend, backend)


def _run(backend: str, func: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """`anyio.run` on the chosen backend; `uvloop` is asyncio on uvloop's event loop (C where
    asyncio's loop is Python: a tenth less CPU per picker request, docs/GATEWAY.md)."""
    import anyio

    if backend == "uvloop":
        return anyio.run(func, *args, backend="asyncio", backend_options={"use_uvloop": True})
    return anyio.run(func, *args, backend=backend)


def _service_and_backend(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[SelectionService, str]:
    settings = settings_from(args, env)
    seed = transport_value(args, env, "random_state", TRANSPORT["random_state"], int)
    backend = transport_value(args, env, "backend", TRANSPORT["backend"], str)
    _check_backend(backend)
    level = transport_value(args, env, "log_level", TRANSPORT["log_level"], str)
    from .transports.logs import LEVELS, set_log_level

    if level not in LEVELS:
        raise UsageError(f"--log-level: invalid choice {level!r} (choose from debug, info, warning, error)")
    set_log_level(level)
    _set_log_format(args, env)
    warn_unknown_env(env)
    rng = random.Random(seed) if seed is not None else random.Random()
    if settings.kv_events == "subscribe":
        connections = transport_value(args, env, "max_connections", TRANSPORT["max_connections"], int) \
            if args.command == "serve" else 0
        settings = _fit_descriptors(settings, connections)
    try:
        service = SelectionService(settings, rng, _tracking_key(args, env), log_decisions=level == "debug")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    restore = transport_value(args, env, "restore", TRANSPORT["restore"], str)
    snapshot = transport_value(args, env, "snapshot", TRANSPORT["snapshot"], str) \
        if args.command == "serve" else None
    if restore is not None and snapshot is not None:
        raise UsageError("--restore and --snapshot go separately: --snapshot restores its own file")
    if restore is not None:
        _restore(service, restore, "--restore")
    elif snapshot is not None and os.path.exists(snapshot):
        # A snapshot that does not read is an error, not an empty start: the catalog it holds
        # would be lost without a word. Move the file aside to start empty.
        _restore(service, snapshot, "--snapshot")
    return service, backend


def _restore(service: SelectionService, path: str, flag: str) -> None:
    from .core.base import jsonio
    from .core.base.errors import SelectionError

    try:
        with open(path, "rb") as fh:
            # The same reader as every request: a dump holds what the API would accept.
            service.restore(jsonio.loads(fh.read()), now=0.0)
    except jsonio.JSONSyntaxError as exc:
        raise UsageError(f"{flag} {path}: invalid JSON: {exc.detail}") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag} {path}: {exc}") from None
    except SelectionError as exc:
        raise UsageError(f"{flag} {path}: {exc.message}") from None


def _tracking_key(args: argparse.Namespace, env: Mapping[str, str]) -> bytes | None:
    path = transport_value(args, env, "router_tracking_key_file", TRANSPORT["router_tracking_key_file"], str)
    if path is None:
        path = env.get("DYN_ROUTER_TRACKING_KEY_FILE")
    if path is None:
        return None
    require_extra("--router-tracking-key-file", "tracking", "blake3")
    try:
        with open(path, "rb") as fh:
            return fh.read(4096)
    except OSError as exc:
        raise UsageError(f"failed to read router tracking key file {path}: {exc.strerror or exc}") from None


def _tls_context(args: argparse.Namespace, env: Mapping[str, str]) -> Any:
    cert = transport_value(args, env, "tls_cert", None, str)
    key = transport_value(args, env, "tls_key", None, str)
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise UsageError("--tls-cert and --tls-key go together")
    import ssl

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"--tls-cert {cert} / --tls-key {key}: {exc.strerror or exc}") from None
    return context


def _auth_token(args: argparse.Namespace, env: Mapping[str, str]) -> bytes | None:
    path = transport_value(args, env, "auth_token_file", None, str)
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            token = fh.read(4097).strip()
    except OSError as exc:
        raise UsageError(f"--auth-token-file {path}: {exc.strerror or exc}") from None
    if not token or len(token) > 4096 or not all(0x21 <= b <= 0x7e for b in token):
        raise UsageError(f"--auth-token-file {path}: expected one token of 1 to 4096 visible ASCII characters")
    return token


def _fit_descriptors(settings: Settings, connections: int) -> Settings:
    """Subscriptions and connections must fit the process's descriptors, with room for accepts:
    the soft RLIMIT_NOFILE is raised to the hard one, and `max_subscriptions` lowered (with a
    warning) when they still do not fit, so that a subscription past it is refused at
    registration (409) instead of failing every accept and handshake once descriptors run out."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Linux or macOS
        return settings
    from .transports.accepting import FD_HEADROOM

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        except (ValueError, OSError):
            pass
    room = max(0, soft - connections - FD_HEADROOM)
    if settings.max_subscriptions <= room:
        return settings
    from .transports.logs import log

    log("warning", "max_subscriptions_lowered", configured=settings.max_subscriptions, to=room,
        open_files_limit=soft, max_connections=connections)
    return attrs.evolve(settings, max_subscriptions=room)


def _stdio(args: argparse.Namespace, env: Mapping[str, str]) -> int:

    from .transports.stdio import serve_stdio

    service, backend = _service_and_backend(args, env)
    _run(backend, serve_stdio, service)
    return 0


def _serve(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from .transports.config import ServerConfig
    from .transports.logs import log
    from .transports.server import serve

    service, backend = _service_and_backend(args, env)
    port = transport_value(args, env, "port", TRANSPORT["port"], int)
    if not 0 <= port <= 65535:
        raise UsageError(f"--port: must be between 1 and 65535 (0: any free port), not {port}")
    max_connections = transport_value(args, env, "max_connections", TRANSPORT["max_connections"], int)
    if max_connections < 1:
        raise UsageError(f"--max-connections: must be at least 1, not {max_connections}")
    max_buffer_bytes = transport_value(args, env, "max_buffer_bytes", TRANSPORT["max_buffer_bytes"], int)
    if max_buffer_bytes < MAX_BODY:
        raise UsageError(f"--max-buffer-bytes: must be at least {MAX_BODY} (one whole body), not {max_buffer_bytes}")
    timeouts = {name: transport_value(args, env, name, TRANSPORT[name], float) for name in (  # each > 0
        "keep_alive_timeout_secs", "request_timeout_secs", "shutdown_timeout_secs", "ws_ping_interval_secs", "engine_metrics_interval_secs")}
    for name, value in timeouts.items():
        if not (value > 0 and math.isfinite(value)):  # NaN fails both
            raise UsageError(f"{flag_name(name)}: must be a finite number greater than 0, not {value}")
    pauses = {name: transport_value(args, env, name, TRANSPORT[name], float) for name in (
        "snapshot_interval_secs", "drain_delay_secs")}
    for name, value in pauses.items():
        if not (value >= 0 and math.isfinite(value)):
            raise UsageError(f"{flag_name(name)}: must be a finite number of at least 0, not {value}")
    processes = transport_value(args, env, "processes", TRANSPORT["processes"], int)
    ledger = _ledger(args, env, service, processes)
    host = transport_value(args, env, "host", TRANSPORT["host"], str)
    if processes > 1:
        from .transports.supervisor import supervise

        ext_proc_port = transport_value(args, env, "ext_proc_port", TRANSPORT["ext_proc_port"], int)
        return supervise(args.argv, host, port, processes, ext_proc_port)
    supervisor = env.get(SUPERVISOR)
    config = ServerConfig(host=host, port=port, ledger=ledger, reuse_port=PROCESS_INDEX in env,
                          supervisor_pid=int(supervisor) if supervisor and supervisor.isdigit() else None,
                          max_connections=max_connections, max_buffer_bytes=max_buffer_bytes,
                          auth_token=_auth_token(args, env),
                          tls=_tls_context(args, env), access_log=flag_on(args, env, "access_log"),
                          snapshot=transport_value(args, env, "snapshot", TRANSPORT["snapshot"], str),
                          ext_proc=ext_proc_options(args, env, host), **timeouts, **pauses)

    peers = transport_value(args, env, "indexer_peers", TRANSPORT["indexer_peers"], str)
    if ledger is not None and not peers and not service.catalog:
        from .transports.config import advertised_url
        from .transports.ledger import registry_peers

        # A replica starts warm: its index from a live peer's /dump; its catalog and bookings
        # come from the ledger. Not from its own address: the processes of `--processes` share
        # one, and a /dump asked there may reach the asker, which takes no connection until it has
        # joined the ledger (a 10 s stall, then catalog writes refused 503). Nor a crashed run's.
        own = advertised_url(host, port, config.tls is not None, ledger.advertise_url)
        peers = ",".join(peer for peer in registry_peers(ledger.url, ledger.scope) if peer != own)
    if peers:
        from .transports.peers import recover_from_peers

        timeout = transport_value(args, env, "indexer_peer_timeout_secs", TRANSPORT["indexer_peer_timeout_secs"], float)
        if not timeout > 0 or timeout == float("inf"):
            raise UsageError("--indexer-peer-timeout-secs: must be a finite number greater than 0")
        listed = tuple(p.strip() for p in peers.split(",") if p.strip())
        if service.catalog:  # restored from --restore or --snapshot: that state is kept
            log("info", "peers_not_asked", detail="state restored from a file at start")
        elif ledger is not None:  # warmed while serving, /ready 503 `index: warming` meanwhile
            config.ledger = attrs.evolve(ledger, warm_from=listed, warm_timeout_secs=timeout)
        else:
            _run(backend, recover_from_peers, service, listed, timeout)
    try:
        _run(backend, serve, service, config)
    except RuntimeError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        log("info", "stopped")
    return 0


def _ledger(args: argparse.Namespace, env: Mapping[str, str], service: SelectionService,
            processes: int) -> LedgerOptions | None:
    """The ledger's options, checked, with the service sharing through it; None without --ledger."""
    url = transport_value(args, env, "ledger", TRANSPORT["ledger"], str)
    if not 1 <= processes <= 64:
        raise UsageError(f"--processes: must be between 1 and 64, not {processes}")
    if url is None:
        if processes > 1:
            raise UsageError("--processes above 1 needs --ledger: processes share bookings through it")
        return None
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise UsageError(f"--ledger: expected redis://, rediss:// or unix:// URL, not {url!r}")
    require_extra("--ledger", "ledger", "redis")
    if processes > 1 and transport_value(args, env, "snapshot", None, str) is not None:
        raise UsageError("--snapshot with --processes above 1: the ledger holds the shared state")
    values = {}
    for name, choices in (("admission", ("advisory", "strict")), ("ledger_failure", ("open", "closed"))):
        values[name] = transport_value(args, env, name, TRANSPORT[name], str)
        if values[name] not in choices:
            raise UsageError(f"{flag_name(name)}: invalid choice {values[name]!r} (choose from {', '.join(choices)})")
    counts = {name: transport_value(args, env, name, TRANSPORT[name], int)
              for name in ("ledger_batch", "ledger_outbox_max", "ledger_feed_max")}
    for name, value in counts.items():
        if not 1 <= value <= 1 << 40:
            raise UsageError(f"{flag_name(name)}: must be a positive integer, not {value}")
    grace = transport_value(args, env, "ledger_free_grace_secs", TRANSPORT["ledger_free_grace_secs"], float)
    if not 0 < grace <= 600:  # NaN fails too
        raise UsageError(f"--ledger-free-grace-secs: must be above 0 and at most 600, not {grace}")
    scope = transport_value(args, env, "ledger_scope", TRANSPORT["ledger_scope"], str)
    if not scope or len(scope) > 128 or any(c in scope for c in "{}") or not scope.isprintable():
        raise UsageError(f"--ledger-scope: expected 1-128 printable characters without braces, not {scope!r}")
    from .core.fleet.journal import LedgerSettings

    origin = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"
    from .transports.config import LedgerOptions

    service.share(LedgerSettings(admission=values["admission"],
                                 failure=values["ledger_failure"],
                                 outbox_max=counts["ledger_outbox_max"], free_grace_secs=grace), origin)
    advertise = transport_value(args, env, "advertise_url", TRANSPORT["advertise_url"], str)
    if advertise is not None and not advertise.startswith("http://"):
        raise UsageError(f"--advertise-url: expected an http:// URL, not {advertise!r}")
    return LedgerOptions(url, scope, counts["ledger_batch"], counts["ledger_feed_max"], advertise)


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)
        if args.command is None:
            raise UsageError("a command is required (serve, stdio, relay, simulate)")
        if args.command == "relay":
            return _relay(args, env)
        if args.command == "simulate":
            from .sim.command import run

            return run(args)
        if args.print_config:
            return print_config(args, env)
        return _stdio(args, env) if args.command == "stdio" else _serve(args, env)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
