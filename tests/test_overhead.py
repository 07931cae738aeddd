"""The fixed time an engine spends on every request, whatever it holds (core/fleet/speed.py,
docs/ROUTING.md "A fixed time per request"): learned from prefill ends as a line through (prefill
tokens, seconds), then charged by `router_policy=ttft` to each request and, drained with time, to
each rank's recent bookings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import Client, stored, worker
from hypothesis import example, given
from hypothesis import strategies as st

from selection_proto.core.base.hashing import block_hashes
from selection_proto.core.fleet.speed import MOST_OVERHEAD_TOKENS, OVERHEAD_AFTER, Fit, Speeds

FIXED, PER_TOKEN = 0.015, 2e-5  # 15 ms a request and 20 µs a token: a request costs 750 tokens
PROMPT = list(range(400))  # 100 blocks of 4


def overhead_metric(c: Client) -> float | None:
    lines = [line for line in c.service.metrics_text(now=c.now).splitlines()
             if line.startswith("selection_proto_learned_request_overhead_tokens{")]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else None


def teach(c: Client, requests: int = OVERHEAD_AFTER) -> None:
    """Prompts of 40 and 400 new tokens, one at a time on workers 1 and 2, each prefilled in
    `FIXED + PER_TOKEN * tokens` seconds as its client reports."""
    for n in range(requests):
        tokens = (40, 400)[n % 2]
        rid = f"t{n}"
        c.ok("POST", "/reservations", {"model_name": "m", "token_ids": list(range(10**6 * (n + 1), 10**6 * (n + 1) + tokens)),
                                       "worker_id": 1 + n % 2, "reservation_id": rid}, status=201)
        c.now += FIXED + PER_TOKEN * tokens
        c.ok("POST", f"/reservations/{rid}/prefill_complete")
        c.ok("DELETE", f"/reservations/{rid}")
        c.now += 1.0


def choice(c: Client) -> tuple[int, dict[int, float]]:
    answer = c.ok("POST", "/select", {"model_name": "m", "token_ids": PROMPT, "explain": True})
    return answer["worker_id"], {row["worker_id"]: row["predicted_wait_secs"] for row in answer["candidates"]}


def fleet(make_client: Callable[..., Client]) -> Client:
    c = make_client(router_policy="ttft")
    for wid in (1, 2):
        c.ok("POST", "/workers", worker(wid), status=201)
    return c


def test_the_overhead_is_learned_from_prefill_completions(make_client: Callable[..., Client]) -> None:
    c = fleet(make_client)
    teach(c, OVERHEAD_AFTER - 1)
    assert overhead_metric(c) == 0.0  # one sample short: nothing read yet
    teach(c, 1)
    assert overhead_metric(c) == pytest.approx(FIXED / PER_TOKEN, rel=1e-6)
    assert overhead_metric(make_client(router_policy="dynamo")) is None  # only ttft learns


def test_a_burst_on_the_engine_holding_the_prompt_moves_once_the_overhead_is_learned(
        make_client: Callable[..., Client]) -> None:
    """Four requests of a prompt worker 1 holds whole: their prefills end at once (nothing new to
    store), yet each costs worker 1 its fixed time. Not learned, the fifth goes there too; learned,
    it goes to idle worker 2, whose 400 new tokens cost less than four requests' fixed times; and
    once worker 1 has worked through them it is the cheaper again."""
    for learned in (False, True):
        c = fleet(make_client)
        if learned:
            teach(c)
        local = block_hashes(PROMPT, 4)
        c.ok("POST", "/kv_events", [stored(1, 1, [(5000 + i, h) for i, h in enumerate(local)])])
        assert choice(c)[0] == 1
        for n in range(4):
            c.ok("POST", "/select_and_reserve", {"model_name": "m", "token_ids": PROMPT, "reservation_id": f"b{n}"})
        chosen, waits = choice(c)
        if not learned:
            assert chosen == 1
            continue
        assert chosen == 2 and waits[1] > waits[2]
        c.now += 4 * FIXED  # the engine worked through the burst's fixed times
        assert choice(c)[0] == 1


@given(fixed=st.floats(0.0, 0.1), per_token=st.floats(1e-7, 1e-3),
       tokens=st.lists(st.integers(0, 8192), min_size=OVERHEAD_AFTER, max_size=200))
@example(fixed=0.0, per_token=1e-7, tokens=[0] * (OVERHEAD_AFTER - 1) + [8192])
def test_a_fit_through_exact_samples_reads_the_line(fixed: float, per_token: float, tokens: list[int]) -> None:
    """Samples on a line give back its fixed time over its time per token (capped), whenever the
    prompts differ enough to tell the two apart; never a negative or unbounded overhead."""
    fit = Fit()
    for t in tokens:
        fit.add(t, fixed + per_token * t)
    line = fit.line()
    mean = sum(tokens) / len(tokens)
    spread = (sum((t - mean) ** 2 for t in tokens) / len(tokens)) ** 0.5
    if spread < 0.06 * mean or spread < 1.0:
        return  # too alike (the fit may or may not read them): nothing to claim
    assert line is not None
    got_fixed, got_per_token = line
    assert got_per_token == pytest.approx(per_token, rel=1e-4)
    assert 0.0 <= got_fixed <= MOST_OVERHEAD_TOKENS * got_per_token * (1 + 1e-9)
    assert got_fixed == pytest.approx(min(fixed, MOST_OVERHEAD_TOKENS * per_token), rel=1e-3, abs=1e-3 * per_token * 8192)


def test_nothing_is_read_from_too_few_or_alike_samples_or_times_that_do_not_grow() -> None:
    alike, flat, few = Fit(), Fit(), Fit()
    for n in range(OVERHEAD_AFTER * 2):
        alike.add(1000, 0.03)
        flat.add((40, 400)[n % 2], 0.02)
    for n in range(OVERHEAD_AFTER - 1):
        few.add((40, 400)[n % 2], FIXED + PER_TOKEN * (40, 400)[n % 2])
    assert alike.line() is None and flat.line() is None and few.line() is None


def test_the_backlog_drains_with_time_and_a_worker_that_leaves_is_forgotten() -> None:
    speeds = Speeds(learn=True)
    speeds.set(1, None, None)
    for n in range(OVERHEAD_AFTER):  # 20 ms a request, 10 µs a token: 2,000 tokens a request
        tokens = (100, 1000)[n % 2]
        speeds.observe((1, 0), 0, float(n), 0)
        speeds.observe((1, 0), tokens, n + 0.02 + 1e-5 * tokens, 1)
        speeds.completed((1, 0), tokens)
    speeds.settle(100.0)  # the last end is read once its moment has passed (speed.py)
    assert speeds.overhead == pytest.approx(2000)
    assert speeds.backlog((1, 0), 100.0) == 0.0
    for _ in range(3):
        speeds.booked((1, 0), 100.0)
    assert speeds.backlog((1, 0), 100.0) == pytest.approx(6000)
    assert speeds.backlog((1, 0), 100.03) == pytest.approx(3000)
    assert speeds.backlog((1, 0), 100.07) == 0.0
    # 500 tokens of prefill still booked there, 5 ms at 10 µs a token and at most 20 ms on a
    # worker as slow as one may be: due by 100.08, so 5 ms behind at 100.085, and never more
    # than the three fixed times written last.
    assert speeds.backlog((1, 0), 100.085, 500) == pytest.approx(500)
    assert speeds.backlog((1, 0), 100.079, 500) == 0.0
    assert speeds.backlog((1, 0), 105.0, 500) == pytest.approx(6000)
    speeds.booked((1, 0), 100.03)  # joins what is left: 30 ms + 20 ms
    assert speeds.backlog((1, 0), 100.03) == pytest.approx(5000)
    speeds.forget(1)
    assert speeds.backlog((1, 0), 100.03) == 0.0


def test_simulated_engines_pay_a_fixed_time_per_prompt_and_the_router_learns_it() -> None:
    """`simulate --request-fixed-ms`: each prompt costs its engine that much more in the iteration
    that ends its prefill, and a `ttft` service in the loop reads it back as prefill tokens
    (here 20 ms at 10,000 tokens a second: 200), from the prefill ends alone."""
    import json

    import selection_proto.sim.routers as routers_module
    from selection_proto.core.base.settings import Settings
    from selection_proto.sim import EngineModel, FleetConfig, parse_trace, simulate

    exact = EngineModel(prefill_fixed_ms=0, attention_ms=0, decode_ms=0, decode_full_ms=0,
                        prefill_tokens_per_sec=10_000.0, request_fixed_ms=20.0)
    assert exact.iteration_ms([(100, 0), (50, 0)], 0, 0.0, ends=1) == pytest.approx(35.0)
    assert exact.iteration_ms([(100, 0)], 0, 0.0) == pytest.approx(10.0)
    # Prompts of one to eight blocks of 64 tokens, nothing shared, one at a time (200 ms apart).
    lines = [json.dumps({"timestamp": i * 200, "input_length": 64 * (1 + i % 8), "output_length": 2,
                         "hash_ids": [100 * i + k for k in range(1 + i % 8)]}).encode() for i in range(200)]
    services: list[Any] = []

    class Kept(routers_module.SelectionService):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            services.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(routers_module, "SelectionService", Kept)
        (run,) = simulate(lambda: parse_trace(lines, "t", 64), FleetConfig(engines=2, kv_blocks=400, model=exact,
                                                                          speedup=1.0, trace_block_size=64),
                          [("ttft", Settings(kv_events="push", router_policy="ttft"))])
    assert run.requests == 200 and run.failed == 0
    text = services[0].metrics_text(now=1e6)
    (learned,) = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("selection_proto_learned_request_overhead_tokens{")]
    assert learned == pytest.approx(200, rel=0.1), learned


def test_an_engine_behind_its_prediction_reads_as_busy_again(make_client: Callable[..., Client]) -> None:
    """Two requests booked on worker 1, which holds the prompt, have not ended their prefills
    well after their fixed times and prefill were due: the engine is behind (a stall). Read as
    idle, worker 1 would keep taking the prompt's requests; the time past due counts as still
    ahead (up to the backlog as last written), so the next goes to idle worker 2, and once the
    engine reports both prefills, worker 1 is the cheaper again (docs/ROUTING.md, "An engine
    behind its prediction")."""
    c = fleet(make_client)
    teach(c)
    local = block_hashes(PROMPT, 4)
    c.ok("POST", "/kv_events", [stored(1, 1, [(5000 + i, h) for i, h in enumerate(local)])])
    for n in range(2):  # the prompt and 4 new tokens each: 4 tokens of prefill booked each
        c.ok("POST", "/reservations", {"model_name": "m", "token_ids": PROMPT + [10**7 + 10 * n + i for i in range(4)],
                                       "worker_id": 1, "reservation_id": f"s{n}"}, status=201)
    assert choice(c)[0] == 2  # two fixed times ahead on worker 1 cost more than 400 new tokens on 2
    c.now += 2 * FIXED + 0.001  # drained 1 ms ago: the prefills may be just ending
    assert choice(c)[0] == 1
    c.now += 0.03  # 31 ms later they still have not: the engine is behind
    chosen, waits = choice(c)
    assert chosen == 2 and waits[1] > waits[2]
    c.now += 10.0  # however long it stalls, it reads no busier than just after the bookings
    assert choice(c)[1][1] == pytest.approx(waits[1])
    for n in range(2):
        c.ok("POST", f"/reservations/s{n}/prefill_complete")
    assert choice(c)[0] == 1


def _taught(ends: list[tuple[int, int]]) -> tuple[dict[int, tuple[float, int]], float]:
    """The speeds and overhead four workers of another speed each are read at, after 80 prefill
    ends one at a time and then `ends` (worker, tokens) all at one moment, in that order."""
    speeds = Speeds(learn=True)
    for wid in (1, 2, 3, 4):
        speeds.set(wid, None, None)
    for n in range(80):
        rank, tokens = (1 + n % 4, 0), (2_000, 9_000, 30_000)[n % 3]
        speeds.observe(rank, 0, float(n), 0)
        speeds.ended(rank, tokens, 1, tokens, n + 0.05 + PER_TOKEN * (0.9 + rank[0] / 10) * tokens, completed=True)
    for wid in (1, 2, 3, 4):
        speeds.observe((wid, 0), 0, 99.95, 0)
    for wid, tokens in ends:
        speeds.ended((wid, 0), 1, 1, tokens, 100.0, completed=True)
    speeds.observe((9, 0), 0, 101.0, 0)  # the next change, after that moment
    return dict(speeds.of), speeds.overhead


@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 40_000)), min_size=2, max_size=10), st.randoms())
def test_what_one_moments_prefill_ends_teach_does_not_depend_on_their_order(ends: list[tuple[int, int]],
                                                                           rng: Any) -> None:
    """A replica hears one moment's prefill ends in another order than one service: its own
    first, then those the ledger brings (docs/ROUTING.md, "Replicas behind a balancer"). What
    they teach, the learned speeds and the overhead, is the same to the last digit."""
    shuffled = list(ends)
    rng.shuffle(shuffled)
    assert _taught(shuffled) == _taught(ends)
