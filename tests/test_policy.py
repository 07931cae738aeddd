"""`router_policy=ttft` (docs/ROUTING.md): the least predicted time to first token, in the core. Each test
asserts a choice a user would see, and the predicted parts `explain` reports."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import Client, stored, worker
from hypothesis import example, given
from hypothesis import strategies as st

from selection_proto.core.base.hashing import block_hashes
from selection_proto.core.base.settings import Settings
from selection_proto.core.fleet.speed import DEFAULT_PREFILL_TOKENS_PER_SEC, LEARN_AFTER_TOKENS, MOST_APART
from selection_proto.core.routing.cost import (
    ATTENTION_CONTEXT_TOKENS,
    DECODE_DRAG,
    KV_PRESSURE,
    REUSE_CREDIT,
)

PROMPT = list(range(64))  # 16 blocks of 4


def _cache(c: Client, worker_id: int, blocks: int) -> None:
    """`worker_id` holds the first `blocks` blocks of PROMPT (engine hash = 1000 + i)."""
    local = block_hashes(PROMPT, 4)
    c.ok("POST", "/kv_events", [stored(worker_id, 1, [(1000 + i, local[i]) for i in range(blocks)])])


def _explained(c: Client, prompt: list[int] = PROMPT) -> dict[int, dict[str, Any]]:
    answer = c.ok("POST", "/select", {"model_name": "m", "token_ids": prompt, "explain": True})
    return {row["worker_id"]: {**row, "chosen": row["worker_id"] == answer["worker_id"]}
            for row in answer["candidates"]}


def _disagreements(c: Client) -> float:
    text = c.service.metrics_text(now=c.now)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("selection_proto_policy_disagreements_total{"))


def test_ttft_follows_the_cache_until_its_queue_costs_more_than_the_cache_saves(
        make_client: Callable[..., Client]) -> None:
    c = make_client(router_policy="ttft")
    for wid in (1, 2):
        c.ok("POST", "/workers", worker(wid), status=201)
    _cache(c, 1, 12)  # 48 of 64 tokens cached on worker 1
    rows = _explained(c)
    assert rows[1]["chosen"]
    rate = DEFAULT_PREFILL_TOKENS_PER_SEC
    new = 64 - 48
    # Nothing booked: the wait is the pressure of the blocks this prompt would hold there.
    assert rows[1]["predicted_wait_secs"] == pytest.approx(KV_PRESSURE * rows[1]["potential_decode_blocks"] * 4 / rate)
    assert rows[1]["predicted_prefill_secs"] == pytest.approx((new + new * (48 + new / 2) / ATTENTION_CONTEXT_TOKENS)
                                                               / rate)
    assert rows[2]["predicted_prefill_secs"] == pytest.approx((64 + 64 * 32 / ATTENTION_CONTEXT_TOKENS) / rate)
    # The cost credits cached tokens beyond their prefill now: later turns find them there too.
    assert rows[1]["logit"] == pytest.approx(rows[1]["predicted_wait_secs"] + rows[1]["predicted_prefill_secs"]
                                             - REUSE_CREDIT * 48 / rate)
    assert rows[2]["logit"] == pytest.approx(rows[2]["predicted_wait_secs"] + rows[2]["predicted_prefill_secs"])
    # Prefill booked on worker 1 and not complete: 80 tokens of queue cost more than the 48 cached
    # tokens save there, credit included.
    c.ok("POST", "/reservations", {"model_name": "m", "token_ids": list(range(500, 580)), "worker_id": 1,
                                   "reservation_id": "q"}, status=201)
    rows = _explained(c)
    assert rows[2]["chosen"] and rows[1]["predicted_wait_secs"] == pytest.approx(
        (80 + KV_PRESSURE * rows[1]["potential_decode_blocks"] * 4) / rate)
    # Its prefill completes: the queue is gone, the cache wins again.
    c.ok("POST", "/reservations/q/prefill_complete")
    assert _explained(c)[1]["chosen"]


def test_ttft_and_dynamo_differ_on_decode_load_and_the_disagreements_are_counted(
        make_client: Callable[..., Client]) -> None:
    clients = {policy: make_client(router_policy=policy) for policy in ("dynamo", "ttft")}
    for c in clients.values():
        for wid in (1, 2):
            c.ok("POST", "/workers", worker(wid), status=201)
        _cache(c, 1, 8)
        for n in range(3):  # decoding requests on worker 1: their prefill is done
            c.ok("POST", "/reservations", {"model_name": "m", "token_ids": list(range(1000 * n, 1000 * n + 64)),
                                           "worker_id": 1, "reservation_id": f"d{n}"}, status=201)
            c.ok("POST", f"/reservations/d{n}/prefill_complete")
    chosen = {p: c.ok("POST", "/select", {"model_name": "m", "token_ids": PROMPT})["worker_id"]
              for p, c in clients.items()}
    # Dynamo counts the 48 decode blocks against worker 1; the TTFT policy sees no queue there
    # and half the prompt cached (its KV capacity unknown: no memory pressure to predict).
    assert chosen == {"dynamo": 2, "ttft": 1}
    assert _disagreements(clients["ttft"]) == 1.0 and _disagreements(clients["dynamo"]) == 0.0
    assert "predicted_wait_secs" not in _explained(clients["dynamo"])[1]  # the default answers as before


def test_ttft_weighs_each_workers_speed_and_kv_capacity(make_client: Callable[..., Client]) -> None:
    c = make_client(router_policy="ttft")
    c.ok("POST", "/workers", worker(1, prefill_tokens_per_sec=1000.0), status=201)
    record = c.ok("POST", "/workers", worker(2, prefill_tokens_per_sec=4000.0, total_kv_blocks=20), status=201)
    assert record["prefill_tokens_per_sec"] == 4000.0
    assert "prefill_tokens_per_sec" not in c.ok("POST", "/workers", worker(3), status=201)
    c.ok("DELETE", "/workers/3")
    rows = _explained(c)
    assert rows[2]["chosen"]  # four times as fast, nothing cached anywhere
    drag = 1 + DECODE_DRAG * 16 / 20  # worker 2's KV use once this prompt's 16 blocks are on it
    assert rows[1]["predicted_prefill_secs"] == pytest.approx(4 * rows[2]["predicted_prefill_secs"] / drag)
    # Worker 2 holds 20 blocks: two running prompts of 50 blocks each overflow it, and the next
    # would wait for room: longer than the slower worker takes.
    for n in range(2):
        c.ok("POST", "/reservations", {"model_name": "m", "token_ids": list(range(1000 * n, 1000 * n + 200)),
                                       "worker_id": 2, "reservation_id": f"r{n}"}, status=201)
        c.ok("POST", f"/reservations/r{n}/prefill_complete")
    rows = _explained(c)
    assert rows[1]["chosen"] and rows[2]["predicted_wait_secs"] > 0.0


def test_the_policy_and_the_speed_are_checked(make_client: Callable[..., Client]) -> None:
    with pytest.raises(ValueError, match="router_policy: must be one of dynamo, ttft"):
        Settings(router_policy="fastest")  # type: ignore[arg-type]
    c = make_client()
    for bad in (0, -1.0, "fast"):
        status, message = c.error("POST", "/workers", worker(1, prefill_tokens_per_sec=bad))
        assert status == 422 and "prefill_tokens_per_sec" in message
    assert c.ok("GET", "/workers") == []


def _run(c: Client, worker_id: int, rid: str, tokens: int, secs: float) -> None:
    """Book `tokens` new tokens on the worker now; their prefill completes `secs` later."""
    c.ok("POST", "/reservations", {"model_name": "m", "token_ids": list(range(10**6, 10**6 + tokens)),
                                   "worker_id": worker_id, "reservation_id": rid}, status=201)
    c.now += secs
    c.ok("POST", f"/reservations/{rid}/prefill_complete")
    c.ok("DELETE", f"/reservations/{rid}")


def _two_learned_workers(make_client: Callable[..., Client]) -> Client:
    """A `ttft` client with workers 1 and 2, both having learned 10,000 tokens a second."""
    c = make_client(router_policy="ttft")
    for wid in (1, 2):
        c.ok("POST", "/workers", worker(wid), status=201)
    for n in range(3):
        _run(c, 1, f"a{n}", 10_000, 1.0)
        _run(c, 2, f"b{n}", 10_000, 1.0)
    return c


def test_ttft_learns_a_slow_worker_that_its_record_does_not_declare(make_client: Callable[..., Client]) -> None:
    c = make_client(router_policy="ttft")
    for wid in (1, 2, 3):
        c.ok("POST", "/workers", worker(wid), status=201)
    before = _explained(c)
    assert before[1]["predicted_prefill_secs"] == pytest.approx(before[2]["predicted_prefill_secs"])
    for n in range(3):  # worker 1 prefills 10,000 tokens a second, worker 2 four times slower
        _run(c, 1, f"a{n}", 10_000, 1.0)
        _run(c, 2, f"b{n}", 10_000, 4.0)
    # Worker 3 has two prompts booked at once: the second waits for the first, which is not slowness.
    for n in range(3):
        for rid in (f"c{n}", f"d{n}"):
            c.ok("POST", "/reservations", {"model_name": "m", "token_ids": list(range(10_000)),
                                           "worker_id": 3, "reservation_id": rid}, status=201)
        for rid in (f"c{n}", f"d{n}"):
            c.now += 1.0
            c.ok("POST", f"/reservations/{rid}/prefill_complete")
            c.ok("DELETE", f"/reservations/{rid}")
    rows = _explained(c)
    # Damped: half the measured ratio in log terms, twice the time for four times slower.
    assert rows[2]["predicted_prefill_secs"] == pytest.approx(2 * rows[1]["predicted_prefill_secs"])
    assert rows[3]["predicted_prefill_secs"] == pytest.approx(rows[1]["predicted_prefill_secs"])
    assert not rows[2]["chosen"]
    learned = {line.split('worker_id="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
               for line in c.service.metrics_text(now=c.now).splitlines()
               if line.startswith("selection_proto_worker_learned_speed{")}
    assert learned["1"] == pytest.approx(learned["3"]) and learned["1"] == pytest.approx(4 * learned["2"])
    # A declared speed wins over what was learned, and a worker that leaves is forgotten.
    c.ok("POST", "/workers", worker(2, prefill_tokens_per_sec=DEFAULT_PREFILL_TOKENS_PER_SEC), status=201)
    rows = _explained(c)
    assert rows[2]["predicted_prefill_secs"] == pytest.approx(before[2]["predicted_prefill_secs"])
    c.ok("DELETE", "/workers/1")
    c.ok("POST", "/workers", worker(1), status=201)
    assert _explained(c)[1]["predicted_prefill_secs"] == pytest.approx(before[1]["predicted_prefill_secs"])


def test_the_dynamo_policy_and_frees_learn_nothing(make_client: Callable[..., Client]) -> None:
    for policy, complete in (("dynamo", True), ("ttft", False)):
        c = make_client(router_policy=policy)
        for wid in (1, 2):
            c.ok("POST", "/workers", worker(wid), status=201)
        for n in range(3):
            for wid, secs in ((1, 1.0), (2, 4.0)):
                c.ok("POST", "/reservations", {"model_name": "m", "token_ids": list(range(10_000)),
                                               "worker_id": wid, "reservation_id": f"r{n}"}, status=201)
                c.now += secs
                if complete:
                    c.ok("POST", f"/reservations/r{n}/prefill_complete")
                c.ok("DELETE", f"/reservations/r{n}")
        assert "selection_proto_worker_learned_speed{" not in c.service.metrics_text(now=c.now)


def test_what_is_left_of_a_running_prefill() -> None:
    """`Speeds.left` (docs/ROUTING.md, "How close to the oracle"): the booked prefill less what the
    worker's learned rate has done since the rank's last prefill ended (or since it had none), so
    that a rate read too high never empties a rank that has been busy for long."""
    from selection_proto.core.fleet.speed import Speeds

    speeds = Speeds(learn=True)
    for w in (1, 2):
        speeds.set(w, None, None)
        speeds.observe((w, 0), 0, 0.0)  # 20,000 tokens booked at 0 and completed at 2 s: 10,000 a second
        speeds.observe((w, 0), 20_000, 2.0)
        speeds.stopped((w, 0), 20_000)
        speeds.completed((w, 0), 20_000)
    speeds.observe((1, 0), 0, 10.0)  # 30,000 booked from 10 s
    # The rate as of now: 20,000 tokens over 2 s busy before and 1 s since.
    assert speeds.left((1, 0), 30_000, 11.0) == pytest.approx(30_000 - 20_000 / 3)
    speeds.observe((1, 0), 30_000, 13.0)
    speeds.stopped((1, 0), 5_000)  # a booking of 5,000 ends at 13 s: the next prefill begins there
    assert speeds.left((1, 0), 25_000, 13.0) == 25_000  # (counted from 10 s, it would read less)
    assert speeds.left((1, 0), 25_000, 14.0) == pytest.approx(25_000 - 20_000 / 6)
    assert speeds.left((1, 0), 1_000, 14.0) == 0.0
    assert Speeds(learn=True).left((1, 0), 7, 99.0) == 7  # no rate learned: as booked


def test_ttft_counts_what_is_left_of_a_running_prefill(make_client: Callable[..., Client]) -> None:
    """The queue a rank's booked prefill makes shrinks as its engine works through it (at the
    rate learned from completions), and counts from the last prefill's end, not from before it."""
    c = _two_learned_workers(make_client)
    for rid in ("x", "y"):  # 20,000 tokens booked on worker 1
        c.ok("POST", "/reservations", {"model_name": "m", "token_ids": list(range(10_000)),
                                       "worker_id": 1, "reservation_id": rid}, status=201)
    booked = _explained(c)[1]["predicted_wait_secs"]
    c.now += 0.5  # half of the first prompt done: 15,000 tokens still to run
    half = _explained(c)[1]["predicted_wait_secs"]
    assert half < booked
    # About 5,000 of 20,000 done (the rate as of now counts this half second busy too), and the
    # rest of the wait is the KV pressure.
    assert 0.15 < (booked - half) / booked <= 5_000 / 20_000
    c.now += 1.5  # the engine was slower than learned: the first ends at 2 s, not 1 s
    c.ok("POST", "/reservations/x/prefill_complete")
    # The second begins now: all 10,000 of its tokens still to run (counted from 0 s at the
    # learned rate, the rank would read as idle).
    assert _explained(c)[1]["predicted_wait_secs"] > 0.5 * booked


