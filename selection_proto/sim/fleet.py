"""The simulated fleet (docs/ROUTING.md): engines with a KV cache and an iteration-level performance
model, the trace's requests arriving in virtual time, and a router deciding where each goes. The
router is the real core (a `SelectionService` per setting, called as a client would:
select_and_reserve, prefill_complete, free, and the KV events the engines publish), or a baseline
(`random`, `round-robin`, and `least-loaded`: cache-blind but load-aware, the engine with the fewest
requests in flight), or the all-knowing `oracle` (oracle.py). One run per setting, each from the
same arrivals."""

from __future__ import annotations

import contextlib
import heapq
import random
from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs

from ..core.errors import NotFound, SelectionError
from ..core.events import KvEvent
from ..core.hashing import signed
from ..core.outputs import SelectionReady
from ..core.responses import Pending, SelectResponse
from ..core.service import SelectionService
from ..core.settings import Settings
from ..core.types import SelectAndReserveRequest, WorkerRequest
from .engine import Engine, FleetConfig, SimRequest, block_hash
from .oracle import fastest
from .service import ServiceRouter
from .trace import TraceRequest

__all__ = ["BASELINES", "ORACLE", "SettingRun", "simulate"]

BASELINES = ("random", "round-robin", "least-loaded")
ORACLE = "oracle"  # the all-knowing router (oracle.py): `--compare oracle`


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

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "settings": self.settings, "ttft": self.ttft, "queue_wait": self.queue_wait,
                "hit_rate": self.hit_rate, "busy_max_mean": self.busy_max_mean, "requests": self.requests,
                "failed": self.failed, "events_failed": self.events_failed,
                **({"tenants": self.tenants} if self.tenants else {})}


