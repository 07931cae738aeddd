"""Request types of api.md §3 and §4 as frozen attrs classes, and the worker record.

Request members carry their JSON kind in attrs metadata (read by codec.py and by the OpenAPI
generator); constructing a request directly runs the same checks as decoding it from JSON. The
answers are in `responses`.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any, ClassVar, Final, Literal
from urllib.parse import urlsplit

import attrs

from .codec import (
    ARRAY,
    BOOL,
    ENUM,
    F32,
    F64,
    I64,
    MAP,
    NULLABLE,
    OBJECT,
    STR,
    U32,
    U64,
    validate_instance,
)

__all__ = [
    "BlockExtraInfo",
    "Lifecycle",
    "MmObject",
    "MmRoutingInfo",
    "ObservedCache",
    "OutputBlockRequest",
    "OverlapScoresRequest",
    "PdOptions",
    "PinnedWorker",
    "PotentialLoadsRequest",
    "ReservationRequest",
    "RouterConfigOverride",
    "RoutingConstraints",
    "SelectAndReserveRequest",
    "SelectPdAndReserveRequest",
    "SelectPdRequest",
    "SelectRequest",
    "SessionContext",
    "WorkerCatalogRecord",
    "WorkerPatchRequest",
    "WorkerRequest",
]

Lifecycle = Literal["incomplete", "schedulable", "draining", "unschedulable"]


def member(
    kind: tuple[Any, ...],
    *,
    default: Any = None,
    factory: Any = None,
    nullable: bool = True,
    required: bool = False,
    rule: Any = None,
    store: Any = None,
) -> Any:
    """An attrs field that knows its JSON kind. `nullable`: `null` means absent; `store` converts
    the checked value into its stored form (sets become sorted tuples, maps sorted dicts)."""
    metadata = {"kind": kind, "nullable": nullable, "required": required, "rule": rule, "store": store}
    if required:
        return attrs.field(metadata=metadata)
    if factory is not None:
        return attrs.field(factory=factory, metadata=metadata)
    return attrs.field(default=default, metadata=metadata)


def _sorted_set(items: Any) -> tuple[str, ...]:
    return tuple(sorted(set(items)))


def _sorted_map(m: Mapping[Any, Any]) -> dict[Any, Any]:
    return {k: m[k] for k in sorted(m)}


def _in_unit(v: float) -> str | None:
    return None if 0.0 <= v <= 1.0 else "must be in [0, 1]"


def _credit_rule(v: float) -> str | None:
    if 0.0 <= v <= 1.0:
        return None
    return "must be in [0, 1]; to weight prefill load more, raise prefill_load_scale instead"


def _positive(v: float) -> str | None:
    return None if 0.0 < v < float("inf") else "must be a finite number greater than 0"


def _http_url(v: str) -> str | None:
    """An engine's metrics URL: `http://host[:port]/path`, at most 2,048 characters."""
    parts = urlsplit(v) if len(v) <= 2048 and v.isascii() and v.isprintable() else None
    try:
        ok = parts is not None and parts.scheme == "http" and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is not a number, or out of range
        ok = False
    return None if ok else "must be an http://host[:port]/path URL of at most 2048 characters"


def _tcp_port(v: int) -> str | None:
    return None if 1 <= v <= 65535 else "must be a TCP port (1 to 65535)"


def _host(v: str) -> str | None:
    """A host name or IP address as an engine's bootstrap server listens on it."""
    ok = 0 < len(v) <= 255 and v.isascii() and v.isprintable() and not any(
        c.isspace() or c in "/?#@" for c in v)
    return None if ok else "must be a host name or IP address of at most 255 characters"


ROLES: Final = ("prefill", "decode", "both")


def _finite_nonneg(v: float) -> str | None:
    return None if v >= 0.0 and v != float("inf") else "must be a finite number >= 0"


class _Checked:
    """Direct construction runs the JSON checks (core.md §4.2)."""

    _json_aliases: ClassVar[Mapping[str, str]] = {}

    def __attrs_post_init__(self) -> None:
        validate_instance(self)