def test_ttft_reads_an_engine_stalled_far_past_its_prediction_as_busy(make_client: Callable[..., Client]) -> None:
    """Worker 1 holds the prompt and has 8 new tokens booked (under 1 ms of prefill at the learned
    rate, so due within 4 s: `MOST_APART` times the mean time a prefill took there), with no
    per-request overhead learned. Before that it still takes the prompt; once its prefill is
    seconds overdue (a stalled engine) the time past `MOST_APART` times its prediction
    reads as work ahead, so the prompt goes to idle worker 2, more so the longer it stalls; its
    prefill's end makes it the cheaper again (docs/ROUTING.md, "An engine far behind")."""
    c = _two_learned_workers(make_client)
    _cache(c, 1, 16)
    c.ok("POST", "/reservations", {"model_name": "m", "token_ids": PROMPT + [10**7 + i for i in range(8)],
                                   "worker_id": 1, "reservation_id": "s"}, status=201)
    c.now += 3.9  # not due before `MOST_APART` times the 1 s a prefill end took there so far
    assert _explained(c)[1]["chosen"]
    c.now += 1.1
    stalled = _explained(c)
    assert stalled[2]["chosen"] and stalled[1]["predicted_wait_secs"] > 0.3
    c.now += 2.0
    assert _explained(c)[1]["predicted_wait_secs"] > stalled[1]["predicted_wait_secs"] + 0.3
    c.ok("POST", "/reservations/s/prefill_complete")
    assert _explained(c)[1]["chosen"]


