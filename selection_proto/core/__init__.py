"""The pure selection state machine: no I/O, no clock reads, no threads, no module-level state.

General layout. `service.SelectionService` is the facade: it keeps the clock (`now` never goes
back), composes the components below, orders their calls and holds the output events they queue.
Each concept has one module:

* the bytes face: `routes` (every route in one table), `handler` (`handle`: decode, run, encode),
  `openapi`, `jsonio` (the JSON readers), `codec` (request shapes), `wire` (responses, queries);
* the vocabulary: `types` (requests, the worker record), `responses` (answers), `errors` (each
  carries its status), `outputs` (what the transport drains), `settings`;
* the catalog side: `catalog` (records, tombstones, the lifecycle and reconcile tables, the
  metadata rules), `workers` (an upsert or delete moving the pools), `pool` (one key's workers,
  index, bookings, freshness and queue);
* the selection side: `selection` (candidates, overload, choice, bookings, dispatch), `prompt`
  (a request's hashes), `cost` (a candidate's cost, the choice), `admission` (the queue, tickets,
  how a ticket ends), `tracker` (bookings and loads), `pending` (selections awaiting their
  booking), `sessions` (session affinity), `pd` (prefill/decode plans: the decider, the pair,
  both bookings or neither), `readouts` (loads and overlap answers),
  `index` (the radix trees), `hashing`;
* the KV-event side: `ingest` (bind and apply, requests applied in steps), `events` (Dynamo
  JSON), `engine` (engine msgpack), `streams` (event sources, their lifecycle table, message
  decoding), `freshness` (continuity of ids and seqs), `tally` (what a batch did);
* `limits` (every limit checked and counted), `budget` (the state budget), `snapshot` (dump and
  restore), `metrics` (families, recorders, the exposition), `deferred` (work left until the
  answer is written).
"""
from .errors import (
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
from .hashing import block_hashes, iv, sequence_hashes
from .outputs import (
    CloseEventStream,
    InternalError,
    Notice,
    OutputEvent,
    SelectionReady,
    SubscribeKvEvents,
    UnsubscribeKvEvents,
)
from .pd import PlanResponse, Verdict
from .responses import *  # noqa: F403 - the wire types are the public API
from .responses import __all__ as _responses_all
from .service import SelectionService
from .settings import Settings
from .types import *  # noqa: F403
from .types import __all__ as _types_all
from .wire import Response

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