_TENANT_ALIAS: Mapping[str, str] = {"routing_group": "tenant_id"}

_WORKER_FIELDS_ORDER = (
    "endpoint",
    "kv_events_endpoint",
    "kv_events_endpoints",
    "replay_endpoint",
    "block_size",
    "data_parallel_start_rank",
    "data_parallel_size",
    "max_num_batched_tokens",
    "total_kv_blocks",
    "stable_routing_id",
    "is_eagle",
    "taints",
    "topology_domains",
    "kv_transfer_domain",
    "kv_transfer_enforcement",
    "kv_transfer_preferred_weight",
)


_PD_FIELDS = ("role", "local_prefill", "bootstrap_host", "bootstrap_port")


@attrs.frozen(kw_only=True)
class WorkerRequest(_Checked):
    """`POST /workers` (api.md §3.1)."""

    _json_aliases: ClassVar[Mapping[str, str]] = _TENANT_ALIAS

    worker_id: int = member(U64, required=True, nullable=False)
    model_name: str = member(STR, default="default", nullable=False)
    tenant_id: str = member(STR, default="default", nullable=False)
    endpoint: str | None = member(STR)
    kv_events_endpoint: str | None = member(STR)
    kv_events_endpoints: dict[int, str] = member(
        MAP(STR, key="u32"), factory=dict, nullable=False, store=_sorted_map
    )
    replay_endpoint: str | None = member(STR)
    block_size: int | None = member(U32)
    data_parallel_start_rank: int | None = member(U32)
    data_parallel_size: int | None = member(U32)
    max_num_batched_tokens: int | None = member(U64)
    total_kv_blocks: int | None = member(U64)
    stable_routing_id: str | None = member(STR)
    is_eagle: bool | None = member(BOOL)  # the key's prompts use eagle windows (1.6.1); all its workers agree
    taints: tuple[str, ...] = member(ARRAY(STR), factory=tuple, nullable=False, store=_sorted_set)
    topology_domains: dict[str, str] = member(
        MAP(STR), factory=dict, nullable=False, store=_sorted_map
    )
    kv_transfer_domain: str | None = member(STR)
    kv_transfer_enforcement: str | None = member(ENUM("required", "preferred"))
    kv_transfer_preferred_weight: float | None = member(F32)
    # Ours: the worker's prefill speed, for `router_policy=ttft` in a mixed fleet (listed when set).
    prefill_tokens_per_sec: float | None = member(F64, rule=_positive)
    # Ours: the engine's Prometheus metrics, scraped now and then and shown in `/loads` (listed when set).
    metrics_endpoint: str | None = member(STR, rule=_http_url)
    # Ours: prefill/decode disaggregation (docs/PD.md), each listed when set. `role` null is
    # `both`; `local_prefill` null is the role's answer (a `both` worker prefills, a `decode`
    # worker that does not say so does not).
    role: str | None = member(ENUM(*ROLES))
    local_prefill: bool | None = member(BOOL)
    bootstrap_host: str | None = member(STR, rule=_host)
    bootstrap_port: int | None = member(U32, rule=_tcp_port)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "worker_id": self.worker_id,
            "model_name": self.model_name,
            "tenant_id": self.tenant_id,
            "routing_group": self.tenant_id,  # 1.6.1's name
        }
        for name in _WORKER_FIELDS_ORDER:
            value = getattr(self, name)
            if name == "kv_events_endpoints":
                value = {str(k): v for k, v in value.items()}
            elif name == "taints":
                value = list(value)
            out[name] = value
        if self.prefill_tokens_per_sec is not None:
            out["prefill_tokens_per_sec"] = self.prefill_tokens_per_sec
        if self.metrics_endpoint is not None:
            out["metrics_endpoint"] = self.metrics_endpoint
        for name in _PD_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


