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
from ..core.journal import LedgerSettings
from ..core.ledger import Ledger
from ..core.ledger_wire import LedgerSnapshot
from ..core.outputs import SelectionReady
from ..core.responses import Pending, SelectResponse
from ..core.service import SelectionService
from ..core.settings import Settings
from ..core.types import PdOptions, SelectAndReserveRequest, SelectPdAndReserveRequest, WorkerRequest
from .engine import DECODE_SENT, PREFILL_FOR_OTHER, Engine, FleetConfig, SimRequest, block_hash
from .ledger import FeedLedger
from .oracle import fastest
from .service import ServiceRouter
from .trace import TraceRequest

__all__ = ["BASELINES", "DECIDERS", "ORACLE", "PdSetup", "ReplicaSetup", "SettingRun", "Setup", "simulate"]

BASELINES = ("random", "round-robin", "least-loaded")
ORACLE = "oracle"  # the all-knowing router (oracle.py): `--compare oracle`
# The core's deciders (docs/PD.md), and `ttft`: no decider named, under router_policy=ttft.
DECIDERS = ("isl_bounding", "uncached_threshold", "always", "never", "ttft")
_EMPTY_LEDGER = LedgerSnapshot("sim", 0, b"0-0", {}, set(), {}, {}, {}, {}, {})  # where shared replicas start


@attrs.frozen(kw_only=True)
class PdSetup:
    """A run planned through the core's P/D plans: the first `prefill_engines` engines prefill
    only (role `prefill`), the others decode and may prefill locally (role `decode`,
    `local_prefill` true); with no prefill engines, the fleet is aggregated (no roles)."""

    settings: Settings
    prefill_engines: int = 0
    decider: str | None = None  # of DECIDERS; None: the core's default

    def options(self, config: FleetConfig) -> PdOptions:
        """What each plan asks: the decider, and the link's speed as the fleet has it."""
        return PdOptions(decider=None if self.decider in (None, "ttft") else self.decider,
                         transfer_tokens_per_sec=config.transfer_tokens_per_sec)


@attrs.frozen(kw_only=True)
class ReplicaSetup:
    """`replicas` services of `settings` behind a round-robin balancer, sharing their bookings
    through one ledger whose changes reach every replica `ledger_delay_secs` after they are made
    (`shared`), or each counting only its own (not `shared`)."""

    settings: Settings
    replicas: int
    shared: bool = True
    ledger_delay_secs: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"replicas": self.replicas, "shared": self.shared, "ledger_delay_secs": self.ledger_delay_secs}


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
    # A `ReplicaSetup` run only: {"replicas", "shared", "ledger_delay_secs"}.
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


class _Router:
    """Where a request goes: the core (booking, completing and freeing as a client does), or a
    baseline that books nothing."""

    def __init__(self, name: str, settings: Settings | None, config: FleetConfig, seed: int | None = None) -> None:
        self.name = name
        seed = config.seed if seed is None else seed
        self.rng = random.Random(seed)
        self.turn = 0
        self.engines = config.engines
        self.service: SelectionService | None = None
        self.fleet: list[Engine] = []  # the engines, which least-loaded and the oracle read
        self.events_failed = 0  # engine events the core refused (none, when the engines are right)
        if settings is not None:
            self.service = SelectionService(settings, random.Random(seed))
            # Each engine's record says its prefill speed, as a real one would: what deadline
            # admission reads. A mixed fleet (`engine_speeds`) is not told: its speeds are learned.
            speed = None if config.engine_speeds else config.model.tokens_per_sec
            for index in range(config.engines):
                self.service.upsert_worker(WorkerRequest(
                    worker_id=index, model_name="m", endpoint=f"sim://{index}",
                    block_size=config.trace_block_size, total_kv_blocks=config.kv_blocks,
                    max_num_batched_tokens=config.model.max_batched_tokens, prefill_tokens_per_sec=speed,
                    **self.role(index)), now=0.0)

    def role(self, index: int) -> dict[str, Any]:
        """The P/D members of engine `index`'s record: none in an aggregated fleet."""
        return {}

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

    def tick(self, now: float) -> None:
        if self.service is not None:
            self.service.tick(now)

    def close(self) -> None:
        """Nothing to let go of in process."""


