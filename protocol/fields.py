"""Field validators used by the schema table in `messages.py`.

Each validator checks one untrusted value and returns it normalised (ints
stay ints, floats become float, optional fields get their defaults), raising
BAD_FIELD with the field's dotted path, what was expected and what came.
The same validators run on encode, so a sender's bug fails locally.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import ErrorCode, ProtocolError, describe

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def is_int(value: object) -> bool:
    """A real int: msgpack and JSON peers may send a bool where an int belongs."""
    return isinstance(value, int) and not isinstance(value, bool)


def bad_field(path: str, expected: str, value: object) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_FIELD, f"{path}: expected {expected}, got {describe(value)}")


class Validator(Protocol):
    def check(self, path: str, value: Any) -> Any: ...


@dataclass(frozen=True)
class Int:
    """A real int (bool rejected) within [lo, hi]; int64 range by default."""

    lo: int = INT64_MIN
    hi: int = INT64_MAX

    def check(self, path: str, value: Any) -> int:
        if not is_int(value):
            raise bad_field(path, "int", value)
        if not self.lo <= value <= self.hi:
            raise bad_field(path, f"int in [{self.lo}, {self.hi}]", value)
        return int(value)


@dataclass(frozen=True)
class Bool:
    def check(self, path: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise bad_field(path, "bool", value)
        return value


@dataclass(frozen=True)
class Float:
    """A finite number >= lo; ints are accepted and widened, bools are not."""

    lo: float = -math.inf

    def check(self, path: str, value: Any) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise bad_field(path, "float", value)
        number = float(value)
        if not math.isfinite(number) or number < self.lo:
            raise bad_field(path, f"finite float >= {self.lo}", value)
        return number


@dataclass(frozen=True)
class Str:
    min_len: int = 0
    max_len: int = 256
    choices: tuple[str, ...] | None = None

    def check(self, path: str, value: Any) -> str:
        if not isinstance(value, str):
            raise bad_field(path, "str", value)
        if self.choices is not None and value not in self.choices:
            raise bad_field(path, f"one of {list(self.choices)}", value)
        if not self.min_len <= len(value) <= self.max_len:
            raise bad_field(path, f"str of {self.min_len}..{self.max_len} chars", value)
        return value


@dataclass(frozen=True)
class List:
    item: Validator
    min_len: int = 0
    max_len: int = 1024

    def check(self, path: str, value: Any) -> list[Any]:
        if not isinstance(value, (list, tuple)):
            raise bad_field(path, "list", value)
        if not self.min_len <= len(value) <= self.max_len:
            raise bad_field(path, f"list of {self.min_len}..{self.max_len} items", value)
        item = self.item
        if isinstance(item, Int) and all(type(v) is int for v in value):  # token ids: checked at C speed
            if not value or (item.lo <= min(value) and max(value) <= item.hi):
                return list(value)
        # Each item's path is built only to name a bad one: for 64K items the labels alone cost
        # more than the checks (a flood of such prompts held the daemon's socket, an audit).
        try:
            return [item.check(path, v) for v in value]
        except ProtocolError:
            for i, v in enumerate(value):
                item.check(f"{path}[{i}]", v)
            raise


_MISSING = object()


@dataclass(frozen=True)
class Struct:
    """A map with a closed set of keys: unknown keys are an error.

    `optional` maps a key to its default, filled in when the key is absent.
    """

    required: dict[str, Validator] = field(default_factory=dict)
    optional: dict[str, tuple[Validator, Any]] = field(default_factory=dict)

    def check(self, path: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise bad_field(path, "map", value)
        extra = [k for k in value if k not in self.required and k not in self.optional]
        if extra:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"{path}: unexpected field(s) {sorted(map(repr, extra))}; "
                f"allowed {sorted([*self.required, *self.optional])}",
            )
        out: dict[str, Any] = {}
        for key, validator in self.required.items():
            item = value.get(key, _MISSING)
            if item is _MISSING:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"{path}: missing required field {key!r}")
            out[key] = validator.check(f"{path}.{key}", item)
        for key, (validator, default) in self.optional.items():
            item = value.get(key, _MISSING)
            out[key] = default if item is _MISSING else validator.check(f"{path}.{key}", item)
        return out


@dataclass(frozen=True)
class Maybe:
    """A value `inner` accepts, or nil (msgpack's None): a part of a map some senders have."""

    inner: Validator

    def check(self, path: str, value: Any) -> Any:
        return None if value is None else self.inner.check(path, value)


@dataclass(frozen=True)
class Json:
    """Free-form map of str keys to msgpack-native scalars, lists and maps.

    Used for diagnostics (`stats`), where the schema cannot be fixed but the
    values must still pack cleanly and stay shallow.
    """

    max_depth: int = 8

    def check(self, path: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise bad_field(path, "map", value)
        try:  # paths are built only to name what is wrong (as List does)
            return self._walk(path, value, 0, named=False)
        except ProtocolError:
            return self._walk(path, value, 0, named=True)

    def _walk(self, path: str, value: Any, depth: int, named: bool) -> Any:
        if depth > self.max_depth:
            raise bad_field(path, f"nesting depth <= {self.max_depth}", value)
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return Int().check(path, value)
        if isinstance(value, float):
            return Float().check(path, value)
        if isinstance(value, (list, tuple)):
            return [self._walk(f"{path}[{i}]" if named else path, v, depth + 1, named) for i, v in enumerate(value)]
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise bad_field(f"{path} key", "str", k)
                out[k] = self._walk(f"{path}.{k}" if named else path, v, depth + 1, named)
            return out
        raise bad_field(path, "None, bool, int, float, str, list or map", value)
