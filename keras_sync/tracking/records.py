"""The spool protocol: the records a writer appends, why a delivery failed, and MLflow's limits.

A record is one JSON object per line of a spool segment; ``"k"`` is its kind (short spellings on
disk, so older spools still replay). The courier's last outcome, told to the writer, is
``{"ok": true}`` or ``{"ok": false, "cause": <one of CAUSES>, "error": ...}``.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from keras_sync.tracking.redact import redact_text

# Each kind, its fields, and what the courier does with it:
BEGIN = "begin"  # ts ms; reopen: logs after end_run; replayed: sent before. Picks the run, alone
METRICS = "m"  # s step, ts ms, d {key: value}; a point at a step its key has is dropped
PARAMS = "p"  # d {key: text}; MLflow params are immutable: the first value stays
TAGS = "t"  # d {key: text}
TEXT = "a"  # f artifact file, text
FILE = "f"  # src staged path, dir artifact dir (`keras_sync.tracking.artifacts`)
MODEL = "model"  # src staged directory, name, step: a model in MLflow's Keras flavour
REPORT = "report"  # f artifact file, h history: the sync report, drawn by the courier
END = "end"  # status, ts: the run ended; last: false when the writer goes on
STOP = "stop"  # the writer closed; its run had ended before
#: Kinds that carry nothing for MLflow: a count of what is left to deliver leaves them out.
BOOKKEEPING = (BEGIN, STOP)
#: Kinds kept in memory whatever the bound: small, and they end a run with the tag of what was lost.
ALWAYS_KEPT = (BEGIN, END, STOP, TAGS)
#: The line a writer sends its courier on its stdin to have the spool delivered now (it spooled a
#: record other than metric points, or a flush waits); points alone wait for the next batch.
WAKE_LINE = b'{"wake":1}\n'

UNREACHABLE = "unreachable"  # a tracking server that does not answer
FAILING_REQUESTS = "failing_requests"  # a server that answers some requests with errors (HTTP 503)
STORE_FAILING = "store_failing"  # a local store (sqlite, files) that raises
REFUSED = "refused"  # a server that answers with an error
CREDENTIALS = "credentials"  # HTTP 401/403: it does not fix itself
#: Each cause in the words of a warning.
CAUSES = {
    UNREACHABLE: "the tracking server {uri} is unreachable",
    FAILING_REQUESTS: "the tracking server {uri} fails requests",
    STORE_FAILING: "the local store {uri} fails",
    REFUSED: "MLflow at {uri} refuses them",
    CREDENTIALS: "MLflow at {uri} refused the credentials",
}

MAX_BATCH = 1000  # metrics + params + tags per `log_batch`
MAX_BATCH_PARAMS_AND_TAGS = 100
MAX_PARAM_VALUE_LENGTH = 6000
MAX_TAG_VALUE_LENGTH = 8000
MAX_KEY_LENGTH = 250
_log = logging.getLogger("keras_sync.tracking")
_BAD_KEY_CHARS = re.compile(r"[^\w.\- :/]")


def is_last_record(rec: dict[str, Any]) -> bool:
    """Whether a record is its writer's last (`MlflowWriter.close`): after it the courier ends."""
    return rec["k"] == STOP or (rec["k"] == END and rec.get("last", True))


def why_failing(status: dict[str, Any], uri: str) -> str:
    """Why delivery fails, from a failed status, for a message: the one wording of each cause.

    >>> why_failing({"cause": CREDENTIALS, "error": "HTTP 401 Unauthorized"}, "http://h:5000")
    'MLflow at http://h:5000 refused the credentials (HTTP 401 Unauthorized)'
    """
    words = CAUSES.get(status.get("cause") or "", "MLflow at {uri} fails").format(uri=uri)
    return f"{words} ({status.get('error', '')})"


def is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def is_remote(uri: str) -> bool:
    """Whether ``uri`` is a store elsewhere (a server or Databricks), not on this machine."""
    return uri.startswith(("http://", "https://", "databricks"))


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
    mark = "...[truncated]"
    return value if len(value) <= limit else value[: limit - len(mark)] + mark


class RecordCleaner:
    """Makes records fit for MLflow: valid metric keys, numbers, secrets scrubbed, values cut."""

    def __init__(self, secrets: Any) -> None:
        self._secrets = secrets
        self._keys: dict[str, str] = {}

    def __call__(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        """The record, cleaned in place; None when nothing is left (no metric was a number)."""
        if rec["k"] == METRICS:
            out = {}
            for key, v in rec["d"].items():
                if key not in self._keys:
                    clean = self._keys[key] = metric_key(key)
                    if clean != key:
                        _log.warning(
                            "Metric key %r is not valid in MLflow; logged as %r.", key, clean
                        )
                try:
                    out[self._keys[key]] = float(v)
                except (TypeError, ValueError):
                    _log.warning("Metric %r=%r is not a number; dropped.", key, v)
            rec["d"] = out
            return rec if out else None
        if rec["k"] in (PARAMS, TAGS):
            limit = MAX_PARAM_VALUE_LENGTH if rec["k"] == PARAMS else MAX_TAG_VALUE_LENGTH
            rec["d"] = {
                self._scrub(k, MAX_KEY_LENGTH): self._scrub(v, limit) for k, v in rec["d"].items()
            }
        elif rec["k"] == TEXT:
            rec["text"] = redact_text(rec["text"], self._secrets)
        return rec

    def _scrub(self, text: str, limit: int) -> str:
        return clip(redact_text(text, self._secrets), limit)