def _learned(speeds: Any, pairs_per_token: float) -> None:
    """Workers 1 and 2 learn 10,000 tokens a second from 20,000-token prefills computed over a
    mean context of `pairs_per_token` tokens each."""
    for w in (1, 2):
        speeds.set(w, None, None)
        speeds.observe((w, 0), 0, 0.0)
        speeds.observe((w, 0), 20_000, 2.0)
        speeds.stopped((w, 0), 20_000)
        speeds.completed((w, 0), 20_000, 20_000 * pairs_per_token)


def test_a_long_prompt_is_further_from_done_than_short_ones_of_as_many_tokens() -> None:
    """`Speeds.left` (docs/ROUTING.md, "What is left of a running prefill"): progress is counted
    in work, each token weighing its context as the cost weighs a prompt's own prefill, so a
    rank running one 40,000-token prompt (its late chunks computed over a long context) reads
    more left after a second than one running four 10,000-token prompts; in plain tokens at the
    learned rate both read the same."""
    from selection_proto.core.fleet.speed import Speeds

    speeds = Speeds(learn=True)
    _learned(speeds, 5_000.0)
    per_context = 1.0 / ATTENTION_CONTEXT_TOKENS
    long_pairs, short_pairs = 40_000 * 20_000.0, 4 * 10_000 * 5_000.0
    for w in (1, 2):
        speeds.observe((w, 0), 0, 10.0)  # both busy from 10 s
    long_left = speeds.left((1, 0), 40_000, 11.0, long_pairs, per_context)
    short_left = speeds.left((2, 0), 40_000, 11.0, short_pairs, per_context)
    assert long_left > short_left > 0.0
    work_done = (20_000 + 20_000 * 5_000.0 * per_context) / 3.0  # 2 s busy before, 1 s since
    assert long_left == pytest.approx(40_000 * (1 - work_done / (40_000 + long_pairs * per_context)))
    # Without context (or weighed at nothing) it is the booked tokens less the learned rate's.
    assert speeds.left((1, 0), 40_000, 11.0) == pytest.approx(40_000 - 20_000 / 3)