@attrs.frozen(kw_only=True)
class WorkerPatchRequest(_Checked):
    """`PATCH /workers/{id}` (api.md §3.2): every member optional; `None` keeps the stored value."""

    endpoint: str | None = member(STR)
    kv_events_endpoint: str | None = member(STR)
    kv_events_endpoints: dict[int, str] | None = member(MAP(STR, key="u32"), store=_sorted_map)
    replay_endpoint: str | None = member(STR)
    block_size: int | None = member(U32)
    data_parallel_start_rank: int | None = member(U32)
    data_parallel_size: int | None = member(U32)
    max_num_batched_tokens: int | None = member(U64)
    total_kv_blocks: int | None = member(U64)
    stable_routing_id: str | None = member(STR)
    is_eagle: bool | None = member(BOOL)
    taints: tuple[str, ...] | None = member(ARRAY(STR), store=_sorted_set)
    topology_domains: dict[str, str] | None = member(MAP(STR), store=_sorted_map)
    kv_transfer_domain: str | None = member(STR)
    kv_transfer_enforcement: str | None = member(ENUM("required", "preferred"))
    kv_transfer_preferred_weight: float | None = member(F32)
    prefill_tokens_per_sec: float | None = member(F64, rule=_positive)
    metrics_endpoint: str | None = member(STR, rule=_http_url)
    role: str | None = member(ENUM(*ROLES))
    local_prefill: bool | None = member(BOOL)
    bootstrap_host: str | None = member(STR, rule=_host)
    bootstrap_port: int | None = member(U32, rule=_tcp_port)


@attrs.frozen(kw_only=True)
class WorkerCatalogRecord:
    """A catalog entry: the request as given plus its lifecycle (api.md §3.3)."""

    request: WorkerRequest
    lifecycle: Lifecycle
    not_schedulable_reasons: tuple[str, ...] = ()

    @property
    def worker_id(self) -> int:
        return self.request.worker_id

    @property
    def key(self) -> tuple[str, str]:
        return (self.request.model_name, self.request.tenant_id)

    def to_json(self) -> dict[str, Any]:
        req = self.request.to_json()
        out: dict[str, Any] = {
            "worker_id": req.pop("worker_id"),
            "model_name": req.pop("model_name"),
            "tenant_id": req.pop("tenant_id"),
            "routing_group": req.pop("routing_group"),
            "lifecycle": self.lifecycle,
        }
        for name, value in req.items():
            if name == "kv_events_endpoints" and not value:
                continue
            out[name] = value
        if self.not_schedulable_reasons:
            out["not_schedulable_reasons"] = list(self.not_schedulable_reasons)
        return out


@attrs.frozen(kw_only=True)
class ObservedCache(_Checked):
    """The body a prefill_complete or a free may carry: what the engine found cached (verdict.py)."""

    cached_tokens: int | None = member(U64)


@attrs.frozen(kw_only=True)
class RouterConfigOverride(_Checked):
    """Per-request cost settings (core.md §9.6); `None` falls back to the service settings."""

    overlap_score_credit: float | None = member(F64, rule=_credit_rule)
    prefill_load_scale: float | None = member(F64, rule=_finite_nonneg)
    overlap_score_weight: float | None = member(F64, rule=_finite_nonneg)
    router_temperature: float | None = member(F64, rule=_finite_nonneg)
    assume_kv_reuse: bool | None = member(BOOL)
    track_prefill_tokens: bool | None = member(BOOL)
    shared_cache_multiplier: float | None = member(F64, rule=_in_unit)


@attrs.frozen(kw_only=True)
class PinnedWorker(_Checked):
    worker_id: int = member(U64, required=True, nullable=False)
    dp_rank: int = member(U32, required=True, nullable=False)


@attrs.frozen(kw_only=True)
class RoutingConstraints(_Checked):
    required_taints: tuple[str, ...] = member(
        ARRAY(STR), factory=tuple, nullable=False, store=_sorted_set
    )
    preferred_taints: dict[str, float] = member(MAP(F64), factory=dict, nullable=False)



NO_CONSTRAINTS: Final = RoutingConstraints()


@attrs.frozen(kw_only=True)
class MmObject(_Checked):
    """One multimodal item of a block: its hash (hashed into the block) and its offsets (not)."""

    mm_hash: int = member(U64, required=True, nullable=False)
    offsets: list[list[int]] = member(ARRAY(ARRAY(U64)), required=True, nullable=False)


