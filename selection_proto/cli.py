"""`selection-proto` command line: settings from flags, `SELECTION_PROTO_*` variables and a TOML
file, in that precedence (transports.md §7)."""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tomllib
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Final, NoReturn

import attrs

from ._version import __version__
from .core.service import SelectionService
from .core.settings import Settings

__all__ = ["main"]

PROG = "selection-proto"
_SETTING_FIELDS = attrs.fields(Settings)
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _kind(field: attrs.Attribute[Any]) -> tuple[str, tuple[str, ...]]:
    """("bool" | "int" | "float" | "choice", choices) from the attrs annotation."""
    hints = typing.get_type_hints(Settings)
    hint = hints[field.name]
    if typing.get_origin(hint) is typing.Literal:
        return "choice", typing.get_args(hint)
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    base = args[0]
    if typing.get_origin(base) is typing.Literal:
        return "choice", typing.get_args(base)
    for alias in args:
        if typing.get_origin(alias) is typing.Literal:
            return "choice", typing.get_args(alias)
    if base is bool:
        return "bool", ()
    if base is str:
        return "str", ()
    if base is int:
        return "int", ()
    return "float", ()


def _nullable(field: attrs.Attribute[Any]) -> bool:
    return type(None) in typing.get_args(typing.get_type_hints(Settings)[field.name])


def _convert(field: attrs.Attribute[Any], raw: Any, source: str) -> Any:
    kind, choices = _kind(field)
    if isinstance(raw, str):
        text = raw.strip()
        if _nullable(field) and text.lower() == "none":
            return None
        if kind == "bool":
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise UsageError(f"{source}: invalid boolean value {raw!r}")
        if kind == "str":
            return raw  # as given: a key id with surrounding spaces is refused, not trimmed
        if kind == "choice":
            if text not in choices:
                raise UsageError(f"{source}: invalid choice {raw!r} (choose from {', '.join(choices)})")
            return text
        try:
            return int(text) if kind == "int" else float(text)
        except ValueError:
            raise UsageError(f"{source}: invalid {kind} value {raw!r}") from None
    return raw


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env(name: str) -> str:
    return "SELECTION_PROTO_" + name.upper()


# Dynamo 1.6.1's environment variables for our settings, read after ours (SELECTION_PROTO_*).
DYNAMO_ENV: Final[Mapping[str, tuple[str, ...]]] = {
    "temperature": ("DYN_ROUTER_TEMPERATURE",),
    "overlap_score_credit": ("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT",),
    "overlap_score_credit_decay": ("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY",),
    "prefill_load_scale": ("DYN_ROUTER_PREFILL_LOAD_SCALE",),
    "overlap_score_weight": ("DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", "DYN_OVERLAP_SCORE_WEIGHT"),
    "decode_active_request_weight": ("DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT",),
    "host_cache_hit_weight": ("DYN_ROUTER_HOST_CACHE_HIT_WEIGHT",),
    "disk_cache_hit_weight": ("DYN_ROUTER_DISK_CACHE_HIT_WEIGHT",),
    "track_active_blocks": ("DYN_ROUTER_TRACK_ACTIVE_BLOCKS",),
    "track_prefill_tokens": ("DYN_ROUTER_TRACK_PREFILL_TOKENS",),
    "assume_kv_reuse": ("DYN_ROUTER_ASSUME_KV_REUSE",),
    "queue_threshold": ("DYN_ROUTER_QUEUE_THRESHOLD",),
    "queue_policy": ("DYN_ROUTER_QUEUE_POLICY",),
    "active_request_expiry_secs": ("DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS",),
    "router_tracking_hash": ("DYN_ROUTER_TRACKING_HASH",),
    "router_ttl_secs": ("DYN_ROUTER_TTL_SECS",),
    "predicted_ttl_secs": ("DYN_ROUTER_PREDICTED_TTL_SECS",),
    "router_tracking_key_id": ("DYN_ROUTER_TRACKING_KEY_ID",),
}
# Dynamo's flags for our settings (`--no-…` too, for booleans).
DYNAMO_FLAGS: Final[Mapping[str, str]] = {"assume_kv_reuse": "--router-assume-kv-reuse"}
# Dynamo variables that choose what one event loop cannot or does not need: read, and ignored.
IGNORED_ENV: Final = ("DYN_ROUTER_EVENT_THREADS",)
# Dynamo variables for features we do not have yet: refused at start, never silently ignored.
UNSUPPORTED_ENV: Final = ("DYN_ROUTER_TRACK_OUTPUT_BLOCKS",)


