"""Where each setting comes from: a flag, a `SELECTION_PROTO_*` variable, one of Dynamo 1.6.1's
variables, the TOML file, or its default (in that order), checked and converted once; the
transport's settings too, and `--print-config`, which shows each with its source."""

from __future__ import annotations

import argparse
import tomllib
import typing
from collections.abc import Mapping
from typing import Any, Final

import attrs

from .core.base.settings import Settings

__all__ = ["DYNAMO_ENV", "DYNAMO_FLAGS", "SETTING_FIELDS", "TRANSPORT", "UsageError", "config_file", "env_name", "ext_proc_options", "flag_name", "settings_with",
           "flag_on", "kind_of", "print_config", "settings_from", "transport_value", "warn_unknown_env"]


SETTING_FIELDS = attrs.fields(Settings)


TRUE = ("true", "1", "yes", "on")


FALSE = ("false", "0", "no", "off")


class UsageError(Exception):
    pass


def kind_of(field: attrs.Attribute[Any]) -> tuple[str, tuple[str, ...]]:
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
    kind, choices = kind_of(field)
    if isinstance(raw, str):
        text = raw.strip()
        if _nullable(field) and text.lower() == "none":
            return None
        if kind == "bool":
            if text.lower() in TRUE:
                return True
            if text.lower() in FALSE:
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


def settings_with(base: Settings, text: str, source: str) -> Settings:
    """`base` with the settings of `text`, `KEY=VALUE[,KEY=VALUE...]` (values as in variables)."""
    fields = {f.name: f for f in SETTING_FIELDS}
    changes: dict[str, Any] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        name, equals, raw = pair.partition("=")
        name = name.strip().replace("-", "_")
        if not equals or name not in fields:
            raise UsageError(f"{source}: expected KEY=VALUE with a setting's name, not {pair!r}")
        changes[name] = _convert(fields[name], raw, f"{source} {name}")
    try:
        return attrs.evolve(base, **changes)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{source}: {exc}") from None


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
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


