"""Replicas sharing one booking ledger on a real Valkey/Redis server (docs/REPLICATION.md), run
in-process: each replica is a `SelectionService` with its own `LedgerLink` in one anyio loop."""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from conftest import Client
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from ledger_server import LedgerServer
from replicas import WORKER, park, replicas, settled, unpark, until

from selection_proto import SelectionService, Settings
from selection_proto.core.fleet.journal import LedgerSettings

PROMPT = {"model_name": "m", "token_ids": list(range(16))}


def run(test: Any, *args: Any) -> None:
    anyio.run(test, *args, backend="asyncio")


async def _two_workers(r: Any) -> None:
    for worker_id in (1, 2):
        await r.ok("POST", "/workers", {**WORKER, "worker_id": worker_id}, status=201)


X_BOOKING = {**PROMPT, "worker_id": 2, "reservation_id": "x"}


async def _x_used_once(a: Any, b: Any) -> None:
    """Two workers; reservation `x` booked on A and freed, both replicas settled: `x` is an id
    used before, whose next booking is one the ledger must order."""
    await _two_workers(a)
    await settled([a, b])
    await a.ok("POST", "/reservations", X_BOOKING, status=201)
    await a.ok("DELETE", "/reservations/x")
    await settled([a, b])


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_bookings_and_the_catalog_converge_and_any_replica_frees_any_booking(ledger: LedgerServer,
                                                                              backend: str) -> None:
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            await until(lambda: sorted(w.worker_id for w in b.service.list_workers()) == [1, 2])
            booked = await a.ok("POST", "/select_and_reserve", {**PROMPT, "reservation_id": "r1"})
            await until(lambda: b.loads().get(booked["worker_id"], (0,))[0] == 1)
            assert b.loads() == a.loads()
            assert a.loads()[booked["worker_id"]] == (1, 16, 4)
            await b.ok("POST", "/reservations/r1/prefill_complete")
            await until(lambda: a.loads()[booked["worker_id"]] == (1, 0, 4))
            await b.ok("DELETE", "/reservations/r1")
            await until(lambda: a.loads()[booked["worker_id"]] == (0, 0, 0))
            # The catalog: a delete on B removes the worker on A too.
            await b.ok("DELETE", "/workers/2")
            await until(lambda: [w.lifecycle for w in a.service.list_workers()] == ["schedulable", "unschedulable"])
            await settled([a, b])
            assert a.loads() == b.loads() == {1: (0, 0, 0)}
            text = b.service.metrics_text(now=0.0)
            lag = float(text.split("\nselection_proto_ledger_feed_lag_seconds ")[1].split()[0])
            assert 0.0 <= lag < 5.0  # how far behind the feed B read, by the wall clock
            assert "\nselection_proto_ledger_connected 1.0\n" in text

    anyio.run(main, backend=backend)


def test_a_free_long_before_its_booking_is_answered_404_and_then_forgotten(ledger: LedgerServer) -> None:
    """A free of an id the ledger has not seen is remembered for `free_grace_secs` only: a booking
    that arrives later (its replica was cut off) stands, as the 404 said."""
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            await settled([a, b])
            a.link.held_writes = True  # A's booking has not reached the ledger yet
            await a.ok("POST", "/reservations", {**PROMPT, "worker_id": 1, "reservation_id": "early"}, status=201)
            started = time.monotonic()
            status, body = await b.call("DELETE", "/reservations/early")
            assert (status, body) == (404, {"error": "reservation early not found"})
            assert time.monotonic() - started >= a.ledger.settings.free_grace_secs
            a.link.held_writes = False
            a.link.poke()
            await settled([a, b])
            assert a.loads()[1] == b.loads()[1] == (1, 16, 4)
            await b.ok("DELETE", "/reservations/early")
            await settled([a, b])
            assert a.loads() == b.loads() == {1: (0, 0, 0), 2: (0, 0, 0)}

    run(main)


def test_an_early_free_answers_200_when_its_booking_reaches_the_ledger_within_the_grace(
        ledger: LedgerServer) -> None:
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            await settled([a, b])
            a.link.held_writes = True
            await a.ok("POST", "/reservations", {**PROMPT, "worker_id": 1, "reservation_id": "soon"}, status=201)
            ticket = b.send("DELETE", "/reservations/soon")
            assert isinstance(ticket, int)  # held: the ledger does not know the id yet
            await until(lambda: ledger.client().zscore("sp:{t}:tomb", "soon") is not None)
            a.link.held_writes = False
            a.link.poke()
            assert await b.answer(ticket) == (200, {"status": "ok"})
            await settled([a, b])
            assert a.loads() == b.loads() == {1: (0, 0, 0), 2: (0, 0, 0)}

    run(main)


def test_a_written_through_free_of_a_booking_in_flight_answers_200(ledger: LedgerServer) -> None:
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            await settled([a, b])
            await park([b], via=a)  # B will not have seen the booking
            await a.ok("POST", "/reservations", {**PROMPT, "worker_id": 2, "reservation_id": "x"}, status=201)
            await until(lambda: ledger.client().hexists("sp:{t}:res", "x"))
            assert await b.call("DELETE", "/reservations/x") == (200, {"status": "ok"})
            unpark([b])
            await settled([a, b])
            assert a.loads() == b.loads() == {1: (0, 0, 0), 2: (0, 0, 0)}

    run(main)


