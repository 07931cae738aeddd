"""Session affinity (Dynamo 1.6.1, hard mode; docs/DECISIONS.md): a multi-turn session stays on
the rank its first booking landed on.

One table per pool. A binding is made by a booking (`/select_and_reserve`, or the replay of a
`/select`), never by a plain `/select`, which only reads it. Every booking made under a binding
holds a lease on it; the binding lives while a lease is held and expires `ttl` seconds after the
last is released. A binding whose rank left is forgotten by the next booking of its session.

| binding | a booking of the session lands on | then |
|---|---|---|
| none (or expired) | any rank | bound to that rank, one lease (none when the table is full) |
| bound to rank R, R schedulable | R | one more lease |
| bound to rank R, R schedulable | another rank (R was not eligible) | the binding is forgotten; 400 |
| bound to rank R, R left | — | forgotten before the selection: as "none" |
"""

from __future__ import annotations

from typing import Final, NamedTuple

from ..base.budget import SESSION_BYTES, StateBudget
from ..base.errors import BadRequest
from ..cache.index import Rank

__all__ = ["MAX_SESSION_ID_BYTES", "Lease", "SessionTable", "check_session_id", "mismatch"]

MAX_SESSION_ID_BYTES: Final = 256


def check_session_id(session: str) -> None:
    if len(session.encode()) > MAX_SESSION_ID_BYTES:
        raise BadRequest(f"session affinity ID must not exceed {MAX_SESSION_ID_BYTES} bytes")


def mismatch(session: str, bound: Rank, booked: Rank) -> BadRequest:
    """The 400 of a booking that lands away from its session's live binding."""
    if bound[0] != booked[0]:
        return BadRequest(f"session {session} is bound to worker {bound[0]}, not {booked[0]}")
    return BadRequest(f"session {session} is bound to DP rank {bound[1]}, not {booked[1]}")


class _Binding:
    __slots__ = ("rank", "leases", "idle_until")

    def __init__(self, rank: Rank) -> None:
        self.rank = rank
        self.leases = 0
        self.idle_until = 0.0  # when it expires once no lease is held


class Lease(NamedTuple):
    """A booking's hold on its session's binding (that binding, not a later one of the same id)."""

    session: str
    binding: _Binding


class SessionTable:
    """One pool's bindings of session id -> rank."""

    __slots__ = ("_ttl", "_limit", "_bindings", "_budget")

    def __init__(self, ttl: float, limit: int, budget: StateBudget) -> None:
        self._ttl = ttl
        self._limit = limit
        self._bindings: dict[str, _Binding] = {}
        self._budget = budget

    def __len__(self) -> int:
        return len(self._bindings)

    def _live(self, session: str, now: float) -> _Binding | None:
        binding = self._bindings.get(session)
        if binding is None:
            return None
        if binding.leases == 0 and binding.idle_until <= now:
            self.forget(session)  # expired: forgotten on sight
            return None
        return binding

    def target(self, session: str, now: float) -> Rank | None:
        """The rank the session is bound to, if its binding is live."""
        binding = self._live(session, now)
        return binding.rank if binding is not None else None

    def forget(self, session: str) -> None:
        if self._bindings.pop(session, None) is not None:
            self._budget.session_bytes -= SESSION_BYTES + len(session)

    def close(self) -> None:
        """The pool goes: so do its bindings."""
        for session in list(self._bindings):
            self.forget(session)

    def lease(self, session: str, rank: Rank, now: float) -> Lease | None:
        """A booking of the session landed on `rank` (the caller checked it is the bound rank, if
        any): bind it if unbound, and hold one more lease. None when the table is full (the
        booking stands, unbound)."""
        binding = self._live(session, now)
        if binding is None:
            if len(self._bindings) >= self._limit:
                self._sweep(now)
                if len(self._bindings) >= self._limit:
                    return None
            binding = self._bindings[session] = _Binding(rank)
            self._budget.session_bytes += SESSION_BYTES + len(session)
        binding.leases += 1
        return Lease(session, binding)

    def release(self, lease: Lease, now: float) -> None:
        """A booking that held `lease` ended; the binding expires `ttl` after its last lease."""
        binding = self._bindings.get(lease.session)
        if binding is not lease.binding or binding.leases == 0:
            return  # forgotten, or forgotten and bound again, since
        binding.leases -= 1
        binding.idle_until = now + self._ttl

    def _sweep(self, now: float) -> None:
        for session in [s for s, b in self._bindings.items() if b.leases == 0 and b.idle_until <= now]:
            self.forget(session)
