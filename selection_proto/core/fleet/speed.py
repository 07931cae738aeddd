"""Each worker's prefill speed as `router_policy=ttft` reads it (docs/ROUTING.md): declared in its
record (`prefill_tokens_per_sec`), or else learned from the calls the service sees.

A learned speed is the prefill tokens a worker's ranks completed (at `prefill_complete`) over the
rank-seconds they had prefill booked, so time a request waits in its engine's queue does not read
as slowness; frees teach nothing (their time includes the decode). A worker is then read against
the mean of the workers learned so far, to the power 0.5: halfway, in log terms, between "all
equal" and what was measured, which damps the noise between engines that are in fact equal.
A declared speed always wins; only the ratios between workers matter to the cost.

A worker also spends a fixed time on every request, whatever its prompt (scheduling, sampling,
the HTTP and gateway hops: 10-20 ms on vLLM on the CPU), which a cached prompt does not save. It
is learned as `overhead`, in prefill tokens (so that only ratios enter, as for the speeds): each
prefill end on a rank is a sample of (its prefill tokens, the rank-seconds with some prefill
pending since the previous end there), and a least-squares line through the pool's samples,
older ones weighing less, gives seconds per request over seconds per token (docs/ROUTING.md, "A
fixed time per request"). Several ends on a rank at one moment are one sample, of the largest
prefill among them (the others had nothing new to store).

What one moment's prefill ends teach is read at the first change after that moment, in an order
of its own: the samples by rank, and the speeds worked out again from what was written down
until then (once every so many completed tokens). A replica hears a moment's ends in another
order than one service (its own first, then the ledger's) and so learns exactly the same
(docs/ROUTING.md, "Replicas behind a balancer"). Each booking then adds that fixed time to its rank's `backlog`, which
drains as time passes: a burst of requests on one engine costs their fixed times however much
of their prompts it holds (their prefill ends are read at once when there is nothing new to
store, so pending bookings alone would not show it).

`left` reads how far a rank's running prefill has got at its worker's learned rate (tokens a
rank-second, absolute) since the rank's last prefill ended, in plain tokens and in work (each
token weighed by the context it is computed over), the larger rest counting: what
`router_policy=ttft` counts as the rank's queue (docs/ROUTING.md, "What is left of a running
prefill")."""

from __future__ import annotations

from typing import Final

from ..cache.index import Rank

__all__ = ["DEFAULT_PREFILL_TOKENS_PER_SEC", "Fit", "Speeds", "worker_speed"]

# A worker's prefill speed when its record does not give one (only the ratios between workers
# matter then: every term of the cost is divided by it).
DEFAULT_PREFILL_TOKENS_PER_SEC: Final = 10_000.0
# Prefill tokens a worker must have completed before its learned speed counts.
LEARN_AFTER_TOKENS: Final = 20_000
# How far a learned speed moves the cost: (fleet mean / worker's speed) ** DAMPING.
DAMPING: Final = 0.5
# A learned worker is read at most this many times slower (or faster) than the fleet's mean.
MOST_APART: Final = 4.0
# Prefill ends a pool must have seen before its per-request overhead is read.
OVERHEAD_AFTER: Final = 64
# Each sample's weight is multiplied by this at every later one: the last ~1,000 prefill ends count.
OVERHEAD_MEMORY: Final = 1.0 - 1.0 / 1024
# The overhead is read as at most this many prefill tokens a request.
MOST_OVERHEAD_TOKENS: Final = 4096.0


def worker_speed(prefill_tokens_per_sec: float | None, total_kv_blocks: int | None) -> tuple[float, int]:
    """Seconds per prefilled token, and KV blocks (0: unknown), of a worker record."""
    return 1.0 / (prefill_tokens_per_sec or DEFAULT_PREFILL_TOKENS_PER_SEC), total_kv_blocks or 0