def _add_settings(command: argparse.ArgumentParser) -> None:
    command.add_argument("--backend", default=None, help="asyncio (default) or trio")
    command.add_argument("--log-level", default=None, help="debug, info, warning, error")
    command.add_argument("--log-format", default=None, help="json (default: one object a line) or text")
    command.add_argument("--random-state", default=None, help="seed of the random generator")
    command.add_argument("--config", default=None, help="TOML file of settings")
    command.add_argument("--restore", default=None, metavar="PATH", help="replay a /dump file at start")
    command.add_argument("--print-config", action="store_true",
                         help="print the effective settings with where each came from, and exit")
    command.add_argument("--router-tracking-key-file", default=None, metavar="PATH",
                         help="32 raw bytes: the key of router_tracking_hash=keyed-xxh3-v1; env "
                              "SELECTION_PROTO_ROUTER_TRACKING_KEY_FILE, DYN_ROUTER_TRACKING_KEY_FILE")
    command.add_argument("--threads", default=None, metavar="N",
                         help="accepted for Dynamo's CLI and ignored: one event loop serves all")
    for field in _SETTING_FIELDS:
        kind, _ = _kind(field)
        names = [_flag(field.name), *([DYNAMO_FLAGS[field.name]] if field.name in DYNAMO_FLAGS else [])]
        envs = ", ".join((_env(field.name), *DYNAMO_ENV.get(field.name, ())))
        default = "none" if field.default is None else str(field.default).lower() if kind == "bool" \
            else str(field.default)
        help_text = f"default {default}; env {envs}"
        if kind == "bool":
            command.add_argument(*names, dest=field.name, default=None, help=help_text,
                                 action=argparse.BooleanOptionalAction)
        else:
            command.add_argument(*names, dest=field.name, default=None, metavar="VALUE", help=help_text)


