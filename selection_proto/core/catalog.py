"""Worker metadata rules: derived values, missing metadata, event endpoint validation (core.md §6)."""

from __future__ import annotations

from .settings import Settings
from .types import WorkerRequest
from .wire import parse_uint

__all__ = [
    "TOPOLOGY_PREFIX",
    "dp_range",
    "effective_taints",
    "endpoint_failure",
    "event_endpoints",
    "missing_metadata",
    "validate_endpoint",
]

TOPOLOGY_PREFIX = "dynamo.topology/"
_U32_END = 1 << 32


def dp_range(req: WorkerRequest) -> range:
    start = req.data_parallel_start_rank or 0
    size = 1 if req.data_parallel_size is None else req.data_parallel_size
    return range(start, min(start + size, _U32_END))


def event_endpoints(req: WorkerRequest) -> dict[int, str]:
    if req.kv_events_endpoints:
        return dict(req.kv_events_endpoints)
    size = 1 if req.data_parallel_size is None else req.data_parallel_size
    if size == 1 and req.kv_events_endpoint is not None:
        return {req.data_parallel_start_rank or 0: req.kv_events_endpoint}
    return {}


def effective_taints(req: WorkerRequest) -> frozenset[str]:
    return frozenset(req.taints) | {f"{TOPOLOGY_PREFIX}{k}={v}" for k, v in req.topology_domains.items()}


def missing_metadata(req: WorkerRequest, settings: Settings) -> list[str]:
    reasons: list[str] = []
    if not req.endpoint:
        reasons.append("endpoint is required")
    if not req.block_size:
        reasons.append("block_size must be greater than 0")
    if req.data_parallel_size == 0:
        reasons.append("data_parallel_size must be greater than 0")
    if settings.queueing and req.max_num_batched_tokens is None:
        reasons.append("max_num_batched_tokens is required while queueing is enabled")
    if settings.kv_events == "subscribe":
        endpoints = event_endpoints(req)
        for r in dp_range(req):
            if not endpoints.get(r):
                reasons.append(f"kv_events endpoint is required for dp_rank {r}")
    return reasons


def _parse_u16(text: str) -> str | None:
    value = parse_uint(text, 16)
    return value if isinstance(value, str) else None


def validate_endpoint(endpoint: str, *, zmq_ok: bool, allow_ws: bool) -> str | None:
    """The §6.3 error text for an event (or replay) endpoint, or None when it is valid."""
    scheme, sep, address = endpoint.partition("://")
    if not sep:
        return f"invalid ZMQ endpoint `{endpoint}`: missing scheme"
    if not address:
        return f"invalid ZMQ endpoint `{endpoint}`: missing address"
    if scheme in ("tcp", "ipc") and not zmq_ok:
        return f"invalid ZMQ endpoint `{endpoint}`: ZMQ endpoints need the optional extra `zmq`"
    if scheme == "tcp":
        tcp_host, colon, tcp_port = address.rpartition(":")
        if not colon:
            return f"invalid ZMQ endpoint `{endpoint}`: missing TCP port"
        if not tcp_host:
            return f"invalid ZMQ endpoint `{endpoint}`: missing TCP host"
        if tcp_host.startswith("["):
            if not tcp_host.endswith("]"):
                return f"invalid ZMQ endpoint `{endpoint}`: missing closing `]`"
        elif ":" in tcp_host:
            return f"invalid ZMQ endpoint `{endpoint}`: missing TCP port"
        why = _parse_u16(tcp_port)
        if why is not None:
            return f"invalid ZMQ endpoint `{endpoint}`: invalid TCP port: {why}"
        return None
    if scheme == "ipc":
        return None
    if scheme in ("ws", "wss") and allow_ws:
        authority = address
        port: str | None
        for stop in ("/", "?"):
            authority = authority.split(stop, 1)[0]
        if authority.startswith("["):
            close = authority.find("]")
            host, rest = (authority[: close + 1], authority[close + 1 :]) if close >= 0 else (authority, "")
            port = rest[1:] if rest.startswith(":") else None
            if rest and not rest.startswith(":"):
                return f"invalid WebSocket endpoint `{endpoint}`: invalid port"
        else:
            host, colon, port_text = authority.partition(":")
            port = port_text if colon else None
        if not host or host == "[]":
            return f"invalid WebSocket endpoint `{endpoint}`: missing host"
        if port is not None and _parse_u16(port) is not None:
            return f"invalid WebSocket endpoint `{endpoint}`: invalid port"
        return None
    return f"invalid ZMQ endpoint `{endpoint}`: unsupported scheme `{scheme}`"


def endpoint_failure(req: WorkerRequest, settings: Settings) -> str | None:
    """The first invalid event or replay endpoint (subscribe mode only), as a failure text."""
    if settings.kv_events != "subscribe":
        return None
    zmq_ok = settings.zmq_endpoints
    for r, endpoint in sorted(event_endpoints(req).items()):
        error = validate_endpoint(endpoint, zmq_ok=zmq_ok, allow_ws=True)
        if error is not None:
            return f"invalid kv_events endpoint for worker {req.worker_id} dp_rank {r}: {error}"
        if req.replay_endpoint is not None:
            error = validate_endpoint(req.replay_endpoint, zmq_ok=zmq_ok, allow_ws=False)
            if error is not None:
                return f"invalid replay endpoint for worker {req.worker_id} dp_rank {r}: {error}"
    return None