def test_ttft_prefers_short_prompts_running_to_a_long_one_of_as_many_tokens(
        make_client: Callable[..., Client]) -> None:
    """All else equal, a rank whose running prefill is many short prompts is sooner free than one
    running a long prompt of as many tokens (its late chunks attend over a long context): the
    latter's rank is avoided although it has a few tokens less booked."""
    c = _two_learned_workers(make_client)
    c.ok("POST", "/reservations", {"model_name": "m", "token_ids": list(range(5 * 10**6, 5 * 10**6 + 40_000)),
                                   "worker_id": 1, "reservation_id": "long"}, status=201)
    for n in range(4):
        c.ok("POST", "/reservations", {"model_name": "m", "token_ids": list(range(10**7 * (n + 1), 10**7 * (n + 1) + 10_004)),
                                       "worker_id": 2, "reservation_id": f"short{n}"}, status=201)
    c.now += 2.0
    rows = _explained(c)
    assert rows[2]["chosen"] and rows[1]["predicted_wait_secs"] > rows[2]["predicted_wait_secs"]


@given(st.lists(st.tuples(st.integers(1, 200_000), st.floats(0.0, 200_000.0)), min_size=1, max_size=6),
       st.integers(0, 300_000), st.floats(0.0, 300_000.0), st.floats(0.0, 30.0))