def test_a_written_through_free_cut_off_by_an_outage_answers_200_once_the_ledger_takes_it(
        ledger: LedgerServer) -> None:
    """A free waiting for the ledger's word when the connection drops is not a 404: the booking
    is kept, and the free goes once the ledger is back (it used to answer 404 at the drop)."""
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            await settled([a, b])
            await park([b], via=a)  # B will not have seen the booking
            await a.ok("POST", "/reservations", {**PROMPT, "worker_id": 2, "reservation_id": "x"}, status=201)
            await until(lambda: ledger.client().hexists("sp:{t}:res", "x"))
            b.link.held_writes = True  # the free stays queued when the ledger goes
            ticket = b.send("DELETE", "/reservations/x")
            assert isinstance(ticket, int)
            ledger.stop()
            await until(lambda: not b.ledger.journal.connected)
            unpark([b])
            assert ticket not in b.answers  # not answered while the ledger is away
            b.link.held_writes = False
            ledger.start()
            assert await b.answer(ticket) == (200, {"status": "ok"})
            await settled([a, b])
            assert a.loads() == b.loads() == {1: (0, 0, 0), 2: (0, 0, 0)}
            assert not ledger.client().hexists("sp:{t}:res", "x")

    run(main)


def test_a_written_through_free_unanswered_through_a_long_outage_answers_503_never_404(
        ledger: LedgerServer) -> None:
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            await settled([a, b])
            await park([b], via=a)
            await a.ok("POST", "/reservations", {**PROMPT, "worker_id": 2, "reservation_id": "x"}, status=201)
            await until(lambda: ledger.client().hexists("sp:{t}:res", "x"))
            b.link.held_writes = True
            ticket = b.send("DELETE", "/reservations/x")
            ledger.stop()
            assert isinstance(ticket, int)
            status, body = await b.answer(ticket)  # the grace (0.3 s) ends while the ledger is away
            assert (status, body["error"]) == (503, "ledger unavailable: reservation x may be booked on another replica")
            unpark([b])
            b.link.held_writes = False
            ledger.start()
            await settled([a, b])  # the free still went: the booking is gone everywhere
            assert a.loads() == b.loads() == {1: (0, 0, 0), 2: (0, 0, 0)}

    run(main)


def test_an_early_free_after_the_ledger_came_back_empty_refuses_the_booking_given_back(
        ledger: LedgerServer) -> None:
    """A booking given back after a reset carried its replica's view of the old feed, which is
    ahead of the new one: an early free of it in the new feed did not refuse it, answered 404
    after the grace and left it counted."""
    async def main() -> None:
        async with replicas(2, ledger.url, ledger=LedgerSettings(free_grace_secs=3.0)) as (a, b):
            await _two_workers(a)
            await settled([a, b])
            for i in range(20):  # the old feed runs well ahead of the new one's first entries
                await b.ok("POST", "/reservations", {**PROMPT, "worker_id": 1, "reservation_id": f"old{i}"},
                           status=201)
                await b.ok("DELETE", f"/reservations/old{i}")
            await b.ok("POST", "/reservations", {**PROMPT, "worker_id": 2, "reservation_id": "x"}, status=201)
            await settled([a, b])
            b.link.held_writes = True  # B gives x back only after A's free of it
            ledger.wipe()
            ledger.start()
            await until(lambda: a.synced() and a.ledger.n < 10 and a.loads()[2] == (0, 0, 0))
            ticket = a.send("DELETE", "/reservations/x")  # A no longer holds x: written through
            assert isinstance(ticket, int)
            await until(lambda: ledger.client().zscore("sp:{t}:tomb", "x") is not None)
            b.link.held_writes = False
            assert await a.answer(ticket) == (200, {"status": "ok"})
            await settled([a, b])
            assert a.loads() == b.loads() == {1: (0, 0, 0), 2: (0, 0, 0)}
            assert not ledger.client().hexists("sp:{t}:res", "x")

    run(main)


def test_an_early_free_remembered_by_the_ledger_answers_503_when_it_goes_away(ledger: LedgerServer) -> None:
    """Whether the booking of a remembered early free came is unknown while the ledger is away:
    503 (retry), not 404; its booking, arriving after, is still refused."""
    async def main() -> None:
        async with replicas(2, ledger.url, ledger=LedgerSettings(free_grace_secs=3.0)) as (a, b):
            await _two_workers(a)
            await settled([a, b])
            a.link.held_writes = True  # A's booking of x reaches the ledger only after B's free
            await a.ok("POST", "/reservations", {**PROMPT, "worker_id": 2, "reservation_id": "x"}, status=201)
            ticket = b.send("DELETE", "/reservations/x")
            assert isinstance(ticket, int)
            await until(lambda: ledger.client().zscore("sp:{t}:tomb", "x") is not None)
            ledger.stop()
            status, body = await b.answer(ticket)
            assert (status, body["error"]) == (503, "ledger unavailable: reservation x may be booked on another replica")
            ledger.start()
            a.link.held_writes = False
            await settled([a, b])
            assert a.loads() == b.loads() == {1: (0, 0, 0), 2: (0, 0, 0)}

    run(main)


def test_a_batch_written_twice_is_counted_once(ledger: LedgerServer) -> None:
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            await settled([a, b])
            a.link.held_writes = True
            await a.ok("POST", "/reservations", {**PROMPT, "worker_id": 1, "reservation_id": "d"}, status=201)
            ops = a.ledger.journal.take(10)
            a.ledger.journal.requeue(ops)
            a.ledger.journal.requeue(list(ops))  # a retry after a timeout: the same ops again
            a.link.held_writes = False
            a.link.poke()
            await settled([a, b])
            assert a.loads()[1] == b.loads()[1] == (1, 16, 4)
            feed = ledger.client().xrange("sp:{t}:feed")
            assert [f[1][b"k"] for f in feed].count(b"add") == 1

    run(main)