class _Replicas(_Router):
    """N services behind a round-robin balancer (`ReplicaSetup`). A request's later calls go to
    the replica that booked it, as a gateway frees what it routed. Shared, after each call the
    replica's journal is written to the ledger and the entries it appended, with the writer's
    replies, reach every replica `ledger_delay_secs` later (`later`), in the ledger's order."""

    def __init__(self, name: str, setup: ReplicaSetup, config: FleetConfig) -> None:
        super().__init__(name, None, config)
        self.setup = setup
        # Replica 0 is seeded as a lone service is: one replica is today's run, exactly.
        self.replicas = [_Router(f"{name}/{i}", setup.settings, config, seed=config.seed + i)
                         for i in range(setup.replicas)]
        self.service = self.replicas[0].service  # what `_run` reads: the core is in the loop
        self.booked: dict[str, int] = {}  # reservation id -> its replica
        self.tickets: dict[tuple[int, int], int] = {}  # (replica, its ticket) -> the run's
        self.issued = 0
        self.ledger = FeedLedger() if setup.shared else None
        self.mirrors: list[Ledger] = []
        # Set by `_run`: call `action(at)` at virtual time `at`, after what is due before it.
        self.later: Callable[[float, Callable[[float], None]], None] = lambda at, action: action(at)
        if self.ledger is not None:
            for i, replica in enumerate(self.replicas):
                assert replica.service is not None
                mirror = replica.service.share(LedgerSettings(), f"replica-{i}")
                mirror.connected(True, 0.0)
                mirror.load(_EMPTY_LEDGER, 0.0)  # which it gives its catalog, as seeds
                self.mirrors.append(mirror)
            for i in range(setup.replicas):  # every replica reads the feed from its first entry
                self.share(i, 0.0)

    def share(self, replica: int, now: float) -> None:
        """Write `replica`'s journal to the ledger; its replies and the feed reach the replicas
        after the delay (at once with none)."""
        if self.ledger is None:
            return
        mirror = self.mirrors[replica]
        ops = mirror.journal.take(len(mirror.journal.ops))
        if not ops:
            return
        replies, entries = self.ledger.write(mirror.origin, ops)

        def arrive(at: float) -> None:
            mirror.results(ops, replies, at)
            for other in self.mirrors:
                other.apply(entries, at)
                if other.needs_snapshot:  # the feed is whole and in order here: a gap is a bug
                    raise RuntimeError(f"simulated replica {other.origin} lost its place in the ledger's feed")

        if self.setup.ledger_delay_secs > 0:
            self.later(now + self.setup.ledger_delay_secs, arrive)
        else:
            arrive(now)

    def choose(self, req: SimRequest, now: float) -> int | Pending | None:
        index = self.turn
        self.turn = (self.turn + 1) % len(self.replicas)
        self.booked[req.rid] = index
        answer = self.replicas[index].choose(req, now)
        self.share(index, now)
        if isinstance(answer, Pending):
            self.issued += 1
            self.tickets[(index, answer.ticket)] = self.issued
            return Pending(self.issued)
        return answer

    def prefill_done(self, req: SimRequest, now: float) -> None:
        index = self.booked[req.rid]
        self.replicas[index].prefill_done(req, now)
        self.share(index, now)

    def freed(self, req: SimRequest, now: float) -> None:
        index = self.booked.pop(req.rid)
        self.replicas[index].freed(req, now)
        self.share(index, now)

    def events(self, engine: int, events: list[KvEvent], now: float) -> None:
        for index, replica in enumerate(self.replicas):  # each replica subscribes to every engine
            replica.events(engine, events, now)
            self.share(index, now)
        self.events_failed = sum(replica.events_failed for replica in self.replicas)

    def ready(self) -> Iterator[SelectionReady]:
        for index, replica in enumerate(self.replicas):
            for out in replica.ready():
                ticket = self.tickets.pop((index, out.ticket), None)
                if ticket is not None:  # else an answer held for the ledger: no client waits on it here
                    yield attrs.evolve(out, ticket=ticket)

    def tick(self, now: float) -> None:
        for index, replica in enumerate(self.replicas):
            replica.tick(now)
            self.share(index, now)