def _stats(values: array[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)
    last = len(ordered) - 1

    def at(q: float) -> float:
        return ordered[min(last, int(q * len(ordered)))]

    return {"mean": sum(ordered) / len(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


class _Router:
    """Where a request goes: the core (booking, completing and freeing as a client does), or a
    baseline that books nothing."""

    def __init__(self, name: str, settings: Settings | None, config: FleetConfig) -> None:
        self.name = name
        self.rng = random.Random(config.seed)
        self.turn = 0
        self.engines = config.engines
        self.service: SelectionService | None = None
        self.fleet: list[Engine] = []  # the engines, which least-loaded and the oracle read
        self.events_failed = 0  # engine events the core refused (none, when the engines are right)
        if settings is not None:
            self.service = SelectionService(settings, random.Random(config.seed))
            # Each engine's record says its prefill speed, as a real one would: what deadline
            # admission reads. A mixed fleet (`engine_speeds`) is not told: its speeds are learned.
            speed = None if config.engine_speeds else config.model.tokens_per_sec
            for index in range(config.engines):
                self.service.upsert_worker(WorkerRequest(
                    worker_id=index, model_name="m", endpoint=f"sim://{index}",
                    block_size=config.trace_block_size, total_kv_blocks=config.kv_blocks,
                    max_num_batched_tokens=config.model.max_batched_tokens, prefill_tokens_per_sec=speed), now=0.0)

    def local_hashes(self, hash_ids: tuple[int, ...]) -> list[int]:
        return [block_hash(h) for h in hash_ids]

    def choose(self, req: SimRequest, now: float) -> int | Pending | None:
        if self.service is None:
            if self.name == "random":
                return self.rng.randrange(self.engines)
            if self.name == ORACLE:
                return fastest(self.fleet, req, now, self.rng)
            if self.name == "least-loaded":
                loads = [e.in_flight() for e in self.fleet]
                fewest = min(loads)
                return self.rng.choice([i for i, n in enumerate(loads) if n == fewest])
            self.turn = (self.turn + 1) % self.engines
            return self.turn
        try:
            answer = self.service.select_and_reserve(SelectAndReserveRequest(
                model_name="m", block_hashes=req.locals.tolist(), sequence_hashes=list(signed(req.seqs)),
                isl_tokens=req.isl,
                reservation_id=req.rid, **req.flow), now=now)
        except SelectionError:
            return None
        return answer if isinstance(answer, Pending) else answer.worker_id

    def prefill_done(self, req: SimRequest, now: float) -> None:
        if self.service is not None:
            with contextlib.suppress(NotFound):  # outlived active_request_expiry_secs: expired, as a client sees
                self.service.prefill_complete(req.rid, now=now)

    def freed(self, req: SimRequest, now: float) -> None:
        if self.service is not None:
            with contextlib.suppress(NotFound):
                self.service.free(req.rid, now=now)

    def events(self, engine: int, events: list[KvEvent], now: float) -> None:
        if self.service is not None:
            self.events_failed += self.service.apply_kv_events(events, now=now, worker_id=engine).failed

    def ready(self) -> Iterator[SelectionReady]:
        """Answers of queued selections that came out of the last calls."""
        if self.service is None:
            return
        while (out := self.service.next_output()) is not None:
            if isinstance(out, SelectionReady):
                yield out

    def close(self) -> None:
        """Nothing to let go of in process."""


_ARRIVE, _STEP, _EVENTS, _SAMPLE, _TICK = range(5)


def _run(name: str, setting: Settings | str | None, arrivals: Iterable[tuple[float, TraceRequest]], end: float,
         config: FleetConfig) -> SettingRun:
    settings = setting if isinstance(setting, Settings) else None
    router: _Router | ServiceRouter
    if isinstance(setting, str):  # a running service's URL
        router = ServiceRouter(setting, config)
    else:
        router = _Router(name, settings, config)
    heap: list[tuple[float, int, int, Any]] = []
    order = 0

    def push(at: float, kind: int, payload: Any) -> None:
        nonlocal order
        order += 1
        heapq.heappush(heap, (at, order, kind, payload))

    outbox: dict[int, list[KvEvent]] = {}

    def publish(engine: int, event: KvEvent) -> None:
        outbox.setdefault(engine, []).append(event)

    engines = [Engine(i, config, publish) for i in range(config.engines)]
    if isinstance(router, _Router):
        router.fleet = engines
    source = iter(arrivals)
    ttft, waits = array("d"), array("d")
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
        target = engines[engine]
        target.waiting.append(req)
        if target.busy_until is None:
            ends = target.start(now)
            if ends is not None:
                push(ends, _STEP, engine)

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
            if isinstance(ready.result, SelectResponse):
                dispatch(req, ready.result.worker_id, now)
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
                ttft.append(req.first_token - req.arrival)
                waits.append(req.started - req.arrival)
                _, mine, waited = tenant(req)
                mine.append(ttft[-1])
                waited.append(waits[-1])
                if config.prefill_complete:
                    router.prefill_done(req, now)
            for req in done:
                router.freed(req, now)
                live -= 1
            deliver(now)
            ends = engine.start(now)
            if ends is not None:
                push(ends, _STEP, payload)
        elif kind == _EVENTS:
            router.events(payload[0], payload[1], now)
        elif kind == _TICK:
            if router.service is not None:
                router.service.tick(now)
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
    cdf_values = sorted(ttft)
    step = max(1, len(cdf_values) // 200)
    cdf = [(cdf_values[i], (i + 1) / len(cdf_values)) for i in range(0, len(cdf_values), step)]
    if cdf_values:
        cdf.append((cdf_values[-1], 1.0))
    return SettingRun(
        name=name, settings={"service": setting} if isinstance(setting, str) else
        {} if settings is None else _changed(settings),
        ttft=_stats(ttft), queue_wait=_stats(waits),
        hit_rate=(sum(e.cached_tokens for e in engines) / prompt) if prompt else 0.0,
        busy_max_mean=(sum(busy_max) / len(busy_max)) if busy_max else 0.0,
        requests=count, failed=failed, events_failed=router.events_failed, ttft_cdf=cdf,
        series={"times": times, "in_flight": inflight, "kv_used": kv},
        tenants={} if set(tenants) <= {""} else {
            name: {"requests": n[0], "failed": n[1], "ttft": _stats(t), "queue_wait": _stats(w)}
            for name, (n, t, w) in sorted(tenants.items())})


def _changed(settings: Settings) -> dict[str, Any]:
    """The settings that differ from the defaults (what names a run)."""
    base = Settings(kv_events="push")
    return {f.name: getattr(settings, f.name) for f in attrs.fields(Settings)
            if getattr(settings, f.name) != getattr(base, f.name)}


def simulate(trace: Callable[[], Iterable[TraceRequest]], config: FleetConfig,
             settings: list[tuple[str, Settings | str | None]]) -> list[SettingRun]:
    """Replay `trace()` (called once for its totals and once per setting: a stream, never held
    whole) through a fleet for each named setting: `Settings` for the core in process, a URL for
    a running service (`ServiceRouter`), None for a baseline of `BASELINES` or the `ORACLE`."""
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

    return [_run(name, s, arrivals(), end, config) for name, s in settings]