def test_strict_admission_spreads_a_burst_that_advisory_piles_on_one_worker(ledger: LedgerServer) -> None:
    """Three replicas select the same prompt on the same view at once, four rounds, starting with
    one worker less loaded than the others."""
    async def burst(admission: str, scope: str) -> list[dict[int, int]]:
        settings = LedgerSettings(admission=admission)  # type: ignore[arg-type]
        rounds = []
        async with replicas(3, ledger.url, scope, settings, prefill_load_scale=1.0) as group:
            for worker_id in (1, 2, 3, 4):
                await group[0].ok("POST", "/workers", {**WORKER, "worker_id": worker_id}, status=201)
            for worker_id in (1, 2, 3):  # worker 4 is the one least loaded
                await group[0].ok("POST", "/reservations", {**PROMPT, "worker_id": worker_id,
                                                            "reservation_id": f"pre{worker_id}"}, status=201)
            await settled(group)
            for round_ in range(4):
                answers = [r.send("POST", "/select_and_reserve", {**PROMPT, "reservation_id": f"{r.ledger.origin}-{round_}"})
                           for r in group]
                bodies = [await r.answer(a) if isinstance(a, int) else a for r, a in zip(group, answers, strict=True)]
                assert all(status == 200 for status, _ in bodies), bodies
                await settled(group)
                rounds.append({w: load[0] for w, load in group[0].loads().items()})
                assert all(r.loads() == group[0].loads() for r in group)
        return rounds

    async def main() -> None:
        strict = await burst("strict", "strict")
        for loads in strict:
            assert max(loads.values()) - min(loads.values()) <= 1, strict
        advisory = await burst("advisory", "advisory")
        assert advisory[0][4] == 3  # the same stale view, three times: the herd

    run(main)


def test_a_strict_booking_conflicts_once_a_rank_of_its_pool_then_books_advisory(ledger: LedgerServer) -> None:
    """Replica b's booking is written each time after replica a has booked the same worker (the
    least loaded) on the view b selected on: it conflicts, b selects again once its feed has
    brought a's booking, and so on. Still strict after 3 conflicts, as long as it has conflicted
    fewer times than its pool has ranks (six); then booked advisory, so never held longer
    (docs/REPLICATION.md, "Strict admission")."""
    async def main() -> None:
        async with replicas(2, ledger.url, "tries", LedgerSettings(admission="strict")) as (a, b):
            for worker_id in range(1, 7):
                await a.ok("POST", "/workers", {**WORKER, "worker_id": worker_id}, status=201)
            for worker_id in range(2, 7):  # worker 1 is the least loaded for the next 8 bookings
                for n in range(8):
                    await a.ok("POST", "/reservations", {**PROMPT, "worker_id": worker_id,
                                                         "reservation_id": f"pre{worker_id}-{n}"}, status=201)
            await settled([a, b])

            def conflicts() -> float:
                return b.service.metrics.value("selection_proto_ledger_events_total", ("conflict",))

            written = b.ledger.results

            def one_write_at_a_time(*args: Any) -> None:  # b's next op waits for the test's word
                b.link.held_writes = True
                written(*args)

            b.ledger.results = one_write_at_a_time  # type: ignore[method-assign]
            b.link.held_writes = True
            ticket = b.send("POST", "/select_and_reserve", {**PROMPT, "reservation_id": "late"})
            assert isinstance(ticket, int)
            for round_ in range(6):
                await until(lambda: bool(b.ledger.journal.ops))  # b's booking, on a view without a's next one
                await a.ok("POST", "/select_and_reserve", {**PROMPT, "reservation_id": f"a{round_}"})
                b.link.held_writes = False
                b.link.poke()
                await until(lambda: conflicts() > round_)  # noqa: B023
                assert conflicts() == round_ + 1 and (ticket in b.answers) == (round_ == 5)
            # Six conflicts, as many as the pool has ranks: selected again and booked advisory,
            # answered at once.
            status, body = await b.answer(ticket)
            assert status == 200 and body["worker_id"] == 1
            b.link.held_writes = False
            b.link.poke()
            await settled([a, b])
            assert a.loads()[1][0] == b.loads()[1][0] == 7 and conflicts() == 6  # a's six and b's

    run(main)


def test_a_ledger_restarted_from_its_log_keeps_every_booking(ledger: LedgerServer) -> None:
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            for i in range(5):
                await a.ok("POST", "/reservations", {**PROMPT, "worker_id": 1 + i % 2, "reservation_id": f"k{i}"}, status=201)
            await settled([a, b])
            before = a.loads()
            ledger.kill()
            await until(lambda: not a.ledger.journal.connected and not b.ledger.journal.connected)
            ledger.start()
            await settled([a, b])
            assert a.loads() == b.loads() == before
            assert ledger.client().hlen("sp:{t}:res") == 5
            assert a.ledger.journal.connected

    run(main)