@attrs.frozen(kw_only=True)
class BlockExtraInfo(_Checked):
    """The multimodal items of one block of a prompt (1.6.1)."""

    mm_objects: list[MmObject] = member(ARRAY(OBJECT(MmObject)), required=True, nullable=False)


@attrs.frozen(kw_only=True)
class MmRoutingInfo(_Checked):
    """1.6.1's `mm_routing_info`: the tokens to route by (placeholders expanded) and their blocks'
    multimodal items; non-empty `routing_token_ids` replace `token_ids`."""

    routing_token_ids: array[int] = member(ARRAY(U32), required=True, nullable=False)
    block_mm_infos: list[BlockExtraInfo | None] = member(ARRAY(NULLABLE(OBJECT(BlockExtraInfo))),
                                                         factory=list, nullable=False)


@attrs.frozen(kw_only=True)
class _Prompt(_Checked):
    """Prompt members shared by the selection requests (api.md §3.5); 1.6.1 names the cache
    namespace `cache_salt`."""

    _json_aliases: ClassVar[Mapping[str, str]] = {**_TENANT_ALIAS, "cache_salt": "cache_namespace"}

    model_name: str = member(STR, default="default", nullable=False)
    tenant_id: str = member(STR, default="default", nullable=False)
    token_ids: array[int] | None = member(ARRAY(U32))
    block_hashes: list[int] | None = member(ARRAY(I64))
    sequence_hashes: list[int] | None = member(ARRAY(I64))
    isl_tokens: int | None = member(U64)
    lora_name: str | None = member(STR)
    cache_namespace: str | None = member(STR)
    is_eagle: bool | None = member(BOOL)  # eagle windows: bs + 1 tokens, stepping bs (core.md §5)
    mm_routing_info: MmRoutingInfo | None = member(OBJECT(MmRoutingInfo))
    block_mm_infos: list[BlockExtraInfo | None] | None = member(ARRAY(NULLABLE(OBJECT(BlockExtraInfo))))


@attrs.frozen(kw_only=True)
class OverlapScoresRequest(_Prompt):
    """`POST /overlap_scores`."""


@attrs.frozen(kw_only=True)
class PotentialLoadsRequest(_Prompt):
    """`POST /potential_loads`."""

    router_config_override: RouterConfigOverride | None = member(OBJECT(RouterConfigOverride))


@attrs.frozen(kw_only=True)
class SessionContext(_Checked):
    """1.6.1's structured session: only `session_id` steers the choice here; the other members
    are accepted (and checked) for 1.6.1's policies."""

    session_id: str = member(STR, required=True, nullable=False)
    parent_session_id: str | None = member(STR)
    session_final: bool | None = member(BOOL)
    input_trigger: str | None = member(ENUM("user_message", "tool_result", "other"))
    agent_headers: dict[str, tuple[str, ...]] | None = member(MAP(ARRAY(STR)))


@attrs.frozen(kw_only=True)
class SelectRequest(_Prompt):
    """`POST /select` (api.md §4.7); `session_id` or `session_context` (which wins) name a session
    for session affinity (sessions.py)."""

    selection_id: str | None = member(STR)
    session_id: str | None = member(STR)
    session_context: SessionContext | None = member(OBJECT(SessionContext))
    router_config_override: RouterConfigOverride | None = member(OBJECT(RouterConfigOverride))
    pinned_worker: PinnedWorker | None = member(OBJECT(PinnedWorker))
    allowed_worker_ids: frozenset[int] | None = member(ARRAY(U64), store=frozenset)
    # One shared instance when absent (read only, as every request is): built per request, its
    # checks ran each time, a few microseconds of every selection.
    routing_constraints: RoutingConstraints = member(OBJECT(RoutingConstraints), default=NO_CONSTRAINTS, nullable=False)
    priority_jump: float | None = member(F64)
    # Flow control (admission.py): who asks, how important, which class, until when it is useful.
    fairness_id: str | None = member(STR)
    priority: int | None = member(I64)  # a tier: higher runs first; negative is sheddable
    policy_class: str | None = member(STR)
    deadline_ms: float | None = member(F64, rule=_positive)  # time to first token the client can still use
    do_not_queue: bool = member(BOOL, default=False, nullable=False)
    expected_output_tokens: int | None = member(U32)
    explain: bool = member(BOOL, default=False, nullable=False)
    advisory: bool = member(BOOL, default=False, nullable=False)  # 1.6.1: answer the worker's load too

    @property
    def session(self) -> str | None:
        """The session this request names, if any."""
        return self.session_context.session_id if self.session_context is not None else self.session_id


