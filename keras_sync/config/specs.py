"""Value specs for config fields: check one YAML value, describe it in errors and JSON Schema."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

# YAML 1.1 (PyYAML) turns these bare words into booleans: `kind: off` arrives as False.
_YAML11_BOOL_WORDS = "yes/no/on/off/true/false"


class FieldValueError(ValueError):
    """A value does not fit its spec; the message says what was expected."""


def _show(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value)


@dataclass(frozen=True)
class Spec:
    """Base of all value specs: `check` a value, `describe` it in words, give its JSON Schema."""

    nullable: bool = False

    def check(self, value: Any) -> Any:
        if value is not None:
            return self._check(value)
        if self.nullable:
            return None
        raise FieldValueError(f"received null, expected {self.describe()}")

    def describe(self) -> str:
        return self._describe() + (" or null" if self.nullable else "")

    def json_schema(self) -> dict[str, Any]:
        schema = self._schema()
        return {"anyOf": [schema, {"type": "null"}]} if self.nullable else schema

    def _fail(self, value: Any) -> FieldValueError:
        return FieldValueError(f"received {_show(value)}, expected {self.describe()}")

    def _check(self, value: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _describe(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _schema(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass(frozen=True)
class Choice(Spec):
    """One of a fixed set of names, matched case-insensitively."""

    values: tuple[str, ...] = ()
    bool_aliases: tuple[tuple[bool, str], ...] = ()
    #: (common spelling, value) pairs for the did-you-mean of a value difflib would not match.
    hints: tuple[tuple[str, str], ...] = ()

    def _check(self, value: Any) -> str:
        if isinstance(value, bool):
            for flag, name in self.bool_aliases:
                if value is flag:
                    return name
            raise FieldValueError(
                f"received {_show(value)}, expected {self.describe()}. YAML 1.1 reads the bare "
                f'words {_YAML11_BOOL_WORDS} as booleans: quote the value, e.g. "off"'
            )
        if not isinstance(value, str):
            raise self._fail(value)
        normal = value.strip().lower().replace("-", "_")
        if normal not in self.values:
            import difflib

            close = [v for k, v in self.hints if k == normal] or difflib.get_close_matches(
                normal, self.values, n=1
            )
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise FieldValueError(f"received {value!r}, expected {self.describe()}{hint}")
        return normal

    def _describe(self) -> str:
        return "one of " + ", ".join(self.values)

    def _schema(self) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "string", "enum": list(self.values)}
        if self.bool_aliases:  # e.g. bare `off`, which YAML 1.1 reads as false and `check` accepts
            schema = {"anyOf": [schema, *({"const": flag} for flag, _ in self.bool_aliases)]}
        return schema


@dataclass(frozen=True)
class Int(Spec):
    """A whole number with an inclusive lower bound."""

    minimum: int = 0

    def _check(self, value: Any) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < self.minimum:
            raise self._fail(value)
        return int(value)

    def _describe(self) -> str:
        return f"an integer >= {self.minimum}"

    def _schema(self) -> dict[str, Any]:
        return {"type": "integer", "minimum": self.minimum}


@dataclass(frozen=True)
class Float(Spec):
    """A finite number, > minimum (exclusive) or >= minimum (inclusive)."""

    minimum: float = 0.0
    exclusive: bool = False

    def _check(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._fail(value)
        if not math.isfinite(value):
            raise FieldValueError(f"received {value}, expected a finite number")
        if value < self.minimum or (self.exclusive and value == self.minimum):
            raise self._fail(value)
        return float(value)

    def _describe(self) -> str:
        return f"a number {'>' if self.exclusive else '>='} {self.minimum:g}"

    def _schema(self) -> dict[str, Any]:
        return {"type": "number", "exclusiveMinimum" if self.exclusive else "minimum": self.minimum}


@dataclass(frozen=True)
class Bool(Spec):
    """true or false."""

    def _check(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self._fail(value)
        return value

    def _describe(self) -> str:
        return "true or false"

    def _schema(self) -> dict[str, Any]:
        return {"type": "boolean"}


@dataclass(frozen=True)
class Str(Spec):
    """A non-empty string; with ``pattern``, one that matches it (``pattern_doc`` says how in words)."""

    pattern: str | None = None
    pattern_doc: str = ""

    def _check(self, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self._fail(value)
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            raise self._fail(value)
        return value

    def _describe(self) -> str:
        return self.pattern_doc or "a non-empty string"

    def _schema(self) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "string", "minLength": 1}
        if self.pattern is not None:
            schema["pattern"] = f"^(?:{self.pattern})$"
        return schema


@dataclass(frozen=True)
class StrList(Spec):
    """A list of non-empty strings (a single string is accepted as a list of one)."""

    def _check(self, value: Any) -> tuple[str, ...]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            raise self._fail(value)
        return tuple(v.strip() for v in value)

    def _describe(self) -> str:
        return "a list of device names such as ['/gpu:0', '/gpu:1']"

    def _schema(self) -> dict[str, Any]:
        return {"type": "array", "items": {"type": "string", "minLength": 1}}


@dataclass(frozen=True)
class AutoOrBool(Spec):
    """`auto`, true or false."""

    def _check(self, value: Any) -> str | bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        raise self._fail(value)

    def _describe(self) -> str:
        return "auto, true or false"

    def _schema(self) -> dict[str, Any]:
        return {"anyOf": [{"type": "boolean"}, {"const": "auto"}]}


@dataclass(frozen=True)
class WordOrInt(Spec):
    """A fixed word (``epoch``, ``auto``) or a positive whole number of ``unit``."""

    word: str = "epoch"
    unit: str = "batches"

    def _check(self, value: Any) -> str | int:
        if isinstance(value, str) and value.strip().lower() == self.word:
            return self.word
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        raise self._fail(value)

    def _describe(self) -> str:
        return f"'{self.word}' or an integer >= 1 ({self.unit})"

    def _schema(self) -> dict[str, Any]:
        return {"anyOf": [{"const": self.word}, {"type": "integer", "minimum": 1}]}