# What each setting does, for `--help` (core.md §3 has the whole story of each).
SETTING_HELP: Final[Mapping[str, str]] = {
    "kv_events": "where KV events come from: subscribe to engines, push to /kv_events, off, or "
                 "approximate (booked prompts count as cached)",
    "overlap_score_credit": "how much a cached block lowers a rank's prefill cost, 0-1",
    "overlap_score_credit_decay": "how fast that credit fades with the rank's load",
    "prefill_load_scale": "weight of prefill tokens in the cost",
    "overlap_score_weight": "Dynamo's older weight of cached blocks (sets the two above when they are not)",
    "decode_active_request_weight": "weight of each active request in the decode cost",
    "host_cache_hit_weight": "a host-memory block's worth against a device block",
    "disk_cache_hit_weight": "a disk or external block's worth against a device block",
    "temperature": "softmax temperature of the choice (0: the lowest cost wins)",
    "router_policy": "dynamo: Dynamo 1.6.1's cost, answers byte-identical; ttft: the least predicted time to "
                     "first token (docs/ROUTING.md)",
    "shadow_policy": "a second router_policy that scores every selection without acting: /metrics and /status "
                     "show how often it disagrees and the predicted time to first token of both choices",
    "track_active_blocks": "count booked decode blocks as load",
    "assume_kv_reuse": "a booked prompt's blocks count as cached on its rank until events say otherwise",
    "track_prefill_tokens": "count booked prefill tokens as load",
    "queue_threshold": "queue selections when every rank is loaded past this share (none: never queue)",
    "queue_policy": "order of queued selections",
    "queue_timeout_secs": "a queued selection is answered 503 after this long",
    "queue_max_pending": "queued selections at most per key",
    "flow_classes": "policy classes, 'name:weight[:max_queued=N][:max_queued_tokens=N][:queue_timeout_secs=S],...'; "
                    "weights share uncached tokens, the first is the default (docs/FLOW_CONTROL.md)",
    "fairness": "queued selections share by fairness ID (off: first come, first served within a class)",
    "fairness_max_queued": "queued selections at most per fairness ID and key (429 past it)",
    "fairness_max_queued_tokens": "queued uncached tokens at most per fairness ID and key (429 past it)",
    "fairness_burst_tokens": "a fairness ID that starts waiting again, having used less than its share, may run "
                             "up to this many uncached tokens ahead of those waiting all along (docs/FLOW_CONTROL.md)",
    "fairness_kv_share": "while another fairness ID has a request in flight or waiting, a fairness ID's requests "
                         "wait once the prompts it has in flight hold more than this times its equal share of the "
                         "key's KV cache (docs/FLOW_CONTROL.md)",
    "priority_promote_secs": "a queued selection climbs one priority tier per this many seconds waited",
    "shed_sheddable": "refuse at once (429) a selection with priority < 0 that would queue",
    "overload_status_code": "the status of refusals that say 'not now' (429, or Dynamo's 529)",
    "active_request_expiry_secs": "a booking nobody frees ends after this long",
    "active_decode_blocks_threshold": "skip ranks with more active decode blocks than this share",
    "active_prefill_tokens_threshold": "skip ranks with more booked prefill tokens than this",
    "active_prefill_tokens_threshold_frac": "the same, as a share of max_num_batched_tokens",
    "zmq_endpoints": "accept tcp:// and ipc:// KV event endpoints",
    "max_keys": "model/tenant keys at most",
    "max_workers_per_key": "workers at most per key",
    "max_dp_size": "data-parallel ranks at most per worker",
    "max_tombstones": "deleted workers remembered at most",
    "max_reservations_per_key": "bookings at most per key",
    "max_prompt_tokens": "tokens at most in one prompt",
    "max_id_length": "characters at most in a name or id",
    "max_subscriptions": "outbound KV event subscriptions at most",
    "max_record_bytes": "JSON bytes at most of one worker record",
    "max_state_bytes": "estimated bytes at most of the index, bookings and catalog (507 past it)",
    "max_events_per_step": "KV events applied at most between two looks at other work",
    "explain_header": "answer each selection with an x-selection-decision header: the chosen worker, "
                      "its cached tokens, the runner-up and the margin (HTTP and the picker)",
    "kv_verdict_window_secs": "a worker whose bookings brought no KV event for this long is no_events "
                              "(docs/VERDICT.md)",
    "router_ttl_secs": "kv_events=approximate: how long a booked prompt counts as cached",
    "predicted_ttl_secs": "with real events, keep a predicted index of booked prompts this long",
    "router_tracking_hash": "the hash of tracked prompts' sequence hashes",
    "router_tracking_key_id": "the key id of keyed-xxh3-v1",
    "session_affinity_ttl_secs": "keep a session on its rank this long after its last release "
                                 "(none: off)",
    "max_sessions_per_key": "session bindings at most per key",
    "selection_cache_ttl_secs": "a pending selection waits this long for its booking",
    "selection_cache_max_entries": "pending selections at most",
    "selection_cache_max_bytes": "bytes at most of pending selections",
}


# Dynamo's flags for our settings (`--no-…` too, for booleans).
DYNAMO_FLAGS: Final[Mapping[str, str]] = {"assume_kv_reuse": "--router-assume-kv-reuse"}


# Dynamo variables that choose what one event loop cannot or does not need: read, and ignored.
IGNORED_ENV: Final = ("DYN_ROUTER_EVENT_THREADS",)


# Dynamo variables for features we do not have yet: refused at start, never silently ignored.
UNSUPPORTED_ENV: Final = ("DYN_ROUTER_TRACK_OUTPUT_BLOCKS",)


