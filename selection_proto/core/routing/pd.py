"""Prefill/decode disaggregation (docs/PD.md): the plan. One call chooses the decode worker first
(the aggregated cost, overlap credit on), decides whether the prompt is prefilled on it (`local`)
or on a prefill worker (`remote`), chooses that prefill worker by its prefill cost, and books both
or neither under role-qualified ids (`<plan_id>:prefill`, `<plan_id>:decode`), which the
reservation calls know like any other. The handoff frees the prefill booking; the end frees both.

`decide` is the rule as a pure function of numbers; `Plans` is the part of `Selector` that plans,
books and ends plans (a mixin, as `queueing.Admission` is)."""

from __future__ import annotations

import math
import random
import uuid
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import attrs

from ..base.errors import BadRequest, NotFound, NotReady, SelectionError
from ..base.responses import Candidate, Excluded
from ..base.types import PdOptions, SelectPdRequest, WorkerRequest
from ..bookings.tracker import Booking, DuplicateReservation
from ..cache.index import Rank
from ..fleet.decisions import Decision, Scored
from ..fleet.pool import Key, Pool, holding
from .cost import Estimates, assumes_kv_reuse, choose, estimates, explain, queue_secs, score, tracks_prefill
from .queueing import Selection

if TYPE_CHECKING:
    from ..base.metrics import Metrics
    from ..base.settings import Settings
    from ..base.types import SelectRequest
    from ..bookings.prompt import PromptHashes
    from ..cache.engine_metrics import EngineMetrics
    from ..fleet.catalog import Catalog
    from ..fleet.journal import Journal
    from ..fleet.limits import Limits

__all__ = ["DECODE_SUFFIX", "PREFILL_SUFFIX", "PlanResponse", "Plans", "Verdict", "can_prefill_locally",
           "decide"]

PREFILL_SUFFIX: Final = ":prefill"
DECODE_SUFFIX: Final = ":decode"


def can_prefill_locally(worker: WorkerRequest) -> bool:
    """Whether a plan may prefill on this decode worker: what its record says, else its role's
    answer (a `both` worker prefills; a `decode` worker that does not say so fails closed)."""
    if worker.local_prefill is not None:
        return worker.local_prefill
    return worker.role in (None, "both")


@attrs.frozen(kw_only=True)
class Verdict:
    """The local-or-remote decision in numbers and in words."""

    path: str  # "local" | "remote"
    decider: str
    isl: int
    cached_on_decode: int
    flags: tuple[str, ...]
    reason: str

    @property
    def uncached_on_decode(self) -> int:
        return max(0, self.isl - self.cached_on_decode)

    @property
    def ratio(self) -> float:
        """Uncached share of the prompt on the decode worker (0.0 for an empty prompt)."""
        return self.uncached_on_decode / self.isl if self.isl > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"decider": self.decider, "isl": self.isl, "cached_on_decode": self.cached_on_decode,
                "uncached_on_decode": self.uncached_on_decode, "ratio": self.ratio,
                "flags": list(self.flags), "reason": self.reason}