@example(done=[(20_000, 0.0)], booked=81, context=261774.45493264275, secs=0.0)  # read 81.00000000000001
def test_what_is_left_stays_within_what_was_booked(done: list[tuple[int, float]], booked: int,
                                                   context: float, secs: float) -> None:
    """Whatever was learned (prefills of any size over any context), what is left of a rank's
    booked prefill is never negative nor more than was booked until it is far past due, and context weighed at nothing
    reads as plain tokens."""
    from selection_proto.core.fleet.speed import Speeds

    speeds = Speeds(learn=True)
    now = 0.0
    for tokens, mean_context in done:
        speeds.observe((1, 0), 0, now)
        now += tokens / 10_000
        speeds.observe((1, 0), tokens, now)
        speeds.stopped((1, 0), tokens)
        speeds.completed((1, 0), tokens, tokens * mean_context)
    speeds.observe((1, 0), 0, now)
    left = speeds.left((1, 0), booked, now + secs, booked * context, 1.0 / ATTENTION_CONTEXT_TOKENS)
    # Past `MOST_APART` times its time at the learned rate, the time past due counts on top
    # (docs/ROUTING.md, "An engine far behind").
    total = sum(tokens for tokens, _ in done)
    busy = total / 10_000 + secs
    due = MOST_APART * max(booked * busy / total, total / 10_000 / len(done))  # at least a mean prefill's
    past = secs - due if total >= LEARN_AFTER_TOKENS else 0.0
    assert 0.0 <= left <= booked + (past * total / busy if past > 0.0 else 0.0) + 1e-6 * booked
    assert speeds.left((1, 0), booked, now + secs, booked * context, 0.0) == pytest.approx(
        speeds.left((1, 0), booked, now + secs))


