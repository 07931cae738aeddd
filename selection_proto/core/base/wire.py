"""Bytes-level pieces of `handle`: responses, query strings, path segments (api.md §2)."""

from __future__ import annotations

import re
from typing import NamedTuple
from urllib.parse import unquote_to_bytes

from . import jsonio
from .errors import BadRequest

__all__ = ["Response", "error_response", "json_response", "raw_json_response", "parse_query", "percent_decode", "query_int"]

_BAD_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")


class Response(NamedTuple):
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


def json_response(status: int, value: object, extra: tuple[tuple[str, str], ...] = ()) -> Response:
    return raw_json_response(status, jsonio.dumps(value), extra)


def raw_json_response(status: int, body: bytes, extra: tuple[tuple[str, str], ...] = ()) -> Response:
    """A response around JSON that is already encoded."""
    return Response(
        status,
        (("content-type", "application/json"), ("content-length", str(len(body))), *extra),
        body,
    )


def error_response(status: int, message: str, extra: tuple[tuple[str, str], ...] = ()) -> Response:
    return json_response(status, {"error": message}, extra)


def percent_decode(text: str, plus_is_space: bool = False) -> str:
    """Strict percent-decoding to UTF-8; raises ValueError on a bad escape or bad UTF-8."""
    if plus_is_space:
        text = text.replace("+", " ")
    if "%" not in text:
        return text
    if _BAD_PERCENT.search(text):
        raise ValueError("invalid percent-encoding")
    return unquote_to_bytes(text).decode("utf-8")


def parse_query(query: str, known: tuple[str, ...]) -> dict[str, str]:
    """Form-urlencoded query; unknown keys ignored, a known key twice is an error (api.md §2.5)."""
    out: dict[str, str] = {}
    if not query:
        return out
    for part in query.split("&"):
        if not part:
            continue
        raw_key, _, raw_value = part.partition("=")
        try:
            key = percent_decode(raw_key, True)
            value = percent_decode(raw_value, True)
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("Failed to deserialize query string: invalid percent-encoding") from None
        if key not in known:
            continue
        if key in out:
            raise BadRequest(f"Failed to deserialize query string: duplicate field `{key}`")
        out[key] = value
    if "routing_group" in out:
        group = out.pop("routing_group")
        if "tenant_id" in out and out["tenant_id"] != group:
            raise BadRequest("Failed to deserialize query string: routing_group conflicts with tenant_id")
        out["tenant_id"] = group
    return out


def parse_uint(text: str, bits: int) -> int | str:
    """A u32/u64 in Rust's `from_str` rules, or its failure text."""
    digits = text[1:] if text.startswith("+") else text
    if not digits:
        return "cannot parse integer from empty string"
    if not (digits.isascii() and digits.isdigit()):
        return "invalid digit found in string"
    # Never hand the interpreter thousands of digits: it refuses them (and they are too large).
    if len(digits.lstrip("0")) > 20:
        return "number too large to fit in target type"
    value = int(digits)
    if value >= 1 << bits:
        return "number too large to fit in target type"
    return value


def query_int(params: dict[str, str], name: str, bits: int) -> int | None:
    if name not in params:
        return None
    value = parse_uint(params[name], bits)
    if isinstance(value, str):
        raise BadRequest(f"Failed to deserialize query string: {name}: {value}")
    return value