# Settings of the transports and the command line, beside `Settings`: also TOML keys.
TRANSPORT: Final[Mapping[str, Any]] = {
    "host": "127.0.0.1", "port": 8092, "max_connections": 1024, "max_buffer_bytes": 256 << 20,
    "keep_alive_timeout_secs": 5.0,
    "request_timeout_secs": 30.0, "shutdown_timeout_secs": 10.0, "ws_ping_interval_secs": 20.0,
    "backend": "asyncio", "log_level": "info", "log_format": "json", "random_state": None, "restore": None, "indexer_peers": None,
    "indexer_peer_timeout_secs": 10.0, "router_tracking_key_file": None, "auth_token_file": None,
    "tls_cert": None, "tls_key": None, "access_log": None, "snapshot": None, "snapshot_interval_secs": 60.0,
    "drain_delay_secs": 0.0, "ledger": None, "ledger_scope": "default", "admission": "advisory",
    "ledger_failure": "open", "ledger_batch": 64, "ledger_outbox_max": 100_000, "ledger_feed_max": 1_000_000,
    "processes": 1, "advertise_url": None, "ledger_free_grace_secs": 2.0,
    "ext_proc_port": None, "ext_proc_host": None, "tokenizer": None, "engine_metrics_interval_secs": 10.0,
}


TRANSPORT_KEYS: Final = tuple(TRANSPORT)


# Our variables that are not settings (the test suite's, the config file's).
_OTHER_ENV: Final = ("SELECTION_PROTO_CONFIG", "SELECTION_PROTO_PROCESS_INDEX", "SELECTION_PROTO_SUPERVISOR_PID", "SELECTION_PROTO_VECTORS", "SELECTION_PROTO_REQUIRE_REFERENCE")