def decide(opts: PdOptions, isl: int, cached: int, *, can_local: bool, prefill_available: bool,
           prefill_busy: bool, decode_kv_busy: bool, times: tuple[float, float] | None = None) -> Verdict:
    """Local or remote for a prompt of `isl` tokens of which the decode worker holds `cached`.
    `mode=local` needs `can_local` and `mode=remote` needs `prefill_available` (the caller has
    made sure). In `auto`, in this order: a decode worker that cannot prefill is never local; with
    no prefill worker to pair with, local; a decode worker near KV exhaustion goes remote; a busy
    prefill pool keeps the prompt local; else the decider, its thresholds strict ("below").
    `times`: the predicted seconds to the first token (local, remote) under router_policy=ttft;
    without a named decider, the faster path wins (a tie stays local)."""
    decider = opts.decider if opts.decider is not None else "ttft" if times is not None else "isl_bounding"
    uncached = max(0, isl - cached)
    ratio = uncached / isl if isl > 0 else 0.0
    flags = tuple(name for name, on in (("decode_cannot_prefill", not can_local),
                                        ("no_prefill_worker", not prefill_available),
                                        ("decode_kv_busy", decode_kv_busy),
                                        ("prefill_busy", prefill_busy)) if on)

    def verdict(path: str, reason: str) -> Verdict:
        return Verdict(path=path, decider=decider, isl=isl, cached_on_decode=min(cached, isl),
                       flags=flags, reason=reason)

    if opts.mode == "local":
        return verdict("local", "mode=local: prefill on the decode worker")
    if opts.mode == "remote":
        return verdict("remote", "mode=remote: prefill on a prefill worker")
    if not can_local:
        return verdict("remote", "the decode worker cannot prefill locally (local_prefill false or unknown)")
    if not prefill_available:
        return verdict("local", "no prefill worker can pair with the decode worker: prefill on it")
    if decode_kv_busy:
        return verdict("remote", f"the decode worker's KV cache is above {opts.kv_busy_fraction:g} "
                                 "of its blocks: prefill elsewhere")
    if prefill_busy:
        return verdict("local", "every prefill worker is busy: prefill on the decode worker")
    if decider == "ttft" and times is not None:
        local, remote = times
        if remote < local:
            return verdict("remote", f"predicted first token in {remote:.4g} s remote (prefill wait, prefill, "
                                     f"KV transfer) < {local:.4g} s local")
        return verdict("local", f"predicted first token in {local:.4g} s local <= {remote:.4g} s remote "
                                "(prefill wait, prefill, KV transfer)")
    if decider == "always":
        return verdict("remote", "decider always: prefill on a prefill worker")
    if decider == "never":
        return verdict("local", "decider never: prefill on the decode worker")
    if decider == "isl_bounding":
        short, cached_enough = uncached < opts.isl_threshold, ratio < opts.ratio_threshold
        if short and cached_enough:
            return verdict("local", f"{uncached} uncached tokens < {opts.isl_threshold} and uncached "
                                    f"share {ratio:.4g} < {opts.ratio_threshold:g}: prefill on the decode worker")
        why = (f"{uncached} uncached tokens >= {opts.isl_threshold}" if not short else
               f"uncached share {ratio:.4g} >= {opts.ratio_threshold:g}")
        return verdict("remote", f"{why}: prefill on a prefill worker")
    # uncached_threshold, llm-d's prefix decider: 0 tokens disables it
    if opts.uncached_tokens > 0 and uncached > opts.uncached_tokens and isl >= opts.prompt_tokens:
        return verdict("remote", f"{uncached} uncached tokens > {opts.uncached_tokens}: prefill on a prefill worker")
    return verdict("local", f"{uncached} uncached tokens, at most {opts.uncached_tokens} (or a prompt under "
                            f"{opts.prompt_tokens} tokens): prefill on the decode worker")


@attrs.frozen(kw_only=True)
class PlanResponse:
    """The answer of `/select_pd` and `/select_pd_and_reserve`."""

    plan_id: str
    selection_id: str | None
    model_name: str
    tenant_id: str
    path: str
    decode: dict[str, Any]
    prefill: dict[str, Any] | None
    verdict: Verdict
    block_size: int
    candidates: tuple[Candidate, ...] | None = None
    prefill_candidates: tuple[Candidate, ...] | None = None
    excluded: tuple[Excluded, ...] | None = None
    decision_header: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"plan_id": self.plan_id}
        if self.selection_id is not None:
            out["selection_id"] = self.selection_id
        out.update(model_name=self.model_name, tenant_id=self.tenant_id, path=self.path, decode=self.decode,
                   prefill=self.prefill, decision=self.verdict.to_json(), block_size=self.block_size)
        if self.candidates is not None:
            out["candidates"] = [c.to_json() for c in self.candidates]
            out["prefill_candidates"] = [c.to_json() for c in self.prefill_candidates or ()]
            out["excluded"] = [e.to_json() for e in self.excluded or ()]
        return out


