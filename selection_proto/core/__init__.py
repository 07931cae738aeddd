"""The pure selection state machine: no I/O, no clock reads, no threads, no module-level state.

`service.SelectionService` is the facade: it keeps the clock (`now` never goes back), composes the
components, orders their calls and holds the output events they queue. The modules stand in wings
(docs/LAYOUT.md), each importing only itself and the wings below it, bottom to top:

* `base`: the words every part speaks: errors, JSON (`jsonio`), bytes (`wire`, `codec`), request and
  answer types, the route table (`routes`), `hashing`, `settings`, `metrics`, the state `budget`;
* `cache`: the engines' KV caches as the router knows them: KV events decoded (`events`, `engine`),
  the radix trees (`index`), `tiers`, `freshness`, `predictions`, engine metrics;
* `bookings`: what the router promised each rank: a prompt's hashes (`prompt`), bookings and loads
  (`tracker`), `sessions`, prefill ends;
* `fleet`: the workers (`catalog`) and, per (model, tenant) key, the `pool` tying the rest together;
  the flow queue (`admission`), speeds, decisions, outcomes, `limits`, the ledger `journal`;
* `intake`: KV events coming in: `streams`, `ingest`, `snapshot`;
* `routing`: choosing and booking: `cost`, `queueing`, `selection`, prefill/decode plans (`pd`);
* `core/` itself: the facade and what spans the rest: `handler` (decode, run, encode), `openapi`,
  `workers`, `ledger` (the mirror of the others' changes), `readouts`, `status`.
"""
from .base.errors import (
    BadRequest,
    Conflict,
    Internal,
    MethodNotAllowed,
    NotFound,
    NotReady,
    PayloadTooLarge,
    SelectionError,
    StreamError,
    TooManyRequests,
    Unprocessable,
    UnsupportedMediaType,
)
from .base.hashing import block_hashes, iv, sequence_hashes
from .base.outputs import (
    CloseEventStream,
    InternalError,
    Notice,
    OutputEvent,
    SelectionReady,
    SubscribeKvEvents,
    UnsubscribeKvEvents,
)
from .base.responses import *  # noqa: F403 - the wire types are the public API
from .base.responses import __all__ as _responses_all
from .base.settings import Settings
from .base.types import *  # noqa: F403
from .base.types import __all__ as _types_all
from .base.wire import Response
from .routing.pd import PlanResponse, Verdict
from .service import SelectionService

__all__ = [
    "BadRequest",
    "CloseEventStream",
    "Conflict",
    "Internal",
    "InternalError",
    "MethodNotAllowed",
    "NotFound",
    "NotReady",
    "Notice",
    "OutputEvent",
    "PayloadTooLarge",
    "PlanResponse",
    "Response",
    "SelectionError",
    "SelectionReady",
    "SelectionService",
    "Settings",
    "StreamError",
    "SubscribeKvEvents",
    "TooManyRequests",
    "UnsubscribeKvEvents",
    "Unprocessable",
    "UnsupportedMediaType",
    "Verdict",
    "block_hashes",
    "iv",
    "sequence_hashes",
    *_types_all,
    *_responses_all,
]
