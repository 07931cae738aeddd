"""Where a simulated request goes (docs/ROUTING.md): the real core as one service, called as a
client would (select_and_reserve, prefill_complete, free, and the KV events the engines publish);
N services behind a round-robin balancer, sharing bookings through an in-process ledger or not
(`ReplicaSetup`); the core's prefill/decode plans (`PdSetup`, docs/PD.md); or a baseline
(`random`, `round-robin`, `least-loaded`) or the all-knowing `oracle` (oracle.py)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from ..core.base import jsonio
from ..core.base.errors import NotFound, SelectionError
from ..core.base.hashing import signed
from ..core.base.outputs import SelectionReady
from ..core.base.responses import Pending
from ..core.base.settings import Settings
from ..core.base.types import PdOptions, SelectAndReserveRequest, SelectPdAndReserveRequest, WorkerRequest
from ..core.base.wire import Response
from ..core.cache.events import KvEvent
from ..core.fleet.journal import LedgerSettings
from ..core.fleet.ledger_wire import LedgerSnapshot
from ..core.ledger import Ledger
from ..core.service import SelectionService
from .engine import PREFILL_FOR_OTHER, Engine, FleetConfig, SimRequest, block_hash
from .ledger import FeedLedger
from .oracle import fastest

__all__ = ["BASELINES", "DECIDERS", "ORACLE", "PdRouter", "PdSetup", "ReplicaSetup", "Replicas", "Router",
           "held_worker"]

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
    # Every replica draws its random choices from one generator, in the order the calls come: a
    # shared run with no delay is then the lone service to the last digit, which tells the
    # random tie-breaks apart from state a replica keeps that the ledger does not carry
    # (docs/ROUTING.md, "Replicas"). Off, replica i is seeded with the run's seed + i.
    one_generator: bool = False
    # Shared: "strict" holds each booking's answer until the ledger confirms that no other
    # replica booked its rank meanwhile, and selects again on a conflict (docs/REPLICATION.md).
    admission: str = "advisory"

    def to_json(self) -> dict[str, Any]:
        return {"replicas": self.replicas, "shared": self.shared, "ledger_delay_secs": self.ledger_delay_secs,
                **({"admission": self.admission} if self.shared and self.admission != "advisory" else {})}


def held_worker(response: Response) -> int | None:
    """The worker of a `select_and_reserve` answered over the wire (an answer the ledger held),
    or None when it was refused."""
    if response.status != 200:
        return None
    worker: int = jsonio.loads(response.body)["worker_id"]
    return worker


class Router:
    """Where a request goes: the core (booking, completing and freeing as a client does), or a
    baseline that books nothing."""

    def __init__(self, name: str, settings: Settings | None, config: FleetConfig, seed: int | None = None,
                 rng: random.Random | None = None) -> None:
        self.name = name
        seed = config.seed if seed is None else seed
        self.rng = random.Random(seed)
        self.turn = 0
        self.engines = config.engines
        self.service: SelectionService | None = None
        self.fleet: list[Engine] = []  # the engines, which least-loaded and the oracle read
        self.events_failed = 0  # engine events the core refused (none, when the engines are right)
        if settings is not None:
            self.service = SelectionService(settings, rng if rng is not None else random.Random(seed))
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


class Replicas(Router):
    """N services behind a round-robin balancer (`ReplicaSetup`). A request's later calls go to
    the replica that booked it, as a gateway frees what it routed. Shared, after each call the
    replica's journal is written to the ledger and the entries it appended, with the writer's
    replies, reach every replica `ledger_delay_secs` later (`later`), in the ledger's order."""

    def __init__(self, name: str, setup: ReplicaSetup, config: FleetConfig) -> None:
        super().__init__(name, None, config)
        self.setup = setup
        # Replica 0 is seeded as a lone service is: one replica is today's run, exactly.
        one = random.Random(config.seed) if setup.one_generator else None
        self.replicas = [Router(f"{name}/{i}", setup.settings, config, seed=config.seed + i, rng=one)
                         for i in range(setup.replicas)]
        self.service = self.replicas[0].service  # what `_run` reads: the core is in the loop
        self.booked: dict[str, int] = {}  # reservation id -> its replica
        self.tickets: dict[tuple[int, int], int] = {}  # (replica, its ticket) -> the run's
        self.issued = 0
        self.ledger = FeedLedger() if setup.shared else None
        self.mirrors: list[Ledger] = []
        # Set by `_run`: call `action(at)` at virtual time `at`, after what is due before it.
        self.later: Callable[[float, Callable[[float], None]], None] = lambda at, action: action(at)
        self.strict = setup.shared and setup.admission == "strict"
        if self.ledger is not None:
            for i, replica in enumerate(self.replicas):
                assert replica.service is not None
                mirror = replica.service.share(LedgerSettings(admission="strict" if self.strict else "advisory"),
                                               f"replica-{i}")
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
            # A strict booking that conflicted selects again once the feed has caught up: here.
            for index, other in enumerate(self.mirrors):
                if other.journal.ops:
                    self.share(index, at)

        if self.setup.ledger_delay_secs > 0:
            self.later(now + self.setup.ledger_delay_secs, arrive)
        else:
            arrive(now)

    def choose(self, req: SimRequest, now: float) -> int | Pending | None:
        index = self.turn
        self.turn = (self.turn + 1) % len(self.replicas)
        self.booked[req.rid] = index
        answer = self._strict(index, req, now) if self.strict else self.replicas[index].choose(req, now)
        self.share(index, now)
        if isinstance(answer, Pending):
            self.issued += 1
            self.tickets[(index, answer.ticket)] = self.issued
            return Pending(self.issued)
        return answer

    def _strict(self, index: int, req: SimRequest, now: float) -> int | Pending | None:
        """The booking as a gateway's request makes it (`handle`, where the ledger holds strict
        answers; the Python API books advisory): a worker, a ticket for the held answer, or None."""
        service = self.replicas[index].service
        assert service is not None
        body = jsonio.dumps({"model_name": "m", "block_hashes": req.locals.tolist(),
                             "sequence_hashes": list(signed(req.seqs)), "isl_tokens": req.isl,
                             "reservation_id": req.rid, **req.flow})
        answer = service.handle("POST", "/select_and_reserve", "", (("content-type", "application/json"),),
                                body, now=now)
        if isinstance(answer, Pending):
            return answer
        return held_worker(answer)

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


class PdRouter(Router):
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