@pytest.mark.parametrize("kv_blocks", [100, 1000])
def test_ttft_counts_no_cache_on_a_rank_queueing_more_than_its_kv_holds(
        make_client: Callable[..., Client], kv_blocks: int) -> None:
    """A rank with more prefill booked than its KV blocks hold allocates all of it before it
    admits this prompt, and LRU evicts what it holds of it by then: its cache is not counted (nor
    booked), and the rank with a little less queued and nothing cached is chosen. With room for
    the queue, the cache wins as before (docs/ROUTING.md, "How close to the oracle (round three)")."""
    c = make_client(router_policy="ttft")
    for wid in (1, 2):
        c.ok("POST", "/workers", worker(wid, total_kv_blocks=kv_blocks), status=201)
    prompt = list(range(400))  # 100 blocks of 4, 96 of them cached on worker 1
    local = block_hashes(prompt, 4)
    c.ok("POST", "/kv_events", [stored(1, 1, [(1000 + i, local[i]) for i in range(96)])])
    for wid, tokens in ((1, 600), (2, 400)):  # 150 and 100 blocks queued
        c.ok("POST", "/reservations", {"model_name": "m", "token_ids": list(range(10**6 * wid, 10**6 * wid + tokens)),
                                       "worker_id": wid, "reservation_id": f"q{wid}"}, status=201)
    rows = _explained(c, prompt)
    if kv_blocks == 100:
        assert rows[2]["chosen"] and rows[1]["cached_tokens"] == 0
        assert rows[1]["potential_prefill_tokens"] == 600 + 400  # booked uncached were it chosen
    else:
        assert rows[1]["chosen"] and rows[1]["cached_tokens"] == 384


def test_a_queue_of_longer_prompts_than_the_rate_was_learned_from_is_heavier() -> None:
    """`Speeds.heavier`: a saturated rank's queue counts in work against what its worker's rate
    was learned from: booked prompts over longer contexts than those weigh more than a token
    each, shorter ones less, alike ones 1 (before a rate is learned: against plain tokens)."""
    from selection_proto.core.fleet.speed import Speeds

    speeds = Speeds(learn=True)
    per_context = 1.0 / ATTENTION_CONTEXT_TOKENS
    assert speeds.heavier((1, 0), 40_000, 40_000 * 20_000.0, per_context) == pytest.approx(1 + 20_000 * per_context)
    _learned(speeds, 5_000.0)
    assert speeds.heavier((1, 0), 40_000, 40_000 * 5_000.0, per_context) == pytest.approx(1.0)
    assert speeds.heavier((1, 0), 40_000, 40_000 * 20_000.0, per_context) == pytest.approx(
        (1 + 20_000 * per_context) / (1 + 5_000 * per_context))
    assert speeds.heavier((1, 0), 40_000, 0.0, per_context) < 1.0