class Fit:
    """A least-squares line `secs = fixed + per_token * tokens` through weighted samples, each older
    one weighing `OVERHEAD_MEMORY` times less: its running sums, O(1) a sample."""

    __slots__ = ("samples", "n", "t", "s", "tt", "ts", "ss")

    def __init__(self) -> None:
        self.samples = 0
        self.n = self.t = self.s = self.tt = self.ts = self.ss = 0.0

    def add(self, tokens: float, secs: float) -> None:
        m = OVERHEAD_MEMORY
        self.samples += 1
        self.n = self.n * m + 1.0
        self.t = self.t * m + tokens
        self.s = self.s * m + secs
        self.tt = self.tt * m + tokens * tokens
        self.ts = self.ts * m + tokens * secs
        self.ss = self.ss * m + secs * secs

    def line(self) -> tuple[float, float] | None:
        """(fixed, per_token) seconds, the fixed time within 0 and `MOST_OVERHEAD_TOKENS` tokens'
        time, and 0 unless it stands out of the noise (twice its standard error: long prompts
        make it an extrapolation); None while there is nothing to read: too few samples, prompts
        too alike to tell the two apart, or times that do not grow with the tokens."""
        if self.samples < OVERHEAD_AFTER:
            return None
        mean_t, mean_s = self.t / self.n, self.s / self.n
        var = self.tt / self.n - mean_t * mean_t
        cov = self.ts / self.n - mean_t * mean_s
        if var <= (0.05 * mean_t) ** 2 or cov <= 0.0:
            return None
        per_token = cov / var
        fixed = mean_s - per_token * mean_t
        residual = max(0.0, self.ss / self.n - mean_s * mean_s - cov * per_token)
        if fixed * fixed <= 4.0 * residual / self.n * (1.0 + mean_t * mean_t / var):
            fixed = 0.0
        return min(MOST_OVERHEAD_TOKENS * per_token, max(0.0, fixed)), per_token


