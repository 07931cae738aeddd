"""The service's counters, gauges and histograms (api.md §5): each family declared once in
`FAMILIES`, recorded through one named recorder per event the core counts, and rendered as the
Prometheus text exposition. Adapters and transports report through `SelectionService.observe`
with the family constants below."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

__all__ = [
    "CONNECTIONS",
    "EXT_PROC_STREAMS",
    "FAMILIES",
    "IGNORED_VALUES",
    "INTERNAL_ERRORS",
    "JSONRPC_MESSAGES",
    "LIMIT_REJECTIONS",
    "PROCESS_CPU",
    "PROCESS_FDS",
    "PROCESS_MEMORY",
    "PROCESS_START",
    "REQUEST_DURATION",
    "KV_REPLAYS",
    "LEDGER_CONNECTED",
    "LEDGER_EVENTS",
    "LEDGER_FEED_LAG",
    "LEDGER_FLUSH",
    "LEDGER_OUTBOX",
    "SNAPSHOTS",
    "SNAPSHOT_LAST_SUCCESS",
    "SUBSCRIPTION_FAILURES",
    "WS_CLOSES",
    "WS_MESSAGES",
    "Metrics",
]

_RATIO_BUCKETS: Final = tuple(round(0.1 * i, 1) for i in range(1, 11))
_WAIT_BUCKETS: Final = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
_DURATION_BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                            0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_RANK_LABELS: Final = ("model_name", "tenant_id", "worker_id", "dp_rank")
_WORKER_LABELS: Final = ("model_name", "tenant_id", "worker_id")

# The families reported from outside the core, by name.
LIMIT_REJECTIONS: Final = "selection_proto_limit_rejections_total"
IGNORED_VALUES: Final = "selection_proto_ignored_values_total"
INTERNAL_ERRORS: Final = "selection_proto_internal_errors_total"
REQUEST_DURATION: Final = "selection_proto_request_duration_seconds"
CONNECTIONS: Final = "selection_proto_connections"
WS_MESSAGES: Final = "selection_proto_ws_messages_total"
WS_CLOSES: Final = "selection_proto_ws_closes_total"
SUBSCRIPTION_FAILURES: Final = "selection_proto_kv_subscription_failures_total"
KV_REPLAYS: Final = "selection_proto_kv_replay_total"
PROCESS_MEMORY: Final = "process_resident_memory_bytes"
PROCESS_CPU: Final = "process_cpu_seconds_total"
PROCESS_FDS: Final = "process_open_fds"
PROCESS_START: Final = "process_start_time_seconds"
JSONRPC_MESSAGES: Final = "selection_proto_jsonrpc_messages_total"
EXT_PROC_STREAMS: Final = "selection_proto_ext_proc_streams_total"
SNAPSHOTS: Final = "selection_proto_snapshots_total"
SNAPSHOT_LAST_SUCCESS: Final = "selection_proto_snapshot_last_success_timestamp_seconds"
LEDGER_CONNECTED: Final = "selection_proto_ledger_connected"
LEDGER_OUTBOX: Final = "selection_proto_ledger_outbox_depth"
LEDGER_EVENTS: Final = "selection_proto_ledger_events_total"
LEDGER_FLUSH: Final = "selection_proto_ledger_write_seconds"
LEDGER_FEED_LAG: Final = "selection_proto_ledger_feed_lag_seconds"

# name -> (type, help, label names, histogram bounds)
FAMILIES: Final[Mapping[str, tuple[str, str, tuple[str, ...], tuple[float, ...]]]] = {
    "selection_proto_info": ("gauge", "Build information.", ("version",), ()),
    "selection_proto_workers": ("gauge", "Catalog records by lifecycle.", ("lifecycle",), ()),
    "selection_proto_schedulable_ranks": ("gauge", "Schedulable ranks per key.",
                                          ("model_name", "tenant_id"), ()),
    "selection_proto_requests_total": ("counter", "Requests answered by handle().",
                                       ("method", "route", "status"), ()),
    "selection_proto_selections_total": ("counter", "Final outcomes of selections.",
                                         ("model_name", "tenant_id", "route", "status"), ()),
    "selection_proto_predicted_hit_ratio": ("histogram", "cached_tokens / isl of selections.",
                                            ("model_name", "tenant_id"), _RATIO_BUCKETS),
    "selection_proto_non_max_overlap_selections_total": (
        "counter", "Selections whose rank had less device overlap than the best candidate.",
        ("model_name", "tenant_id"), ()),
    "selection_proto_policy_disagreements_total": (
        "counter", "router_policy=ttft selections of a rank Dynamo's cost would not have chosen.",
        ("model_name", "tenant_id"), ()),
    "selection_proto_prompt_tokens_total": (
        "counter", "Prompt tokens of successful selections: what hit rates divide by.", ("model_name", "tenant_id"), ()),
    "selection_proto_achieved_cached_tokens_total": (
        "counter", "Cached tokens the chosen rank held of each prompt (predicted by the index).",
        ("model_name", "tenant_id"), ()),
    "selection_proto_achievable_cached_tokens_total": (
        "counter", "Cached tokens the best-cached schedulable rank held of each prompt at the same moment.",
        ("model_name", "tenant_id"), ()),
    "selection_proto_cache_losses_total": (
        "counter", "Selections whose rank held fewer cached tokens than the best-cached one, by why "
        "(constraints, affinity, load, queue, sampling).", ("model_name", "tenant_id", "reason"), ()),
    "selection_proto_lost_cached_tokens_total": (
        "counter", "Achievable minus achieved cached tokens, by why.", ("model_name", "tenant_id", "reason"), ()),
    "selection_proto_engine_prefix_cache_hit_rate": (
        "gauge", "The prefix-cache hit rate a worker's engine reports at its metrics_endpoint (0-1).",
        _WORKER_LABELS, ()),
    "selection_proto_shadow_selections_total": (
        "counter", "Selections the shadow policy scored without acting.", ("model_name", "tenant_id", "policy"), ()),
    "selection_proto_shadow_disagreements_total": (
        "counter", "Of them, those where it would have chosen another rank.", ("model_name", "tenant_id", "policy"),
        ()),
    "selection_proto_shadow_predicted_ttft_seconds_total": (
        "counter", "Predicted seconds to first token of the rank each policy chose (choice: acting or shadow); "
        "divide by the shadow's selections for the mean.", ("model_name", "tenant_id", "choice"), ()),
    "selection_proto_reservations_active": ("gauge", "Live bookings.", ("model_name", "tenant_id"), ()),
    "selection_proto_pd_plans_total": ("counter", "Prefill/decode plans answered, by route, path (local, remote) "
                                       "and decider (docs/PD.md).",
                                       ("model_name", "tenant_id", "route", "path", "decider"), ()),
    "selection_proto_pd_events_total": ("counter", "Plan bookings: handoffs, plans ended, legs expired as "
                                        "orphans, legs freed because the other could not be booked "
                                        "(compensated).", ("model_name", "tenant_id", "event"), ()),
    "selection_proto_reservation_events_total": ("counter", "Booking lifecycle events.",
                                                 ("model_name", "tenant_id", "event"), ()),
    "selection_proto_queue_pending": ("gauge", "Queued selections.", ("model_name", "tenant_id"), ()),
    "selection_proto_queue_events_total": ("counter", "Queue events.",
                                           ("model_name", "tenant_id", "event"), ()),
    "selection_proto_queue_wait_seconds": ("histogram", "Time from enqueue to outcome.",
                                           ("model_name", "tenant_id"), _WAIT_BUCKETS),
    "selection_proto_flow_events_total": ("counter", "Queue events per policy class and fairness ID "
                                          "(queued, dispatched, shed, and the other queue outcomes).",
                                          ("model_name", "tenant_id", "policy_class", "fairness_id", "event"), ()),
    "selection_proto_flow_wait_seconds": ("histogram", "Time queued per policy class and fairness ID.",
                                          ("model_name", "tenant_id", "policy_class", "fairness_id"),
                                          _WAIT_BUCKETS),
    "selection_proto_kv_events_total": ("counter", "KV events applied or failed.",
                                        ("model_name", "tenant_id", "tier", "kind", "result"), ()),
    "selection_proto_kv_events_dropped_total": ("counter", "KV events or messages not applied.",
                                                ("model_name", "tenant_id", "reason"), ()),
    "selection_proto_kv_event_gaps_total": ("counter", "Detected event-id gaps.", _RANK_LABELS, ()),
    "selection_proto_kv_missing_events_total": ("counter", "Event ids skipped by gaps.",
                                                _RANK_LABELS, ()),
    "selection_proto_kv_event_rewinds_total": ("counter", "Event ids that went backwards.",
                                               _RANK_LABELS, ()),
    "selection_proto_kv_restarts_total": ("counter", "Engine restarts seen (stream seqs that began again); "
                                          "each dropped the rank's index.", _RANK_LABELS, ()),
    "selection_proto_kv_routing_state": ("gauge", "Each worker's KV routing verdict: 1 for its state "
                                         "(docs/VERDICT.md).", (*_WORKER_LABELS, "state"), ()),
    "selection_proto_kv_observations_total": ("counter", "Bookings whose engine reported its cached tokens.",
                                              _WORKER_LABELS, ()),
    "selection_proto_kv_predicted_cached_tokens_total": (
        "counter", "Cached tokens the index predicted for those bookings.", _WORKER_LABELS, ()),
    "selection_proto_kv_observed_cached_tokens_total": (
        "counter", "Cached tokens their engines reported.", _WORKER_LABELS, ()),
    "selection_proto_kv_stale_ranks": ("gauge", "Ranks whose index may miss events.",
                                       ("model_name", "tenant_id"), ()),
    "selection_proto_index_blocks": ("gauge", "Indexed blocks per tier.",
                                     ("model_name", "tenant_id", "tier"), ()),
    "selection_proto_state_bytes": ("gauge", "Estimated memory of the index, bookings and catalog.",
                                    (), ()),
    "selection_proto_state_budget_bytes": ("gauge", "The state budget (max_state_bytes).", (), ()),
    "selection_proto_pending_selections": ("gauge", "Selections awaiting their booking (1.6.1's replay form).",
                                           (), ()),
    "selection_proto_pending_selection_bytes": ("gauge", "Their size, as 1.6.1 counts it.", (), ()),
    "selection_proto_session_bindings": ("gauge", "Session-affinity bindings, live or awaiting expiry.",
                                         ("model_name", "tenant_id"), ()),
    LIMIT_REJECTIONS: ("counter", "Requests refused by a limit.", ("limit",), ()),
    IGNORED_VALUES: ("counter", "Request members ignored for a bad value, the request served without them.",
                     ("member",), ()),
    INTERNAL_ERRORS: (
        "counter", "Unexpected exceptions confined to one request, connection, stream or task.",
        ("where",), ()),
    REQUEST_DURATION: ("histogram", "Request handling time.", ("route",),
                                                 _DURATION_BUCKETS),
    CONNECTIONS: ("gauge", "Open connections.", ("kind",), ()),
    WS_MESSAGES: ("counter", "WebSocket messages.", ("direction", "type"), ()),
    WS_CLOSES: ("counter", "WebSocket closes.", ("direction", "code"), ()),
    PROCESS_MEMORY: ("gauge", "Resident memory of the serving process.", (), ()),
    PROCESS_CPU: ("counter", "CPU time of the serving process (user and system).", (), ()),
    PROCESS_FDS: ("gauge", "Open file descriptors of the serving process.", (), ()),
    PROCESS_START: ("gauge", "When the serving process started, in seconds since the epoch.", (), ()),
    SNAPSHOTS: ("counter", "Snapshots written (--snapshot), by result: ok or failed.", ("result",), ()),
    SNAPSHOT_LAST_SUCCESS: ("gauge", "When the last snapshot was written, in seconds since the epoch.",
                            (), ()),
    LEDGER_CONNECTED: ("gauge", "1 while the booking ledger (--ledger) is reachable.", (), ()),
    LEDGER_OUTBOX: ("gauge", "Own changes waiting to be written to the ledger.", (), ()),
    LEDGER_EVENTS: ("counter", "Ledger events: snapshots, gaps, conflicts, tombstone hits, reseeds...",
                    ("event",), ()),
    LEDGER_FEED_LAG: ("gauge", "Wall time now minus the ledger's time of the last feed entry read "
                               "(clocks of ledger and replica agreeing).", (), ()),
    LEDGER_FLUSH: ("histogram", "Time of one ledger write (a batch of changes).", (), _DURATION_BUCKETS),
    "selection_proto_rank_active_requests": ("gauge", "Live bookings per rank.", _RANK_LABELS, ()),
    "selection_proto_rank_prefill_tokens": ("gauge", "Booked prefill tokens per rank.", _RANK_LABELS, ()),
    "selection_proto_rank_decode_blocks": ("gauge", "Active decode blocks per rank.", _RANK_LABELS, ()),
    "selection_proto_worker_learned_speed": (
        "gauge", "router_policy=ttft: a worker's prefill speed against its pool's mean as learned (2: twice as "
        "fast); workers whose record declares prefill_tokens_per_sec are not learned.",
        _WORKER_LABELS, ()),
    "selection_proto_learned_request_overhead_tokens": (
        "gauge", "router_policy=ttft: the time an engine spends on every request whatever it holds, in its "
        "pool's prefill tokens, as learned from prefill ends (0 until learned).",
        ("model_name", "tenant_id"), ()),
    KV_REPLAYS: ("counter", "Engine replays: requests, batches recovered, lost and passed over (before "
                             "the engine's newest clear), replays that failed.",
                 ("result",), ()),
    SUBSCRIPTION_FAILURES: ("counter", "Subscription failures.",
                                                       ("scheme", "reason"), ()),
    JSONRPC_MESSAGES: ("counter", "JSON-RPC messages.", ("outcome",), ()),
    EXT_PROC_STREAMS: ("counter", "Envoy ext_proc streams by outcome: routed, or the status of the "
                                  "immediate response that refused them.", ("outcome",), ()),
}

Labels = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(names: Iterable[str], values: Iterable[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=False)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Histogram:
    __slots__ = ("counts", "total", "count")

    def __init__(self, bounds: int) -> None:
        self.counts = [0] * bounds
        self.total = 0.0
        self.count = 0


MAX_FAIRNESS_LABELS: Final = 100
_CACHE_TOTALS: Final = {"selection_proto_prompt_tokens_total": 0, "selection_proto_achieved_cached_tokens_total": 1,
                        "selection_proto_achievable_cached_tokens_total": 2}


class Metrics:
    """Stored samples; gauges that mirror state are passed to `render` by the service."""

    def __init__(self) -> None:
        self._values: dict[str, dict[Labels, float]] = {}
        self._histograms: dict[str, dict[Labels, _Histogram]] = {}
        self._fairness_labels: set[str] = {""}
        # key -> [prompt, achieved, achievable] tokens: added to on every selection, so kept apart
        # from the general samples (one lookup) and rendered as the `_CACHE_TOTALS` families.
        self._cache_totals: dict[Labels, list[float]] = {}

    def _family(self, name: str, labels: Labels) -> tuple[str, str, tuple[str, ...], tuple[float, ...]]:
        family = FAMILIES.get(name)
        if family is None:
            raise ValueError(f"unknown metric family {name!r}")
        if len(labels) != len(family[2]):
            raise ValueError(f"{name} takes labels {family[2]}, got {labels!r}")
        return family

    def inc(self, name: str, labels: Labels = (), by: float = 1.0) -> None:
        self._family(name, labels)
        samples = self._values.setdefault(name, {})
        samples[labels] = samples.get(labels, 0.0) + by

    def set(self, name: str, labels: Labels, value: float) -> None:
        self._family(name, labels)
        self._values.setdefault(name, {})[labels] = value

    def observe(self, name: str, labels: Labels, value: float) -> None:
        bounds = self._family(name, labels)[3]
        hist = self._histograms.setdefault(name, {}).get(labels)
        if hist is None:
            hist = self._histograms[name][labels] = _Histogram(len(bounds))
        for i, b in enumerate(bounds):
            if value <= b:
                hist.counts[i] += 1
        hist.total += value
        hist.count += 1

    def record(self, name: str, labels: Labels, value: float) -> None:
        """What a transport reports: counters add, gauges set, histograms observe."""
        kind = self._family(name, labels)[0]
        if kind == "counter":
            self.inc(name, labels, value)
        elif kind == "gauge":
            self.set(name, labels, value)
        else:
            self.observe(name, labels, value)

    # -- the core's recorders: one per thing it counts ------------------------------------------

    def request(self, method: str, route: str, status: str) -> None:
        self.inc("selection_proto_requests_total", (method, route, status))

    def limit(self, name: str) -> None:
        """A request was refused by the limit `name` (a Settings limit, or a transport's)."""
        self.inc(LIMIT_REJECTIONS, (name,))

    def internal_error(self, where: str) -> None:
        self.inc(INTERNAL_ERRORS, (where,))

    def selection(self, key: Labels, route: str, status: int) -> None:
        """A selection's final outcome (a queued one counts when its ticket ends)."""
        self.inc("selection_proto_selections_total", (*key, route, str(status)))

    def selected(self, key: Labels, hit_ratio: float | None, below_max_overlap: bool,
                 policy_differs: bool = False) -> None:
        """What the chosen rank had cached: its predicted hit ratio (None for an empty prompt),
        whether another candidate had more device overlap, and (router_policy=ttft) whether
        Dynamo's cost would have chosen otherwise."""
        if hit_ratio is not None:
            self.observe("selection_proto_predicted_hit_ratio", key, hit_ratio)
        if below_max_overlap:
            self.inc("selection_proto_non_max_overlap_selections_total", key)
        if policy_differs:
            self.inc("selection_proto_policy_disagreements_total", key)

    def achieved(self, key: Labels, prompt_tokens: int, achieved: int, achievable: int, loss: str | None) -> None:
        """A selection's cached tokens against the best-cached rank's, and why it got fewer (outcomes.py)."""
        totals = self._cache_totals.get(key)
        if totals is None:
            totals = self._cache_totals[key] = [0.0, 0.0, 0.0]
        totals[0] += prompt_tokens
        totals[1] += achieved
        totals[2] += achievable
        if loss is not None:
            self.inc("selection_proto_cache_losses_total", (*key, loss))
            self.inc("selection_proto_lost_cached_tokens_total", (*key, loss), achievable - achieved)

    def shadowed(self, key: Labels, policy: str, disagrees: bool, acting_ttft: float, shadow_ttft: float) -> None:
        """The shadow policy scored a selection: whether it would have chosen another rank, and the
        predicted time to first token of each choice."""
        self.inc("selection_proto_shadow_selections_total", (*key, policy))
        if disagrees:
            self.inc("selection_proto_shadow_disagreements_total", (*key, policy))
        for choice, seconds in (("acting", acting_ttft), ("shadow", shadow_ttft)):
            self.inc("selection_proto_shadow_predicted_ttft_seconds_total", (*key, choice), seconds)

    def booking(self, key: Labels, event: str, count: int = 1) -> None:
        """Bookings booked, freed, prefill_complete, expired or dropped."""
        self.inc("selection_proto_reservation_events_total", (*key, event), count)

    def plan(self, key: Labels, route: str, path: str, decider: str) -> None:
        """A prefill/decode plan answered (pd.py)."""
        self.inc("selection_proto_pd_plans_total", (*key, route, path, decider))

    def plan_event(self, key: Labels, event: str, count: int = 1) -> None:
        """A plan's handoff, end, orphaned leg expired, or leg compensated."""
        self.inc("selection_proto_pd_events_total", (*key, event), count)

    def queue(self, key: Labels, event: str, waited: float | None = None) -> None:
        """A queue event (admission.OUTCOMES, queued, rejected_full); an outcome with its wait."""
        self.inc("selection_proto_queue_events_total", (*key, event))
        if waited is not None:
            self.observe("selection_proto_queue_wait_seconds", key, waited)

    def flow(self, key: Labels, policy_class: str, fairness_id: str, event: str, waited: float | None = None) -> None:
        """A queue event of one lane (admission.py). Fairness IDs are the clients' own words: the
        first `MAX_FAIRNESS_LABELS` get a label of their own, later ones share `other`."""
        if fairness_id not in self._fairness_labels:
            if len(self._fairness_labels) < MAX_FAIRNESS_LABELS:
                self._fairness_labels.add(fairness_id)
            else:
                fairness_id = "other"
        labels = (*key, policy_class, fairness_id)
        self.inc("selection_proto_flow_events_total", (*labels, event))
        if waited is not None:
            self.observe("selection_proto_flow_wait_seconds", labels, waited)

    def kv_event(self, key: Labels, tier: str, kind: str, result: str) -> None:
        self.inc("selection_proto_kv_events_total", (*key, tier, kind, result))

    def kv_dropped(self, key: Labels, reason: str) -> None:
        """A KV event or message was not applied: `reason` says why."""
        self.inc("selection_proto_kv_events_dropped_total", (*key, reason))

    def kv_gap(self, rank_labels: Labels, missing: int) -> None:
        self.inc("selection_proto_kv_event_gaps_total", rank_labels)
        self.inc("selection_proto_kv_missing_events_total", rank_labels, missing)

    def kv_rewind(self, rank_labels: Labels) -> None:
        self.inc("selection_proto_kv_event_rewinds_total", rank_labels)

    def kv_restart(self, rank_labels: Labels) -> None:
        self.inc("selection_proto_kv_restarts_total", rank_labels)

    def kv_observed(self, key: tuple[str, str], worker_id: int, predicted: int, observed: int) -> None:
        """An engine reported a booking's cached tokens (verdict.py)."""
        labels = (*key, str(worker_id))
        self.inc("selection_proto_kv_observations_total", labels)
        self.inc("selection_proto_kv_predicted_cached_tokens_total", labels, predicted)
        self.inc("selection_proto_kv_observed_cached_tokens_total", labels, observed)

    def value(self, name: str, labels: Labels = ()) -> float:
        if name in _CACHE_TOTALS:
            return self._cache_totals.get(labels, [0.0, 0.0, 0.0])[_CACHE_TOTALS[name]]
        return self._values.get(name, {}).get(labels, 0.0)

    def render(self, state_gauges: Mapping[str, Mapping[Labels, float]]) -> str:
        lines: list[str] = []
        for name in sorted(FAMILIES):
            kind, help_text, label_names, bounds = FAMILIES[name]
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            if kind == "histogram":
                for labels, hist in sorted(self._histograms.get(name, {}).items()):
                    for b, c in zip(bounds, hist.counts, strict=False):
                        le = f'le="{float(b)!r}"'
                        lines.append(f"{name}_bucket{_labels(label_names, labels, le)} {float(c)!r}")
                    inf = 'le="+Inf"'
                    lines.append(f"{name}_bucket{_labels(label_names, labels, inf)} {float(hist.count)!r}")
                    lines.append(f"{name}_sum{_labels(label_names, labels)} {float(hist.total)!r}")
                    lines.append(f"{name}_count{_labels(label_names, labels)} {float(hist.count)!r}")
                continue
            samples = dict(self._values.get(name, {}))
            samples.update(state_gauges.get(name, {}))
            if name in _CACHE_TOTALS:
                samples.update((key, totals[_CACHE_TOTALS[name]]) for key, totals in self._cache_totals.items())
            for labels, v in sorted(samples.items()):
                lines.append(f"{name}{_labels(label_names, labels)} {float(v)!r}")
        return "\n".join(lines) + "\n"
