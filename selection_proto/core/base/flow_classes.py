"""Policy classes (`flow_classes`, docs/FLOW_CONTROL.md): each class's weight against the tier's
other classes, its caps and queue timeout, read from the setting's text. A value: settings check
it, the admission queue (admission.py) and the door (queueing.py) use it."""

from __future__ import annotations

import functools
import math
from typing import Final, NamedTuple

__all__ = ["DEFAULT_CLASS", "FlowClass", "parse_classes"]

_CLASS_KEYS: Final = ("max_queued", "max_queued_tokens", "queue_timeout_secs")


class FlowClass(NamedTuple):
    """A policy class (`flow_classes`): its weight in uncached tokens against the tier's other
    classes, its caps on queued requests and tokens (None: none), and its queue timeout."""

    name: str
    weight: float = 1.0
    max_queued: int | None = None
    max_queued_tokens: int | None = None
    queue_timeout_secs: float | None = None


DEFAULT_CLASS: Final = FlowClass("default")


@functools.lru_cache(maxsize=8)
def parse_classes(text: str | None) -> tuple[FlowClass, ...]:
    """`name:weight[:key=value...]`, comma-separated (keys: max_queued, max_queued_tokens,
    queue_timeout_secs); the first is the default class. None or empty: one class, `default`.
    Raises ValueError("flow_classes: ...")."""
    if not text or not text.strip():
        return (DEFAULT_CLASS,)
    classes: list[FlowClass] = []
    for part in text.split(","):
        name, _, rest = part.strip().partition(":")
        fields = rest.split(":") if rest else []
        if not name or not name.isidentifier() or any(c.name == name for c in classes):
            raise ValueError(f"flow_classes: {part.strip()!r}: a class needs a new name of letters, digits and _")
        try:
            weight = float(fields[0]) if fields else 1.0
            options: dict[str, float] = {}
            for option in fields[1:]:
                key, _, value = option.partition("=")
                if key not in _CLASS_KEYS or key in options:
                    raise ValueError(f"unknown or repeated option {key!r} (one of {', '.join(_CLASS_KEYS)})")
                options[key] = float(value)
        except ValueError as exc:
            raise ValueError(f"flow_classes: {name}: {exc}") from None
        if not (math.isfinite(weight) and weight > 0) or not all(math.isfinite(v) and v > 0 for v in options.values()):
            raise ValueError(f"flow_classes: {name}: the weight and every option must be a number > 0")
        caps = {k: int(v) for k, v in options.items() if k != "queue_timeout_secs"}
        if any(caps[k] != options[k] for k in caps):
            raise ValueError(f"flow_classes: {name}: caps are whole numbers")
        classes.append(FlowClass(name, weight, caps.get("max_queued"), caps.get("max_queued_tokens"),
                                 options.get("queue_timeout_secs")))
    return tuple(classes)
