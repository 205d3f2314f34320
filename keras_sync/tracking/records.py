"""The spool protocol: what a writer appends, why a delivery failed, and MLflow's limits, defined once.

The writer (`keras_sync.tracking.MlflowWriter`) appends records to the spool
(`keras_sync.tracking.spool`, its files); the courier (`keras_sync.tracking.courier`) reads them in
order and its `RunSender` (`keras_sync.tracking.deliver`) sends them to one MLflow run. A record is one
JSON object per line whose ``"k"`` is its kind. The kinds keep their short spellings on disk (a spool
left by an earlier version is still delivered by ``keras-sync sync-spool``); code names them by the
constants below, never by the letter.

==============  =============================================================================
kind            fields, and what the courier does with it
==============  =============================================================================
`BEGIN`         ``ts`` (start, ms); ``reopen`` when the writer logs again after ending its run
                (the next ``fit``); the courier adds ``replayed`` to one it sent before. Picks
                the run (`keras_sync.tracking.MlflowWriter` says which one) and always goes alone.
`METRICS`       ``s`` step, ``ts`` ms, ``d`` {key: value}: metric points at one step; a point at a
                step its key already has in the run is dropped.
`PARAMS`        ``d`` {key: text}: MLflow params (immutable: the first value stays).
`TAGS`          ``d`` {key: text}: MLflow tags.
`TEXT`          ``f`` artifact file, ``text``: a text artifact.
`FILE`          ``src`` staged path, ``dir`` artifact dir: a file or directory of files
                (`keras_sync.tracking.artifacts`).
`MODEL`         ``src`` staged directory, ``name``, ``step``: a model in MLflow's Keras flavour.
`REPORT`        ``f`` artifact file, ``h`` history: the sync report, drawn by the courier
                (`keras_sync.tracking.report_plot`), not in the training process. The courier
                holds it (in the spool's ``report.json``) until no record came for a while (2 s,
                at most 120 s held), the writer's last record, or a newer one of the same file;
                ``now`` (an epoch's, or one the writer waits for): drawn at once.
`END`           ``status``, ``ts``: the run ended; ``last: false`` when the writer goes on.
`STOP`          the writer closed; its run had ended before.
==============  =============================================================================

After its writer's last record (`is_last_record`) the courier ends. The courier's last outcome
(``status.json``) is ``{"ok": true}`` or ``{"ok": false, "cause": <one of CAUSES>, "error": ...}``.
"""

from __future__ import annotations

from typing import Any

BEGIN = "begin"
METRICS = "m"
PARAMS = "p"
TAGS = "t"
TEXT = "a"
FILE = "f"
MODEL = "model"
REPORT = "report"
END = "end"
STOP = "stop"
#: Every record kind, in the order of the table above.
KINDS = (BEGIN, METRICS, PARAMS, TAGS, TEXT, FILE, MODEL, REPORT, END, STOP)
#: Kinds that carry nothing for MLflow: a count of what is left to deliver leaves them out.
BOOKKEEPING = (BEGIN, STOP)
#: Kinds that stay in memory whatever the bound: small, and they end a run with the tag of what was lost.
ALWAYS_KEPT = (BEGIN, END, STOP, TAGS)

#: Why the courier's last delivery failed (``status.json``'s ``cause``), and how a person is told:
#: the words of the warning once behind, and the word of the one-line log when it first happens.
UNREACHABLE = "unreachable"  # a tracking server that does not answer (transient errors)
FAILING_REQUESTS = (
    "failing_requests"  # a tracking server that answers some requests with errors (HTTP 503)
)
STORE_FAILING = "store_failing"  # a local store (sqlite, files) that raises
REFUSED = "refused"  # a server that answers with an error
CREDENTIALS = "credentials"  # HTTP 401/403: it does not fix itself
CAUSES: dict[str, tuple[str, str]] = {
    UNREACHABLE: ("the tracking server {uri} is unreachable", "unreachable"),
    FAILING_REQUESTS: ("the tracking server {uri} fails requests", "failing requests"),
    STORE_FAILING: ("the local store {uri} fails", "failing"),
    REFUSED: ("MLflow at {uri} refuses them", "refusing records"),
    CREDENTIALS: ("MLflow at {uri} refused the credentials", "refusing the credentials"),
}

#: MLflow's `log_batch` takes at most this many metrics + params + tags per call.
MAX_BATCH = 1000
#: MLflow's `log_batch` takes at most this many params + tags per call.
MAX_BATCH_PARAMS_AND_TAGS = 100
MAX_PARAM_VALUE_LENGTH = 6000  # MLflow 3.x; longer values are refused
MAX_TAG_VALUE_LENGTH = 8000
MAX_KEY_LENGTH = 250


def is_last_record(rec: dict[str, Any]) -> bool:
    """Whether a spool record is its writer's last: after it the courier ends.

    `END` from `MlflowWriter.close` (``last`` absent in spools of earlier versions) or `STOP`;
    the `END` of `MlflowWriter.end_run` ends the MLflow run but not the writer.

    >>> is_last_record({"k": END, "status": "FINISHED"}), is_last_record({"k": END, "last": False})
    (True, False)
    """
    return rec["k"] == STOP or (rec["k"] == END and rec.get("last", True))


def cause_in_words(cause: str | None, uri: str) -> str:
    """Why delivery failed, for a warning: ``"the tracking server http://... is unreachable"``.

    >>> cause_in_words(CREDENTIALS, "http://127.0.0.1:5000")
    'MLflow at http://127.0.0.1:5000 refused the credentials'
    """
    return CAUSES[cause][0].format(uri=uri) if cause in CAUSES else "MLflow fails"


def cause_in_a_word(cause: str | None) -> str:
    """The state of the store in a word or two, for ``MLflow at <uri> is <...>``."""
    return CAUSES[cause][1] if cause in CAUSES else "refusing records"


def is_http(uri: str) -> bool:
    """Whether MLflow is reached over HTTP(S) at ``uri`` (a tracking server with a web UI of its own).

    >>> is_http("https://mlflow.example"), is_http("databricks"), is_http("sqlite:///m.db")
    (True, False, False)
    """
    return uri.startswith(("http://", "https://"))


def is_remote(uri: str) -> bool:
    """Whether ``uri`` is a store elsewhere (a server or Databricks) rather than one on this machine.

    >>> is_remote("databricks://profile"), is_remote("http://127.0.0.1:5000"), is_remote("file:///tmp/mlruns")
    (True, True, False)
    """
    return is_http(uri) or uri.startswith("databricks")
