"""A record made fit for MLflow before it is spooled: valid metric keys, numbers, secrets scrubbed,
values cut to MLflow's limits."""

from __future__ import annotations

import logging
import re
from typing import Any

from keras_sync.tracking.records import (
    MAX_KEY_LENGTH,
    MAX_PARAM_VALUE_LENGTH,
    MAX_TAG_VALUE_LENGTH,
    METRICS,
    PARAMS,
    TAGS,
    TEXT,
)
from keras_sync.tracking.redact import redact_text

_log = logging.getLogger("keras_sync.tracking")
_TRUNCATED = "...[truncated]"
_BAD_KEY_CHARS = re.compile(r"[^\w.\- :/]")


def metric_key(key: str) -> str:
    """A metric key MLflow takes: ``a@b`` -> ``a_b``, no leading ``/``, no ``..``.

    >>> metric_key("/loss@0/../x")
    'loss_0/__/x'
    """
    clean = _BAD_KEY_CHARS.sub("_", str(key)).lstrip("/")
    clean = re.sub(r"/+", "/", clean).replace("..", "__")[:MAX_KEY_LENGTH]
    return clean if clean not in ("", ".") else "_"


def clip(value: str, limit: int) -> str:
    """``value`` cut to ``limit`` characters, marked as cut."""
    return value if len(value) <= limit else value[: limit - len(_TRUNCATED)] + _TRUNCATED


class RecordCleaner:
    """Cleans records in place; says once per metric key that it was rewritten."""

    def __init__(self, secrets: Any) -> None:
        self._secrets = secrets
        self._keys: dict[str, str] = {}

    def __call__(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        """The record fit to spool, or None when nothing of it is left (no metric was a number)."""
        k = rec["k"]
        if k == METRICS:
            out = {}
            for key, v in rec["d"].items():
                clean = self._keys.get(key)
                if clean is None:
                    clean = self._keys[key] = metric_key(key)
                    if clean != key:
                        _log.warning(
                            "Metric key %r is not valid in MLflow; logged as %r.", key, clean
                        )
                try:
                    out[clean] = float(v)
                except (TypeError, ValueError):
                    _log.warning("Metric %r=%r is not a number; dropped.", key, v)
            rec["d"] = out
            return rec if out else None
        if k in (PARAMS, TAGS):
            limit = MAX_PARAM_VALUE_LENGTH if k == PARAMS else MAX_TAG_VALUE_LENGTH
            rec["d"] = {
                clip(redact_text(key, self._secrets), MAX_KEY_LENGTH): clip(
                    redact_text(v, self._secrets), limit
                )
                for key, v in rec["d"].items()
            }
        elif k == TEXT:
            rec["text"] = redact_text(rec["text"], self._secrets)
        return rec
