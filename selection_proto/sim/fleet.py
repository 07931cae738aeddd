"""The simulated fleet (docs/ROUTING.md): engines with a KV cache and an iteration-level performance
model, the trace's requests arriving in virtual time, and a router deciding where each goes. The
router is the real core (a `SelectionService` per setting, called as a client would:
select_and_reserve, prefill_complete, free, and the KV events the engines publish), or a baseline
(`random`, `round-robin`, and `least-loaded`: cache-blind but load-aware, the engine with the fewest
requests in flight), or the all-knowing `oracle` (oracle.py). One run per setting, each from the
same arrivals.

A `PdSetup` runs a fleet through the core's plans (docs/PD.md): `select_pd_and_reserve` at
arrival, the prefill leg's `prefill_complete` when a prefill engine is done, the handoff at the
first token, the end at the last; the prompt's KV crosses the prefill engine's link to the decode
engine in between. Its aggregated form (no prefill engines) is the same fleet as a `Settings`
run, planned: every plan is local, on the engine `/select` picks.

A `ReplicaSetup` runs N services behind a round-robin balancer (docs/ROUTING.md, "Replicas"):
each has its own index and receives every engine's KV events; a request's prefill completion and
free go to the replica that booked it. Shared, their journals go through an in-process ledger
(ledger.py) and every replica applies its feed, after `ledger_delay_secs`; alone, each counts only
its own bookings."""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs

from ..core.base.responses import Pending, SelectResponse
from ..core.base.settings import Settings
from ..core.cache.events import KvEvent
from .engine import DECODE_SENT, Engine, FleetConfig, SimRequest
from .routers import (
    BASELINES,
    DECIDERS,
    ORACLE,
    PdRouter,
    PdSetup,
    Replicas,
    ReplicaSetup,
    Router,
    held_worker,
)
from .service import ServiceRouter
from .trace import TraceRequest

__all__ = ["BASELINES", "DECIDERS", "ORACLE", "PdSetup", "ReplicaSetup", "SettingRun", "Setup", "simulate"]

@attrs.frozen(kw_only=True)
class SettingRun:
    """One setting's results. `ttft` and `queue_wait` are seconds ({mean, p50, p90, p99}); hit
    rate is the engines' cached prompt tokens over all prompt tokens; `busy_max_mean` the
    time-average of the busiest engine's requests in flight."""

    name: str
    settings: dict[str, Any]
    ttft: dict[str, float]
    queue_wait: dict[str, float]
    hit_rate: float
    busy_max_mean: float
    requests: int
    failed: int
    events_failed: int
    ttft_cdf: list[tuple[float, float]]  # (seconds, fraction), for the report
    series: dict[str, Any]  # times, per engine in-flight requests and KV use, for the report
    tenants: dict[str, dict[str, Any]] = attrs.Factory(dict)  # trace lines' `tenant`: each one's figures
    # A `PdSetup` run only: its fleet and decider ({"prefill_engines", "decode_engines",
    # "decider"}), the time per output token in seconds ({mean, p50, p90, p99}, over requests of
    # two tokens or more: from the first token to the last, over the tokens after the first), and
    # the share of plans that prefilled remotely.
    pd: dict[str, Any] | None = None
    tpot: dict[str, float] | None = None
    remote_share: float | None = None
    tpot_cdf: list[tuple[float, float]] = attrs.Factory(list)  # (seconds, fraction), for the report
    # A `ReplicaSetup` run only: {"replicas", "shared", "ledger_delay_secs"}, and "admission" when strict.
    replicas: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        planned = {} if self.pd is None else {"pd": self.pd, "tpot": self.tpot, "remote_share": self.remote_share}
        return {"name": self.name, "settings": self.settings, "ttft": self.ttft, "queue_wait": self.queue_wait,
                "hit_rate": self.hit_rate, "busy_max_mean": self.busy_max_mean, "requests": self.requests,
                "failed": self.failed, "events_failed": self.events_failed, **planned,
                **({"replicas": self.replicas} if self.replicas is not None else {}),
                **({"tenants": self.tenants} if self.tenants else {})}