class Speeds:
    """One pool's workers: `of` is what the cost reads (worker -> `worker_speed`, learned ones
    scaled), and `overhead` (prefill tokens each request costs beyond its own, learned: 0 until
    then); `observe`, `stopped` and `completed` are fed by the bookings when `learn` is on."""

    __slots__ = ("of", "learn", "shadow", "overhead", "_declared", "_busy", "_done", "_since", "_unread", "_moment", "_ends",
                 "_started", "_pending", "_fit", "_fixed", "_per_token", "_backlog", "_done_pairs", "_done_ends")

    def __init__(self, learn: bool, shadow: Speeds | None = None) -> None:
        self.of: dict[int, tuple[float, int]] = {}
        self.learn = learn
        # A shadow policy's own speeds, fed the same calls: what the acting cost reads stays as
        # it would be without a shadow (docs/STATUS.md, "The shadow policy").
        self.shadow = shadow
        self._declared: set[int] = set()
        self._busy: dict[int, float] = {}  # worker -> rank-seconds with prefill booked
        self._done: dict[int, int] = {}  # worker -> prefill tokens completed
        self._done_pairs: dict[int, float] = {}  # worker -> their attention pairs (`Booking.pairs`)
        self._done_ends: dict[int, int] = {}  # worker -> its prefills completed (of some tokens)
        self._since: dict[Rank, float] = {}  # rank -> when its booked prefill last changed
        self._unread = 0  # tokens completed since the speeds were last worked out
        self._moment = 0.0  # when the last prefill ended
        self._ends: dict[Rank, tuple[int, float]] = {}  # rank -> that moment's sample (tokens, secs)
        # Rank -> when its running prefill began: its booked prefill last went from none to some,
        # or a prefill on it last ended (`left`).
        self._started: dict[Rank, float] = {}
        self.overhead = 0.0
        self._pending: dict[Rank, float] = {}  # rank -> seconds with prefill pending since its last end
        self._fit = Fit()
        self._fixed = 0.0  # learned seconds a request costs whatever it holds (0: not learned)
        self._per_token = 0.0  # learned seconds a prefill token costs
        self._backlog: dict[Rank, tuple[float, float]] = {}  # rank -> (fixed seconds ahead, as of when)

    def set(self, worker_id: int, prefill_tokens_per_sec: float | None, total_kv_blocks: int | None) -> None:
        """The worker joined or its record changed."""
        if self.shadow is not None:
            self.shadow.set(worker_id, prefill_tokens_per_sec, total_kv_blocks)
        per_token, kv_blocks = worker_speed(prefill_tokens_per_sec, total_kv_blocks)
        if prefill_tokens_per_sec:
            self._declared.add(worker_id)
        else:
            self._declared.discard(worker_id)
            per_token *= self._slowness().get(worker_id, 1.0)
        self.of[worker_id] = (per_token, kv_blocks)

    def forget(self, worker_id: int) -> None:
        """The worker left: what was learned of it goes too (it may come back another engine)."""
        if self.shadow is not None:
            self.shadow.forget(worker_id)
        self.of.pop(worker_id, None)
        self._declared.discard(worker_id)
        self._busy.pop(worker_id, None)
        self._done.pop(worker_id, None)
        self._done_pairs.pop(worker_id, None)
        self._done_ends.pop(worker_id, None)
        for rank in [r for r in self._since if r[0] == worker_id]:
            del self._since[rank]
            self._started.pop(rank, None)
            self._pending.pop(rank, None)
            self._backlog.pop(rank, None)

    def observe(self, rank: Rank, booked_prefill: int, now: float, pending: int = 0) -> None:
        """Called before the rank's booked prefill changes, with what it was until `now`: its
        tokens, and `pending`, its bookings whose prefill had not ended (a cached one has none)."""
        if self.shadow is not None:
            self.shadow.observe(rank, booked_prefill, now, pending)
        if not self.learn:
            return
        self.settle(now)
        since = self._since.get(rank)
        if since is not None and now > since:
            if booked_prefill > 0:
                self._busy[rank[0]] = self._busy.get(rank[0], 0.0) + (now - since)
            if pending > 0:
                self._pending[rank] = self._pending.get(rank, 0.0) + (now - since)
        self._since[rank] = now
        if booked_prefill <= 0:
            self._started[rank] = now

    def booked(self, rank: Rank, now: float) -> None:
        """A request was booked on the rank: its fixed time joins the rank's backlog."""
        if self.shadow is not None:
            self.shadow.booked(rank, now)
        if self._fixed > 0.0:
            ahead = self._backlog.get(rank)
            left = ahead[0] - (now - ahead[1]) if ahead is not None else 0.0
            self._backlog[rank] = ((left if left > 0.0 else 0.0) + self._fixed, now)

    def backlog(self, rank: Rank, now: float, booked_prefill: int = 0) -> float:
        """The fixed time of the rank's recent bookings not yet drained by `now`, in prefill tokens.
        `booked_prefill`: the rank's booked prefill tokens whose end has not been read. Once the
        fixed times and those tokens' time (at `MOST_APART` times the learned time a token) have
        all passed since the last booking and the prefill has still not ended, its engine is
        slower now than learned (a stall, another process on its core): the time past that counts
        as still ahead, up to the backlog as last written, where the rank would read as idle
        (docs/ROUTING.md, "An engine behind its prediction")."""
        ahead = self._backlog.get(rank)
        if ahead is None:
            return 0.0
        left = ahead[0] - (now - ahead[1])
        if left > 0.0:
            return left / self._per_token
        # Its prefill's time is read as on a worker as slow as a learned speed may be (`MOST_APART`
        # times the pool's): a slower worker is not yet behind.
        behind = -left - booked_prefill * self._per_token * MOST_APART if booked_prefill > 0 else 0.0
        return min(behind, ahead[0]) / self._per_token if behind > 0.0 else 0.0

    def stopped(self, rank: Rank, prefill_tokens: int) -> None:
        """A booking's prefill tokens stopped counting on the rank (completed, or freed before),
        at the `now` of the `observe` just before: the engine's next prefill begins there."""
        if prefill_tokens > 0 and rank in self._started:
            self._started[rank] = self._since[rank]

    def ended(self, rank: Rank, booked_prefill: int, pending: int, prefill_tokens: int, now: float,
              completed: bool, pairs: float = 0.0) -> None:
        """A booking's prefill of `prefill_tokens` stopped counting on the rank at `now`, which had
        `booked_prefill` tokens and `pending` bookings in prefill until then: `completed` (its
        prefill ran: what was learned moves), or freed before."""
        self.observe(rank, booked_prefill, now, pending)
        self.stopped(rank, prefill_tokens)
        if completed:
            self.completed(rank, prefill_tokens, pairs)

    def left(self, rank: Rank, booked_prefill: int, now: float, booked_pairs: float = 0.0,
             per_context: float = 0.0) -> float:
        """The rank's booked prefill still to run, in tokens: what was booked, less what its
        engine has done at the worker's learned rate since its last prefill ended (or since it
        had none), so that an error in the rate never outlives the next prefill's end (all of it
        until a rate is learned); `booked_pairs`, `per_context`: that progress also counted in
        work, each token weighed by its context, and the larger reading kept."""
        started = self._started.get(rank)
        if started is None or booked_prefill <= 0:
            return booked_prefill
        # The rate as of now, its open interval too (not as of the last time the busy time was
        # written down): replicas that wrote it down at other moments read the same.
        done_tokens = self._done.get(rank[0], 0)
        busy = self._busy.get(rank[0], 0.0) + now - self._since.get(rank, now)
        if done_tokens < LEARN_AFTER_TOKENS or busy <= 0.0:
            return booked_prefill
        elapsed = now - started
        plain = booked_prefill - done_tokens / busy * elapsed
        # And in work, each token weighing 1 + its context * `per_context`, the booked ones and those
        # the rate was learned from alike, as that share of the booked tokens. The larger counts:
        # reading an engine as freer than it is piles requests onto it, which costs more than the
        # other way (docs/ROUTING.md, "How close to the oracle": max 0.975x the oracle over the
        # 18 cases, work alone 1.003x, tokens alone 1.022x).
        booked = booked_prefill + booked_pairs * per_context
        done = (done_tokens + self._done_pairs.get(rank[0], 0.0) * per_context) / busy * elapsed
        weighed = booked_prefill - booked_prefill * (done / booked) if done < booked else 0.0  # never above
        rest = plain if plain > weighed else weighed
        # An engine far behind: its running prefill has taken more than `MOST_APART` times its
        # time at the learned rate and still not ended (a stall, another process on its core).
        # The time past that reads as work still ahead, growing with the stall; read only from
        # the rank's own ends at a learned rate, so a rank whose ends are never heard (silent
        # clients, no events) never reads behind (docs/ROUTING.md, "An engine far behind").
        # A prefill takes at least one of the engine's iterations whatever its size: the due time
        # is never below `MOST_APART` times the worker's mean rank-seconds a prefill end, read
        # without the open interval (a stall must not raise its own due time).
        predicted = booked_prefill * busy / done_tokens
        per_end = self._busy.get(rank[0], 0.0) / self._done_ends[rank[0]]
        # Counted from the rank's last prefill end or booking, whichever came later: a rank whose
        # ends are late (or read only from its blocks) and keeps taking requests is not behind
        # (counted from the end alone, silent clients on the conversation trace lost 5%).
        quiet = now - max(started, self._since.get(rank, started))
        past = (quiet if quiet < elapsed else elapsed) - MOST_APART * (predicted if predicted > per_end else per_end)
        return rest + past * done_tokens / busy if past > 0.0 else rest

    def heavier(self, rank: Rank, booked_prefill: int, booked_pairs: float, per_context: float) -> float:
        """How much more work a token of the rank's booked prefill is than a token of what its
        worker's rate was learned from, each token weighing 1 + its context * `per_context`
        (against 1 until a rate is learned)."""
        booked = 1.0 + booked_pairs * per_context / booked_prefill
        done_tokens = self._done.get(rank[0], 0)
        if done_tokens < LEARN_AFTER_TOKENS:
            return booked
        return booked / (1.0 + self._done_pairs.get(rank[0], 0.0) * per_context / done_tokens)

    def completed(self, rank: Rank, prefill_tokens: int, pairs: float = 0.0) -> None:
        """A booking on the rank finished its prefill (observed just before): the learned speeds
        and overhead move."""
        if self.shadow is not None:
            self.shadow.completed(rank, prefill_tokens, pairs)
        if not self.learn:
            return
        secs = self._pending.pop(rank, 0.0)
        # A prefill that ended the moment the one ahead did (nothing new to store) or its booking
        # was made took no time of its own to measure: alone, not a sample. Decided from the
        # pool's own state, so that a replica hearing the end through the ledger decides the same.
        tokens = max(prefill_tokens, 0)
        held = self._ends.get(rank)
        if held is not None:
            self._ends[rank] = (max(tokens, held[0]), held[1] + secs)
        elif secs > 0.0:
            self._ends[rank] = (tokens, secs)
        if tokens:
            self._done[rank[0]] = self._done.get(rank[0], 0) + tokens
            self._done_ends[rank[0]] = self._done_ends.get(rank[0], 0) + 1
            self._unread += tokens
            if pairs:
                self._done_pairs[rank[0]] = self._done_pairs.get(rank[0], 0.0) + pairs
        self._moment = self._since.get(rank, self._moment)

    def settle(self, now: float) -> None:
        """Read what the last moment's prefill ends taught, once `now` is past it (before the
        first change after it, or a read): its samples, by rank; and once every so many completed
        tokens the speeds, a pass over the workers that one completion among many barely moves."""
        if now <= self._moment or not (self._ends or self._unread):
            return
        if self._ends:
            for rank in sorted(self._ends):
                self._fit.add(*self._ends[rank])
            self._ends.clear()
            line = self._fit.line()
            if line is not None:
                self._fixed, self._per_token = line
                self.overhead = self._fixed / self._per_token
        if self._unread * 16 < LEARN_AFTER_TOKENS * len(self._done):
            return
        self._unread = 0
        base = worker_speed(None, None)[0]
        for worker, slower in self._slowness().items():
            if worker in self.of and worker not in self._declared:
                self.of[worker] = (base * slower, self.of[worker][1])

    def _slowness(self) -> dict[int, float]:
        """Each learned worker's time per token against the fleet's mean (1: as fast), damped."""
        rates = {w: done / self._busy[w] for w, done in self._done.items()
                 if done >= LEARN_AFTER_TOKENS and self._busy.get(w, 0.0) > 0.0}
        if len(rates) < 2:
            return {}
        mean = sum(rates.values()) / len(rates)
        return {w: min(MOST_APART, max(1.0 / MOST_APART, (mean / rate) ** DAMPING)) for w, rate in rates.items()}

    def learned(self) -> dict[int, float]:
        """Each learned worker's speed against the mean, undamped (2.0: twice as fast), for the
        operator; declared workers are not listed."""
        return {w: 1.0 / slower ** (1.0 / DAMPING) for w, slower in self._slowness().items()
                if w in self.of and w not in self._declared}