def config_file(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[dict[str, Any], str]:
    """The TOML file's keys (read once per run) and how errors name it."""
    cached = getattr(args, "_file", None)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    path = getattr(args, "config", None) or env.get(env_name("config"))
    values: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as fh:
                values = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise UsageError(f"--config {path}: {exc}") from None
        known = {f.name for f in SETTING_FIELDS} | set(TRANSPORT_KEYS)
        for name in values:
            if name not in known:
                raise UsageError(f"--config {path}: unknown setting {name!r}")
    args._file = (values, f"--config {path}")
    return args._file  # type: ignore[no-any-return]


def transport_value(args: argparse.Namespace, env: Mapping[str, str], name: str, default: Any,
                     cast: type) -> Any:
    """A transport setting: its flag, else `SELECTION_PROTO_*`, else the TOML file, else `default`."""
    raw = getattr(args, name, None)
    source = flag_name(name)
    if raw is None and env_name(name) in env:
        raw, source = env[env_name(name)], env_name(name)
    if raw is None:
        from_file, file_source = config_file(args, env)
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


def warn_unknown_env(env: Mapping[str, str]) -> None:
    from .transports.logs import log

    known = {env_name(f.name) for f in SETTING_FIELDS} | {env_name(n) for n in TRANSPORT_KEYS} | set(_OTHER_ENV)
    for name in sorted(n for n in env if n.startswith("SELECTION_PROTO_") and n not in known):
        log("warning", "unknown_variable", name=name, detail="not a setting; ignored")


def settings_from(args: argparse.Namespace, env: Mapping[str, str],
                  sources: dict[str, str] | None = None) -> Settings:
    """The settings of flags, `SELECTION_PROTO_*`, Dynamo's variables and the TOML file, in that
    order; `sources`, when given, receives where each came from."""
    from_file, file_source = config_file(args, env)
    unsupported = [name for name in UNSUPPORTED_ENV if name in env]
    if unsupported:
        raise UsageError(f"{unsupported[0]}: not supported yet (automatic output tracking is open work); "
                         "unset it")
    values: dict[str, Any] = {}
    sources = {} if sources is None else sources
    _dynamo_kv_mode(env, values, sources)
    for field in SETTING_FIELDS:
        name = field.name
        flag_value = getattr(args, name, None)
        dynamo = next((var for var in DYNAMO_ENV.get(name, ()) if var in env), None)
        if flag_value is not None:
            values[name], sources[name] = _convert(field, flag_value, flag_name(name)), flag_name(name)
        elif env_name(name) in env:
            values[name], sources[name] = _convert(field, env[env_name(name)], env_name(name)), env_name(name)
        elif dynamo is not None:
            values[name], sources[name] = _convert(field, env[dynamo], dynamo), dynamo
        elif name in from_file:
            source = f"{file_source}: {name}"
            raw = from_file[name]
            if kind_of(field)[0] == "bool" and not isinstance(raw, bool):
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
        if text not in (*TRUE, *FALSE):
            raise UsageError(f"{name}: invalid boolean value {env[name]!r}")
        approximate = text in FALSE
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


def flag_on(args: argparse.Namespace, env: Mapping[str, str], name: str) -> bool:
    """A boolean transport setting: the flag, `SELECTION_PROTO_*` (true/false...), or a TOML boolean."""
    if getattr(args, name, None) is not None:
        return True
    if env_name(name) in env:
        text = env[env_name(name)].strip().lower()
        if text not in (*TRUE, *FALSE):
            raise UsageError(f"{env_name(name)}: invalid boolean value {env[env_name(name)]!r}")
        return text in TRUE
    from_file, source = config_file(args, env)
    value = from_file.get(name, False)
    if not isinstance(value, bool):
        raise UsageError(f"{source}: {name}: expected a boolean, not {value!r}")
    return value


def print_config(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    """Every setting, TOML-shaped, with its source: flag, variable, file or default."""
    sources: dict[str, str] = {}
    settings = settings_from(args, env, sources)
    lines = []
    for field in SETTING_FIELDS:
        value = getattr(settings, field.name)
        lines.append(f"{field.name} = {_toml(value)}  # {sources.get(field.name, 'default')}")
    from_file, file_source = config_file(args, env)
    for name, default in TRANSPORT.items():
        if args.command == "stdio" and name not in ("backend", "log_level", "log_format", "random_state", "restore",
                                                     "router_tracking_key_file"):
            continue
        cast = type(default) if default is not None else int if name == "random_state" else str
        # Checked as the command would check it.
        value = flag_on(args, env, name) if name == "access_log" else transport_value(args, env, name, default, cast)
        source = (flag_name(name) if getattr(args, name, None) is not None else env_name(name) if env_name(name) in env
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


def require_extra(what: str, extra: str, *modules: str) -> None:
    """Refuse `what` in one line that names the extra to install, when one of its modules is missing
    (a bare install serves without any extra)."""
    import importlib.util

    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise UsageError(f"{what}: no module named {module!r}; install 'selection-proto[{extra}]'")


def ext_proc_options(args: argparse.Namespace, env: Mapping[str, str], host: str) -> Any:
    """`serve`'s endpoint picker options (a `transports.config.ExtProcOptions`), or None without
    `--ext-proc-port`."""
    port = transport_value(args, env, "ext_proc_port", None, int)
    if port is None:
        return None
    if not 0 <= port <= 65535:
        raise UsageError(f"--ext-proc-port: must be between 1 and 65535 (0: any free port), not {port}")
    pairs = []
    for item in (transport_value(args, env, "tokenizer", None, str) or "").split(","):
        model, sep, path = item.strip().partition("=")
        if item.strip() and (not sep or not model or not path):
            raise UsageError(f"--tokenizer: expected MODEL=PATH, not {item.strip()!r}")
        if item.strip():
            pairs.append((model, path))
    require_extra("--ext-proc-port", "gateway", "hpack", "grpc_health", "envoy", "tokenizers", "jinja2")
    from .transports.config import ExtProcOptions
    from .transports.ext_proc import load_tokenizers
    try:
        tokenizers = load_tokenizers(tuple(pairs))
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None
    return ExtProcOptions(port, transport_value(args, env, "ext_proc_host", None, str) or host, tokenizers,
                          transport_value(args, env, "tls_cert", None, str), transport_value(args, env, "tls_key", None, str))
