"""Shape checking of JSON-like values with the exact error texts of api.md §2.3.

Request types (types.py) declare each member's JSON kind in attrs metadata; this module checks a
decoded JSON object against those declarations, and the types run the same checks when they are
constructed directly, so the typed API and the bytes API answer with one text.
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Callable, Mapping
from typing import Any, Final, NamedTuple, TypeVar

import attrs

from .errors import ShapeError
from .hashing import pack_tokens
from .jsonio import LONE_SURROGATE
from .wire import parse_uint

__all__ = [
    "ARRAY",
    "BOOL",
    "ENUM",
    "F32",
    "F64",
    "I64",
    "MAP",
    "NULLABLE",
    "OBJECT",
    "STR",
    "U32",
    "U64",
    "FloatForInteger",
    "ShapeContext",
    "check_value",
    "describe",
    "from_json",
    "shape_error",
    "validate_instance",
]


U64_MAX: Final = (1 << 64) - 1
U32_MAX: Final = (1 << 32) - 1
I64_MIN: Final = -(1 << 63)
I64_MAX: Final = (1 << 63) - 1

# Kinds are plain tuples so that the OpenAPI generator can read them too.
U64: Final = ("int", "u64", 0, U64_MAX)
U32: Final = ("int", "u32", 0, U32_MAX)
I64: Final = ("int", "i64", I64_MIN, I64_MAX)
F64: Final = ("float", "f64")
F32: Final = ("float", "f32")
STR: Final = ("str",)
BOOL: Final = ("bool",)


def ARRAY(item: tuple[Any, ...]) -> tuple[Any, ...]:
    return ("array", item)


def NULLABLE(item: tuple[Any, ...]) -> tuple[Any, ...]:
    """An array item that may be `null` (kept as None)."""
    return ("nullable", item)


def MAP(value: tuple[Any, ...], key: str = "str") -> tuple[Any, ...]:
    """A JSON object with arbitrary keys; `key` is "str" or "u32" (decimal dp ranks)."""
    return ("map", value, key)


def ENUM(*values: str) -> tuple[Any, ...]:
    return ("enum", values)


def OBJECT(cls: type) -> tuple[Any, ...]:
    return ("object", cls)


_EXPECTED: Final = {
    "str": "a string",
    "bool": "a boolean",
    "array": "a sequence",
    "map": "a map",
    "object": "a map",
    "enum": "a string",
}


class FloatForInteger(ShapeError):
    """A float stood where an integer belongs. With orjson that may be an integer beyond 64 bits
    that it parsed as a float, so the bytes layer re-reads the body exactly and checks again."""


@attrs.frozen
class ShapeContext:
    """`may_contain_bools`: False when the raw JSON has no `true`/`false` literal at all, which lets
    integer arrays skip the per-element bool test (the hot path of long `token_ids`)."""

    may_contain_bools: bool = True


TYPED: Final = ShapeContext()


def describe(value: Any) -> str:
    if value is None:
        return "null"
    if value is True:
        return "boolean `true`"
    if value is False:
        return "boolean `false`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value!r}`"
    if isinstance(value, str):
        return "string " + json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple, array)):
        return "sequence"
    if isinstance(value, bytes):
        return "byte array"
    if isinstance(value, Mapping):
        return "map"
    return f"value of type {type(value).__name__}"


def join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def shape_error(path: str, reason: str, cls: type[ShapeError] = ShapeError) -> ShapeError:
    return cls(f"{path}: {reason}" if path else reason)


def _invalid_type(path: str, value: Any, expected: str) -> ShapeError:
    cls = FloatForInteger if isinstance(value, float) and not expected.startswith(("f", "a ")) else ShapeError
    return shape_error(path, f"invalid type: {describe(value)}, expected {expected}", cls)


def _check_int(kind: tuple[Any, ...], value: Any, path: str) -> int:
    if type(value) is not int:
        if isinstance(value, int) and not isinstance(value, bool):
            value = int(value)
        else:
            raise _invalid_type(path, value, kind[1])
    if value < kind[2] or value > kind[3]:
        raise shape_error(path, f"invalid value: integer `{value}`, expected {kind[1]}")
    return int(value)


def _check_int_array(kind: tuple[Any, ...], value: Any, path: str, ctx: ShapeContext) -> Any:
    """Integer arrays: u32 become array('I'), i64 become a list of u64 (bit-for-bit reinterpreted),
    u64 a list. The C-level conversion validates the range; bools are looked for separately."""
    name = kind[1]
    if name == "u32" and type(value) is bytes:  # msgpack `bin`: little-endian u32, no per-item objects
        if len(value) % 4:
            raise shape_error(path, f"invalid length {len(value)}: a bin of little-endian u32 takes a "
                                    "multiple of 4 bytes")
        packed = array("I")
        packed.frombytes(value)
        if not _LOW_BYTE_FIRST:  # pragma: no cover - big-endian hosts only
            packed.byteswap()
        return packed
    if not isinstance(value, (list, tuple, array)):
        raise _invalid_type(path, value, "a sequence")
    try:
        if name == "u32":
            packed = pack_tokens(value)
        elif name == "i64":
            packed = array("q", value)
        else:
            packed = array("Q", value)
        if ctx.may_contain_bools and not isinstance(value, array) and _has_bool(value, packed):
            raise TypeError
    except (OverflowError, TypeError, ValueError):
        for i, item in enumerate(value):
            _check_int(kind, item, f"{path}[{i}]")
        raise AssertionError("unreachable: array conversion failed on valid items") from None
    if name == "u32":
        return packed
    if name == "i64":
        return array("Q", packed.tobytes()).tolist()
    return packed.tolist()


_LOW_BYTE_FIRST: Final = sys.byteorder == "little"


def _has_bool(value: Any, packed: array[int]) -> bool:
    """Whether `value` holds a bool. A bool packs as 0 or 1, so only lanes whose lowest byte is 0 or
    1 can hold one; those are found with a C-level search of the lowest bytes (a strided copy of
    a bytes object: eight times faster than a strided memoryview's), and only they are looked at."""
    width = packed.itemsize
    start = 0 if _LOW_BYTE_FIRST else width - 1
    low = packed.tobytes()[start::width]
    for needle in (b"\x00", b"\x01"):
        i = low.find(needle)
        while i != -1:
            if packed[i] <= 1 and type(value[i]) is bool:
                return True
            i = low.find(needle, i + 1)
    return False


def check_value(kind: tuple[Any, ...], value: Any, path: str, ctx: ShapeContext = TYPED) -> Any:
    """Check one non-null value against `kind`; return it converted to its stored form."""
    tag = kind[0]
    if tag == "int":
        return _check_int(kind, value, path)
    if tag == "nullable":
        return None if value is None else check_value(kind[1], value, path, ctx)
    if tag == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _invalid_type(path, value, kind[1])
        return float(value)
    if tag == "str":
        if not isinstance(value, str):
            raise _invalid_type(path, value, "a string")
        if not value.isascii() and not _encodable(value):
            # Only the typed API can get here (JSON readers refuse these): such a value stored
            # would make every later answer that echoes it fail to encode.
            raise shape_error(path, f"invalid value: {LONE_SURROGATE}")
        return value
    if tag == "bool":
        if not isinstance(value, bool):
            raise _invalid_type(path, value, "a boolean")
        return value
    if tag == "enum":
        if not isinstance(value, str):
            raise _invalid_type(path, value, "a string")
        if value not in kind[1]:
            raise shape_error(path, f"unknown variant `{value}`, expected {_one_of(kind[1])}")
        return value
    if tag == "array":
        item = kind[1]
        if item[0] == "int":
            return _check_int_array(item, value, path, ctx)
        if not isinstance(value, (list, tuple)):
            raise _invalid_type(path, value, "a sequence")
        return [check_value(item, v, f"{path}[{i}]", ctx) for i, v in enumerate(value)]
    if tag == "map":
        if not isinstance(value, Mapping):
            raise _invalid_type(path, value, "a map")
        out: dict[Any, Any] = {}
        for k, v in value.items():
            key: Any = k
            if kind[2] == "u32":
                key = _dp_rank_key(k, path)
            item_path = join(path, str(k))
            if v is None:
                raise _invalid_type(item_path, v, _expected(kind[1]))
            out[key] = check_value(kind[1], v, item_path, ctx)
        return out
    if tag == "object":
        cls = kind[1]
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise _invalid_type(path, value, "a map")
        return from_json(cls, value, path, ctx)
    raise AssertionError(f"unknown kind {kind!r}")


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _dp_rank_key(k: Any, path: str) -> int:
    if isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= U32_MAX:
        return k
    text = str(k)
    if not text.startswith("+"):
        value = parse_uint(text, 32)
        if isinstance(value, int):
            return value
    raise shape_error(join(path, text), f"invalid value: {describe(text)}, expected a dp_rank (u32)")


def _expected(kind: tuple[Any, ...]) -> str:
    if kind[0] in ("int", "float"):
        return str(kind[1])
    return _EXPECTED[kind[0]]


def _one_of(values: tuple[str, ...]) -> str:
    quoted = [f"`{v}`" for v in values]
    if len(quoted) == 2:
        return f"{quoted[0]} or {quoted[1]}"
    return "one of " + ", ".join(quoted)


T = TypeVar("T")
FACTORY_TYPE: Final[type[Any]] = type(attrs.Factory(list))

# A member's rule returns the reason text of a violation, or None.
Rule = Callable[[Any], "str | None"]


class _Member(NamedTuple):
    name: str
    kind: tuple[Any, ...] | None  # None: not a JSON member, always its default
    required: bool
    nullable: bool
    rule: Rule | None
    store: Callable[[Any], Any] | None
    default: Any
    factory: Callable[[], Any] | None
    alias: str | None


def members(cls: type) -> tuple[_Member, ...]:
    """The member table of a request type, derived once from its attrs fields (read-only after)."""
    table: tuple[_Member, ...] | None = cls.__dict__.get("_json_members")
    if table is None:
        aliases = {target: alias for alias, target in getattr(cls, "_json_aliases", {}).items()}
        rows = []
        for field in attrs.fields(cls):
            meta = field.metadata
            factory = field.default.factory if isinstance(field.default, FACTORY_TYPE) else None
            default = None if factory is not None or field.default is attrs.NOTHING else field.default
            rows.append(_Member(field.name, meta.get("kind"), bool(meta.get("required")),
                                bool(meta.get("nullable")), meta.get("rule"), meta.get("store"),
                                default, factory, aliases.get(field.name)))
        table = tuple(rows)
        type.__setattr__(cls, "_json_members", table)
    return table


def from_json(cls: type[T], obj: Any, path: str = "", ctx: ShapeContext = TYPED) -> T:
    """Build `cls` from a decoded JSON object; raises Unprocessable with the api.md §2.3 text.
    The instance is filled directly: its checks are the ones made here."""
    if not isinstance(obj, Mapping):
        raise _invalid_type(path, obj, "a map")
    aliases: Mapping[str, str] = getattr(cls, "_json_aliases", {})
    for alias, target in aliases.items():
        if alias in obj and target in obj and obj[target] != obj[alias]:
            raise shape_error(path, f"{alias}: conflicts with {target}")
    inst = object.__new__(cls)
    put = object.__setattr__
    for m in members(cls):
        name = m.name
        if name in obj and m.kind is not None:
            value = obj[name]
        elif m.alias is not None and m.alias in obj:
            value = obj[m.alias]
        else:
            if m.required:
                raise shape_error(path, f"missing field `{name}`")
            default = m.factory() if m.factory is not None else m.default
            put(inst, name, m.store(default) if m.store is not None and default is not None else default)
            continue
        field_path = f"{path}.{name}" if path else name
        if value is None:
            if not m.nullable:
                raise _invalid_type(field_path, None, _expected(m.kind))  # type: ignore[arg-type]
            put(inst, name, None)
            continue
        checked = check_value(m.kind, value, field_path, ctx)  # type: ignore[arg-type]
        if m.rule is not None:
            reason = m.rule(checked)
            if reason is not None:
                raise shape_error(field_path, reason)
        put(inst, name, m.store(checked) if m.store is not None else checked)
    return inst


def validate_instance(inst: Any, path: str = "") -> None:
    """Run the member checks on a directly constructed request (the typed API)."""
    for m in members(type(inst)):
        if m.kind is None:
            continue
        value = getattr(inst, m.name)
        if value is None:
            if not m.nullable:
                raise _invalid_type(f"{path}.{m.name}" if path else m.name, None, _expected(m.kind))
            continue
        field_path = f"{path}.{m.name}" if path else m.name
        checked = check_value(m.kind, value, field_path, TYPED)
        if m.rule is not None:
            reason = m.rule(checked)
            if reason is not None:
                raise shape_error(field_path, reason)
        if m.store is not None:
            checked = m.store(checked)
        if checked is not value:
            object.__setattr__(inst, m.name, checked)