class _PdRouter(_Router):
    """The core's plans (docs/PD.md), called as a P/D router's client would."""

    def __init__(self, name: str, setup: PdSetup, config: FleetConfig) -> None:
        self.setup = setup
        self.options = setup.options(config)
        self.remote = 0
        super().__init__(name, setup.settings, config)

    def role(self, index: int) -> dict[str, Any]:
        if not self.setup.prefill_engines:
            return {}
        if index < self.setup.prefill_engines:
            return {"role": "prefill"}
        return {"role": "decode", "local_prefill": True}

    def choose(self, req: SimRequest, now: float) -> int | Pending | None:
        """The decode engine; a remote plan also sets the request's stage and where its KV goes,
        and answers the prefill engine."""
        assert self.service is not None
        try:
            plan = self.service.plan(SelectPdAndReserveRequest(
                model_name="m", block_hashes=req.locals.tolist(), sequence_hashes=list(signed(req.seqs)),
                isl_tokens=req.isl, plan_id=req.rid, pd=self.options, **req.flow), now=now)
        except SelectionError:
            return None
        decode: int = plan.decode["worker_id"]
        if plan.prefill is None:
            return decode
        self.remote += 1
        req.stage, req.decode_engine = PREFILL_FOR_OTHER, decode
        prefill: int = plan.prefill["worker_id"]
        return prefill

    def prefilled(self, req: SimRequest, now: float) -> None:
        """The prefill engine is done: the prefill leg's work is over (the handoff frees it)."""
        assert self.service is not None
        with contextlib.suppress(NotFound):
            self.service.prefill_complete(req.rid + ":prefill", now=now)

    def prefill_done(self, req: SimRequest, now: float) -> None:
        """The first token: the handoff."""
        assert self.service is not None
        self.service.release_plan(req.rid, end=False, now=now)

    def freed(self, req: SimRequest, now: float) -> None:
        assert self.service is not None
        self.service.release_plan(req.rid, end=True, now=now)


_ARRIVE, _STEP, _EVENTS, _SAMPLE, _TICK, _SENT, _LATER = range(7)


Setup = Settings | PdSetup | ReplicaSetup | str | None


def _run(name: str, setting: Setup, arrivals: Iterable[tuple[float, TraceRequest]],
         end: float, config: FleetConfig) -> SettingRun:
    settings = setting.settings if isinstance(setting, PdSetup | ReplicaSetup) else \
        setting if isinstance(setting, Settings) else None
    router: _Router | ServiceRouter
    if isinstance(setting, str):  # a running service's URL
        router = ServiceRouter(setting, config)
    elif isinstance(setting, PdSetup):
        router = _PdRouter(name, setting, config)
    elif isinstance(setting, ReplicaSetup):
        router = _Replicas(name, setting, config)
    else:
        router = _Router(name, settings, config)
    heap: list[tuple[float, int, int, Any]] = []
    order = 0

    def push(at: float, kind: int, payload: Any) -> None:
        nonlocal order
        order += 1
        heapq.heappush(heap, (at, order, kind, payload))

    if isinstance(router, _Replicas):
        router.later = lambda at, action: push(at, _LATER, action)

    outbox: dict[int, list[KvEvent]] = {}

    def publish(engine: int, event: KvEvent) -> None:
        outbox.setdefault(engine, []).append(event)

    engines = [Engine(i, config, publish) for i in range(config.engines)]
    if isinstance(router, _Router):
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
                if req.osl > 1 and isinstance(router, _PdRouter):
                    tpot.append((now - req.first_token) / (req.osl - 1))
                router.freed(req, now)
                live -= 1
            for req in engine.prefilled:  # prefilled for another engine: to it, to be admitted there
                if config.prefill_complete and isinstance(router, _PdRouter):
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
            if isinstance(router, _Router):
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
        pd=None if not isinstance(router, _PdRouter) else {
            "prefill_engines": router.setup.prefill_engines,
            "decode_engines": config.engines - router.setup.prefill_engines, "decider": router.setup.decider},
        tpot=_stats(tpot) if isinstance(router, _PdRouter) else None, tpot_cdf=_cdf(tpot),
        remote_share=(router.remote / count if count else 0.0) if isinstance(router, _PdRouter) else None,
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
             settings: list[tuple[str, Setup]]) -> list[SettingRun]:
    """Replay `trace()` (called once for its totals and once per setting: a stream, never held
    whole) through a fleet for each named setting: `Settings` for the core in process, a
    `PdSetup` for its plans, a `ReplicaSetup` for replicas of it, a URL for a running service (`ServiceRouter`), None for a baseline of
    `BASELINES` or the `ORACLE`."""
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