def _stats(values: array[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)
    last = len(ordered) - 1

    def at(q: float) -> float:
        return ordered[min(last, int(q * len(ordered)))]

    return {"mean": sum(ordered) / len(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


_ARRIVE, _STEP, _EVENTS, _SAMPLE, _TICK, _SENT, _LATER = range(7)


Setup = Settings | PdSetup | ReplicaSetup | str | None


def _run(name: str, setting: Setup, arrivals: Iterable[tuple[float, TraceRequest]],
         end: float, config: FleetConfig, watch: Callable[[str, SimRequest], None] | None = None) -> SettingRun:
    settings = setting.settings if isinstance(setting, PdSetup | ReplicaSetup) else \
        setting if isinstance(setting, Settings) else None
    router: Router | ServiceRouter
    if isinstance(setting, str):  # a running service's URL
        router = ServiceRouter(setting, config)
    elif isinstance(setting, PdSetup):
        router = PdRouter(name, setting, config)
    elif isinstance(setting, ReplicaSetup):
        router = Replicas(name, setting, config)
    else:
        router = Router(name, settings, config)
    heap: list[tuple[float, int, int, Any]] = []
    order = 0

    def push(at: float, kind: int, payload: Any) -> None:
        nonlocal order
        order += 1
        heapq.heappush(heap, (at, order, kind, payload))

    if isinstance(router, Replicas):
        router.later = lambda at, action: push(at, _LATER, action)

    outbox: dict[int, list[KvEvent]] = {}

    def publish(engine: int, event: KvEvent) -> None:
        outbox.setdefault(engine, []).append(event)

    engines = [Engine(i, config, publish) for i in range(config.engines)]
    if isinstance(router, Router):
        router.fleet = engines
    source = iter(arrivals)
    ttft, waits, tpot = array("d"), array("d"), array("d")
    link_free = [0.0] * config.engines  # when each prefill engine's link is done sending
    failed = 0
    tickets: dict[int, SimRequest] = {}
    interval = max(end / config.samples, 1e-3)
    times: list[float] = []
    inflight: list[list[int]] = [[] for _ in engines]
    kv: list[list[float]] = [[] for _ in engines]
    busy_max: list[int] = []
    count = 0
    live = 0  # requests arrived and not yet finished (or failed)
    more = True  # arrivals still to come
    # Per tenant (trace lines that name one): [requests, failed, ttft seconds, queue waits].
    tenants: dict[str, tuple[list[int], array[float], array[float]]] = {}

    def tenant(req: SimRequest) -> tuple[list[int], array[float], array[float]]:
        return tenants.setdefault(req.tenant, ([0, 0], array("d"), array("d")))

    def fail(req: SimRequest) -> None:
        nonlocal failed, live
        failed += 1
        live -= 1
        tenant(req)[0][1] += 1

    def next_arrival() -> None:
        nonlocal count, more
        item = next(source, None)
        more = item is not None
        if item is not None:
            at, trace = item
            count += 1
            push(at, _ARRIVE, SimRequest(f"r{count}", at, trace, config.trace_block_size,
                                         router.local_hashes(trace.hash_ids)))

    def dispatch(req: SimRequest, engine: int, now: float) -> None:
        req.engine = engine
        req.dispatched = now
        target = engines[engine]
        target.waiting.append(req)
        if target.busy_until is None:
            start(engine, now)

    def start(engine: int, now: float) -> None:
        """The engine's next iteration; the transfers of the sent prompts it admitted begin,
        each when its prefill engine's link is free."""
        target = engines[engine]
        ends = target.start(now)
        if ends is not None:
            push(ends, _STEP, engine)
        for req, tokens in target.to_send:
            begins = max(now, link_free[req.engine])
            link_free[req.engine] = begins + config.transfer_secs(tokens)
            push(link_free[req.engine], _SENT, req)
        target.to_send.clear()

    def deliver(now: float) -> None:
        for engine, events in outbox.items():
            if events:
                if config.event_delay_secs > 0:
                    push(now + config.event_delay_secs, _EVENTS, (engine, events))
                else:
                    router.events(engine, events, now)
        outbox.clear()

    def answered(now: float) -> None:
        nonlocal failed, live
        for ready in router.ready():
            req = tickets.pop(ready.ticket)
            # None: an answer the ledger held (strict admission), said over the wire.
            worker = ready.result.worker_id if isinstance(ready.result, SelectResponse) else \
                held_worker(ready.response) if ready.result is None else None
            if worker is not None:
                dispatch(req, worker, now)
            else:
                fail(req)

    next_arrival()
    push(0.0, _SAMPLE, None)
    if router.service is not None and settings is not None and settings.queue_threshold is not None:
        push(0.0, _TICK, None)
    while heap:
        now, _, kind, payload = heapq.heappop(heap)
        if kind == _ARRIVE:
            req = payload
            next_arrival()
            live += 1
            tenant(req)[0][0] += 1
            choice = router.choose(req, now)
            if isinstance(choice, Pending):
                tickets[choice.ticket] = req
            elif choice is None:
                fail(req)
            else:
                dispatch(req, choice, now)
        elif kind == _STEP:
            engine = engines[payload]
            first, done = engine.finish(now)
            for req in first:
                if watch is not None:
                    watch(name, req)
                ttft.append(req.first_token - req.arrival)
                waits.append(req.started - req.arrival)
                _, mine, waited = tenant(req)
                mine.append(ttft[-1])
                waited.append(waits[-1])
                if config.prefill_complete:
                    router.prefill_done(req, now)
            for req in done:
                if req.osl > 1 and isinstance(router, PdRouter):
                    tpot.append((now - req.first_token) / (req.osl - 1))
                router.freed(req, now)
                live -= 1
            for req in engine.prefilled:  # prefilled for another engine: to it, to be admitted there
                if config.prefill_complete and isinstance(router, PdRouter):
                    router.prefilled(req, now)
                req.stage = DECODE_SENT  # `engine` stays its prefill engine, whose link sends it
                target = engines[req.decode_engine]
                target.waiting.append(req)
                if target.busy_until is None:
                    start(req.decode_engine, now)
            engine.prefilled.clear()
            deliver(now)
            start(payload, now)
        elif kind == _SENT:  # a prompt's KV reached its decode engine
            req = payload
            engines[req.engine].sent(req)
            engines[req.decode_engine].received(req)
            deliver(now)
            for index in (req.decode_engine, req.engine):  # both may start: one has work, one room
                if engines[index].busy_until is None:
                    start(index, now)
        elif kind == _EVENTS:
            router.events(payload[0], payload[1], now)
        elif kind == _LATER:
            payload(now)
        elif kind == _TICK:
            if isinstance(router, Router):
                router.tick(now)
            if live or more:
                push(now + 0.1, _TICK, None)
        else:  # a sample of the engines
            times.append(now)
            loads = [e.in_flight() for e in engines]
            busy_max.append(max(loads))
            for i, e in enumerate(engines):
                inflight[i].append(loads[i])
                kv[i].append(round(e.used() / e.capacity, 4))
            if len(times) >= 2 * config.samples:  # the fleet runs on long past the last arrival:
                interval *= 2  # every other sample kept, at half the pace (the series stay bounded)
                times[:] = times[::2]
                busy_max[:] = busy_max[::2]
                for counts in inflight:
                    counts[:] = counts[::2]
                for shares in kv:
                    shares[:] = shares[::2]
            if live or more:
                push(times[-1] + interval, _SAMPLE, None)
        answered(now)
    router.close()
    prompt = sum(e.prompt_tokens for e in engines)
    return SettingRun(
        name=name, settings={"service": setting} if isinstance(setting, str) else
        {} if settings is None else _changed(settings),
        ttft=_stats(ttft), queue_wait=_stats(waits),
        hit_rate=(sum(e.cached_tokens for e in engines) / prompt) if prompt else 0.0,
        busy_max_mean=(sum(busy_max) / len(busy_max)) if busy_max else 0.0,
        requests=count, failed=failed, events_failed=router.events_failed, ttft_cdf=_cdf(ttft),
        series={"times": times, "in_flight": inflight, "kv_used": kv},
        pd=None if not isinstance(router, PdRouter) else {
            "prefill_engines": router.setup.prefill_engines,
            "decode_engines": config.engines - router.setup.prefill_engines, "decider": router.setup.decider},
        tpot=_stats(tpot) if isinstance(router, PdRouter) else None, tpot_cdf=_cdf(tpot),
        remote_share=(router.remote / count if count else 0.0) if isinstance(router, PdRouter) else None,
        replicas=setting.to_json() if isinstance(setting, ReplicaSetup) else None,
        tenants={} if set(tenants) <= {""} else {
            name: {"requests": n[0], "failed": n[1], "ttft": _stats(t), "queue_wait": _stats(w)}
            for name, (n, t, w) in sorted(tenants.items())})


def _cdf(values: array[float]) -> list[tuple[float, float]]:
    """(value, fraction at or below it) at ~200 points, for the report."""
    ordered = sorted(values)
    step = max(1, len(ordered) // 200)
    cdf = [(ordered[i], (i + 1) / len(ordered)) for i in range(0, len(ordered), step)]
    if ordered:
        cdf.append((ordered[-1], 1.0))
    return cdf


def _changed(settings: Settings) -> dict[str, Any]:
    """The settings that differ from the defaults (what names a run)."""
    base = Settings(kv_events="push")
    return {f.name: getattr(settings, f.name) for f in attrs.fields(Settings)
            if getattr(settings, f.name) != getattr(base, f.name)}


def simulate(trace: Callable[[], Iterable[TraceRequest]], config: FleetConfig,
             settings: list[tuple[str, Setup]],
             watch: Callable[[str, SimRequest], None] | None = None) -> list[SettingRun]:
    """Replay `trace()` (called once for its totals and once per setting: a stream, never held
    whole) through a fleet for each named setting: `Settings` for the core in process, a
    `PdSetup` for its plans, a `ReplicaSetup` for replicas of it, a URL for a running service (`ServiceRouter`), None for a baseline of
    `BASELINES` or the `ORACLE`. `watch(setting name, request)`: called at each first token, with
    when the request arrived, was sent to its engine, started there and got its first token, and
    the prompt tokens its engine had cached (what bench/tenants.py --explain reads)."""
    first = last = None
    count = isl = osl = blocks = 0
    for req in trace():
        first = req.arrival if first is None else first
        last = req.arrival
        count += 1
        isl += req.input_length
        osl += req.output_length
        blocks += len(req.hash_ids)
    if first is None or last is None:
        return [_run(name, s, [], 0.0, config) for name, s in settings]
    rate = sum(map(config.speed, range(config.engines))) * config.model.request_rate(config.kv_blocks, isl / count, osl / count, blocks / count)
    # Arrivals are compressed (or stretched) so that they come at `load` times the rate the
    # fleet sustains without reuse: whatever the cache saves is the router's to win.
    span = last - first
    if config.speedup is not None:
        scale = 1.0 / config.speedup
    else:
        scale = (count / (config.load * rate)) / span if span > 0 else 1.0
    end = span * scale

    def arrivals() -> Iterator[tuple[float, TraceRequest]]:
        for req in trace():
            yield (req.arrival - first) * scale, req

    return [_run(name, s, arrivals(), end, config, watch) for name, s in settings]
