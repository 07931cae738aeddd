"""The pure selection state machine: no I/O, no clock reads, no threads, no module-level state."""

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
from .outputs import CloseEventStream, OutputEvent, SelectionReady, SubscribeKvEvents, UnsubscribeKvEvents
from .service import SelectionService
from .settings import Settings
from .types import *  # noqa: F403 - the wire types are the public API
from .types import __all__ as _types_all
from .wire import Response

__all__ = [
    "BadRequest",
    "CloseEventStream",
    "Conflict",
    "Internal",
    "MethodNotAllowed",
    "NotFound",
    "NotReady",
    "OutputEvent",
    "PayloadTooLarge",
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
    "block_hashes",
    "iv",
    "sequence_hashes",
    *_types_all,
]
