"""Sending records to one MLflow run through `MlflowClient`: find or create the run, batch, retry.

A point at a step its key already has in the run is dropped (a re-sent batch, a resumed job's
steps). Each transient failure is retried alone (`Retrier`) with a backoff any success resets;
MLflow's own retries are off (`fast_fail_env`, its variables put back by `environ_restored`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from keras_sync.tracking import artifacts
from keras_sync.tracking import records as r
from keras_sync.tracking.report_plot import SyncHistory, upload
from keras_sync.tracking.sqlite_store import ensure_sqlite_store

T = TypeVar("T")
_log = logging.getLogger("keras_sync.tracking")
JOB_TAG = "keras_sync.job_id"
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
#: After a failure, this many successes in a row make the server healthy again.
HEALTHY_AFTER = 20
#: Kinds of failure that mean the server did not answer at all, and the words that tell them.
_NO_ANSWER = {
    "connection refused": ("connection refused", "failed to establish a new connection"),
    "a timeout": ("timeout", "timed out"),
    "a dropped connection": ("connection aborted", "remotedisconnected", "connection reset"),
}
_HTTP = re.compile(
    r"too many (\d{3}) error responses|failed with error code (\d{3})|\bHTTP (\d{3})\b"
)
_TRANSIENT_CODES = {
    "INTERNAL_ERROR",
    "TEMPORARILY_UNAVAILABLE",
    "REQUEST_LIMIT_EXCEEDED",
    "DEADLINE_EXCEEDED",
    "ABORTED",
    "IO_ERROR",
}
_CREDENTIAL_CODES = {"UNAUTHENTICATED": 401, "CUSTOMER_UNAUTHORIZED": 401, "PERMISSION_DENIED": 403}
# MLflow reads these on every request; the lock keeps two threads from interleaving save/restore.
_ENV_LOCK = threading.Lock()
_FAST_FAIL_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
    # set_terminated otherwise prints "View run ... at: <tracking URI>", password included.
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}


@contextlib.contextmanager
def environ_restored(*keys: str) -> Iterator[None]:
    """Inside: change ``keys`` freely. After: each has the value it had, or is absent if it was.

    >>> os.environ.pop("KS_DOCTEST", None)
    >>> with environ_restored("KS_DOCTEST"):
    ...     os.environ["KS_DOCTEST"] = "1"
    >>> "KS_DOCTEST" in os.environ
    False
    """
    saved = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def fast_fail_env(tracking_uri: str, timeout_s: int) -> Iterator[None]:
    """MLflow HTTP calls with no retries, a short timeout and ``MLFLOW_TRACKING_URI`` set."""
    if not r.is_http(tracking_uri):
        yield
        return
    wanted = dict(
        _FAST_FAIL_ENV,
        MLFLOW_HTTP_REQUEST_TIMEOUT=str(max(1, int(timeout_s))),
        MLFLOW_TRACKING_URI=tracking_uri,
    )
    with _ENV_LOCK, environ_restored(*wanted):
        os.environ.update(wanted)
        yield


def is_transient(exc: BaseException) -> bool:
    """True if a failed MLflow call may succeed later (server down, overloaded, store locked)."""
    code = getattr(exc, "error_code", None)
    return code is None or code in _TRANSIENT_CODES


def refused_credentials(exc: BaseException) -> int | None:
    """401 or 403 when the server refused the credentials, else None."""
    return _CREDENTIAL_CODES.get(getattr(exc, "error_code", None) or "")


def failure_kind(exc: BaseException) -> str:
    """What a failed request met, in a few words.

    >>> failure_kind(Exception("Max retries exceeded (Caused by ResponseError('too many 503 error responses'))"))
    'HTTP 503'
    >>> failure_kind(ConnectionRefusedError("[Errno 111] Connection refused"))
    'connection refused'
    """
    if m := _HTTP.search(str(exc)):
        return f"HTTP {next(g for g in m.groups() if g)}"
    low = str(exc).lower()
    kind = next((kind for kind, words in _NO_ANSWER.items() if any(w in low for w in words)), None)
    return kind or str(getattr(exc, "error_code", None) or type(exc).__name__)


def in_words(requests: int, failures: Counter[str]) -> str:
    """``"7 of 40 requests failed with HTTP 503"``; several kinds, most first, each with its count.

    >>> in_words(40, Counter({"HTTP 503": 7, "HTTP 500": 5}))
    '12 of 40 requests failed: HTTP 503 (7), HTTP 500 (5)'
    """
    n = sum(failures.values())
    if len(failures) == 1:
        return f"{n} of {requests} requests failed with {next(iter(failures))}"
    kinds = ", ".join(f"{kind} ({count})" for kind, count in failures.most_common())
    return f"{n} of {requests} requests failed: {kinds}"


class Retrier:
    """Retries each ``transient`` failure of a request until it succeeds or `give_up` says stop."""

    def __init__(
        self,
        transient: Callable[[BaseException], bool],
        *,
        give_up: Callable[[], bool] = lambda: False,
        on_change: Callable[[Retrier], None] = lambda retrier: None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.transient, self.give_up = transient, give_up
        self.on_change, self._sleep = on_change, sleep
        self.backoff = 0.0
        self.requests = 0  # since the first failure
        self.failures: Counter[str] = Counter()
        self.succeeded_in_a_row = 0
        self.failing_since: float | None = None  # wall time of the first failure
        self.answered_at: float | None = None  # wall time of the last success
        self.last_error: BaseException | None = None

    @property
    def failing(self) -> bool:
        return self.failing_since is not None

    def unreachable(self) -> bool:
        """Whether every request since the first failure failed without an answer."""
        no_answer = set(self.failures) <= set(_NO_ANSWER)
        return self.failing and no_answer and self.requests == sum(self.failures.values())

    def summary(self) -> str:
        """What happened to the requests since they started failing ("" while healthy)."""
        return in_words(self.requests, self.failures) if self.failures else ""

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        while True:
            try:
                result = fn(*args, **kwargs)
            except Exception as e:
                if not self.transient(e):
                    raise  # a refusal is not this policy's to count or retry
                self.last_error = e
                if self.failing_since is None:
                    self.failing_since, self.requests = time.time(), 0
                self.requests += 1
                self.failures[failure_kind(e)] += 1
                self.succeeded_in_a_row = 0
                self.backoff = min(max(self.backoff * 2, FIRST_BACKOFF_S), MAX_BACKOFF_S)
                self.on_change(self)
                if self.give_up() or not self._wait():
                    raise
                continue
            self.backoff, self.answered_at = 0.0, time.time()
            self.requests += 1
            self.succeeded_in_a_row += 1
            if self.failing:
                if self.succeeded_in_a_row >= HEALTHY_AFTER:
                    self.failing_since, self.failures, self.requests = None, Counter(), 0
                self.on_change(self)
            return result

    def _wait(self) -> bool:
        """Sleep the backoff in short slices; False if `give_up` said stop meanwhile."""
        left = self.backoff
        while left > 1e-9:
            self._sleep(min(left, 0.1))
            left -= 0.1
            if self.give_up():
                return False
        return True


class RunSender:
    """Sends records to the job's run: ``run_id`` if usable, else the one tagged with its job id."""

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        run_name: str | None,
        job_id: str | None,
        *,
        explicit: bool = False,
        run_id: str | None = None,
    ):
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.job_id, self.explicit, self._hint = job_id, explicit, run_id
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._checked = False
        self._client: Any = None
        #: Per metric key, the highest step the run has; points at or below it are dropped.
        self.floors: dict[str, int] = {}
        self._floors_of: str | None = None  # the run whose steps `floors` holds
        self.dropped = self.points_sent = 0
        self.start_time_ms: int | None = None
        self.retrier = Retrier(is_transient)

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        def once() -> T:
            with fast_fail_env(self.tracking_uri, 5):
                return fn(*args, **kwargs)

        return self.retrier.call(once)

    def client(self) -> Any:
        if self._client is None:
            from mlflow import MlflowClient

            ensure_sqlite_store(self.tracking_uri)  # a kill while MLflow builds it: half-built
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def ensure_run(self, reopen: bool = False, continuing: bool = False) -> None:
        """Find, reopen (even FINISHED) or create the job's run; ``continuing``: as it is."""
        if self.run_id is not None and self._checked:
            return
        run = self.get_run(self.run_id) if continuing and self.run_id is not None else None
        continued = run is not None  # taken as it is: no status change
        for candidate in (self.run_id, self._hint) if run is None else ():
            if candidate is not None:
                run = self._usable(self.get_run(candidate), reopen and candidate == self.run_id)
                if run is not None:
                    break
        if run is None and self.job_id is not None:
            run = self._call(self._find_job_run, self._experiment_id())
        if run is None:
            run = self._create_run(self._experiment_id())
            self.floors = {}
        else:
            if run.info.status != "RUNNING" and not continued:
                self._call(self.client().update_run, run.info.run_id, status="RUNNING")
            if run.info.run_id != self._floors_of:
                self.floors = self._logged_steps(run)
        self.run_id, self._checked, self._hint = run.info.run_id, True, None
        self._floors_of, self.experiment_id = self.run_id, run.info.experiment_id

    def _create_run(self, exp_id: str) -> Any:
        """Create the job's run; a retry first looks for the run a try whose answer was lost made."""
        tags = {JOB_TAG: self.job_id} if self.job_id is not None else None
        tried = False

        def attempt() -> Any:
            nonlocal tried
            made = self._find_job_run(exp_id) if tried and self.job_id is not None else None
            tried = True
            return made or self.client().create_run(
                exp_id, start_time=self.start_time_ms, run_name=self.run_name, tags=tags
            )

        return self._call(attempt)

    def _find_job_run(self, exp_id: str) -> Any:
        """The newest usable run tagged with the job's id, or None."""
        found = self.client().search_runs(
            [exp_id],
            filter_string=f"tags.`{JOB_TAG}` = '{self.job_id}'",
            max_results=20,
            order_by=["attributes.start_time DESC"],
        )
        return next((run for run in map(self._usable, found) if run is not None), None)

    def get_run(self, run_id: str) -> Any:
        """The run if it exists and is not deleted, else None; a transient failure raises."""
        try:
            run = self._call(self.client().get_run, run_id)
        except Exception as e:
            if is_transient(e):
                raise
            return None  # deleted, or another store: look the job up by its tag
        return run if run.info.lifecycle_stage == "active" else None

    def _usable(self, run: Any, reopen: bool = False) -> Any:
        """The run, unless it is FINISHED and neither the job id was explicit nor ``reopen``."""
        if run is None or (run.info.status == "FINISHED" and not (self.explicit or reopen)):
            return None
        return run

    def _experiment_id(self) -> str:
        c = self.client()
        exp = self._call(c.get_experiment_by_name, self.experiment)
        if exp is not None:
            return exp.experiment_id
        try:
            return self._call(c.create_experiment, self.experiment)
        except Exception as e:  # another process created it first
            if getattr(e, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                raise
            return self._call(c.get_experiment_by_name, self.experiment).experiment_id

    def _logged_steps(self, run: Any) -> dict[str, int]:
        """The highest step of every metric the run has."""
        floors: dict[str, int] = {}
        for key in run.data.metrics:
            history = self._call(self.client().get_metric_history, run.info.run_id, key)
            if history:
                floors[key] = max(m.step for m in history)
        return floors

    def send(
        self, records: list[dict[str, Any]], done: Callable[[int], None] = lambda i: None
    ) -> int:
        """Deliver records in order; return the points sent; ``done(i)``: MLflow has up to ``i``."""
        from mlflow.entities import Metric, Param, RunTag

        if all(rec["k"] == r.STOP for rec in records):  # a writer that logged nothing: no run
            return 0
        if records and records[0]["k"] != r.BEGIN:
            self.ensure_run(continuing=True)
        metrics: list[Any] = []
        params: list[Any] = []
        tags: list[Any] = []
        floors = dict(self.floors)  # committed only when the batch is accepted
        sent = self.points_sent

        def flush(upto: int) -> None:
            if metrics or params or tags:
                self._send_batch(metrics, params, tags)
                self.points_sent += len(metrics)
                self.floors.update(floors)
                del metrics[:], params[:], tags[:]
                if upto >= 0:
                    done(upto)

        for i, rec in enumerate(records):
            k = rec["k"]
            if k == r.METRICS:
                if len(metrics) + len(params) + len(tags) + len(rec["d"]) > r.MAX_BATCH:
                    flush(i - 1)
                for key, v in rec["d"].items():
                    if rec["s"] > floors.get(key, rec["s"] - 1):
                        metrics.append(Metric(key, v, rec["ts"], rec["s"]))
                        floors[key] = rec["s"]
                    else:
                        self.dropped += 1
                continue
            if k in (r.PARAMS, r.TAGS):
                if len(params) + len(tags) + len(rec["d"]) > r.MAX_BATCH_PARAMS_AND_TAGS:
                    flush(i - 1)
                target, cls = (params, Param) if k == r.PARAMS else (tags, RunTag)
                target.extend(cls(key, v) for key, v in rec["d"].items())
                continue
            flush(i - 1)
            if k == r.TEXT:
                self._call(self.client().log_text, self.run_id, rec["text"], rec["f"])
            elif k in (r.FILE, r.MODEL):
                artifacts.deliver(self.client(), str(self.run_id), rec, self._call)
            elif k == r.END:  # (a STOP: the writer closed after ending the run, nothing to send)
                end = self.client().set_terminated
                self._call(end, self.run_id, status=rec["status"], end_time=rec.get("ts"))
            elif k == r.REPORT:
                log = self.client().log_artifact
                history = SyncHistory.from_dict(rec["h"])
                upload(history, rec["f"], lambda p: self._call(log, self.run_id, p, rec.get("dir")))
            elif k == r.BEGIN:
                self._checked = False  # a writer (re)started: check the run again
                self.start_time_ms = self.start_time_ms or rec.get("ts")
                if rec.get("replayed"):  # sent before by a courier killed before it moved on
                    self.ensure_run(continuing=True)
                else:
                    self.ensure_run(reopen=bool(rec.get("reopen")))
                floors = dict(self.floors)  # the run may be another one now
            done(i)
        flush(len(records) - 1)
        return self.points_sent - sent

    def _send_batch(self, metrics: list[Any], params: list[Any], tags: list[Any]) -> None:
        log_batch = self.client().log_batch
        try:
            self._call(log_batch, self.run_id, metrics=metrics, params=params, tags=tags)
        except Exception as e:
            if is_transient(e) or not params:
                raise
            # A param logged before with another value is refused for good: send the rest.
            self._call(log_batch, self.run_id, metrics=metrics, params=[], tags=tags)
            for p in params:
                try:
                    self._call(log_batch, self.run_id, params=[p])
                except Exception as pe:
                    if is_transient(pe):
                        raise
                    _log.warning(f"MLflow refused param {p.key!r} (logged before?); it is dropped.")