def _build_parser() -> _Parser:
    parser = _Parser(prog=PROG, description="KV-cache-aware worker selection service.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    serve = sub.add_parser("serve", help="HTTP API on host:port")
    serve.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", default=None, help="0 = any free port (default 8092)")
    serve.add_argument("--max-connections", default=None)
    serve.add_argument("--keep-alive-timeout-secs", default=None)
    serve.add_argument("--request-timeout-secs", default=None)
    serve.add_argument("--shutdown-timeout-secs", default=None)
    serve.add_argument("--ws-ping-interval-secs", default=None)
    serve.add_argument("--indexer-peers", default=None, metavar="URL[,URL...]",
                       help="start from the first of these peers whose /dump restores (1.6.1's "
                            "format too); env SELECTION_PROTO_INDEXER_PEERS")
    serve.add_argument("--auth-token-file", default=None, metavar="PATH",
                       help="every route but /health, /ready, /metrics and /openapi.json then needs "
                            "'Authorization: Bearer <the file's token>'")
    serve.add_argument("--tls-cert", default=None, metavar="PATH", help="serve HTTPS and wss:// with this "
                                                                         "certificate chain (PEM), with --tls-key")
    serve.add_argument("--tls-key", default=None, metavar="PATH", help="the private key of --tls-cert (PEM)")
    serve.add_argument("--access-log", default=None, action="store_const", const="true",
                       help="log every answer: method, path, status, milliseconds")
    serve.add_argument("--indexer-peer-timeout-secs", default=None, metavar="SECONDS",
                       help="how long one peer may take to answer (default 10)")
    _add_settings(serve)
    stdio = sub.add_parser("stdio", help="JSON-RPC 2.0 lines on stdin/stdout")
    _add_settings(stdio)
    relay = sub.add_parser("relay", help="forward an engine's ZMQ KV events over one WebSocket")
    relay.add_argument("--zmq", required=True, help="the engine's ZMQ PUB endpoint (tcp:// or ipc://)")
    relay.add_argument("--to", required=True, help="ws://SELECTOR:8092/kv_events")
    relay.add_argument("--worker-id", required=True, type=int)
    relay.add_argument("--dp-rank", default=0, type=int)
    relay.add_argument("--topic", default="", help="ZMQ topic prefix (default: all)")
    relay.add_argument("--buffer", default=1024, type=int, help="messages buffered while disconnected")
    relay.add_argument("--replay", default=None, metavar="ENDPOINT",
                       help="the engine's replay (ROUTER) endpoint: resume where the service stands")
    relay.add_argument("--backend", default=None, help="asyncio (default) or trio")
    relay.add_argument("--log-level", default=None, help="debug, info, warning, error")
    relay.add_argument("--log-format", default=None, help="json (default: one object a line) or text")
    return parser


def _relay(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    import anyio

    from .transports.logs import LEVELS, set_log_level

    level = _transport_value(args, env, "log_level", TRANSPORT["log_level"], str)
    if level not in LEVELS:
        raise UsageError(f"--log-level: invalid choice {level!r} (choose from debug, info, warning, error)")
    set_log_level(level)
    _set_log_format(args, env)
    backend = _transport_value(args, env, "backend", TRANSPORT["backend"], str)
    _check_backend(backend)
    if not args.zmq.startswith(("tcp://", "ipc://")):
        raise UsageError(f"--zmq: expected a tcp:// or ipc:// endpoint, not {args.zmq!r}")
    if not args.to.startswith(("ws://", "wss://")):
        raise UsageError(f"--to: expected a ws:// or wss:// URL, not {args.to!r}")
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
    anyio.run(run_relay, args.zmq, args.to, args.worker_id, args.dp_rank, args.topic, args.buffer,
              args.replay, backend=backend)
    return 0


# Settings of the transports and the command line, beside `Settings`: also TOML keys.
TRANSPORT: Final[Mapping[str, Any]] = {
    "host": "127.0.0.1", "port": 8092, "max_connections": 1024, "keep_alive_timeout_secs": 5.0,
    "request_timeout_secs": 30.0, "shutdown_timeout_secs": 10.0, "ws_ping_interval_secs": 20.0,
    "backend": "asyncio", "log_level": "info", "log_format": "json", "random_state": None, "restore": None, "indexer_peers": None,
    "indexer_peer_timeout_secs": 10.0, "router_tracking_key_file": None, "auth_token_file": None,
    "tls_cert": None, "tls_key": None, "access_log": None,
}
TRANSPORT_KEYS: Final = tuple(TRANSPORT)
# Our variables that are not settings (the test suite's, the config file's).
_OTHER_ENV: Final = ("SELECTION_PROTO_CONFIG", "SELECTION_PROTO_VECTORS", "SELECTION_PROTO_REQUIRE_REFERENCE")


def _config_file(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[dict[str, Any], str]:
    """The TOML file's keys (read once per run) and how errors name it."""
    cached = getattr(args, "_file", None)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    path = getattr(args, "config", None) or env.get(_env("config"))
    values: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as fh:
                values = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise UsageError(f"--config {path}: {exc}") from None
        known = {f.name for f in _SETTING_FIELDS} | set(TRANSPORT_KEYS)
        for name in values:
            if name not in known:
                raise UsageError(f"--config {path}: unknown setting {name!r}")
    args._file = (values, f"--config {path}")
    return args._file  # type: ignore[no-any-return]


def _transport_value(args: argparse.Namespace, env: Mapping[str, str], name: str, default: Any,
                     cast: type) -> Any:
    """A transport setting: its flag, else `SELECTION_PROTO_*`, else the TOML file, else `default`."""
    raw = getattr(args, name, None)
    source = _flag(name)
    if raw is None and _env(name) in env:
        raw, source = env[_env(name)], _env(name)
    if raw is None:
        from_file, file_source = _config_file(args, env)
        if name in from_file:
            raw, source = from_file[name], f"{file_source}: {name}"
            if isinstance(raw, bool) or (cast is not str and isinstance(raw, str)):
                raise UsageError(f"{source}: expected a {cast.__name__}, not {raw!r}")
    if raw is None:
        return default
    try:
        return cast(raw)
    except ValueError:
        raise UsageError(f"{source}: invalid {cast.__name__} value {raw!r}") from None


def _warn_unknown_env(env: Mapping[str, str]) -> None:
    from .transports.logs import log

    known = {_env(f.name) for f in _SETTING_FIELDS} | {_env(n) for n in TRANSPORT_KEYS} | set(_OTHER_ENV)
    for name in sorted(n for n in env if n.startswith("SELECTION_PROTO_") and n not in known):
        log("warning", "unknown_variable", name=name, detail="not a setting; ignored")


def settings_from(args: argparse.Namespace, env: Mapping[str, str],
                  sources: dict[str, str] | None = None) -> Settings:
    """The settings of flags, `SELECTION_PROTO_*`, Dynamo's variables and the TOML file, in that
    order; `sources`, when given, receives where each came from."""
    from_file, file_source = _config_file(args, env)
    unsupported = [name for name in UNSUPPORTED_ENV if name in env]
    if unsupported:
        raise UsageError(f"{unsupported[0]}: not supported yet (automatic output tracking is open work); "
                         "unset it")
    values: dict[str, Any] = {}
    sources = {} if sources is None else sources
    _dynamo_kv_mode(env, values, sources)
    for field in _SETTING_FIELDS:
        name = field.name
        flag_value = getattr(args, name, None)
        dynamo = next((var for var in DYNAMO_ENV.get(name, ()) if var in env), None)
        if flag_value is not None:
            values[name], sources[name] = _convert(field, flag_value, _flag(name)), _flag(name)
        elif _env(name) in env:
            values[name], sources[name] = _convert(field, env[_env(name)], _env(name)), _env(name)
        elif dynamo is not None:
            values[name], sources[name] = _convert(field, env[dynamo], dynamo), dynamo
        elif name in from_file:
            source = f"{file_source}: {name}"
            raw = from_file[name]
            if _kind(field)[0] == "bool" and not isinstance(raw, bool):
                raise UsageError(f"{source}: expected a boolean, not {raw!r}")
            values[name], sources[name] = _convert(field, raw, source), source
    try:
        return Settings(**values)
    except (ValueError, TypeError) as exc:
        text = str(exc)
        name, _, reason = text.partition(": ")
        raise UsageError(f"{sources.get(name, name)}: {reason or text}") from None


def _dynamo_kv_mode(env: Mapping[str, str], values: dict[str, Any], sources: dict[str, str]) -> None:
    """1.6.1's switch to approximate mode (`DYN_ROUTER_USE_KV_EVENTS=false`) and its cache policy;
    our own `kv_events` setting, read after, wins."""
    name = next((n for n in ("DYN_ROUTER_USE_KV_EVENTS", "DYN_USE_KV_EVENTS") if n in env), None)
    approximate = False
    if name is not None:
        text = env[name].strip().lower()
        if text not in (*_TRUE, *_FALSE):
            raise UsageError(f"{name}: invalid boolean value {env[name]!r}")
        approximate = text in _FALSE
        if approximate:
            values["kv_events"], sources["kv_events"] = "approximate", name
    policy = env.get("DYN_ROUTER_APPROXIMATE_CACHE_POLICY")
    if policy is not None:
        if policy not in ("ttl", "lru"):
            raise UsageError(f"unknown approximate cache policy \"{policy}\", expected 'ttl' or 'lru'")
        if policy == "lru" and not approximate:
            raise UsageError("router_approximate_cache_policy=lru requires use_kv_events=false; "
                             "the local side indexer is TTL-only")
        if policy == "lru":
            from .transports.logs import log

            log("warning", "approximate_cache_policy", detail="router_approximate_cache_policy=lru is not "
                "supported by the selection service yet; falling back to TTL retention")


def _set_log_format(args: argparse.Namespace, env: Mapping[str, str]) -> None:
    from .transports.logs import FORMATS, set_log_format

    name = _transport_value(args, env, "log_format", TRANSPORT["log_format"], str)
    if name not in FORMATS:
        raise UsageError(f"--log-format: invalid choice {name!r} (choose from json, text)")
    set_log_format(name)


def _check_backend(backend: str) -> None:
    if backend not in ("asyncio", "trio"):
        raise UsageError(f"--backend: invalid choice {backend!r} (choose from asyncio, trio)")
    if backend == "trio":
        try:
            import trio  # noqa: F401
        except ImportError:
            raise UsageError("--backend trio: the trio package is not installed "
                             "(pip install 'selection-proto[trio]')") from None


def _service_and_backend(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[SelectionService, str]:
    settings = settings_from(args, env)
    seed = _transport_value(args, env, "random_state", TRANSPORT["random_state"], int)
    backend = _transport_value(args, env, "backend", TRANSPORT["backend"], str)
    _check_backend(backend)
    level = _transport_value(args, env, "log_level", TRANSPORT["log_level"], str)
    from .transports.logs import LEVELS, set_log_level

    if level not in LEVELS:
        raise UsageError(f"--log-level: invalid choice {level!r} (choose from debug, info, warning, error)")
    set_log_level(level)
    _set_log_format(args, env)
    _warn_unknown_env(env)
    rng = random.Random(seed) if seed is not None else random.Random()
    try:
        service = SelectionService(settings, rng, _tracking_key(args, env), log_decisions=level == "debug")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    restore = _transport_value(args, env, "restore", TRANSPORT["restore"], str)
    if restore is not None:
        from .core import jsonio
        from .core.errors import SelectionError

        try:
            with open(restore, "rb") as fh:
                # The same reader as every request: a dump holds what the API would accept.
                service.restore(jsonio.loads(fh.read()), now=0.0)
        except jsonio.JSONSyntaxError as exc:
            raise UsageError(f"--restore {restore}: invalid JSON: {exc.detail}") from None
        except (OSError, ValueError) as exc:
            raise UsageError(f"--restore {restore}: {exc}") from None
        except SelectionError as exc:
            raise UsageError(f"--restore {restore}: {exc.message}") from None
    return service, backend


def _tracking_key(args: argparse.Namespace, env: Mapping[str, str]) -> bytes | None:
    path = _transport_value(args, env, "router_tracking_key_file", TRANSPORT["router_tracking_key_file"], str)
    if path is None:
        path = env.get("DYN_ROUTER_TRACKING_KEY_FILE")
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            return fh.read(4096)
    except OSError as exc:
        raise UsageError(f"failed to read router tracking key file {path}: {exc.strerror or exc}") from None


def _flag_on(args: argparse.Namespace, env: Mapping[str, str], name: str) -> bool:
    """A boolean transport setting: the flag, `SELECTION_PROTO_*` (true/false...), or a TOML boolean."""
    if getattr(args, name, None) is not None:
        return True
    if _env(name) in env:
        text = env[_env(name)].strip().lower()
        if text not in (*_TRUE, *_FALSE):
            raise UsageError(f"{_env(name)}: invalid boolean value {env[_env(name)]!r}")
        return text in _TRUE
    from_file, source = _config_file(args, env)
    value = from_file.get(name, False)
    if not isinstance(value, bool):
        raise UsageError(f"{source}: {name}: expected a boolean, not {value!r}")
    return value


def _tls_context(args: argparse.Namespace, env: Mapping[str, str]) -> Any:
    cert = _transport_value(args, env, "tls_cert", None, str)
    key = _transport_value(args, env, "tls_key", None, str)
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
    path = _transport_value(args, env, "auth_token_file", None, str)
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


def _stdio(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    import anyio

    from .transports.stdio import serve_stdio

    service, backend = _service_and_backend(args, env)
    anyio.run(serve_stdio, service, backend=backend)
    return 0


def _serve(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from .transports.logs import log
    from .transports.server import ServerConfig, serve

    service, backend = _service_and_backend(args, env)
    port = _transport_value(args, env, "port", TRANSPORT["port"], int)
    if not 0 <= port <= 65535:
        raise UsageError(f"--port: must be between 1 and 65535 (0: any free port), not {port}")
    max_connections = _transport_value(args, env, "max_connections", TRANSPORT["max_connections"], int)
    if max_connections < 1:
        raise UsageError(f"--max-connections: must be at least 1, not {max_connections}")
    timeouts = {name: _transport_value(args, env, name, TRANSPORT[name], float) for name in (
        "keep_alive_timeout_secs", "request_timeout_secs", "shutdown_timeout_secs", "ws_ping_interval_secs")}
    for name, value in timeouts.items():
        if not (value > 0 and math.isfinite(value)):  # NaN fails both
            raise UsageError(f"{_flag(name)}: must be a finite number greater than 0, not {value}")
    config = ServerConfig(host=_transport_value(args, env, "host", TRANSPORT["host"], str), port=port,
                          max_connections=max_connections, auth_token=_auth_token(args, env),
                          tls=_tls_context(args, env), access_log=_flag_on(args, env, "access_log"),
                          **timeouts)
    import anyio

    peers = _transport_value(args, env, "indexer_peers", TRANSPORT["indexer_peers"], str)
    if peers:
        from .transports.peers import recover_from_peers

        timeout = _transport_value(args, env, "indexer_peer_timeout_secs", TRANSPORT["indexer_peer_timeout_secs"], float)
        if not timeout > 0 or timeout == float("inf"):
            raise UsageError("--indexer-peer-timeout-secs: must be a finite number greater than 0")
        anyio.run(recover_from_peers, service, [p.strip() for p in peers.split(",") if p.strip()],
                  timeout, backend=backend)
    try:
        anyio.run(serve, service, config, backend=backend)
    except RuntimeError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        log("info", "stopped")
    return 0


def _print_config(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    """Every setting, TOML-shaped, with its source: flag, variable, file or default."""
    sources: dict[str, str] = {}
    settings = settings_from(args, env, sources)
    lines = []
    for field in _SETTING_FIELDS:
        value = getattr(settings, field.name)
        lines.append(f"{field.name} = {_toml(value)}  # {sources.get(field.name, 'default')}")
    from_file, file_source = _config_file(args, env)
    for name, default in TRANSPORT.items():
        if args.command == "stdio" and name not in ("backend", "log_level", "log_format", "random_state", "restore",
                                                     "router_tracking_key_file"):
            continue
        cast = type(default) if default is not None else int if name == "random_state" else str
        # Checked as the command would check it.
        value = _flag_on(args, env, name) if name == "access_log" else _transport_value(args, env, name, default, cast)
        source = (_flag(name) if getattr(args, name, None) is not None else _env(name) if _env(name) in env
                  else f"{file_source}: {name}" if name in from_file else "default")
        lines.append(f"{name} = {_toml(value)}  # {source}")
    print("\n".join(lines))
    return 0


def _toml(value: Any) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            raise UsageError("a command is required (serve, stdio, relay)")
        if args.command == "relay":
            return _relay(args, env)
        if args.print_config:
            return _print_config(args, env)
        return _stdio(args, env) if args.command == "stdio" else _serve(args, env)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