def test_a_ledger_that_came_back_empty_is_given_each_replicas_own_state(ledger: LedgerServer) -> None:
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            await settled([a, b])  # B learns of the workers through the feed
            await a.ok("POST", "/reservations", {**PROMPT, "worker_id": 1, "reservation_id": "ra"}, status=201)
            await b.ok("POST", "/reservations", {**PROMPT, "worker_id": 2, "reservation_id": "rb"}, status=201)
            await settled([a, b])
            ledger.wipe()
            ledger.start()
            await a.ok("POST", "/reservations", {**PROMPT, "worker_id": 2, "reservation_id": "rc"}, status=201)
            await settled([a, b], timeout=10)
            assert a.loads() == b.loads() == {1: (1, 16, 4), 2: (2, 32, 4)}
            client = ledger.client()
            assert sorted(client.hkeys("sp:{t}:res")) == [b"ra", b"rb", b"rc"]
            assert sorted(client.hkeys("sp:{t}:workers")) == [b"1", b"2"]
            await b.ok("DELETE", "/reservations/ra")
            await a.ok("DELETE", "/reservations/rb")
            await a.ok("DELETE", "/reservations/rc")
            await settled([a, b])
            assert a.loads() == b.loads() == {1: (0, 0, 0), 2: (0, 0, 0)}

    run(main)


@pytest.mark.parametrize("failure", ["open", "closed"])
def test_an_outage_of_the_ledger(ledger: LedgerServer, failure: str) -> None:
    async def main() -> None:
        async with replicas(2, ledger.url, ledger=LedgerSettings(failure=failure)) as (a, b):  # type: ignore[arg-type]
            await _two_workers(a)
            await settled([a, b])
            ledger.stop()
            await until(lambda: not a.ledger.journal.connected)
            status, body = await a.call("POST", "/workers", {**WORKER, "worker_id": 3})
            assert (status, body["error"]) == (503, "ledger unavailable: catalog writes need the ledger")
            status, body = await a.call("POST", "/select_and_reserve", {**PROMPT, "reservation_id": "out"})
            ready = a.service.ready(now=0.0)
            if failure == "closed":
                assert (status, body) == (503, {"error": "ledger unavailable"})
                assert not ready.ready and ready.details == ("ledger: disconnected",)
            else:
                assert status == 200  # served from local state, queued for the ledger
                assert ready.ready and ready.details == ("ledger: disconnected",)
            ledger.start()
            await settled([a, b])
            expected = 1 if failure == "open" else 0
            assert sum(v[0] for v in a.loads().values()) == sum(v[0] for v in b.loads().values()) == expected
            assert [w.worker_id for w in b.service.list_workers()] == [1, 2]

    run(main)


def test_a_reader_whose_feed_was_trimmed_loads_a_snapshot(ledger: LedgerServer) -> None:
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            await settled([a, b])
            await park([a], via=b)
            for i in range(40):
                await b.ok("POST", "/reservations", {**PROMPT, "worker_id": 1, "reservation_id": f"t{i}"}, status=201)
            await settled([b])
            ledger.client().xtrim("sp:{t}:feed", maxlen=3, approximate=False)
            snapshots = a.service.metrics.value("selection_proto_ledger_events_total", ("snapshot",))
            unpark([a])
            await settled([a, b])
            assert a.service.metrics.value("selection_proto_ledger_events_total", ("gap",)) == 1
            assert a.service.metrics.value("selection_proto_ledger_events_total", ("snapshot",)) == snapshots + 1
            assert a.loads() == b.loads() and a.loads()[1][0] == 40

    run(main)


def test_a_lease_ends_on_the_ledger_clock_and_every_mirror_drops_it(ledger: LedgerServer) -> None:
    async def main() -> None:
        async with replicas(2, ledger.url, active_request_expiry_secs=0.5) as (a, b):
            await _two_workers(a)
            await park([a, b], via=a)
            await a.ok("POST", "/reservations", {**PROMPT, "worker_id": 1, "reservation_id": "lease"}, status=201)
            await until(lambda: ledger.client().hexists("sp:{t}:res", "lease"))
            await until(lambda: not ledger.client().hexists("sp:{t}:res", "lease"), timeout=5)
            expired = [f for f in ledger.client().xrange("sp:{t}:feed") if f[1][b"k"] == b"expire"]
            assert len(expired) == 1  # two reapers, one expiry
            unpark([a, b])
            await settled([a, b])
            assert a.loads()[1] == b.loads()[1] == (0, 0, 0)

    run(main)


def test_a_booking_made_on_a_worker_the_mirror_lacks_is_dropped_and_counted(ledger: LedgerServer) -> None:
    async def main() -> None:
        async with replicas(1, ledger.url) as (a,):
            await _two_workers(a)
            await settled([a])
            from selection_proto.core.fleet.ledger_wire import AddRecord, encode_add, rank_key

            body = encode_add(AddRecord("m", "default", 9, 0, 4, None, [1, 2]))
            client = ledger.client()
            n = client.incr("sp:{t}:seq")
            client.xadd("sp:{t}:feed", {"n": n, "o": "elsewhere", "k": "add", "i": "ghost", "b": body})
            n = client.incr("sp:{t}:seq")
            client.xadd("sp:{t}:feed", {"n": n, "o": "elsewhere", "k": "nonsense", "i": "x", "b": b""})
            client.set("sp:{t}:last", client.xrevrange("sp:{t}:feed", count=1)[0][0])
            await until(lambda: a.ledger.n == n)
            events = a.service.metrics.value
            assert events("selection_proto_ledger_events_total", ("dropped",)) == 1
            assert events("selection_proto_ledger_events_total", ("bad_entry",)) == 1
            assert a.ledger.journal.adds[rank_key("m", "default", 9, 0)] == 1
            assert a.loads() == {1: (0, 0, 0), 2: (0, 0, 0)}

    run(main)


# -- random operations over replicas end where one process would -----------------------------------

