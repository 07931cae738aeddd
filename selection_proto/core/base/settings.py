"""Service settings (core.md §3). Out-of-range values raise `ValueError("<setting>: <reason>")`."""

from __future__ import annotations

import math
from typing import Any, Literal

import attrs

from .flow_classes import parse_classes

__all__ = ["Settings", "KvEventsMode", "QueuePolicy"]

KvEventsMode = Literal["subscribe", "push", "off", "approximate"]
QueuePolicy = Literal["fcfs", "lcfs", "wspt"]
RouterPolicy = Literal["dynamo", "ttft"]
TrackingHash = Literal["public-xxh3-v1", "keyed-xxh3-v1"]


def _check(name: str, ok: bool, reason: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {reason}")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@attrs.frozen(kw_only=True)
class Settings:
    """Router and limit settings. `prefill_load_scale` and `overlap_score_credit` are `None` when
    not given, so that the deprecated `overlap_score_weight` alias can apply (core.md §3);
    `resolve_weights` gives the values in force."""

    kv_events: KvEventsMode = "subscribe"
    overlap_score_credit: float | None = None
    overlap_score_credit_decay: float = 0.0
    prefill_load_scale: float | None = None
    overlap_score_weight: float | None = None
    decode_active_request_weight: float = 0.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    temperature: float = 0.0
    router_policy: RouterPolicy = "dynamo"  # ttft: the least predicted time to first token (cost.py)
    shadow_policy: RouterPolicy | None = None  # scores every selection beside router_policy, never acting
    track_active_blocks: bool = True
    assume_kv_reuse: bool = True
    track_prefill_tokens: bool = True
    queue_threshold: float | None = None
    queue_policy: QueuePolicy = "fcfs"
    queue_timeout_secs: float = 30.0
    queue_max_pending: int = 1024
    flow_classes: str | None = None  # flow_classes.parse_classes: "name:weight[:key=value...],..."; the first is the default
    fairness: bool = True  # queued requests share by fairness ID; off: one lane per class and tier
    fairness_max_queued: int | None = None  # queued requests at most per fairness ID (per key)
    fairness_max_queued_tokens: int | None = None  # and their uncached tokens
    fairness_burst_tokens: int | None = None  # a light fairness ID's burst may run this many uncached tokens ahead
    fairness_kv_share: float | None = None  # with others present, a fairness ID holds at most this x its share of KV
    priority_promote_secs: float | None = None  # a queued request climbs one tier per this many seconds
    shed_sheddable: bool = True  # a request with priority < 0 that would queue is refused at once
    overload_status_code: int = 429  # the status of backpressure refusals; 529 is Dynamo's
    active_request_expiry_secs: float = 300.0
    active_decode_blocks_threshold: float | None = None
    active_prefill_tokens_threshold: int | None = None
    active_prefill_tokens_threshold_frac: float | None = None
    zmq_endpoints: bool = True
    max_keys: int = 1024
    max_workers_per_key: int = 1024
    max_dp_size: int = 1024
    max_tombstones: int = 4096
    max_reservations_per_key: int = 100000
    max_prompt_tokens: int = 1048576
    max_id_length: int = 256
    max_subscriptions: int = 4096
    max_record_bytes: int = 65536
    max_state_bytes: int = 4 * 1024**3
    max_events_per_step: int | None = 1024
    explain_header: bool = False  # each selection's answer says why in `x-selection-decision`
    kv_verdict_window_secs: float = 60.0  # bookings with new blocks and no event this long: no_events
    router_ttl_secs: float = 120.0  # kv_events=approximate: how long a booked prompt is assumed cached
    predicted_ttl_secs: float | None = None  # with real events: a predicted side index, this TTL
    router_tracking_hash: TrackingHash = "public-xxh3-v1"
    router_tracking_key_id: str | None = None  # with keyed-xxh3-v1 (the key is given to the service)
    session_affinity_ttl_secs: float | None = None  # None: session affinity is off
    max_sessions_per_key: int = 65536
    selection_cache_ttl_secs: float = 120.0
    selection_cache_max_entries: int = 4096
    selection_cache_max_bytes: int = 256 * 1024**2

    def __attrs_post_init__(self) -> None:
        _check("kv_events", self.kv_events in ("subscribe", "push", "off", "approximate"),
               "must be one of subscribe, push, off, approximate")
        _check("router_ttl_secs", _is_number(self.router_ttl_secs) and self.router_ttl_secs > 0,
               "must be greater than 0")
        if self.predicted_ttl_secs is not None:
            _check("predicted_ttl_secs", _is_number(self.predicted_ttl_secs) and self.predicted_ttl_secs > 0,
                   "must be greater than 0")
            _check("predicted_ttl_secs", self.kv_events != "approximate",
                   "router_predicted_ttl_secs requires use_kv_events=true")
        _check("queue_policy", self.queue_policy in ("fcfs", "lcfs", "wspt"),
               "must be one of fcfs, lcfs, wspt")
        _check("router_policy", self.router_policy in ("dynamo", "ttft"), "must be one of dynamo, ttft")
        if self.shadow_policy is not None:
            _check("shadow_policy", self.shadow_policy in ("dynamo", "ttft"), "must be one of dynamo, ttft")
            _check("shadow_policy", self.shadow_policy != self.router_policy,
                   f"must differ from router_policy ({self.router_policy}): it scores what the other would choose")
        if self.overlap_score_credit is not None:
            _check("overlap_score_credit",
                   _is_number(self.overlap_score_credit) and 0 <= self.overlap_score_credit <= 1,
                   "must be in [0, 1]")
        for name in ("overlap_score_credit_decay", "decode_active_request_weight",
                     "host_cache_hit_weight", "disk_cache_hit_weight", "temperature"):
            value = getattr(self, name)
            _check(name, _is_number(value) and value >= 0, "must be a finite number >= 0")
        for name in ("prefill_load_scale", "overlap_score_weight"):
            value = getattr(self, name)
            if value is not None:
                _check(name, _is_number(value) and value >= 0, "must be a finite number >= 0")
        for name in ("queue_threshold", "active_decode_blocks_threshold",
                     "active_prefill_tokens_threshold_frac", "fairness_kv_share"):
            value = getattr(self, name)
            if value is not None:
                _check(name, _is_number(value) and value > 0, "must be greater than 0")
        parse_classes(self.flow_classes)  # raises ValueError("flow_classes: ...")
        _check("overload_status_code", self.overload_status_code in (429, 529), "must be 429 or 529")
        for name in ("fairness_max_queued", "fairness_max_queued_tokens", "fairness_burst_tokens"):
            value = getattr(self, name)
            _check(name, value is None or (_is_int(value) and value >= 1), "must be an integer >= 1")
        if self.priority_promote_secs is not None:
            _check("priority_promote_secs", _is_number(self.priority_promote_secs)
                   and self.priority_promote_secs > 0, "must be greater than 0")
        for name in ("queue_timeout_secs", "active_request_expiry_secs", "kv_verdict_window_secs"):
            value = getattr(self, name)
            _check(name, _is_number(value) and value > 0, "must be greater than 0")
        if self.max_events_per_step is not None:
            _check("max_events_per_step", _is_int(self.max_events_per_step) and self.max_events_per_step >= 1,
                   "must be an integer >= 1")
        if self.active_prefill_tokens_threshold is not None:
            _check("active_prefill_tokens_threshold",
                   _is_int(self.active_prefill_tokens_threshold)
                   and self.active_prefill_tokens_threshold >= 0, "must be an integer >= 0")
        for name in ("queue_max_pending", "max_keys", "max_workers_per_key", "max_dp_size",
                     "max_reservations_per_key", "max_prompt_tokens", "max_id_length",
                     "max_subscriptions", "max_record_bytes", "max_state_bytes", "max_sessions_per_key"):
            value = getattr(self, name)
            _check(name, _is_int(value) and value >= 1, "must be an integer >= 1")
        for name in ("max_tombstones", "selection_cache_max_entries", "selection_cache_max_bytes"):
            value = getattr(self, name)
            _check(name, _is_int(value) and value >= 0, "must be an integer >= 0")
        _check("router_tracking_hash", self.router_tracking_hash in ("public-xxh3-v1", "keyed-xxh3-v1"),
               f"router_tracking_hash must be public-xxh3-v1 or keyed-xxh3-v1, got \"{self.router_tracking_hash}\"")
        key_id = self.router_tracking_key_id
        if self.router_tracking_hash == "keyed-xxh3-v1":
            _check("router_tracking_key_id", isinstance(key_id, str) and key_id != "" and key_id == key_id.strip(),
                   "keyed-xxh3-v1 requires a nonempty router_tracking_key_id")
        else:
            _check("router_tracking_key_id", key_id is None,
                   "router tracking key options require router_tracking_hash=keyed-xxh3-v1")
        if self.session_affinity_ttl_secs is not None:
            _check("session_affinity_ttl_secs", _is_number(self.session_affinity_ttl_secs)
                   and 1 <= self.session_affinity_ttl_secs <= 31536000, "must be between 1 and 31536000")
        _check("selection_cache_ttl_secs", _is_number(self.selection_cache_ttl_secs)
               and self.selection_cache_ttl_secs >= 0, "must be a finite number >= 0")
        for name in ("track_active_blocks", "assume_kv_reuse", "track_prefill_tokens",
                     "zmq_endpoints", "shed_sheddable", "fairness"):
            _check(name, isinstance(getattr(self, name), bool), "must be a boolean")

    @property
    def queueing(self) -> bool:
        return self.queue_threshold is not None


def resolve_weights(
    weight: float | None,
    scale: float | None,
    credit: float | None,
    fallback_scale: float,
    fallback_credit: float,
) -> tuple[float, float]:
    """(prefill_load_scale, overlap_score_credit): the deprecated alias first, explicit values win."""
    eff_scale, eff_credit = fallback_scale, fallback_credit
    if weight is not None:
        eff_scale = weight
        if weight == 0:
            eff_credit = 0.0
    if scale is not None:
        eff_scale = scale
    if credit is not None:
        eff_credit = credit
    return eff_scale, eff_credit