@attrs.frozen(kw_only=True)
class SelectAndReserveRequest(SelectRequest):
    """`POST /select_and_reserve`: a select that also books, under `reservation_id`."""

    reservation_id: str | None = member(STR)


@attrs.frozen(kw_only=True)
class PdOptions(_Checked):
    """How `/select_pd` decides between prefilling on the decode worker (local) and on a
    prefill worker (remote); the thresholds are those of the named decider (docs/PD.md)."""

    mode: str = member(ENUM("auto", "remote", "local"), default="auto", nullable=False)
    # Absent: `isl_bounding`, or under router_policy=ttft the faster predicted path (docs/PD.md).
    decider: str | None = member(ENUM("isl_bounding", "uncached_threshold", "always", "never"))
    # isl_bounding (Dynamo's defaults): local iff effective ISL < isl_threshold and
    # effective / ISL < ratio_threshold, both strictly.
    isl_threshold: int = member(U64, default=2048, nullable=False)
    ratio_threshold: float = member(F64, default=0.7, nullable=False, rule=_in_unit)
    # uncached_threshold (llm-d's prefix decider): remote iff the uncached tokens on the decode
    # worker exceed uncached_tokens (0: never) and the prompt has at least prompt_tokens.
    uncached_tokens: int = member(U64, default=256, nullable=False)
    prompt_tokens: int = member(U64, default=0, nullable=False)
    # A decode worker whose KV use (booked, or its engine's scraped kv_usage) is above this
    # fraction of its blocks takes the remote path.
    kv_busy_fraction: float = member(F64, default=0.9, nullable=False, rule=_in_unit)
    # router_policy=ttft: how many prompt tokens of KV the link from a prefill worker moves a second.
    transfer_tokens_per_sec: float = member(F64, default=100_000.0, nullable=False, rule=_positive)


DEFAULT_PD: Final = PdOptions()


@attrs.frozen(kw_only=True)
class SelectPdRequest(SelectRequest):
    """`POST /select_pd` (docs/PD.md): a select that returns a prefill/decode plan; `plan_id`
    names it (drawn when absent), `pd` says how to decide."""

    plan_id: str | None = member(STR)
    pd: PdOptions = member(OBJECT(PdOptions), default=DEFAULT_PD, nullable=False)


@attrs.frozen(kw_only=True)
class SelectPdAndReserveRequest(SelectPdRequest):
    """`POST /select_pd_and_reserve`: the plan, booked on both workers or on neither."""


@attrs.frozen(kw_only=True)
class ReservationRequest(_Prompt):
    """`POST /reservations` (api.md §4.10): a booking on `worker_id`, or without it the pending
    selection `selection_id` (1.6.1's replay form). The booking id is `reservation_id`, else
    `selection_id` (1.6.1's name for it)."""

    reservation_id: str | None = member(STR)
    selection_id: str | None = member(STR)
    worker_id: int | None = member(U64)
    dp_rank: int | None = member(U32)
    router_config_override: RouterConfigOverride | None = member(OBJECT(RouterConfigOverride))
    expected_output_tokens: int | None = member(U32)


@attrs.frozen(kw_only=True)
class OutputBlockRequest(_Checked):
    """`POST /reservations/{reservation_id}/output_block` (1.6.1): one more decode block; the range
    of `decay_fraction` is checked by the service (400, before the booking is looked up)."""

    decay_fraction: float | None = member(F64)