def _temperature(req: SelectRequest, s: Settings) -> float:
    o = req.router_config_override
    return o.router_temperature if o is not None and o.router_temperature is not None else s.temperature


class Plans:
    """The plan methods of `Selector` (selection.py), which provides what is declared here."""

    __slots__ = ()

    if TYPE_CHECKING:
        _settings: Settings
        _rng: random.Random
        _metrics: Metrics
        _limits: Limits
        _catalog: Catalog
        _pools: Mapping[Key, Pool]
        journal: Journal | None
        engines: EngineMetrics | None

        def gate(self, model_name: str, tenant_id: str, now: float) -> Pool: ...
        def _candidates(self, req: SelectRequest, pool: Pool, bound: Rank | None = None,
                        roles: bool = True) -> tuple[list[Rank], dict[Rank, str]]: ...
        def _filter_overloaded(self, sel: Selection) -> list[Rank]: ...
        def _overloaded(self, pool: Pool, rank: Rank) -> bool: ...
        def _busy(self, pool: Pool, rank: Rank) -> bool: ...
        def expire(self, pool: Pool, now: float) -> bool: ...
        def _book(self, pool: Pool, rid: str, rank: Rank, prompt: PromptHashes, cached: int,
                  track_prefill: bool, reuse: bool, expected_output_tokens: int | None, now: float,
                  duplicate: Callable[[DuplicateReservation], SelectionError] | None = None, *,
                  decode_blocks: bool = True, predict: bool = True) -> Booking: ...
        def _predict(self, pool: Pool, rank: Rank, prompt: PromptHashes, now: float) -> None: ...
        def finish_booking(self, rid: str, model_name: str | None, tenant_id: str | None, now: float, *,
                           free: bool, cached_tokens: int | None = None) -> Pool: ...
        def dispatch(self, pool: Pool | None, now: float) -> None: ...

    # -- planning ----------------------------------------------------------------------------------

    def _plan(self, req: SelectPdRequest, reserve: bool, now: float,
              conflict: Callable[[DuplicateReservation], SelectionError]) -> PlanResponse:
        s, opts = self._settings, req.pd
        pool = self.gate(req.model_name, req.tenant_id, now)
        longest = s.max_id_length - len(PREFILL_SUFFIX)
        if req.plan_id is not None and len(req.plan_id) > longest:
            self._metrics.limit("id_length")
            raise BadRequest(f"plan_id must be at most {longest} characters")
        for name in ("selection_id", "fairness_id", "policy_class"):
            self._limits.id_length(name, getattr(req, name))
        plan_id = req.plan_id if req.plan_id is not None else str(uuid.UUID(int=self._rng.getrandbits(128), version=4))
        prompt = self._limits.prompt(req, pool)
        candidates, excluded = self._candidates(req, pool, roles=False)
        worker = self._worker
        has_prefill = bool(pool.prefill_only)  # a key without prefill workers serves aggregated
        if opts.mode == "remote" and not has_prefill:
            raise NotReady(f"no prefill workers for {pool.label}")
        local_only = opts.mode == "local" or not has_prefill
        decode: list[Rank] = []
        for r in candidates:
            w = worker(r)
            if w.role == "prefill":
                excluded[r] = "prefill_role"
            elif local_only and not can_prefill_locally(w):
                excluded[r] = "cannot_prefill_locally"
            else:
                decode.append(r)
        if not decode:
            if any(reason == "cannot_prefill_locally" for reason in excluded.values()):
                raise NotReady(f"no decode worker can prefill locally for {pool.label}")
            raise NotReady("no endpoints available to route work")
        found = estimates(pool, prompt.blocks)
        sel = Selection(pool, req, None, prompt, decode, excluded, found)
        scored, lowest = score(req, pool, prompt, self._filter_overloaded(sel), found, s, now)
        temperature = _temperature(req, s)
        chosen = choose(pool, scored, temperature, self._rng)
        prefill_ranks = [] if local_only else self._prefill_ranks(req, pool)
        choose_prefill = partial(self._choose_prefill, req, pool, prompt, found, temperature, now)
        verdict, pairs, prefill, prefill_scored = self._verdict(opts, pool, prompt.isl, chosen, prefill_ranks,
                                                                choose_prefill)
        if verdict.path == "remote" and not pairs:
            # No prefill worker may pair with it (a required kv_transfer_domain, or none within the
            # request's constraints): choose the decode worker again among those that have one.
            viable = [c for c in scored if self._pairs(c.rank, prefill_ranks)]
            if not viable:
                raise NotReady(f"no prefill worker can pair with an eligible decode worker for {pool.label}")
            chosen = choose(pool, viable, temperature, self._rng)
            verdict, pairs, prefill, prefill_scored = self._verdict(opts, pool, prompt.isl, chosen, prefill_ranks,
                                                                    choose_prefill)
            verdict = attrs.evolve(verdict, flags=(*verdict.flags, "decode_rechosen_for_domain"))
        if verdict.path == "local":
            prefill, prefill_scored = None, []
        elif prefill is None:
            prefill, prefill_scored = choose_prefill(chosen, pairs)
        booked = self._book_plan(pool, plan_id, req, prompt, chosen, prefill, now, conflict) if reserve else {}
        try:
            for rid in booked.values():
                self._predict(pool, pool.tracker.bookings[rid].rank, prompt, now)
            self._metrics.selected(pool.key, chosen.cached / prompt.isl if prompt.isl > 0 else None,
                                   chosen.device < max(c.device for c in scored))
            pool.recent.append(Decision.of(now, prompt.isl, chosen, scored, lowest is not None, (
                verdict.path, None if prefill is None else prefill.rank, verdict.reason), request_id=plan_id))
            response = self._response(req, pool, plan_id, verdict, chosen, prefill, booked, prompt.isl)
            if req.explain:
                response = attrs.evolve(response, candidates=explain(scored, lowest is not None),
                                        prefill_candidates=explain(prefill_scored),
                                        excluded=tuple(Excluded(worker_id=r[0], dp_rank=r[1], reason=why)
                                                       for r, why in sorted(sel.excluded.items())))
        except BaseException:
            self._undo(pool, booked.values(), now)  # a plan not answered holds nothing
            raise
        return response

    def _response(self, req: SelectPdRequest, pool: Pool, plan_id: str, verdict: Verdict, decode: Scored,
                  prefill: Scored | None, booked: dict[str, str], isl: int) -> PlanResponse:
        header = None
        if self._settings.explain_header:
            header = (f"path={verdict.path};decider={verdict.decider};decode={decode.rank[0]}:{decode.rank[1]}"
                      + ("" if prefill is None else f";prefill={prefill.rank[0]}:{prefill.rank[1]}")
                      + f";cached={decode.cached};isl={isl}")
        return PlanResponse(
            plan_id=plan_id, selection_id=req.selection_id, model_name=req.model_name, tenant_id=req.tenant_id,
            path=verdict.path, decode=self._leg(decode, booked.get("decode"), None),
            prefill=None if prefill is None else self._leg(prefill, booked.get("prefill"), self._worker(prefill.rank)),
            verdict=verdict, block_size=pool.block_size, decision_header=header)

    def _worker(self, rank: Rank) -> WorkerRequest:
        return self._catalog[rank[0]].request

    def _leg(self, c: Scored, rid: str | None, prefill: WorkerRequest | None) -> dict[str, Any]:
        leg: dict[str, Any] = {"worker_id": c.rank[0], "dp_rank": c.rank[1],
                               "endpoint": self._worker(c.rank).endpoint or "", "reservation_id": rid,
                               "cached_tokens": c.cached}
        if prefill is None:
            leg["effective_overlap_blocks"] = float(c.effective)
        else:
            leg["bootstrap_host"] = prefill.bootstrap_host
            leg["bootstrap_port"] = prefill.bootstrap_port
        return leg

    def _prefill_ranks(self, req: SelectRequest, pool: Pool) -> list[Rank]:
        """The ranks that may prefill for another worker: role `prefill` or `both`, within the
        request's allowed workers and required taints (a pinned worker pins the decode side)."""
        allowed, required = req.allowed_worker_ids, req.routing_constraints.required_taints
        return [r for r in pool.ranks()
                if self._worker(r).role != "decode" and (allowed is None or r[0] in allowed)
                and (not required or pool.taints[r[0]].issuperset(required))]

    def _pairs(self, decode: Rank, prefill_ranks: list[Rank]) -> list[Rank]:
        """The prefill ranks that may serve `decode`: another worker, and the same
        kv_transfer_domain when either side requires it."""
        d = self._worker(decode)
        out = []
        for r in prefill_ranks:
            if r[0] == decode[0]:
                continue
            p = self._worker(r)
            if "required" in (d.kv_transfer_enforcement, p.kv_transfer_enforcement) and (
                    d.kv_transfer_domain is None or d.kv_transfer_domain != p.kv_transfer_domain):
                continue
            out.append(r)
        return out

    def _domain_weight(self, decode: Rank, prefill: Rank) -> float:
        """A cost multiplier below 1 for a prefill worker in the decode worker's domain when
        either prefers it: exp(-tanh(weight)), as preferred taints weigh (weight 1 by default)."""
        d, p = self._worker(decode), self._worker(prefill)
        if d.kv_transfer_domain is None or d.kv_transfer_domain != p.kv_transfer_domain:
            return 1.0
        for w in (p, d):
            if w.kv_transfer_enforcement == "preferred":
                weight = w.kv_transfer_preferred_weight
                return math.exp(-math.tanh(1.0 if weight is None else weight))
        return 1.0

    def _prefill_busy(self, pool: Pool, rank: Rank) -> bool:
        """Over an overload threshold, or (queueing on) over the queue's busy threshold."""
        return self._overloaded(pool, rank) or (self._settings.queue_threshold is not None
                                                and self._busy(pool, rank))

    def _decode_kv_busy(self, opts: PdOptions, decode: Scored) -> bool:
        """The decode worker's KV use with this prompt booked, or its engine's scraped share,
        above `kv_busy_fraction` (unknown when neither is known: not busy)."""
        total = self._worker(decode.rank).total_kv_blocks
        if total and decode.decode_blocks > opts.kv_busy_fraction * total:
            return True
        used = self.engines.kv_usage(decode.rank[0]) if self.engines is not None else None
        return used is not None and used > opts.kv_busy_fraction

    def _choose_prefill(self, req: SelectPdRequest, pool: Pool, prompt: PromptHashes, found: Estimates,
                        temperature: float, now: float, decode: Scored, pairs: list[Rank]) -> tuple[Scored, list[Scored]]:
        """The prefill worker among `pairs` (the busy ones only when all are), and each one's cost:
        the prefill tokens the rank would hold (KV-aware: its cached prefix is not recomputed), in
        blocks, or under router_policy=ttft its predicted wait and prefill; weighed by a preferred
        transfer domain. A prefill leg holds no decode blocks: they are its current ones."""
        usable = [r for r in pairs if not self._prefill_busy(pool, r)] or pairs
        raw, _ = score(req, pool, prompt, usable, found, self._settings, now)
        bs, loads, ttft = pool.block_size, pool.tracker.loads, self._settings.router_policy == "ttft"
        held = [c._replace(decode_blocks=loads[c.rank].decode_blocks()) for c in raw]
        weighted = [c._replace(logit=((queue_secs(pool, c) + c.prefill) if ttft else c.prefill_tokens / bs)
                               * self._domain_weight(decode.rank, c.rank)) for c in held]
        return choose(pool, weighted, temperature, self._rng), weighted

    def _verdict(self, opts: PdOptions, pool: Pool, isl: int, chosen: Scored, prefill_ranks: list[Rank],
                 choose_prefill: Callable[[Scored, list[Rank]], tuple[Scored, list[Scored]]]
                 ) -> tuple[Verdict, list[Rank], Scored | None, list[Scored]]:
        """The decision for the decode worker `chosen`, its possible prefill ranks, and (when
        the decision needed it: router_policy=ttft) the prefill worker chosen."""
        pairs = self._pairs(chosen.rank, prefill_ranks) if prefill_ranks else []
        prefill: Scored | None = None
        prefill_scored: list[Scored] = []
        times: tuple[float, float] | None = None
        if self._settings.router_policy == "ttft" and opts.decider is None and opts.mode == "auto" and pairs:
            prefill, prefill_scored = choose_prefill(chosen, pairs)
            # Where the prefill runs differs: the prefill booked ahead of it, its own, and the KV the
            # decode worker lacks crossing the link. The decode worker's KV pressure is in both.
            transfer = max(0, isl - chosen.cached) / opts.transfer_tokens_per_sec
            pressure = chosen.wait - queue_secs(pool, chosen)
            times = (chosen.wait + chosen.prefill, queue_secs(pool, prefill) + prefill.prefill + transfer + pressure)
        verdict = decide(opts, isl, chosen.cached, can_local=can_prefill_locally(self._worker(chosen.rank)),
                         prefill_available=bool(pairs),
                         prefill_busy=bool(pairs) and all(self._prefill_busy(pool, r) for r in pairs),
                         decode_kv_busy=self._decode_kv_busy(opts, chosen), times=times)
        return verdict, pairs, prefill, prefill_scored

    # -- booking both or neither -------------------------------------------------------------------

    def _book_plan(self, pool: Pool, plan_id: str, req: SelectPdRequest, prompt: PromptHashes,
                   decode: Scored, prefill: Scored | None, now: float,
                   conflict: Callable[[DuplicateReservation], SelectionError]) -> dict[str, str]:
        """Remote: the prompt's prefill on P (no decode blocks), its decode blocks on D (no
        prefill); local: both on D, as `/select_and_reserve` books. Every check runs before the
        first booking; a failure after it frees what was booked, so `/loads` is as before."""
        s, o = self._settings, req.router_config_override
        self.expire(pool, now)
        legs = [("decode", plan_id + DECODE_SUFFIX)]
        if prefill is not None:
            legs.insert(0, ("prefill", plan_id + PREFILL_SUFFIX))
        for _, rid in legs:
            try:
                self._limits.reservations(pool, rid, room=len(legs))
            except DuplicateReservation as exc:
                raise conflict(exc) from None
        track, reuse = tracks_prefill(s, o), assumes_kv_reuse(s, o)
        done: list[Booking] = []
        try:
            if prefill is not None:
                done.append(self._book(pool, legs[0][1], prefill.rank, prompt, prefill.cached, track, reuse, None,
                                       now, conflict, decode_blocks=False, predict=False))
                done.append(self._book(pool, legs[1][1], decode.rank, prompt, decode.cached, False, reuse,
                                       req.expected_output_tokens, now, conflict, predict=False))
            else:
                done.append(self._book(pool, legs[0][1], decode.rank, prompt, decode.cached, track, reuse,
                                       req.expected_output_tokens, now, conflict, predict=False))
        except BaseException:
            self._undo(pool, (rid for _, rid in legs), now)  # by id: one booked before its `_book` failed too
            raise
        for booking in done:
            booking.plan = True
        return dict(legs)

    def _undo(self, pool: Pool, rids: Iterable[str], now: float) -> None:
        """Free the legs booked by a call that fails (compensation): its loads are as before it."""
        for rid in rids:
            booking = pool.tracker.bookings.get(rid)
            if booking is None:
                continue
            pool.free(rid, now)
            if self.journal is not None:
                self.journal.freed(booking)
            self._metrics.booking(pool.key, "freed")
            self._metrics.plan_event(pool.key, "compensated")

    def free_other_leg(self, rid: str, pool: Pool, now: float) -> None:
        """One leg of a plan was undone (the shared ledger refused it): its other leg goes too,
        through the journal, so that no replica keeps half a plan."""
        for mine, other in ((PREFILL_SUFFIX, DECODE_SUFFIX), (DECODE_SUFFIX, PREFILL_SUFFIX)):
            if rid.endswith(mine):
                sibling = rid[: -len(mine)] + other
                booking = pool.tracker.bookings.get(sibling)
                if booking is not None and booking.plan:
                    self.finish_booking(sibling, *pool.key, now, free=True)
                    self._metrics.plan_event(pool.key, "compensated")
                return

    # -- handoff and end ---------------------------------------------------------------------------

    def _holding(self, rid: str, model_name: str | None, tenant_id: str | None) -> Pool | None:
        try:
            return holding(self._pools, rid, model_name, tenant_id)
        except NotFound:
            return None

    def release_plan(self, plan_id: str, model_name: str | None, tenant_id: str | None, now: float, *,
                     end: bool) -> list[str]:
        """The handoff (the first decode response came): the prefill leg ends, and a local plan's
        prefill on the decode worker is complete; or with `end` (the request ended or was
        cancelled) both legs end. Idempotent: what this call ended. Queued selections may run."""
        released, pools = self._end_plan(plan_id, model_name, tenant_id, now) if end else \
            self._handoff(plan_id, model_name, tenant_id, now)
        for pool in pools:
            self.dispatch(pool, now)
        return released

    def _handoff(self, plan_id: str, model_name: str | None, tenant_id: str | None, now: float
                 ) -> tuple[list[str], list[Pool]]:
        released: list[str] = []
        pools: list[Pool] = []
        rid = plan_id + PREFILL_SUFFIX
        pool = self._holding(rid, model_name, tenant_id)
        if pool is not None:
            if not pool.tracker.bookings[rid].prefill_done:  # it is over: router_policy=ttft learns its speed
                self.finish_booking(rid, *pool.key, now, free=False)
            self.finish_booking(rid, *pool.key, now, free=True)
            self._metrics.plan_event(pool.key, "handoff")
            released.append("prefill")
            pools.append(pool)
        rid = plan_id + DECODE_SUFFIX
        pool = self._holding(rid, model_name, tenant_id)
        if pool is not None:
            booking = pool.tracker.bookings[rid]
            if not booking.prefill_done:
                pending = booking.prefill_tokens > 0
                self.finish_booking(rid, *pool.key, now, free=False)
                if pending:
                    released.append("decode_prefill")
                    pools.append(pool)
        return released, pools

    def _end_plan(self, plan_id: str, model_name: str | None, tenant_id: str | None, now: float
                  ) -> tuple[list[str], list[Pool]]:
        released: list[str] = []
        pools: list[Pool] = []
        for role, suffix in (("prefill", PREFILL_SUFFIX), ("decode", DECODE_SUFFIX)):
            pool = self._holding(plan_id + suffix, model_name, tenant_id)
            if pool is not None:
                self.finish_booking(plan_id + suffix, *pool.key, now, free=True)
                released.append(role)
                pools.append(pool)
        if pools:
            self._metrics.plan_event(pools[0].key, "ended")
        return released, pools
