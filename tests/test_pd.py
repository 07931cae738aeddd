"""Prefill/decode plans (docs/PD.md): the decider's thresholds and monotonicity, fail-closed pairing,
the plan on a fleet without prefill workers equal to `/select`, both-or-neither booking under
injected failures and expiries (a stateful machine), hostile inputs, and the same plan over a real
HTTP socket and a real `stdio` subprocess."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from selection_proto import SelectionService, Settings
from selection_proto.core.base.hashing import block_hashes
from selection_proto.core.base.types import PdOptions, WorkerRequest
from selection_proto.core.bookings.tracker import Tracker
from selection_proto.core.cache.engine_metrics import EngineSample
from selection_proto.core.routing.pd import can_prefill_locally, decide
from selection_proto.core.routing.selection import Selector
from tests.test_http import Server, api_call

JSON = [("content-type", "application/json")]


class Svc:
    """A service driven through its bytes API, as every adapter drives it."""

    def __init__(self, settings: Settings | None = None, seed: int = 0) -> None:
        self.service = SelectionService(settings or Settings(kv_events="push"), random.Random(seed))
        self.now = 1.0
        self.event_id = 0

    def call(self, method: str, path: str, body: Any = None, query: str = "") -> tuple[int, Any]:
        raw = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
        r = self.service.handle(method, path, query, JSON, raw, now=self.now)
        assert not hasattr(r, "ticket"), "plans are never queued"
        return r.status, json.loads(r.body) if r.body else None

    def worker(self, wid: int, **fields: Any) -> dict[str, Any]:
        status, record = self.call("POST", "/workers", {"worker_id": wid, "model_name": "m", "block_size": 4,
                                                        "endpoint": f"http://w{wid}:8000", **fields})
        assert status == 201, record
        assert record["lifecycle"] == "schedulable", record
        return dict(record)

    def cache(self, wid: int, tokens: list[int]) -> None:
        """The worker's engine reports the prompt's whole blocks as cached."""
        self.event_id += 1
        blocks = [{"block_hash": h, "tokens_hash": h} for h in block_hashes(tokens, 4)]
        status, report = self.call("POST", "/kv_events", [{"worker_id": wid, "event": {
            "event_id": self.event_id, "data": {"stored": {"parent_hash": None, "blocks": blocks}}}}])
        assert status == 200 and report["failed"] == 0, report

    def loads(self) -> Any:
        return self.call("GET", "/loads")[1]

    def workers(self) -> Any:
        return self.call("GET", "/workers")[1]

    def bookings(self) -> set[str]:
        return {rid for pool in self.service.pools.values() for rid in pool.tracker.bookings}

    def metric(self, name: str, **labels: str) -> float:
        text = self.service.metrics_text(now=self.now)
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


def plan_body(n: int, **extra: Any) -> dict[str, Any]:
    return {"model_name": "m", "token_ids": list(range(1, n + 1)), **extra}


# -- the decider, as numbers ------------------------------------------------------------------------

AUTO = PdOptions()


def path(opts: PdOptions, isl: int, cached: int, **flags: bool) -> str:
    kw = {"can_local": True, "prefill_available": True, "prefill_busy": False, "decode_kv_busy": False, **flags}
    return decide(opts, isl, cached, **kw).path


@pytest.mark.parametrize(("isl", "cached", "expected"), [
    (10_000, 7_953, "local"),   # 2,047 uncached, share 0.2047: both strictly below
    (10_000, 7_952, "remote"),  # 2,048 uncached: not below 2,048
    (10, 3, "remote"),          # share exactly 0.7: not below
    (1_000, 301, "local"),      # share 0.699
    (100, 0, "remote"),         # nothing cached: share 1.0
    (0, 0, "local"),            # an empty prompt has nothing to prefill
])
def test_isl_bounding_thresholds_are_strict(isl: int, cached: int, expected: str) -> None:
    assert path(AUTO, isl, cached) == expected


def test_uncached_threshold_and_the_fixed_deciders() -> None:
    llmd = PdOptions(decider="uncached_threshold", uncached_tokens=8, prompt_tokens=20)
    assert path(llmd, 100, 92) == "local"    # 8 uncached: not above 8
    assert path(llmd, 100, 91) == "remote"   # 9 uncached
    assert path(llmd, 19, 0) == "local"      # a prompt under prompt_tokens
    assert path(PdOptions(decider="uncached_threshold", uncached_tokens=0), 10**6, 0) == "local"  # 0: never
    assert path(PdOptions(decider="always"), 1, 1) == "remote"
    assert path(PdOptions(decider="never"), 10**6, 0) == "local"
    # the steering flags, in their order
    assert path(AUTO, 1, 1, can_local=False) == "remote"
    assert path(AUTO, 100, 0, prefill_available=False) == "local"
    assert path(PdOptions(decider="never"), 1, 1, decode_kv_busy=True) == "remote"
    assert path(PdOptions(decider="always"), 1, 1, prefill_busy=True) == "local"
    verdict = decide(AUTO, 100, 40, can_local=True, prefill_available=True, prefill_busy=False,
                     decode_kv_busy=False)
    assert (verdict.uncached_on_decode, verdict.ratio, verdict.flags) == (60, 0.6, ())
    assert "60 uncached tokens < 2048" in verdict.reason


options = st.builds(PdOptions, decider=st.sampled_from([None, "isl_bounding", "uncached_threshold", "always", "never"]),
                    isl_threshold=st.integers(0, 5000), ratio_threshold=st.floats(0, 1),
                    uncached_tokens=st.integers(0, 5000), prompt_tokens=st.integers(0, 5000))
flag_sets = st.fixed_dictionaries({"can_local": st.booleans(), "prefill_available": st.booleans(),
                                   "prefill_busy": st.booleans(), "decode_kv_busy": st.booleans()})


@given(options, st.integers(0, 20_000), st.integers(0, 20_000), st.integers(0, 20_000), flag_sets)
@example(AUTO, 10_000, 7_952, 7_953, {"can_local": True, "prefill_available": True, "prefill_busy": False,
                                     "decode_kv_busy": False})
def test_more_cache_on_decode_never_flips_local_to_remote(opts: PdOptions, isl: int, c1: int, c2: int,
                                                          flags: dict[str, bool]) -> None:
    less, more = sorted((c1, c2))
    if path(opts, isl, less, **flags) == "local":
        assert path(opts, isl, more, **flags) == "local"


@given(options, st.integers(0, 20_000), st.integers(0, 20_000), st.integers(0, 20_000), flag_sets)
def test_a_longer_prompt_never_flips_remote_to_local(opts: PdOptions, i1: int, i2: int, cached: int,
                                                     flags: dict[str, bool]) -> None:
    shorter, longer = sorted((i1, i2))
    assume(cached <= shorter)
    if path(opts, shorter, cached, **flags) == "remote":
        assert path(opts, longer, cached, **flags) == "remote"


@given(options, st.integers(0, 20_000), st.integers(0, 20_000), flag_sets)
def test_busier_decode_kv_never_flips_remote_to_local_and_unable_is_never_local(
        opts: PdOptions, isl: int, cached: int, flags: dict[str, bool]) -> None:
    if path(opts, isl, cached, **{**flags, "decode_kv_busy": False}) == "remote":
        assert path(opts, isl, cached, **{**flags, "decode_kv_busy": True}) == "remote"
    assert path(opts, isl, cached, **{**flags, "can_local": False}) == "remote"


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 400), st.integers(0, 400), st.integers(0, 400), st.integers(1, 1700),
       st.sampled_from([{}, {"decider": "uncached_threshold", "uncached_tokens": 64}, {"isl_threshold": 300}]))
def test_through_the_service_more_cache_never_remote_and_a_longer_prompt_never_local(
        c1: int, c2: int, extra: int, isl: int, pd: dict[str, Any]) -> None:
    svc = Svc()
    svc.worker(1, role="both")
    svc.worker(3, role="prefill")
    tokens = list(range(1, 2101 + 4 * 400))
    less, more = sorted((min(c1, isl // 4), min(c2, isl // 4)))

    def path_(cached_blocks: int, n: int) -> str:
        svc.call("POST", "/kv_events", [{"worker_id": 1, "event": {"event_id": 0, "data": "cleared"}}])
        if cached_blocks:
            svc.cache(1, tokens[:4 * cached_blocks])
        status, plan = svc.call("POST", "/select_pd", plan_body(n, pd=pd))
        assert status == 200, plan
        assert plan["decision"]["cached_on_decode"] == 4 * cached_blocks
        return str(plan["path"])

    if path_(less, isl) == "local":
        assert path_(more, isl) == "local"
    if path_(less, isl) == "remote":
        assert path_(less, isl + extra) == "remote"


# -- the catalog -----------------------------------------------------------------------------------

def test_roles_are_listed_only_when_set_and_validated() -> None:
    svc = Svc()
    plain = svc.worker(1)
    assert not {"role", "local_prefill", "bootstrap_host", "bootstrap_port"} & plain.keys()
    record = svc.worker(2, role="prefill", bootstrap_host="10.0.0.2", bootstrap_port=8998)
    assert (record["role"], record["bootstrap_host"], record["bootstrap_port"]) == ("prefill", "10.0.0.2", 8998)
    assert "local_prefill" not in record
    status, record = svc.call("PATCH", "/workers/1", {"role": "decode", "local_prefill": False})
    assert status == 200 and (record["role"], record["local_prefill"]) == ("decode", False)
    # a dump restores them
    fresh = Svc()
    fresh.service.restore(svc.service.dump(), now=1.0)
    assert fresh.workers() == svc.workers()
    assert can_prefill_locally(WorkerRequest(worker_id=1)) is True
    assert can_prefill_locally(WorkerRequest(worker_id=1, role="decode")) is False  # unknown fails closed
    assert can_prefill_locally(WorkerRequest(worker_id=1, role="decode", local_prefill=True)) is True
    assert can_prefill_locally(WorkerRequest(worker_id=1, role="both", local_prefill=False)) is False


PREFIX = "Failed to deserialize the JSON body into the target type: "
HUGE = "<a 5,000-digit integer>"


def encode(value: Any) -> bytes:
    """JSON with `HUGE` as a 5,000-digit integer, and a lone surrogate as its escape `\\udc80`."""
    return json.dumps(value).replace(json.dumps(HUGE), "9" * 5000).encode()


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"role": "decoder"}, 422, PREFIX + "role: unknown variant `decoder`, expected one of `prefill`, `decode`, `both`"),
    ({"role": 1}, 422, PREFIX + "role: invalid type: integer `1`, expected a string"),
    ({"local_prefill": "yes"}, 422, PREFIX + 'local_prefill: invalid type: string "yes", expected a boolean'),
    ({"bootstrap_port": 70000}, 422, PREFIX + "bootstrap_port: must be a TCP port (1 to 65535)"),
    ({"bootstrap_port": 0}, 422, PREFIX + "bootstrap_port: must be a TCP port (1 to 65535)"),
    ({"bootstrap_port": HUGE}, 400, "Failed to parse the request body as JSON: integer with 5000 digits (at most 4300)"),
    ({"bootstrap_port": 10**30}, 422, PREFIX + f"bootstrap_port: invalid value: integer `{10**30}`, expected u32"),
    ({"bootstrap_port": -1}, 422, PREFIX + "bootstrap_port: invalid value: integer `-1`, expected u32"),
    ({"bootstrap_host": "a b"}, 422, PREFIX + "bootstrap_host: must be a host name or IP address of at most 255 characters"),
    ({"bootstrap_host": ""}, 422, None),
    ({"bootstrap_host": "h" * 256}, 422, None),
    ({"bootstrap_host": "\udc80"}, 400, "Failed to parse the request body as JSON: lone surrogate in string"),
])
def test_hostile_worker_fields_change_nothing(body: dict[str, Any], status: int, message: str | None) -> None:
    svc = Svc()
    svc.worker(1)
    before = (svc.workers(), svc.loads())
    for method, path_, payload in (("POST", "/workers", {"worker_id": 2, "model_name": "m", "block_size": 4,
                                                         "endpoint": "http://x", **body}),
                                   ("PATCH", "/workers/1", body)):
        got, answer = svc.call(method, path_, encode(payload))
        assert got == status, answer
        if message is not None:
            assert answer == {"error": message}
        assert (svc.workers(), svc.loads()) == before


# -- plans -----------------------------------------------------------------------------------------

def pd_fleet(svc: Svc) -> None:
    svc.worker(1, role="decode", local_prefill=True, total_kv_blocks=10_000)
    svc.worker(2, role="decode")  # local prefill unknown: never local
    svc.worker(3, role="prefill", bootstrap_host="10.0.0.3", bootstrap_port=8998)
    svc.worker(4, role="prefill", bootstrap_host="10.0.0.4", bootstrap_port=8998)


def test_remote_plan_books_prefill_on_p_and_blocks_on_d_then_handoff_and_end() -> None:
    svc = Svc()
    pd_fleet(svc)
    status, plan = svc.call("POST", "/select_pd_and_reserve", plan_body(400, plan_id="p1", pd={"decider": "always"},
                                                                   pinned_worker={"worker_id": 1, "dp_rank": 0}))
    assert status == 200, plan
    assert plan["path"] == "remote" and plan["plan_id"] == "p1"
    d, p = plan["decode"], plan["prefill"]
    assert d["reservation_id"] == "p1:decode" and p["reservation_id"] == "p1:prefill"
    assert d["worker_id"] == 1 and p["worker_id"] in (3, 4)
    assert (p["bootstrap_host"], p["bootstrap_port"]) == (f"10.0.0.{p['worker_id']}", 8998)
    assert plan["decision"]["reason"] == "decider always: prefill on a prefill worker"
    loads = {row["worker_id"]: row for row in svc.loads()[0]["loads"]}
    assert (loads[p["worker_id"]]["potential_prefill_tokens"], loads[p["worker_id"]]["potential_decode_blocks"]) == (400, 0)
    assert (loads[d["worker_id"]]["potential_prefill_tokens"], loads[d["worker_id"]]["potential_decode_blocks"]) == (0, 100)
    # the legs are reservations like any other
    assert svc.call("POST", "/reservations/p1:decode/prefill_complete")[0] == 200
    assert svc.call("POST", "/plans/p1/handoff") == (200, {"status": "ok", "plan_id": "p1", "released": ["prefill"]})
    # the prefill leg's prefill completed before it was freed (what router_policy=ttft learns from)
    assert svc.metric("selection_proto_reservation_events_total", event="prefill_complete") == 2.0
    assert svc.call("POST", "/plans/p1/handoff") == (200, {"status": "ok", "plan_id": "p1", "released": []})
    assert svc.bookings() == {"p1:decode"}
    assert svc.call("DELETE", "/plans/p1") == (200, {"status": "ok", "plan_id": "p1", "released": ["decode"]})
    assert svc.call("DELETE", "/plans/p1") == (200, {"status": "ok", "plan_id": "p1", "released": []})
    assert all(row["active_requests"] == 0 for row in svc.loads()[0]["loads"])
    assert svc.metric("selection_proto_pd_plans_total", path="remote", decider="always") == 1.0
    assert svc.metric("selection_proto_pd_events_total", event="handoff") == 1.0
    assert svc.metric("selection_proto_pd_events_total", event="ended") == 1.0


def test_local_plan_books_like_select_and_reserve_and_cache_flips_the_decision() -> None:
    svc = Svc()
    svc.worker(1, role="both")
    svc.worker(3, role="prefill")
    tokens = list(range(1, 101))
    status, plan = svc.call("POST", "/select_pd", plan_body(100, pd={"isl_threshold": 64}))
    assert (status, plan["path"], plan["decode"]["reservation_id"]) == (200, "remote", None)
    svc.cache(1, tokens[:80])  # 20 uncached of 100: share 0.2, below both thresholds
    status, plan = svc.call("POST", "/select_pd_and_reserve", plan_body(100, plan_id="q", pd={"isl_threshold": 64}))
    assert status == 200 and plan["path"] == "local" and plan["prefill"] is None, plan
    assert plan["decision"]["cached_on_decode"] == 80 and plan["decision"]["uncached_on_decode"] == 20
    loads = {row["worker_id"]: row for row in svc.loads()[0]["loads"]}
    assert loads[1]["potential_prefill_tokens"] == 20 and loads[1]["active_requests"] == 1
    assert svc.call("POST", "/plans/q/handoff")[1]["released"] == ["decode_prefill"]
    assert {row["worker_id"]: row for row in svc.loads()[0]["loads"]}[1]["potential_prefill_tokens"] == 0
    assert svc.call("POST", "/plans/q/handoff")[1]["released"] == []


def test_fail_closed_and_steering() -> None:
    svc = Svc()
    svc.worker(2, role="decode")
    svc.worker(3, role="prefill")
    # the only decode worker cannot prefill locally: never local, whatever the decider says
    status, plan = svc.call("POST", "/select_pd", plan_body(8, pd={"decider": "never"}))
    assert plan["path"] == "remote" and "decode_cannot_prefill" in plan["decision"]["flags"]
    status, answer = svc.call("POST", "/select_pd", plan_body(8, pd={"mode": "local"}))
    assert (status, answer) == (503, {"error": "no decode worker can prefill locally for model=m tenant=default"})
    # no prefill worker in the key, and no decode worker that may prefill: 503, nothing booked
    svc2 = Svc()
    svc2.worker(2, role="decode")
    assert svc2.call("POST", "/select_pd_and_reserve", plan_body(8))[0] == 503
    assert svc2.call("POST", "/select_pd", plan_body(8, pd={"mode": "remote"})) == (
        503, {"error": "no prefill workers for model=m tenant=default"})
    assert svc2.bookings() == set()


def test_decode_kv_near_exhaustion_steers_remote_booked_or_scraped() -> None:
    svc = Svc()
    svc.worker(1, role="both", total_kv_blocks=100)
    svc.worker(3, role="prefill")
    never = {"decider": "never"}
    assert svc.call("POST", "/select_pd", plan_body(40, pd=never))[1]["path"] == "local"  # 10 of 100 blocks
    assert svc.call("POST", "/select_pd", plan_body(400, pd=never))[1]["path"] == "remote"  # 100 > 90
    svc.service.engine_scraped(1, EngineSample({"kv_usage": 0.95}), None, now=svc.now)
    plan = svc.call("POST", "/select_pd", plan_body(40, pd=never))[1]
    assert plan["path"] == "remote" and plan["decision"]["flags"] == ["decode_kv_busy"]
    assert svc.call("POST", "/select_pd", plan_body(40, pd={**never, "kv_busy_fraction": 0.96}))[1]["path"] == "local"


def test_a_busy_prefill_pool_keeps_the_prefill_local() -> None:
    svc = Svc(Settings(kv_events="push", active_prefill_tokens_threshold=100))
    svc.worker(1, role="both")
    svc.worker(3, role="prefill")
    assert svc.call("POST", "/reservations", {"model_name": "m", "reservation_id": "x", "worker_id": 3,
                                              "token_ids": list(range(200))})[0] == 201
    plan = svc.call("POST", "/select_pd", plan_body(400, pd={"decider": "always"}))[1]
    assert plan["path"] == "local" and plan["decision"]["flags"] == ["prefill_busy"]


def test_transfer_domains_required_fail_closed_preferred_weighs() -> None:
    svc = Svc()
    svc.worker(1, role="decode", kv_transfer_domain="a", kv_transfer_enforcement="required")
    svc.worker(3, role="prefill", kv_transfer_domain="b")
    always = {"decider": "always"}
    assert svc.call("POST", "/select_pd_and_reserve", plan_body(8, pd=always)) == (503, {"error": (
        "no prefill worker can pair with an eligible decode worker for model=m tenant=default")})
    assert svc.bookings() == set()
    svc.worker(2, role="decode", kv_transfer_domain="b")  # not required, and a prefill worker in its domain
    plan = svc.call("POST", "/select_pd", plan_body(8, pd=always))[1]
    assert (plan["decode"]["worker_id"], plan["prefill"]["worker_id"]) == (2, 3)
    svc.worker(4, role="prefill", kv_transfer_domain="a")
    for _ in range(5):
        plan = svc.call("POST", "/select_pd", plan_body(8, pd=always, pinned_worker={"worker_id": 1, "dp_rank": 0}))[1]
        assert (plan["decode"]["worker_id"], plan["prefill"]["worker_id"]) == (1, 4)
    # preferred: of two idle prefill workers, the one in the decode worker's domain
    svc3 = Svc()
    svc3.worker(1, role="decode", local_prefill=True, kv_transfer_domain="x", kv_transfer_enforcement="preferred")
    svc3.worker(3, role="prefill", kv_transfer_domain="y")
    svc3.worker(4, role="prefill", kv_transfer_domain="x")
    assert {svc3.call("POST", "/select_pd", plan_body(8, pd=always))[1]["prefill"]["worker_id"]
            for _ in range(5)} == {4}


def test_select_skips_prefill_workers_unless_named_and_explain_shows_the_plan() -> None:
    svc = Svc(Settings(kv_events="push", explain_header=True))
    svc.worker(1, role="decode", local_prefill=True)
    svc.worker(3, role="prefill")
    for _ in range(5):
        assert svc.call("POST", "/select", plan_body(8))[1]["worker_id"] == 1
    assert svc.call("POST", "/select", plan_body(8, allowed_worker_ids=[3]))[1]["worker_id"] == 3
    r = svc.service.handle("POST", "/select_pd", "", JSON, json.dumps(plan_body(8, explain=True)).encode(), now=1.0)
    plan = json.loads(r.body)
    assert plan["excluded"] == [{"worker_id": 3, "dp_rank": 0, "reason": "prefill_role"}]
    assert [c["worker_id"] for c in plan["candidates"]] == [1]
    assert [c["worker_id"] for c in plan["prefill_candidates"]] == [3]  # isl 8: remote by isl_bounding
    assert dict(r.headers)["x-selection-decision"].startswith("path=remote;decider=isl_bounding;decode=1:0;prefill=3:0")
    # the status page's recent decisions show the plan
    decisions = svc.call("GET", "/status/snapshot")[1]["decisions"]
    plans = [d for d in decisions if "plan" in d]
    assert len(decisions) == 7 and len(plans) == 1  # five /select, one naming worker 3, one plan
    assert plans[0]["worker_id"] == 1 and plans[0]["plan"] == {
        "path": "remote", "prefill": {"worker_id": 3, "dp_rank": 0},
        "reason": "uncached share 1 >= 0.7: prefill on a prefill worker"}


@pytest.mark.parametrize(("body", "status", "message"), [
    (plan_body(8, pd={"mode": "both"}), 422, PREFIX + "pd.mode: unknown variant `both`, expected one of `auto`, `remote`, `local`"),
    (plan_body(8, pd={"ratio_threshold": 2}), 422, PREFIX + "pd.ratio_threshold: must be in [0, 1]"),
    (plan_body(8, pd={"isl_threshold": HUGE}), 400,
     "Failed to parse the request body as JSON: integer with 5000 digits (at most 4300)"),
    (plan_body(8, pd={"isl_threshold": 2**64}), 422, PREFIX + f"pd.isl_threshold: invalid value: integer `{2**64}`, expected u64"),
    (plan_body(8, pd=None), 422, PREFIX + "pd: invalid type: null, expected a map"),
    (plan_body(8, pd=[]), 422, PREFIX + "pd: invalid type: sequence, expected a map"),
    (plan_body(8, plan_id="x" * 249), 400, "plan_id must be at most 248 characters"),
    (plan_body(8, plan_id=7), 422, PREFIX + "plan_id: invalid type: integer `7`, expected a string"),
    (b'{"model_name": "m", "token_ids": [1], "plan_id": "\\ud800"}', 400,
     "Failed to parse the request body as JSON: lone surrogate in string"),
    (b'{"token_ids": [1', 400, None),
])
def test_hostile_plan_requests_change_nothing(body: Any, status: int, message: str | None) -> None:
    svc = Svc()
    pd_fleet(svc)
    before = (svc.workers(), svc.loads(), svc.bookings())
    for route in ("/select_pd", "/select_pd_and_reserve"):
        got, answer = svc.call("POST", route, body if isinstance(body, bytes) else encode(body))
        assert got == status, answer
        if message is not None:
            assert answer == {"error": message}
        assert (svc.workers(), svc.loads(), svc.bookings()) == before
    # a plan id in the path is any text, percent-encoded
    assert svc.call("DELETE", "/plans/%ZZ") == (400, {"error": "Invalid URL: invalid percent-encoding"})
    assert svc.call("POST", "/plans/a%2Fb/handoff") == (200, {"status": "ok", "plan_id": "a/b", "released": []})
    assert svc.call("GET", "/plans/x")[0] == 405


def test_router_policy_ttft_takes_the_faster_predicted_path() -> None:
    svc = Svc(Settings(kv_events="push", router_policy="ttft"))
    svc.worker(1, role="both", prefill_tokens_per_sec=5_000.0)
    svc.worker(3, role="prefill", prefill_tokens_per_sec=50_000.0)
    # a long prompt: ten times faster prefill plus the transfer beats prefilling on the decode worker
    plan = svc.call("POST", "/select_pd", plan_body(8000))[1]
    assert (plan["path"], plan["decision"]["decider"]) == ("remote", "ttft"), plan
    assert plan["decision"]["reason"].startswith("predicted first token in ")
    # a link too slow for the KV: prefill where the decode runs
    plan = svc.call("POST", "/select_pd", plan_body(8000, pd={"transfer_tokens_per_sec": 100.0}))[1]
    assert (plan["path"], plan["decision"]["decider"]) == ("local", "ttft"), plan
    # a named decider still decides
    plan = svc.call("POST", "/select_pd", plan_body(8000, pd={"decider": "never"}))[1]
    assert (plan["path"], plan["decision"]["decider"]) == ("local", "never")
    # more cache on the decode worker never turns local into remote
    tokens = list(range(1, 8001))
    paths = []
    for blocks in (0, 500, 1000, 1500, 1999):
        svc.cache(1, tokens[:4 * blocks])
        paths.append(svc.call("POST", "/select_pd", plan_body(8000))[1]["path"])
    assert paths == sorted(paths, key=lambda p: p == "local") and paths[-1] == "local", paths
    assert svc.call("POST", "/select_pd", plan_body(8, pd={"transfer_tokens_per_sec": 0}))[0] == 422


# -- the plan without prefill workers is /select's choice ------------------------------------------

fleets = st.lists(st.tuples(st.sampled_from([None, "both", "decode"]), st.integers(0, 3), st.integers(0, 40)),
                  min_size=1, max_size=5)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets, st.integers(0, 60), st.sampled_from([0.0, 0.5]), st.integers(0, 2**32))
def test_without_prefill_workers_the_plan_is_local_on_the_select_choice(
        fleet: list[tuple[str | None, int, int]], isl: int, temperature: float, seed: int) -> None:
    services = [Svc(Settings(kv_events="push", temperature=temperature), seed) for _ in range(2)]
    tokens = list(range(1, isl + 1))
    for svc in services:
        for wid, (role, cached_blocks, load) in enumerate(fleet, 1):
            fields: dict[str, Any] = {} if role is None else {"role": role}
            if role == "decode":
                fields["local_prefill"] = True
            svc.worker(wid, **fields)
            if cached_blocks and isl >= 4 * cached_blocks:
                svc.cache(wid, tokens[:4 * cached_blocks])
            if load:
                assert svc.call("POST", "/reservations", {"model_name": "m", "reservation_id": f"r{wid}",
                                                          "worker_id": wid, "token_ids": list(range(1000, 1000 + load))})[0] == 201
    status, chosen = services[0].call("POST", "/select", plan_body(isl))
    status_pd, plan = services[1].call("POST", "/select_pd", plan_body(isl, plan_id="p"))
    assert (status, status_pd) == (200, 200)
    assert plan["path"] == "local" and plan["prefill"] is None
    assert (plan["decode"]["worker_id"], plan["decode"]["dp_rank"]) == (chosen["worker_id"], chosen["dp_rank"])
    assert plan["decode"]["cached_tokens"] == chosen["cached_tokens"]


# -- random fleets: never a plan that breaks a rule -------------------------------------------------

worker_specs = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from([None, "prefill", "decode", "both"]), "local_prefill": st.sampled_from([None, True, False]),
    "kv_transfer_domain": st.sampled_from([None, "a", "b"]),
    "kv_transfer_enforcement": st.sampled_from([None, "required", "preferred"])}), min_size=1, max_size=6)


@settings(max_examples=80, deadline=None)
@given(worker_specs, st.integers(0, 3000), st.sampled_from(["auto", "remote", "local"]),
       st.sampled_from(["isl_bounding", "uncached_threshold", "always", "never"]))
def test_random_fleets_never_get_a_plan_that_breaks_a_rule(specs: list[dict[str, Any]], isl: int, mode: str,
                                                           decider: str) -> None:
    svc = Svc()
    records = {}
    for wid, spec in enumerate(specs, 1):
        records[wid] = WorkerRequest(worker_id=wid, **{k: v for k, v in spec.items() if v is not None})
        svc.worker(wid, **{k: v for k, v in spec.items() if v is not None})
    before = svc.loads()
    status, plan = svc.call("POST", "/select_pd_and_reserve", plan_body(isl, plan_id="p", pd={"mode": mode, "decider": decider}))
    if status != 200:
        assert status == 503, plan
        assert svc.loads() == before and svc.bookings() == set()
        return
    d = records[plan["decode"]["worker_id"]]
    assert d.role != "prefill"
    if plan["path"] == "local":
        assert can_prefill_locally(d), plan
        assert svc.bookings() == {"p:decode"}
    else:
        p = records[plan["prefill"]["worker_id"]]
        assert p.role != "decode" and p.worker_id != d.worker_id
        if "required" in (d.kv_transfer_enforcement, p.kv_transfer_enforcement):
            assert d.kv_transfer_domain is not None and d.kv_transfer_domain == p.kv_transfer_domain
        assert any(r.role == "prefill" for r in records.values())
        assert svc.bookings() == {"p:decode", "p:prefill"}
    assert svc.call("DELETE", "/plans/p")[0] == 200
    assert svc.loads() == before


# -- both or neither: a stateful machine with injected failures and expiries -----------------------

EXPIRY = 30.0


class Fault:
    """Where the next plan call is made to fail: at the n-th booking it makes (1: before any,
    2: between the two), or after both (in the prediction step). Counts the bookings it let through."""

    at: int | None = None
    after = False
    made = 0


def _patch_faults() -> Callable[[], None]:
    book, predict = Tracker.book, Selector._predict

    def faulty_book(self: Tracker, *args: Any, **kwargs: Any) -> Any:
        if Fault.at is not None and Fault.made + 1 == Fault.at:
            raise RuntimeError("injected fault between bookings")
        result = book(self, *args, **kwargs)
        Fault.made += 1
        return result

    def faulty_predict(self: Selector, *args: Any, **kwargs: Any) -> None:
        if Fault.after:
            raise RuntimeError("injected fault after the bookings")
        predict(self, *args, **kwargs)

    Tracker.book = faulty_book  # type: ignore[method-assign]
    Selector._predict = faulty_predict  # type: ignore[method-assign]

    def restore() -> None:
        Tracker.book, Selector._predict = book, predict  # type: ignore[method-assign]
    return restore


class PlanMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.svc = Svc(Settings(kv_events="push", active_request_expiry_secs=EXPIRY))
        self.svc.worker(1, role="decode", local_prefill=True)
        self.svc.worker(2, role="decode")
        self.svc.worker(3, role="prefill")
        self.svc.worker(4, role="prefill")
        self.svc.worker(5, role="both")
        self.legs: dict[str, tuple[int, int, int, float]] = {}  # rid -> (worker, prefill tokens, blocks, booked at)
        self.plans = 0
        self.compensated = 0
        self.orphans = 0
        self.restore = _patch_faults()  # last: `teardown` undoes it

    def teardown(self) -> None:
        self.restore()
        Fault.at, Fault.after, Fault.made = None, False, 0

    def expected_loads(self) -> dict[int, tuple[int, int, int]]:
        out = {w: (0, 0, 0) for w in range(1, 6)}
        for worker, prefill, blocks, _ in self.legs.values():
            p, b, n = out[worker]
            out[worker] = (p + prefill, b + blocks, n + 1)
        return out

    @rule(isl=st.integers(0, 400), mode=st.sampled_from(["auto", "remote", "local"]),
          decider=st.sampled_from(["isl_bounding", "always", "never"]),
          fault=st.sampled_from([None, None, 1, 2, "after"]))
    def plan(self, isl: int, mode: str, decider: str, fault: int | str | None) -> None:
        self.plans += 1
        plan_id = f"p{self.plans}"
        # Prompts never share a block, so a rank's decode blocks are the sum of its legs'.
        tokens = list(range(self.plans * 10_000, self.plans * 10_000 + isl))
        before = (self.svc.loads(), self.svc.bookings())
        Fault.at, Fault.after, Fault.made = (fault if isinstance(fault, int) else None), fault == "after", 0
        status, answer = self.svc.call("POST", "/select_pd_and_reserve", {
            "model_name": "m", "token_ids": tokens, "plan_id": plan_id, "pd": {"mode": mode, "decider": decider}})
        made = Fault.made
        Fault.at, Fault.after = None, False
        if status != 200:
            assert (self.svc.loads(), self.svc.bookings()) == before, answer
            if status == 500:
                assert answer == {"error": "internal error"}
                self.compensated += made
            return
        blocks = isl // 4
        d, p = answer["decode"], answer["prefill"]
        if answer["path"] == "local":
            self.legs[f"{plan_id}:decode"] = (d["worker_id"], isl, blocks, self.svc.now)
        else:
            self.legs[f"{plan_id}:prefill"] = (p["worker_id"], isl, 0, self.svc.now)
            self.legs[f"{plan_id}:decode"] = (d["worker_id"], 0, blocks, self.svc.now)

    def _some_plan(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted({rid.split(":")[0] for rid in self.legs})))

    @precondition(lambda self: self.legs)
    @rule(data=st.data())
    def handoff(self, data: st.DataObject) -> None:
        plan_id = self._some_plan(data)
        status, answer = self.svc.call("POST", f"/plans/{plan_id}/handoff")
        assert status == 200
        freed = self.legs.pop(f"{plan_id}:prefill", None)
        assert ("prefill" in answer["released"]) == (freed is not None)
        d = self.legs.get(f"{plan_id}:decode")
        if d is not None:
            self.legs[f"{plan_id}:decode"] = (d[0], 0, d[2], d[3])

    @precondition(lambda self: self.legs)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        plan_id = self._some_plan(data)
        status, answer = self.svc.call("DELETE", f"/plans/{plan_id}")
        expected = [role for role in ("prefill", "decode") if self.legs.pop(f"{plan_id}:{role}", None)]
        assert (status, answer["released"]) == (200, expected)

    @precondition(lambda self: self.legs)
    @rule(data=st.data())
    def free_one_leg(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.legs)))
        assert self.svc.call("DELETE", f"/reservations/{rid}")[0] == 200
        del self.legs[rid]

    @rule(dt=st.sampled_from([1.0, 10.0, 29.0, 31.0]))
    def time_passes(self, dt: float) -> None:
        self.svc.now += dt
        self.svc.service.tick(self.svc.now)
        for rid, leg in list(self.legs.items()):
            if self.svc.now - leg[3] >= EXPIRY:
                del self.legs[rid]
                self.orphans += 1

    @invariant()
    def loads_are_the_legs(self) -> None:
        assert self.svc.bookings() == set(self.legs)
        got = {row["worker_id"]: (row["potential_prefill_tokens"], row["potential_decode_blocks"],
                                  row["active_requests"]) for row in self.svc.loads()[0]["loads"]}
        assert got == self.expected_loads()

    @invariant()
    def counted(self) -> None:
        assert self.svc.metric("selection_proto_pd_events_total", event="compensated") == self.compensated
        assert self.svc.metric("selection_proto_pd_events_total", event="orphan_expired") == self.orphans


TestPlanMachine = PlanMachine.TestCase
TestPlanMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# -- real transports -------------------------------------------------------------------------------

def _register(call: Callable[..., tuple[int, Any]]) -> None:
    assert call("POST", "/workers", {"worker_id": 1, "model_name": "m", "endpoint": "http://d:1", "block_size": 4,
                                     "role": "decode", "local_prefill": True})[0] == 201
    assert call("POST", "/workers", {"worker_id": 3, "model_name": "m", "endpoint": "http://p:1", "block_size": 4,
                                     "role": "prefill", "bootstrap_host": "10.1.1.1", "bootstrap_port": 9000})[0] == 201


def test_a_plan_over_a_real_http_socket() -> None:
    server = Server("--random-state", "5")
    try:
        def call(method: str, path_: str, body: Any = None) -> tuple[int, Any]:
            return api_call(server.port, method, path_, body)
        _register(call)
        status, plan = call("POST", "/select_pd_and_reserve", plan_body(64, plan_id="h1"))
        assert status == 200 and plan["path"] == "remote" and plan["prefill"]["bootstrap_port"] == 9000
        assert call("POST", "/plans/h1/handoff")[1]["released"] == ["prefill"]
        assert call("DELETE", "/plans/h1")[1]["released"] == ["decode"]
        assert all(row["active_requests"] == 0 for row in call("GET", "/loads")[1][0]["loads"])
        document = call("GET", "/openapi.json")[1]
        assert {"/select_pd", "/select_pd_and_reserve", "/plans/{plan_id}/handoff", "/plans/{plan_id}"} <= document["paths"].keys()
        assert document["paths"]["/plans/{plan_id}"]["delete"]["operationId"] == "end_plan"
        import http.client
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        assert re.search(r'selection_proto_pd_plans_total\{model_name="m",tenant_id="default",'
                         r'route="select_pd_and_reserve",path="remote",decider="isl_bounding"\} 1\.0', text)
        assert 'selection_proto_pd_events_total{model_name="m",tenant_id="default",event="handoff"} 1.0' in text
    finally:
        assert server.stop() == 0


def test_the_same_plan_over_stdio_json_rpc() -> None:
    def rpc(rid: int, method: str, **params: Any) -> bytes:
        return json.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params}).encode() + b"\n"
    worker = {"model_name": "m", "block_size": 4}
    data = b"".join([
        rpc(1, "workers.create", worker_id=1, endpoint="http://d:1", role="decode", local_prefill=True, **worker),
        rpc(2, "workers.create", worker_id=3, endpoint="http://p:1", role="prefill", bootstrap_host="10.1.1.1",
            bootstrap_port=9000, **worker),
        rpc(3, "select_pd_and_reserve", **plan_body(64, plan_id="s1")),
        rpc(4, "plans.handoff", plan_id="s1"),
        rpc(5, "plans.end", plan_id="s1", model_name="m"),
        rpc(6, "plans.end", plan_id=5),
    ])
    proc = subprocess.run([sys.executable, "-m", "selection_proto", "stdio", "--kv-events", "push"],
                          input=data, capture_output=True, timeout=60)
    answers = {a["id"]: a for a in map(json.loads, proc.stdout.decode().splitlines())}
    svc = Svc()
    _register(svc.call)
    assert answers[3]["result"] == svc.call("POST", "/select_pd_and_reserve", plan_body(64, plan_id="s1"))[1]
    assert answers[4]["result"]["released"] == ["prefill"]
    assert answers[5]["result"]["released"] == ["decode"]
    assert answers[6]["error"] == {"code": -32602, "message": "Invalid params",
                                   "data": {"detail": "plan_id must be a string"}}


# -- replicas: the legs go through the shared ledger ----------------------------------------------

def _pd_replica(**ledger: Any) -> tuple[SelectionService, Any]:
    from tests.test_ledger_core import replica, send
    service, mirror = replica(**ledger)  # workers 1 and 2 of model m
    assert send(service, "PATCH", "/workers/1", {"role": "decode", "local_prefill": True}).status == 200
    assert send(service, "PATCH", "/workers/2", {"role": "prefill"}).status == 200
    mirror.journal.take(100)
    return service, mirror


def test_plan_legs_are_journaled_and_a_full_outbox_between_them_books_neither() -> None:
    from selection_proto.core.fleet.ledger_wire import Reply, decode_add
    from tests.test_ledger_core import active, answers, send

    service, mirror = _pd_replica()
    answer = send(service, "POST", "/select_pd_and_reserve", plan_body(16, plan_id="L", pd={"decider": "always"}))
    assert answer.status == 200
    ops = mirror.journal.take(10)
    assert [(op.kind, op.ident) for op in ops] == [("add", "L:prefill"), ("add", "L:decode")]
    prefill, decode = decode_add(ops[0].body), decode_add(ops[1].body)
    assert (prefill.worker_id, prefill.prefill_tokens, prefill.blocks) == (2, 16, None)
    assert (decode.worker_id, decode.prefill_tokens, len(decode.blocks or [])) == (1, 0, 4)
    held = send(service, "DELETE", "/plans/L")  # a free waits for the ledger's word
    frees = mirror.journal.take(10)
    assert [(op.kind, op.ident) for op in frees] == [("free", "L:prefill"), ("free", "L:decode")]
    mirror.results(frees, [Reply("ok", 3), Reply("ok", 4)], 1.0)
    assert answers(service) == {held.ticket: (200, {"status": "ok", "plan_id": "L", "released": ["prefill", "decode"]})}
    # The ledger is away and the outbox has room for one more change: the prefill leg is booked,
    # the decode leg refused (503), and the prefill leg freed again.
    service, mirror = _pd_replica(outbox_max=1)
    mirror.connected(False, 1.0)
    before = active(service)
    refused = send(service, "POST", "/select_pd_and_reserve", plan_body(16, plan_id="F", pd={"decider": "always"}))
    assert (refused.status, json.loads(refused.body)) == (503, {"error": "ledger outbox full"})
    assert active(service) == before and not any(pool.tracker.bookings for pool in service.pools.values())
    assert [(op.kind, op.ident) for op in mirror.journal.ops] == [("add", "F:prefill"), ("free", "F:prefill")]
    assert service.metrics.value("selection_proto_pd_events_total", ("m", "default", "compensated")) == 1


def test_a_strict_conflict_on_one_leg_frees_the_other_and_plans_again() -> None:
    from selection_proto.core.fleet.ledger_wire import Reply
    from tests.test_ledger_core import active, answers, send

    service, mirror = _pd_replica(admission="strict")
    held = send(service, "POST", "/select_pd_and_reserve", plan_body(16, pd={"decider": "always"}))
    assert hasattr(held, "ticket")
    ops = mirror.journal.take(10)
    plan_id = ops[0].ident.split(":")[0]
    assert [op.ident for op in ops] == [f"{plan_id}:prefill", f"{plan_id}:decode"]
    mirror.results(ops, [Reply("conflict", 0), Reply("ok", 1)], 1.0)
    # the refused prefill leg is undone here, its decode leg freed through the ledger, and the
    # request planned again (a new plan id: none was given)
    again = mirror.journal.take(10)
    assert [(op.kind, op.ident) for op in again[:1]] == [("free", f"{plan_id}:decode")]
    new_id = again[1].ident.split(":")[0]
    assert new_id != plan_id and [op.ident for op in again[1:]] == [f"{new_id}:prefill", f"{new_id}:decode"]
    assert service.metrics.value("selection_proto_pd_events_total", ("m", "default", "compensated")) == 1
    mirror.results(again, [Reply("ok", 2), Reply("ok", 3), Reply("ok", 4)], 1.0)
    (status, body), = answers(service).values()
    assert status == 200 and body["path"] == "remote" and body["plan_id"] == new_id
    assert active(service) == {1: 1, 2: 1}
