"""A simulated engine (docs/ROUTING.md): its iteration-level performance model, its KV cache of
reference-counted blocks with the unheld ones kept in LRU order, first-come-first-served
admission under that cache, chunked prefill, and the KV events a vLLM engine publishes. In a
disaggregated fleet (docs/PD.md) an engine also prefills for another (it holds the prompt's blocks
until they are sent) and decodes what another prefilled (it takes the blocks, then the KV arrives)."""

from __future__ import annotations

import heapq
import math
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from ..core.base.hashing import sequence_hashes
from ..core.cache.events import KvEvent

if TYPE_CHECKING:
    from .trace import TraceRequest

__all__ = ["DECODE_SENT", "PREFILL_FOR_OTHER", "WHOLE", "Engine", "EngineModel", "FleetConfig", "SimRequest",
           "block_hash"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def block_hash(hash_id: int) -> int:
    """The router-side hash of a trace block: any fixed spread of its id (the trace's ids already
    name a block and its prefix)."""
    return ((hash_id + 1) * _GOLDEN) & _MASK >> 1  # the API takes block hashes as i64


@attrs.frozen(kw_only=True)
class EngineModel:
    """The time of one engine iteration. An iteration prefills up to `max_batched_tokens` new
    tokens (first come, first served, a long prompt in chunks) and decodes one token for every
    request past its prefill. It takes, in milliseconds:

        prefill_fixed_ms                                   (when it prefills)
      + new_tokens / prefill_tokens_per_sec * 1000
      + attention_ms * new_tokens * (context + new_tokens / 2) / 1e6   (attention over the context)
      + decode_ms + (decode_full_ms - decode_ms) * kv_used              (when any request decodes)
      + request_fixed_ms * prompts whose prefill ends in it               (sampling, detokenizing,
                                                                          the HTTP hops: 0 here)

    The defaults are fitted to Dynamo's mocker polynomials (prefill 1k tokens ≈ 32 ms, 8k ≈ 169 ms;
    a decode step 5.7 ms on an empty cache, 34 ms on a full one). Where they depart: the attention
    term here also counts the context before a chunk (earlier chunks, a cached prefix), which the
    mocker leaves out, so a 32k-token prompt prefills in ~1.0 s here and ~0.68 s there; the mocker's
    quadratic is over the iteration's total new tokens, ours per chunk; and its decode step is
    quadratic in KV use (26 ms at half), ours linear (20 ms). `mocker=True` uses the mocker's
    formulas exactly (its scheduler's watermark and preemption are not modelled):

        4.209989e-07 * T**2 + 1.518344e-02 * T + 16.50142    (T: the iteration's new tokens)
      + max(1, -25.74 * kv_used**2 + 54.01 * kv_used + 5.74)  (when any request decodes)"""

    prefill_fixed_ms: float = 16.5
    prefill_tokens_per_sec: float = 65_861.0
    attention_ms: float = 0.84  # per million token-pairs
    decode_ms: float = 5.74
    decode_full_ms: float = 34.0
    max_batched_tokens: int = 8192
    max_running: int = 256
    mocker: bool = False
    # What a real engine spends on every request whatever its prompt (vLLM on the CPU: 10-20 ms):
    # a cached prompt does not save it (docs/ROUTING.md, "A fixed time per request").
    request_fixed_ms: float = 0.0
    # An engine that stalls now and then (another process on its core, a pause of its runtime):
    # each engine's iterations stop for `stall_ms` once every `stall_every_secs` of time, at a
    # phase of its own (0: never). What a real engine on shared cores does and the router cannot
    # be told (docs/ROUTING.md, "An engine behind its prediction").
    stall_ms: float = 0.0
    stall_every_secs: float = 0.0

    @property
    def tokens_per_sec(self) -> float:
        """Its prefill speed as a worker record states it: new tokens a second, beside the fixed
        and attention costs (the mocker's linear term)."""
        return 1000.0 / 1.518344e-02 if self.mocker else self.prefill_tokens_per_sec

    def iteration_ms(self, prefill: list[tuple[int, int]], decoding: int, kv_used: float, ends: int = 0) -> float:
        """`prefill`: (new tokens, context before them) of each chunk this iteration; `ends`: how
        many of them end their prompt's prefill."""
        fixed = self.request_fixed_ms * ends
        if self.mocker:
            new = sum(tokens for tokens, _ in prefill)
            ms = 4.209989e-07 * new * new + 1.518344e-02 * new + 16.50142 if new else 0.0
            if decoding:
                used = min(1.0, kv_used)
                ms += max(1.0, -25.74 * used * used + 54.01 * used + 5.74)
            return ms + fixed
        ms = fixed
        if prefill:
            ms += self.prefill_fixed_ms
            for tokens, context in prefill:
                ms += tokens * 1000.0 / self.prefill_tokens_per_sec
                ms += self.attention_ms * tokens * (context + tokens / 2) / 1e6
        if decoding:
            ms += self.decode_ms + (self.decode_full_ms - self.decode_ms) * min(1.0, kv_used)
        return ms

    def request_rate(self, kv_blocks: int, isl: float, osl: float, blocks: float) -> float:
        """Requests a second one engine sustains with prompts of `isl` tokens in `blocks` blocks
        and `osl` output tokens, without any cache reuse (what `--load` is relative to): the
        highest rate within both its prefill compute (full budgets of new tokens, each iteration
        also paying a decode step at 80% KV use) and its KV blocks, which each request holds from
        admission to its last token. Decode iterations are slower while prompts are prefilled
        beside them, so the KV bound falls as the rate rises: found by bisection."""
        prefill_iteration = self.iteration_ms([(self.max_batched_tokens, 0)], 1, 0.8) / 1000.0
        decode_iteration = self.iteration_ms([], 1, 0.8) / 1000.0
        per_token = prefill_iteration / self.max_batched_tokens
        per_request = self.request_fixed_ms / 1000.0
        prefill_bound = 1.0 / (max(isl, 1.0) * per_token + per_request)
        concurrent = kv_blocks / max(blocks, 1.0)

        def kv_bound(rate: float) -> float:
            if decode_iteration == 0:  # decoding costs nothing: a request holds its blocks for its prefill
                return concurrent / (isl * per_token + per_request)
            prefilling = min(1.0, rate * (isl * per_token + per_request))  # the share of time in prefill iterations
            iterations = prefilling / prefill_iteration + (1.0 - prefilling) / decode_iteration
            return concurrent / (osl / iterations + isl * per_token + per_request)

        low, high = 0.0, prefill_bound
        for _ in range(50):
            middle = (low + high) / 2
            low, high = (middle, high) if middle <= kv_bound(middle) else (low, middle)
        return low


@attrs.frozen(kw_only=True)
class FleetConfig:
    engines: int = 8
    kv_blocks: int = 1000  # per engine, in trace blocks
    trace_block_size: int = 512
    load: float = 0.8  # offered prefill work without reuse, as a fraction of the fleet's capacity
    speedup: float | None = None  # instead of `load`: the trace's own timestamps, this many times faster
    event_delay_secs: float = 0.0  # KV events reach the router this much after the engine acts
    seed: int = 0
    model: EngineModel = EngineModel()
    samples: int = 200  # points of the per-engine time series
    # The KV transfer of a disaggregated fleet (docs/PD.md): bytes of KV cache a prompt token
    # takes, and each prefill engine's link, which sends one prompt at a time. Defaults: Llama 3.1
    # 8B in bf16 (32 layers x 8 KV heads x 128 dims x K and V x 2 bytes), a 100 Gb/s NIC.
    kv_bytes_per_token: int = 131_072
    link_bytes_per_sec: float = 12.5e9
    # Each engine's speed, a multiple of the model's (cycled over the engines; the router is not
    # told): a mixed fleet, as with two GPU generations.
    engine_speeds: tuple[float, ...] = ()
    prefill_complete: bool = True  # False: clients never tell the router their prefill is done

    def speed(self, engine: int) -> float:
        return self.engine_speeds[engine % len(self.engine_speeds)] if self.engine_speeds else 1.0

    def transfer_secs(self, tokens: int) -> float:
        """The time the link takes to send `tokens` prompt tokens of KV cache."""
        return tokens * self.kv_bytes_per_token / self.link_bytes_per_sec

    @property
    def transfer_tokens_per_sec(self) -> float:
        """The link as the core's `pd.transfer_tokens_per_sec` counts it."""
        return self.link_bytes_per_sec / self.kv_bytes_per_token


# SimRequest.stage: prefilled and decoded on one engine; prefilled on a prefill engine for
# another; decoded on the engine the KV is sent to.
WHOLE, PREFILL_FOR_OTHER, DECODE_SENT = range(3)


class SimRequest:
    __slots__ = ("rid", "arrival", "isl", "osl", "seqs", "locals", "full", "engine", "cached", "left",
                 "context", "started", "first_token", "private", "blocks_held", "tenant", "flow",
                 "stage", "decode_engine", "sent_blocks", "sent_private", "dispatched")

    def __init__(self, rid: str, arrival: float, trace: TraceRequest, block_size: int,
                 local_hashes: list[int]) -> None:
        self.rid = rid
        self.arrival = arrival
        self.isl = trace.input_length
        self.osl = max(1, trace.output_length)
        # The router-side hash of each of its blocks, and their sequence hashes, packed: a trace
        # line of a million hash ids would take ~90 MB as lists of ints, 16 MB as arrays.
        self.locals = array("Q", local_hashes)
        self.seqs = array("Q", sequence_hashes(local_hashes))
        self.full = trace.input_length // block_size  # cacheable blocks: the full ones
        self.engine = -1
        self.dispatched = -1.0  # sent to its engine (after any wait in the router's queue)
        self.cached = 0  # prompt tokens the engine had cached
        self.left = 0  # prompt tokens still to prefill
        self.context = 0  # tokens before the next chunk
        self.started = -1.0  # admitted by its engine
        self.first_token = -1.0
        self.stage = WHOLE
        self.decode_engine = -1  # PREFILL_FOR_OTHER: where its KV goes
        # On the prefill engine, once prefilled: the blocks it holds there until they are sent.
        self.sent_blocks: list[int] = []
        self.sent_private = 0
        self.private = 0  # blocks allocated for it and not shared (in computation, or partial)
        self.blocks_held: list[int] = []  # shared cached blocks it holds a reference to
        self.tenant = trace.tenant or ""
        # What the router's flow control reads (docs/FLOW_CONTROL.md), the members the trace gave.
        self.flow: dict[str, Any] = {k: v for k, v in (("fairness_id", trace.tenant), ("priority", trace.priority),
                                       ("deadline_ms", trace.deadline_ms), ("policy_class", trace.policy_class))
                                     if v is not None}

    def fork(self) -> SimRequest:
        """A copy whose engine-side progress moves on its own (the oracle runs engines ahead)."""
        twin = SimRequest.__new__(SimRequest)
        for name in SimRequest.__slots__:
            setattr(twin, name, getattr(self, name))
        twin.blocks_held = list(self.blocks_held)
        return twin


def _discard(engine: int, event: KvEvent) -> None:
    """A fork's events go nowhere."""


EVENT_BLOCKS = 4096  # blocks per stored event at most: a 1M-block prompt's event was ~120 MB


class Engine:
    """One engine: FCFS admission under its KV capacity, chunked prefill, one decode token per
    iteration for each running request. Cached blocks are shared and reference-counted; blocks no
    request holds stay cached, least recently used evicted first. It publishes what a vLLM engine
    does: a stored event when blocks are computed, a removed event when one is evicted."""

    def __init__(self, index: int, config: FleetConfig, publish: Callable[[int, KvEvent], None]) -> None:
        self.index = index
        self.speed = config.speed(index)
        self.capacity = config.kv_blocks
        self.block_size = config.trace_block_size
        self.model = config.model
        self.publish = publish
        self.active: dict[int, int] = {}  # block (its sequence hash) -> requests holding it
        self.inactive: OrderedDict[int, None] = OrderedDict()  # cached, held by none: LRU first
        self.private = 0
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.decoding: list[tuple[int, int, SimRequest]] = []
        self.iterations = 0  # iterations finished
        self.order = 0
        self.busy_until: float | None = None  # the end of the iteration under way
        self.last_prefill: list[tuple[SimRequest, int]] = []
        self.cached_tokens = 0
        self.prompt_tokens = 0
        # Disaggregated (docs/PD.md): prompts prefilled here for another engine, awaiting their
        # send (drained by the fleet); prompts admitted here whose KV is on its way (`loading`,
        # and in `to_send` for the fleet to start the transfer, with the tokens to send); prompts
        # whose KV arrived (`arrived`), joining the next iteration (`joining`: their first token
        # comes at its end).
        self.prefilled: list[SimRequest] = []
        self.loading: set[SimRequest] = set()
        self.to_send: list[tuple[SimRequest, int]] = []
        self.arrived: list[SimRequest] = []
        self.joining: list[SimRequest] = []

    def fork(self) -> Engine:
        """A copy to run ahead on, publishing nothing: its cache and the requests not yet decoding
        are copied; decoding ones are shared, as from here on they are only read (`_end` leaves
        a request as it was)."""
        twin = Engine.__new__(Engine)
        twin.index, twin.speed, twin.capacity = self.index, self.speed, self.capacity
        twin.block_size, twin.model, twin.publish = self.block_size, self.model, _discard
        twin.active = dict(self.active)
        twin.inactive = self.inactive.copy()
        twin.private = self.private
        twin.waiting = deque(req.fork() for req in self.waiting)
        forks = {id(req): req.fork() for req in self.prefilling}
        twin.prefilling = [forks[id(req)] for req in self.prefilling]
        twin.last_prefill = [(forks[id(req)], take) for req, take in self.last_prefill]
        twin.decoding = list(self.decoding)  # a copy of a heap is a heap
        twin.iterations, twin.order, twin.busy_until = self.iterations, self.order, self.busy_until
        twin.cached_tokens, twin.prompt_tokens = self.cached_tokens, self.prompt_tokens
        # The oracle runs aggregated fleets only: no prompt is ever on its way between engines.
        assert not (self.prefilled or self.loading or self.to_send or self.arrived or self.joining)
        twin.prefilled, twin.loading, twin.to_send, twin.arrived, twin.joining = [], set(), [], [], []
        return twin

    def in_flight(self) -> int:
        return (len(self.waiting) + len(self.prefilling) + len(self.decoding) + len(self.loading)
                + len(self.arrived))

    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding) + len(self.loading) + len(self.arrived)

    def used(self) -> int:
        return len(self.active) + len(self.inactive) + self.private

    def _admit(self, req: SimRequest) -> bool:
        held = []
        for seq in req.seqs[:req.full]:
            if seq in self.active:
                self.active[seq] += 1
            elif seq in self.inactive:
                del self.inactive[seq]
                self.active[seq] = 1
            else:
                break
            held.append(seq)
        need = len(req.seqs) - len(held)
        evicted = []
        while self.used() + need > self.capacity and self.inactive:
            evicted.append(self.inactive.popitem(last=False)[0])
        if evicted:  # one event for the blocks one admission evicts, as an engine batches them
            self.publish(self.index, KvEvent(worker_id=self.index, dp_rank=0, tier="device", event_id=None,
                                             kind="removed", block_hashes=tuple(evicted)))
        if self.used() + need > self.capacity:
            for seq in reversed(held):  # not now: give back what it took
                self._release(seq)
            return False
        self.private += need
        req.private = need
        req.blocks_held = held
        if req.stage == DECODE_SENT:  # computed elsewhere: what this engine lacks is sent to it
            self.loading.add(req)
            self.to_send.append((req, req.isl - min(len(held) * self.block_size, req.isl)))
            return True
        req.cached = min(len(held) * self.block_size, req.isl - 1)  # the last token is always computed
        req.left = req.isl - req.cached
        req.context = req.cached
        self.cached_tokens += req.cached
        self.prompt_tokens += req.isl
        return True

    def _release(self, seq: int) -> None:
        count = self.active[seq] - 1
        if count:
            self.active[seq] = count
        else:
            del self.active[seq]
            self.inactive[seq] = None

    def start(self, now: float) -> float | None:
        """Begin an iteration if there is work; the time it ends."""
        for req in self.arrived:  # its KV is here: it decodes from this iteration on, osl tokens
            self.order += 1
            heapq.heappush(self.decoding, (self.iterations + req.osl, self.order, req))
        self.joining, self.arrived = self.arrived, []
        while self.waiting and self.running() < self.model.max_running:
            if not self._admit(self.waiting[0]):
                break
            req = self.waiting.popleft()
            if req.stage != DECODE_SENT:  # a sent prompt started on its prefill engine
                req.started = now
                self.prefilling.append(req)
        budget = self.model.max_batched_tokens
        chunks: list[tuple[SimRequest, int]] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            take = min(budget, req.left)
            chunks.append((req, take))
            budget -= take
        if not chunks and not self.decoding:
            self.busy_until = None
            return None
        ms = self.model.iteration_ms([(take, req.context) for req, take in chunks], len(self.decoding),
                                     self.used() / self.capacity,
                                     sum(1 for req, take in chunks if take == req.left)) / self.speed
        self.last_prefill = chunks
        self.busy_until = now + ms / 1000.0
        every = self.model.stall_every_secs
        if self.model.stall_ms > 0.0 and every > 0.0:
            phase = (self.index * 0.6180339887498949) % 1.0 * every  # engines stall at different times
            if math.floor((self.busy_until - phase) / every) > math.floor((now - phase) / every):
                self.busy_until += self.model.stall_ms / 1000.0  # a stall point falls in this iteration
        return self.busy_until

    def finish(self, now: float) -> tuple[list[SimRequest], list[SimRequest]]:
        """End the iteration: (requests whose first token came, requests that finished)."""
        first, done = [], []
        self.iterations += 1
        decoding = self.decoding  # a heap by the iteration of each one's last token
        for req in self.joining:
            req.first_token = now
            first.append(req)
        self.joining = []
        while decoding and decoding[0][0] <= self.iterations:
            req = heapq.heappop(decoding)[2]
            done.append(req)
            self._end(req)
        for req, take in self.last_prefill:
            req.left -= take
            req.context += take
            if req.left <= 0:
                self.prefilling.remove(req)
                self._computed(req)
                if req.stage == PREFILL_FOR_OTHER:  # held here until sent; its tokens come from elsewhere
                    req.sent_blocks, req.sent_private = req.blocks_held, req.private
                    req.blocks_held, req.private = [], 0
                    self.prefilled.append(req)
                    continue
                req.first_token = now
                first.append(req)
                if req.osl <= 1:
                    done.append(req)
                    self._end(req)
                else:  # one more token each following iteration
                    self.order += 1
                    heapq.heappush(self.decoding, (self.iterations + req.osl - 1, self.order, req))
        self.last_prefill = []
        return first, done

    def sent(self, req: SimRequest) -> None:
        """A prompt it prefilled for another engine has been sent: its blocks are let go (they
        stay cached)."""
        for seq in reversed(req.sent_blocks):
            self._release(seq)
        self.private -= req.sent_private
        req.sent_blocks, req.sent_private = [], 0

    def received(self, req: SimRequest) -> None:
        """The KV of a prompt admitted here arrived: its blocks are cached and published, as
        computed ones are, and it decodes from the next iteration."""
        self.loading.remove(req)
        self._computed(req)
        self.arrived.append(req)

    def _computed(self, req: SimRequest) -> None:
        """Its prompt's new full blocks are cached now: shared, and published (runs of new ones)."""
        start = len(req.blocks_held)
        run: list[tuple[int, int]] = []
        run_parent = req.seqs[start - 1] if start else None
        for i in range(start, req.full):
            seq = req.seqs[i]
            if seq in self.active or seq in self.inactive:  # another request computed it meanwhile
                if seq in self.inactive:
                    del self.inactive[seq]
                    self.active[seq] = 0
                self.active[seq] += 1
                self._flush(run, run_parent)
                run, run_parent = [], seq
            else:
                self.active[seq] = 1
                run.append((seq, req.locals[i]))
                if len(run) == EVENT_BLOCKS:  # a long prompt is published in chained events
                    self._flush(run, run_parent)
                    run, run_parent = [], seq
            req.blocks_held.append(seq)
            self.private -= 1
            req.private -= 1
        self._flush(run, run_parent)

    def _flush(self, run: list[tuple[int, int]], parent: int | None) -> None:
        if run:
            self.publish(self.index, KvEvent(worker_id=self.index, dp_rank=0, tier="device", event_id=None,
                                             kind="stored", parent_hash=parent, blocks=tuple(run)))

    def _end(self, req: SimRequest) -> None:
        # The tail first, as vLLM frees them: a block is never evicted before the ones after it,
        # which would leave them cached without their prefix.
        # The request is left as it is: a fork (the oracle's) ends requests it shares with its engine.
        for seq in reversed(req.blocks_held):
            self._release(seq)
        self.private -= req.private
