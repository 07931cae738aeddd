"""What `serve` is told at start: where to listen, its limits and timeouts, TLS, snapshots, the
ledger replicas share, and the gateway's endpoint picker."""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["ExtProcOptions", "LedgerOptions", "ServerConfig", "advertised_url"]


def advertised_url(host: str, port: int, tls: bool, advertise_url: str | None) -> str | None:
    """Where peers reach this replica for `/dump` (the ledger's registry): `--advertise-url`, else
    the listening address (None on a wildcard address: no peer could use it)."""
    if advertise_url is not None:
        return advertise_url
    if host in ("0.0.0.0", "::", ""):  # noqa: S104 - compared, not bound
        return None
    return f"{'https' if tls else 'http'}://{f'[{host}]' if ':' in host else host}:{port}"


@attrs.frozen
class LedgerOptions:
    url: str
    scope: str = "default"
    batch: int = 64
    feed_max: int = 1_000_000
    advertise_url: str | None = None  # this replica's URL for peers; default: the listening one
    warm_from: tuple[str, ...] = ()  # peers whose /dump fills the index before the ledger is joined
    warm_timeout_secs: float = 10.0


class ServerConfig:
    def __init__(self, host: str = "127.0.0.1", port: int = 8092, max_connections: int = 1024,
                 keep_alive_timeout_secs: float = 5.0, request_timeout_secs: float = 30.0,
                 shutdown_timeout_secs: float = 10.0, ws_ping_interval_secs: float = 20.0,
                 auth_token: bytes | None = None, tls: ssl.SSLContext | None = None,
                 access_log: bool = False, snapshot: str | None = None,
                 snapshot_interval_secs: float = 60.0, drain_delay_secs: float = 0.0,
                 ledger: LedgerOptions | None = None, reuse_port: bool = False,
                 supervisor_pid: int | None = None, max_buffer_bytes: int = 256 << 20,
                 ext_proc: ExtProcOptions | None = None, engine_metrics_interval_secs: float = 10.0) -> None:
        self.engine_metrics_interval_secs = engine_metrics_interval_secs  # scrapes of metrics_endpoints
        self.ext_proc = ext_proc  # also serve Envoy's ext_proc (an endpoint picker) with these options
        self.max_buffer_bytes = max_buffer_bytes  # request bodies and WebSocket messages in flight
        self.supervisor_pid = supervisor_pid  # --processes: stop when this parent is gone
        self.ledger = ledger  # share bookings and the catalog through this ledger (service.share first)
        self.reuse_port = reuse_port  # several processes on one port (--processes)
        self.drain_delay_secs = drain_delay_secs  # serve, marked not ready, before draining
        self.snapshot = snapshot  # write the dump here periodically and at shutdown
        self.snapshot_interval_secs = snapshot_interval_secs  # 0: only at shutdown
        self.access_log = access_log  # log every answer (method, path, status, milliseconds)
        self.ws_ping_interval_secs = ws_ping_interval_secs
        self.tls = tls  # serve HTTPS and wss:// with this context
        self.auth_token = auth_token  # bearer token every route but the open ones needs
        self.host, self.port, self.max_connections = host, port, max_connections
        self.keep_alive_timeout_secs = keep_alive_timeout_secs
        self.request_timeout_secs = request_timeout_secs
        self.shutdown_timeout_secs = shutdown_timeout_secs


@attrs.frozen
class ExtProcOptions:
    """`--ext-proc-port`: an endpoint picker for Envoy's ext_proc filter (docs/GATEWAY.md)."""

    port: int
    host: str = "127.0.0.1"
    tokenizers: Mapping[str, Any] = attrs.field(factory=dict)  # model -> adapters.openai.ChatTokenizer
    tls_cert: str | None = None  # serve's --tls-cert and --tls-key: gRPC over TLS too (ALPN h2)
    tls_key: str | None = None