_SCOPES = itertools.count()  # a fresh scope of the shared ledger for each example
_OPS = st.lists(st.tuples(st.sampled_from(["book", "prefill", "output", "free"]), st.integers(0, 2),
                          st.integers(0, 5), st.integers(1, 2), st.integers(1, 3), st.booleans()),
                max_size=25)


@pytest.fixture(scope="module")
def shared_ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LedgerServer]:
    server = LedgerServer(tmp_path_factory.mktemp("ledger")).start()
    yield server
    server.kill()


# 25 examples in the default suite; a soak: LEDGER_EXAMPLES=500 python -m pytest tests/test_ledger.py -k random
@settings(max_examples=int(os.environ.get("LEDGER_EXAMPLES", "25")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
# A retried free answers 404, and the id booked again stays counted, on one replica and
# across two (booked on A, freed on B, the free retried on A, booked again on B).
@example(ops=[("book", 0, 0, 1, 1, False), ("free", 0, 0, 1, 1, False), ("free", 0, 0, 1, 1, False),
              ("book", 0, 0, 1, 1, False), ("output", 0, 0, 1, 1, False)])
@example(ops=[("book", 0, 0, 1, 1, False), ("free", 1, 0, 1, 1, False), ("free", 0, 0, 1, 1, False),
              ("book", 1, 0, 2, 1, False), ("prefill", 2, 0, 1, 1, False)])
# The same, the retry and the new booking made before the free reached the ledger.
@example(ops=[("book", 0, 0, 1, 1, False), ("free", 1, 0, 1, 1, True), ("free", 0, 0, 1, 1, True),
              ("book", 2, 0, 2, 2, True), ("output", 2, 0, 1, 1, False)])
# Freed and booked again on A while B still held the first booking: B's op went to the first.
@example(ops=[("book", 0, 1, 1, 1, False), ("free", 0, 1, 1, 1, True), ("book", 0, 1, 1, 1, True),
              ("prefill", 1, 1, 1, 1, False)])
def test_random_operations_over_replicas_end_in_the_loads_of_one_process(
        shared_ledger: LedgerServer, ops: list[tuple[str, int, int, int, int, bool]]) -> None:
    """Each op goes to one of three replicas, mostly one at a time, sometimes several before the
    ledger has them (`burst`). One process applying the ops that succeeded, in order, is the model:
    the loads every replica ends with are the model's."""
    model = Client(SelectionService(Settings(kv_events="push")))

    async def main() -> None:
        async with replicas(3, shared_ledger.url, f"p{next(_SCOPES)}") as group:
            for worker_id in (1, 2):
                await group[0].ok("POST", "/workers", {**WORKER, "worker_id": worker_id}, status=201)
                model.ok("POST", "/workers", {**WORKER, "worker_id": worker_id}, status=201)
            await settled(group)
            calm = True
            fresh: dict[str, int] = {}  # id -> the replica that booked it since the last settle
            for kind, replica, rid_number, worker_id, blocks, burst in ops:
                rid = f"r{rid_number}"
                method, path, body = {
                    "book": ("POST", "/reservations", {"model_name": "m", "token_ids": list(range(4 * blocks)),
                                                       "worker_id": worker_id, "reservation_id": rid}),
                    "prefill": ("POST", f"/reservations/{rid}/prefill_complete", None),
                    "output": ("POST", f"/reservations/{rid}/output_block", {}),
                    "free": ("DELETE", f"/reservations/{rid}", None),
                }[kind]
                live = any(rid in pool.tracker.bookings for pool in model.service.pools.values())
                if kind == "book" and live:
                    continue  # ids are unique while live (as in Dynamo); once freed, any replica reuses them
                if fresh.get(rid, replica) != replica:
                    # Booked again moments ago elsewhere: this replica can only act on the booking
                    # it has seen, which one process cannot model (it has no "moments ago").
                    continue
                status, _ = await group[replica].call(method, path, body)
                if kind == "book" and status < 300:
                    fresh[rid] = replica
                if calm:  # every replica has seen every change: it answers as one process does
                    got, _ = model.call(method, path, body)
                    assert got == status, (kind, rid)
                elif status < 300:
                    got, _ = model.call(method, path, body)
                    # A replica may act on a booking another one has just freed (a burst): the
                    # ledger's order then makes it a no-op, and the model has nothing to do.
                    assert got == status or (got == 404 and kind != "book")
                calm = not burst
                if calm:
                    await settled(group)
                    fresh.clear()
            await settled(group)
            expected = {rank[0]: (load.requests, load.prefill_tokens, load.decode_blocks())
                        for pool in model.service.pools.values() for rank, load in pool.tracker.loads.items()}
            for replica in group:
                assert replica.loads() == expected

    run(main)


def test_a_free_on_its_way_does_not_free_the_same_id_booked_again_elsewhere(ledger: LedgerServer) -> None:
    """A books and frees r (both still in its journal); B books r anew and reaches the ledger
    first. A's free names A's booking: B's stays (found by the property test)."""
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            await settled([a, b])
            a.link.held_writes = True
            await a.ok("POST", "/reservations", {**PROMPT, "worker_id": 1, "reservation_id": "r"}, status=201)
            ticket = a.send("DELETE", "/reservations/r")  # its answer waits for the ledger's word
            assert isinstance(ticket, int) and a.loads()[1] == (0, 0, 0)
            await b.ok("POST", "/reservations", {**PROMPT, "worker_id": 1, "reservation_id": "r"}, status=201)
            await settled([b])
            a.link.held_writes = False
            a.link.poke()
            assert await a.answer(ticket) == (200, {"status": "ok"})  # A's booking, waiting behind B's, ended
            await settled([a, b])
            assert a.loads()[1] == b.loads()[1] == (1, 16, 4)
            assert ledger.client().hget("sp:{t}:owner", "r") == b.ledger.origin.encode()

    run(main)


def test_output_blocks_reported_on_two_replicas_at_once_add_up(ledger: LedgerServer) -> None:
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            await settled([a, b])
            await a.ok("POST", "/reservations", {**PROMPT, "worker_id": 1, "reservation_id": "o"}, status=201)
            await settled([a, b])
            await park([a, b], via=a)  # neither sees the other's report before making its own
            await a.ok("POST", "/reservations/o/output_block", {})
            await b.ok("POST", "/reservations/o/output_block", {})
            await b.ok("POST", "/reservations/o/output_block", {})
            unpark([a, b])
            await settled([a, b])
            assert a.loads()[1] == b.loads()[1] == (1, 16, 4 + 3)
            assert json.loads(ledger.client().hget("sp:{t}:out", "o")) == {a.ledger.origin: 1, b.ledger.origin: 2}

    run(main)


def test_a_ledger_emptied_under_idle_replicas_is_noticed_and_refilled(ledger: LedgerServer) -> None:
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            await a.ok("POST", "/reservations", {**PROMPT, "worker_id": 1, "reservation_id": "kept"}, status=201)
            await settled([a, b])
            ledger.client().flushall()  # no connection drops: only the epoch tells
            await until(lambda: ledger.client().hexists("sp:{t}:res", "kept"), timeout=5)
            await settled([a, b])
            await b.ok("DELETE", "/reservations/kept")
            await settled([a, b])
            assert a.loads() == b.loads() == {1: (0, 0, 0), 2: (0, 0, 0)}
            assert sorted(ledger.client().hkeys("sp:{t}:workers")) == [b"1", b"2"]

    run(main)


# -- the contract: a booking answered 2xx stays counted until a free sent after that answer ----------

def _workers_json(r: Any) -> list[dict[str, Any]]:
    return [w.to_json() for w in r.service.list_workers()]


def test_a_retried_free_answers_404_and_the_id_booked_again_stays_counted(ledger: LedgerServer) -> None:
    """One replica, as a client with retries would drive it."""
    async def main() -> None:
        async with replicas(1, ledger.url) as (a,):
            await _two_workers(a)
            booking = {**PROMPT, "worker_id": 1, "reservation_id": "r0"}
            await a.ok("POST", "/reservations", booking, status=201)
            await a.ok("DELETE", "/reservations/r0")
            assert await a.call("DELETE", "/reservations/r0") == (404, {"error": "reservation r0 not found"})
            await a.ok("POST", "/reservations", booking, status=201)
            await settled([a])
            # The same retry once the replica's own free has come back through the feed.
            assert await a.call("DELETE", "/reservations/nothing-here") == (
                404, {"error": "reservation nothing-here not found"})
            await anyio.sleep(a.ledger.settings.free_grace_secs + 0.2)  # past any remembered free
            await settled([a])
            assert a.loads()[1] == (1, 16, 4)
            assert ledger.client().hexists("sp:{t}:res", "r0")
            await a.ok("DELETE", "/reservations/r0")
            await settled([a])
            assert a.loads()[1] == (0, 0, 0)

    run(main)


@pytest.mark.parametrize("retry_before_the_feed", [False, True])
def test_a_free_retried_on_another_replica_does_not_take_back_the_id_booked_again(
        ledger: LedgerServer, retry_before_the_feed: bool) -> None:
    """Booked on A, freed on B, the free retried on A, booked again on B: the new booking stays
    counted on both. With `retry_before_the_feed`, A still holds the first booking when the retry
    comes (it has not read B's free): the ledger says it has ended."""
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            await settled([a, b])
            booking = {**PROMPT, "worker_id": 2, "reservation_id": "r"}
            await a.ok("POST", "/reservations", booking, status=201)
            await settled([a, b])
            if retry_before_the_feed:
                await park([a], via=b)
            await b.ok("DELETE", "/reservations/r")
            if retry_before_the_feed:
                await until(lambda: not ledger.client().hexists("sp:{t}:res", "r"))
                # A still holds it, but the ledger has its end: 404, as one process answers.
                assert await a.call("DELETE", "/reservations/r") == (404, {"error": "reservation r not found"})
                unpark([a])
            else:
                await settled([a, b])
                assert await a.call("DELETE", "/reservations/r") == (404, {"error": "reservation r not found"})
            await b.ok("POST", "/reservations", booking, status=201)
            await settled([a, b])
            await anyio.sleep(b.ledger.settings.free_grace_secs + 0.2)
            await settled([a, b])
            assert a.loads()[2] == b.loads()[2] == (1, 16, 4)
            assert await b.call("DELETE", "/reservations/r") == (200, {"status": "ok"})
            await settled([a, b])
            assert a.loads()[2] == b.loads()[2] == (0, 0, 0)
            assert await a.call("DELETE", "/reservations/r") == (404, {"error": "reservation r not found"})

    run(main)


def test_a_retried_free_unknown_to_the_replica_is_answered_404_by_the_ledger(ledger: LedgerServer) -> None:
    """A replica started after the booking ended knows nothing of it: the ledger remembers that
    it ended, so the retry answers 404 at once, not after the grace, and leaves no tombstone."""
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            await settled([a, b])
            await a.ok("POST", "/reservations", {**PROMPT, "worker_id": 1, "reservation_id": "old"}, status=201)
            await a.ok("DELETE", "/reservations/old")
            await settled([a, b])
            b.ledger.journal.ended.clear()  # as a replica restarted since
            started = time.monotonic()
            assert await b.call("DELETE", "/reservations/old") == (404, {"error": "reservation old not found"})
            assert time.monotonic() - started < b.ledger.settings.free_grace_secs
            assert ledger.client().zscore("sp:{t}:tomb", "old") is None
            await a.ok("POST", "/reservations", {**PROMPT, "worker_id": 1, "reservation_id": "old"}, status=201)
            await settled([a, b])
            assert a.loads()[1] == b.loads()[1] == (1, 16, 4)

    run(main)


def test_an_early_free_refuses_only_the_booking_it_raced_not_one_made_after_it(ledger: LedgerServer) -> None:
    """The early free's tombstone is fenced by its place in the feed: A's booking, made before A
    saw the free, is refused (the held free answers 200); the id booked again after is kept, even
    while the tombstone's time has not run out."""
    async def main() -> None:
        async with replicas(2, ledger.url, ledger=LedgerSettings(free_grace_secs=3.0)) as (a, b):
            await _two_workers(a)
            await settled([a, b])
            a.link.held_writes = True
            booking = {**PROMPT, "worker_id": 1, "reservation_id": "race"}
            await a.ok("POST", "/reservations", booking, status=201)
            ticket = b.send("DELETE", "/reservations/race")
            assert isinstance(ticket, int)
            await until(lambda: ledger.client().zscore("sp:{t}:tomb", "race") is not None)
            a.link.held_writes = False
            a.link.poke()
            assert await b.answer(ticket) == (200, {"status": "ok"})
            await settled([a, b])
            assert a.loads()[1] == b.loads()[1] == (0, 0, 0)
            # Booked again at once, on either replica: made after the free, it stands.
            await b.ok("POST", "/reservations", booking, status=201)
            await settled([a, b])
            assert a.loads()[1] == b.loads()[1] == (1, 16, 4)
            assert await a.call("DELETE", "/reservations/race") == (200, {"status": "ok"})
            await settled([a, b])
            # A tombstone still running does not refuse a booking made after its free was seen.
            ticket = a.send("DELETE", "/reservations/later")
            assert isinstance(ticket, int)
            await until(lambda: ledger.client().zscore("sp:{t}:tomb", "later") is not None)
            await settled([a, b])
            await b.ok("POST", "/reservations", {**booking, "reservation_id": "later"}, status=201)
            await settled([a, b])
            assert a.loads()[1] == b.loads()[1] == (1, 16, 4)
            assert await a.answer(ticket) == (404, {"error": "reservation later not found"})
            await settled([a, b])
            assert a.loads()[1] == b.loads()[1] == (1, 16, 4)

    run(main)


def test_after_the_ledger_comes_back_empty_every_catalog_is_the_same_deleted_workers_included(
        ledger: LedgerServer) -> None:
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            await a.ok("POST", "/workers", {**WORKER, "worker_id": 3}, status=201)
            await settled([a, b])
            await a.ok("DELETE", "/workers/2")
            await settled([a, b])
            assert _workers_json(a) == _workers_json(b)
            ledger.wipe()
            ledger.start()
            await settled([a, b], timeout=10)
            await a.ok("DELETE", "/workers/3")
            await settled([a, b])
            assert [w["lifecycle"] for w in _workers_json(a)] == ["schedulable", "unschedulable", "unschedulable"]
            assert _workers_json(a) == _workers_json(b)
        # A replica that starts now learns the deleted ones too.
        async with replicas(1, ledger.url) as (c,):
            await settled([c])
            assert _workers_json(c) == _workers_json(a)

    run(main)


def test_an_id_booked_again_before_its_free_reached_the_ledger_waits_and_then_counts(
        ledger: LedgerServer) -> None:
    """A frees r (still in its journal) and B at once books r anew: the ledger holds B's booking
    behind A's until A's free arrives, then starts it with what B reported meanwhile."""
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            booking = {**PROMPT, "worker_id": 1, "reservation_id": "r"}
            await a.ok("POST", "/reservations", booking, status=201)
            await settled([a, b])
            a.link.held_writes = True
            ticket = a.send("DELETE", "/reservations/r")  # answered once the ledger has it
            await settled([b])  # B never saw the free: it still mirrors A's booking
            assert b.loads()[1] == (1, 16, 4)
            # The client's free was answered: it books the id again, on B.
            await b.ok("POST", "/reservations", {**booking, "worker_id": 2}, status=201)
            await b.ok("POST", "/reservations/r/prefill_complete")
            await until(lambda: ledger.client().hexists("sp:{t}:wait", "r"))
            assert ledger.client().hget("sp:{t}:owner", "r") == a.ledger.origin.encode()
            a.link.held_writes = False
            a.link.poke()
            assert await a.answer(ticket) == (200, {"status": "ok"})
            await settled([a, b])
            assert a.loads() == b.loads() == {1: (0, 0, 0), 2: (1, 0, 4)}
            assert ledger.client().hget("sp:{t}:owner", "r") == b.ledger.origin.encode()
            assert await a.call("DELETE", "/reservations/r") == (200, {"status": "ok"})
            await settled([a, b])
            assert a.loads() == b.loads() == {1: (0, 0, 0), 2: (0, 0, 0)}

    run(main)


def test_an_id_booked_again_during_an_outage_waits_for_the_ledger(ledger: LedgerServer) -> None:
    """x is booked and freed; the ledger goes away; A books x again. Answered at once (it was,
    in open mode), A's booking reached the ledger after the reconnect, behind B's free of x sent
    after that answer: B answered 404 and the booking stayed until its lease (the soak's
    kept_but_404, docs/REPLICATION.md). A refuses it 503 while away; once back, the same
    booking is answered and a free on B frees it."""
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _x_used_once(a, b)
            booking = X_BOOKING
            ledger.stop()
            await until(lambda: not a.ledger.journal.connected and not b.ledger.journal.connected)
            a.link.held_writes = True  # what A queues stays queued after the ledger is back
            assert await a.call("POST", "/reservations", booking) == (503, {
                "error": "ledger unavailable: reservation x was booked lately; book it again once the ledger is back"})
            ledger.start()
            await until(lambda: b.ledger.journal.connected)
            assert await b.call("DELETE", "/reservations/x") == (404, {"error": "reservation x not found"})
            a.link.held_writes = False
            await settled([a, b])
            assert a.loads() == b.loads() == {1: (0, 0, 0), 2: (0, 0, 0)}
            await until(lambda: a.ledger.journal.connected)
            await a.ok("POST", "/reservations", booking, status=201)
            await b.ok("DELETE", "/reservations/x")
            await settled([a, b])
            assert a.loads() == b.loads() == {1: (0, 0, 0), 2: (0, 0, 0)}

    run(main)


def test_an_id_booked_again_unanswered_when_the_ledger_goes_is_undone_503(ledger: LedgerServer) -> None:
    """The same race from a booking of an id used again that waits for the ledger's word when the
    connection drops: answered 201 at the drop (its add still queued), B's free of x after the
    reconnect answered 404 and the booking stayed. It is undone and answered 503."""
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _x_used_once(a, b)
            booking = X_BOOKING
            a.link.held_writes = True
            ticket = a.send("POST", "/reservations", booking)
            assert isinstance(ticket, int)  # waits for the ledger: the id was used before
            ledger.stop()
            assert await a.answer(ticket) == (503, {
                "error": "ledger unavailable: reservation x was booked lately; book it again once the ledger is back"})
            ledger.start()
            await until(lambda: b.ledger.journal.connected)
            assert await b.call("DELETE", "/reservations/x") == (404, {"error": "reservation x not found"})
            a.link.held_writes = False
            await settled([a, b])
            assert a.loads() == b.loads() == {1: (0, 0, 0), 2: (0, 0, 0)}

    run(main)


def test_an_id_whose_end_came_with_a_snapshot_is_booked_again_once_the_ledger_has_it(
        ledger: LedgerServer) -> None:
    """B loads a snapshot (as after a reconnect) that no longer holds A's booking of x: B drops its
    copy. Booked again on B, x used to count as a new id, answered at once; a free of it sent to
    A after that answer reached the ledger before B's booking, found x ended and answered 404,
    and the booking stayed until its lease. B now knows x ended: its booking waits for the
    ledger, so a free sent after its answer finds it."""
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            await settled([a, b])
            booking = {**PROMPT, "worker_id": 2, "reservation_id": "x"}
            await a.ok("POST", "/reservations", booking, status=201)
            await settled([a, b])
            await park([b], via=a)  # B will not read x's end from the feed
            await a.ok("DELETE", "/reservations/x")
            await until(lambda: not ledger.client().hexists("sp:{t}:res", "x"))
            b.ledger.needs_snapshot = True
            b.link.wake.set()
            await until(lambda: not b.ledger.needs_snapshot)
            unpark([b])
            assert b.loads()[2] == (0, 0, 0)
            b.link.held_writes = True  # B's booking is not in the ledger yet
            ticket = b.send("POST", "/reservations", booking)
            assert isinstance(ticket, int), ticket  # not answered before the ledger has it
            assert await a.call("DELETE", "/reservations/x") == (404, {"error": "reservation x not found"})
            b.link.held_writes = False
            assert (await b.answer(ticket))[0] == 201
            await a.ok("DELETE", "/reservations/x")  # sent after the answer: it finds the booking
            await settled([a, b])
            assert a.loads() == b.loads() == {1: (0, 0, 0), 2: (0, 0, 0)}

    run(main)


def test_an_id_whose_whole_life_a_snapshot_skipped_is_booked_again_once_the_ledger_has_it(
        ledger: LedgerServer) -> None:
    """As above, for a replica that never saw x: booked and freed on A while B's reader was away,
    then B loads a snapshot. The snapshot brings the ids that ended since B's place in the feed."""
    async def main() -> None:
        async with replicas(2, ledger.url) as (a, b):
            await _two_workers(a)
            await settled([a, b])
            booking = {**PROMPT, "worker_id": 2, "reservation_id": "x"}
            await park([b], via=a)
            await a.ok("POST", "/reservations", booking, status=201)
            await a.ok("DELETE", "/reservations/x")
            await until(lambda: not ledger.client().hexists("sp:{t}:res", "x"))
            b.ledger.needs_snapshot = True
            b.link.wake.set()
            await until(lambda: not b.ledger.needs_snapshot)
            unpark([b])
            b.link.held_writes = True
            ticket = b.send("POST", "/reservations", booking)
            assert isinstance(ticket, int), ticket  # not answered before the ledger has it
            assert await a.call("DELETE", "/reservations/x") == (404, {"error": "reservation x not found"})
            b.link.held_writes = False
            assert (await b.answer(ticket))[0] == 201
            await a.ok("DELETE", "/reservations/x")
            await settled([a, b])
            assert a.loads() == b.loads() == {1: (0, 0, 0), 2: (0, 0, 0)}

    run(main)
