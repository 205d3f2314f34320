"""Value specs: what one config key accepts, in words (errors, reference), as JSON Schema, and its check."""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_YAML11_BOOLS = '. YAML 1.1 reads the bare words yes/no/on/off/true/false as booleans: quote the value, e.g. "off"'


class FieldValueError(ValueError):
    """A value does not fit its spec; the message says what was received and what was expected."""


@dataclass(frozen=True)
class Spec:
    """What one key accepts: in words, as JSON Schema, and ``parse`` (`ValueError` ends the message)."""

    expected: str
    schema: dict[str, Any]
    parse: Callable[[Any], Any]
    nullable: bool = False

    def describe(self) -> str:
        return self.expected + (" or null" if self.nullable else "")

    def json_schema(self) -> dict[str, Any]:
        return {"anyOf": [self.schema, {"type": "null"}]} if self.nullable else self.schema

    def check(self, value: Any) -> Any:
        """The value to keep; `FieldValueError` naming the value received and what is expected."""
        if value is None and self.nullable:
            return None
        try:
            return self.parse(value)  # every parse refuses None
        except ValueError as exc:
            shown = json.dumps(value) if isinstance(value, bool) or value is None else repr(value)
            raise FieldValueError(f"received {shown}, expected {self.describe()}{exc}") from None


def integer(
    minimum: int, nullable: bool = False, maximum: int | None = None, expected: str = ""
) -> Spec:
    """A whole number >= ``minimum`` (and <= ``maximum``); ``expected``: that in words."""
    top = math.inf if maximum is None else maximum

    def parse(value: Any) -> int:
        whole = int(value) if isinstance(value, float) and value.is_integer() else value
        if isinstance(whole, bool) or not isinstance(whole, int) or not minimum <= whole <= top:
            raise ValueError()
        return whole

    schema = {"type": "integer", "minimum": minimum}
    schema |= {} if maximum is None else {"maximum": maximum}
    return Spec(expected or f"an integer >= {minimum}", schema, parse, nullable)


def number(minimum: float, exclusive: bool = False) -> Spec:
    """A finite number > ``minimum`` (``exclusive``) or >= it."""

    def parse(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError()
        if not math.isfinite(value):
            raise ValueError(", and finite")
        if value < minimum or (exclusive and value == minimum):
            raise ValueError()
        return float(value)

    word, key = (">", "exclusiveMinimum") if exclusive else (">=", "minimum")
    return Spec(f"a number {word} {minimum:g}", {"type": "number", key: minimum}, parse)


def text(nullable: bool = False, pattern: str | None = None, pattern_doc: str = "") -> Spec:
    """A non-empty string; with ``pattern``, one that matches it (``pattern_doc`` says how)."""

    def parse(value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise ValueError()
        if pattern is not None and not re.fullmatch(pattern, value):
            raise ValueError()
        return value

    schema: dict[str, Any] = {"type": "string", "minLength": 1}
    if pattern is not None:
        schema["pattern"] = f"^(?:{pattern})$"
    return Spec(pattern_doc or "a non-empty string", schema, parse, nullable)


def choice(*values: str, false: str | None = None, hints: dict[str, str] | None = None) -> Spec:
    """One of ``values`` (any case, ``-`` as ``_``); ``false``: YAML's false; ``hints``: misspellings."""

    def parse(value: Any) -> str:
        if value is False and false is not None:
            return false
        if isinstance(value, bool):  # YAML 1.1 (PyYAML) reads `kind: off` as False
            raise ValueError(_YAML11_BOOLS)
        if not isinstance(value, str):
            raise ValueError()
        normal = value.strip().lower().replace("-", "_")
        if normal in values:
            return normal
        hint = (hints or {}).get(normal)
        close = [hint] if hint else difflib.get_close_matches(normal, values, n=1)
        raise ValueError(f"; did you mean {close[0]!r}?" if close else "")

    schema: dict[str, Any] = {"type": "string", "enum": list(values)}
    if false is not None:  # bare `off`, which YAML 1.1 reads as false
        schema = {"anyOf": [schema, {"const": False}]}
    return Spec("one of " + ", ".join(values), schema, parse)


def word_or_int(word: str, unit: str, maximum: int | None = None) -> Spec:
    """A fixed word (``epoch``, ``auto``) or a whole number of ``unit`` from 1 (to ``maximum``)."""
    number = integer(1, maximum=maximum)

    def parse(value: Any) -> str | int:
        if isinstance(value, str) and value.strip().lower() == word:
            return word
        return number.parse(value)

    until = ">= 1" if maximum is None else f"from 1 to {maximum}"
    schema = {"anyOf": [{"const": word}, number.schema]}
    return Spec(f"'{word}' or an integer {until} ({unit})", schema, parse)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError()
    return value


def _auto_or_bool(value: Any) -> str | bool:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return _bool(value)


def _devices(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) and v.strip() for v in items):
        raise ValueError()
    return tuple(v.strip() for v in items)


BOOL = Spec("true or false", {"type": "boolean"}, _bool)
AUTO_OR_BOOL = Spec(
    "auto, true or false", {"anyOf": [{"type": "boolean"}, {"const": "auto"}]}, _auto_or_bool
)
#: A list of device names (one name alone is a list of one).
DEVICES = Spec(
    "a list of device names such as ['/gpu:0', '/gpu:1']",
    {"type": "array", "items": {"type": "string", "minLength": 1}},
    _devices,
)
