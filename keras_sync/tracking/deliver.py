"""Sending spooled records to one MLflow run: find or create the run, batch, drop repeated steps.

The only keras-sync module that calls MLflow's tracking client. It carries out the writer's rule
of which run its records go to (told in `keras_sync.tracking.MlflowWriter`; what a `Sync` gives
the writer is told in `keras_sync.training.job_run`).

Every metric point at a step that its key already has in the run is dropped, so no run ever
holds two points at one (key, step): a batch re-sent after a crash, or the steps a restored job
trains again after its backup, keep the first point.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from keras_sync.tracking.environ import environ_restored
from keras_sync.tracking.records import (
    BEGIN,
    END,
    FILE,
    MAX_BATCH,
    MAX_BATCH_PARAMS_AND_TAGS,
    METRICS,
    MODEL,
    PARAMS,
    REPORT,
    STOP,
    TAGS,
    TEXT,
    is_http,
    is_last_record,
)
from keras_sync.tracking.retry import Retrier

_log = logging.getLogger("keras_sync.tracking")

# MLflow reads its HTTP retry settings from the environment on every request. Retrying is ours
# to do (per request, with a backoff any success resets: keras_sync.tracking.retry), so each of our
# calls runs with MLflow's retries off and a short timeout (MLflow's own, minutes per call against a
# dead server, would hold every other request behind one); the lock keeps two of our threads from
# interleaving their save/restore.
_ENV_LOCK = threading.Lock()
_FAST_FAIL_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
    # set_terminated otherwise prints "View run ... at: <tracking URI>" to stdout, password included.
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}
JOB_TAG = "keras_sync.job_id"


@contextlib.contextmanager
def fast_fail_env(tracking_uri: str, timeout_s: int) -> Iterator[None]:
    """Run MLflow HTTP calls with no retries and a short timeout; restore the user's values after.

    Also ``MLFLOW_TRACKING_URI`` for the call: MLflow 2.x resolves a server-served artifact URI
    (``mlflow-artifacts:/...``) with the process-wide tracking URI, not the client's. Set only
    during the call: the variable would also redirect a later `keras_sync.load()` of this process.
    """
    if not is_http(tracking_uri):
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
    if code is None:
        return True  # OSError, requests errors, sqlite "database is locked": try again
    return code in {
        "INTERNAL_ERROR",
        "TEMPORARILY_UNAVAILABLE",
        "REQUEST_LIMIT_EXCEEDED",
        "DEADLINE_EXCEEDED",
        "ABORTED",
        "IO_ERROR",
    }


#: MLflow's error codes of a refused credential, as the HTTP status the server answered.
_CREDENTIAL_CODES = {"UNAUTHENTICATED": 401, "CUSTOMER_UNAUTHORIZED": 401, "PERMISSION_DENIED": 403}


def refused_credentials(exc: BaseException) -> int | None:
    """401 or 403 when the tracking server refused the credentials (or their absence); else None.

    MLflow raises these with the server's whole response body (an HTML page behind a proxy):
    the status is all a person needs, so only it is kept.
    """
    return _CREDENTIAL_CODES.get(getattr(exc, "error_code", None) or "")


class RunSender:
    """Sends spooled records to one MLflow run through `MlflowClient`.

    Args:
        tracking_uri: where to send (credentials included; never written to disk).
        experiment, run_name: of a run it creates.
        job_id: the job's id; runs are found by the tag ``keras_sync.job_id``.
        explicit: the job id was given by the user: a FINISHED run with it is reopened.
        run_id: a run id recorded with the job's backup, tried first.
    """

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        run_name: str | None,
        job_id: str | None,
        *,
        explicit: bool = False,
        run_id: str | None = None,
        request_timeout_s: int = 5,
    ):
        self.tracking_uri = tracking_uri
        self.experiment, self.run_name, self.job_id = experiment, run_name, job_id
        self.explicit = explicit
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._hint = run_id
        self._checked = False
        self.request_timeout_s = request_timeout_s
        self._client: Any = None
        #: Per metric key, the highest step the run has; points at or below it are dropped.
        self.floors: dict[str, int] = {}
        self._floors_of: str | None = None  # the run whose steps `floors` holds
        self.dropped = 0
        self.start_time_ms: int | None = None
        #: Hold a `REPORT` (drawing it costs CPU time, that a fit started meanwhile would share the
        #: cores with) instead of drawing it at once: the courier draws the held one when the spool is
        #: idle, at the writer's last record, or never when a newer report of the run comes first (each
        #: holds the whole run's history). A report marked ``now`` (the process is killed as soon as
        #: `fit` returns) is drawn at once. ``keras-sync sync-spool`` does not hold.
        self.hold_reports = False
        #: (run id, record) of the held report; ``on_held`` is told of every change before the
        #: position moves past the record (the courier keeps it in the spool's ``report.json``).
        self.held_report: tuple[str, dict[str, Any]] | None = None
        self.on_held: Any = None
        #: Retries each MLflow call on its own until it succeeds (or its ``give_up`` says stop).
        self.retrier = Retrier(is_transient)
        #: Metric points MLflow has taken from this sender, request by request (a caller's progress).
        self.points_sent = 0

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """One MLflow call, retried alone on a transient failure (`retrier`)."""
        return self.retrier.call(self._call_once, fn, *args, **kwargs)

    def _call_once(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        with fast_fail_env(self.tracking_uri, self.request_timeout_s):
            return fn(*args, **kwargs)

    def client(self) -> Any:
        if self._client is None:
            from mlflow import MlflowClient

            from keras_sync.tracking.sqlite_store import ensure_sqlite_store

            ensure_sqlite_store(
                self.tracking_uri
            )  # a kill while MLflow builds it would leave it half-built
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def new_session(self, start_time_ms: int | None) -> None:
        """A writer (re)started: check the run again before the next batch (it may have ended)."""
        self._checked = False
        if self.start_time_ms is None:
            self.start_time_ms = start_time_ms

    def ensure_run(self, reopen: bool = False, continuing: bool = False) -> tuple[str, bool]:
        """Return (run id, whether it changed now): find, reopen or create the job's run.

        ``reopen``: the writer of this run logs again after ending it (``begin`` with ``reopen``):
        the run this sender was writing is continued even if FINISHED.
        ``continuing``: the records are the rest of a session whose run an earlier courier of the
        spool chose (``self.run_id``, from run.json): they go to that run as it is, ended or not,
        its status untouched (what follows a run's end: a "stop", a report, a replayed batch).
        """
        if self.run_id is not None and self._checked:
            return self.run_id, False
        before = self.run_id
        c = self.client()
        run = self._get_run(self.run_id) if continuing and self.run_id is not None else None
        continued = run is not None  # taken as it is: no status change
        for candidate in (self.run_id, self._hint) if run is None else ():
            if candidate is not None:
                run = self._usable(
                    self._get_run(candidate), reopen=reopen and candidate == self.run_id
                )
                if run is not None:
                    break
        if run is None and self.job_id is not None:
            run = self._call(self._find_job_run, self._experiment_id())
        if run is None:
            run = self._create_run(self._experiment_id())
            self.floors = {}
        else:
            if run.info.status != "RUNNING" and not continued:
                self._call(c.update_run, run.info.run_id, status="RUNNING")
            if (
                run.info.run_id != self._floors_of
            ):  # also a run id an earlier courier of this spool found
                self.floors = self._logged_steps(run)
        self.run_id, self._checked, self._hint = run.info.run_id, True, None
        self._floors_of = self.run_id
        self.experiment_id = run.info.experiment_id
        return self.run_id, self.run_id != before

    def _create_run(self, exp_id: str) -> Any:
        """Create the job's run; a retry first looks for the run a failed try may have made after all.

        A gateway can lose the answer to a request the server carried out (a 502 or a timeout after
        the run was made): sending ``create_run`` again would make a second run of the job.
        """
        c = self.client()
        tags = {JOB_TAG: self.job_id} if self.job_id is not None else None
        tried = False

        def attempt() -> Any:
            nonlocal tried
            made = self._find_job_run(exp_id) if tried and self.job_id is not None else None
            if made is not None:
                return made
            tried = True
            return c.create_run(
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
        return next((r for r in map(self._usable, found) if r is not None), None)

    def _get_run(self, run_id: str) -> Any:
        try:
            run = self._call(self.client().get_run, run_id)
        except Exception as e:
            if is_transient(e):
                raise
            return None  # deleted, or another store: look the job up by its tag
        return run if run.info.lifecycle_stage == "active" else None

    def _usable(self, run: Any, reopen: bool = False) -> Any:
        """The run, unless it is FINISHED and neither the job id was given explicitly nor ``reopen``."""
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
        """The highest step of every metric the run has (MLflow's public metric histories)."""
        floors: dict[str, int] = {}
        for key in run.data.metrics:
            history = self._call(self.client().get_metric_history, run.info.run_id, key)
            if history:
                floors[key] = max(m.step for m in history)
        return floors

    def send(self, records: list[dict[str, Any]], done: Callable[[int], None] | None = None) -> int:
        """Deliver records in order; return how many metric points were sent.

        ``done(i)``: called after each request MLflow took, with the index of the last record it now has whole.
        """
        from mlflow.entities import Metric, Param, RunTag

        if all(rec["k"] == STOP for rec in records):  # a writer that logged nothing: no run to make
            self.release_report()  # (or one whose last report is held)
            return 0
        if records and records[0]["k"] != BEGIN:  # a "begin" sets the start time of a new run first
            self.ensure_run(continuing=True)
        c = self.client()
        metrics: list[Any] = []
        params: list[Any] = []
        tags: list[Any] = []
        floors = dict(self.floors)  # committed only when the batch is accepted
        sent = dropped = 0
        had = -1  # the last record MLflow has whole (told to ``done``)

        def took(i: int) -> None:
            nonlocal had
            if done is not None and i > had:
                had = i
                done(i)

        def flush(upto: int) -> None:  # the batch holds records up to ``upto``
            nonlocal sent
            if metrics or params or tags:
                self._send_batch(metrics, params, tags)
                sent += len(metrics)
                self.points_sent += len(metrics)
                self.floors.update(floors)
                metrics.clear()
                params.clear()
                tags.clear()
                took(upto)

        for i, rec in enumerate(records):
            k = rec["k"]
            flush_upto = i - 1
            if k == METRICS:
                if len(metrics) + len(rec["d"]) + len(params) + len(tags) > MAX_BATCH:
                    flush(flush_upto)
                step = rec["s"]
                for key, v in rec["d"].items():
                    if step > floors.get(key, step - 1):
                        metrics.append(Metric(key, v, rec["ts"], step))
                        floors[key] = step
                    else:
                        dropped += 1
            elif k in (PARAMS, TAGS):
                if len(params) + len(tags) + len(rec["d"]) > MAX_BATCH_PARAMS_AND_TAGS:
                    flush(flush_upto)
                target, cls = (params, Param) if k == PARAMS else (tags, RunTag)
                target.extend(cls(key, v) for key, v in rec["d"].items())
            elif k == TEXT:
                flush(flush_upto)
                self._call(c.log_text, self.run_id, rec["text"], rec["f"])
                took(i)
            elif k in (FILE, MODEL):  # staged files and models: keras_sync.tracking.artifacts
                flush(flush_upto)
                from keras_sync.tracking import artifacts as _artifacts

                _artifacts.deliver(c, str(self.run_id), rec, self._call)
                took(i)
            elif k == END:
                flush(flush_upto)
                if is_last_record(rec):
                    self.release_report()
                self._call(
                    c.set_terminated, self.run_id, status=rec["status"], end_time=rec.get("ts")
                )
                took(i)
            elif k == STOP:  # the writer closed after ending the run: nothing to send
                flush(flush_upto)
                self.release_report()
            elif k == REPORT:  # drawn here, not in the training process
                flush(flush_upto)
                if self.hold_reports and not rec.get("now") and self._hold_report(rec):
                    continue
                self._deliver_report(rec)
                if self.held_report is not None and self._same_picture(rec):
                    self._set_held(None)  # the newer picture went: the held one is older
                took(i)
            elif k == BEGIN:
                flush(flush_upto)
                self.new_session(rec.get("ts"))
                if rec.get(
                    "replayed"
                ):  # sent before by a courier killed before it moved the position
                    self.ensure_run(continuing=True)
                else:
                    self.ensure_run(reopen=bool(rec.get("reopen")))
                floors = dict(self.floors)  # the run may be another one now
        flush(len(records) - 1)
        self.dropped += dropped
        return sent

    def _hold_report(self, rec: dict[str, Any]) -> bool:
        """Hold ``rec`` instead of drawing it now (see `hold_reports`); False if it cannot be kept."""
        if self.held_report is not None and not self._same_picture(rec):
            self.release_report()  # another run's, or another file: drawn first
        try:
            self._set_held((str(self.run_id), rec))
        except OSError:  # the spool's disk refuses report.json: drawn now, as without holding
            return False
        return True

    def _same_picture(self, rec: dict[str, Any]) -> bool:
        """Whether ``rec`` draws the held report's file of the same run (a newer one: the history is the run's)."""
        held = self.held_report
        return (
            held is not None
            and held[0] == self.run_id
            and (held[1].get("f"), held[1].get("dir")) == (rec.get("f"), rec.get("dir"))
        )

    def _set_held(self, held: tuple[str, dict[str, Any]] | None) -> None:
        if self.on_held is not None:
            self.on_held(held)
        self.held_report = held

    def release_report(self) -> None:
        """Draw and upload the held report into its run, if any; raises what the upload raised (kept held)."""
        if self.held_report is None:
            return
        run_id, rec = self.held_report
        self._deliver_report(rec, run_id)
        try:
            self._set_held(None)
        except OSError:  # report.json stays: a later courier draws it once more, into the same file
            self.held_report = None

    def _deliver_report(self, rec: dict[str, Any], run_id: str | None = None) -> None:
        """Draw a `keras_sync.SyncReport` picture from its data and upload it (to ``run_id``, default the run).

        A picture that cannot be drawn is skipped with a warning; an upload that fails raises
        (retried with the batch, like any other record).
        """
        import shutil
        import tempfile
        from pathlib import Path

        from keras_sync.tracking.report_plot import SyncHistory, render

        tmp = Path(tempfile.mkdtemp(prefix="keras-sync-report-"))
        try:
            path = tmp / rec["f"]
            try:
                render(SyncHistory.from_dict(rec["h"]), path)
            except Exception as e:
                _log.warning(
                    "keras-sync could not draw %s (%s: %s); the metrics are delivered as usual.",
                    rec["f"],
                    type(e).__name__,
                    e,
                )
                return
            self._call(self.client().log_artifact, run_id or self.run_id, str(path), rec.get("dir"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _send_batch(self, metrics: list[Any], params: list[Any], tags: list[Any]) -> None:
        c = self.client()
        try:
            self._call(c.log_batch, self.run_id, metrics=metrics, params=params, tags=tags)
        except Exception as e:
            if is_transient(e) or not params:
                raise
            # A param logged before with another value is refused for good (params are
            # immutable); send the rest without it rather than retry the batch forever.
            self._call(c.log_batch, self.run_id, metrics=metrics, params=[], tags=tags)
            for p in params:
                try:
                    self._call(c.log_batch, self.run_id, params=[p])
                except Exception as pe:
                    if is_transient(pe):
                        raise
                    _log.warning(
                        "MLflow refused param %r (logged before with another value?); "
                        "it is dropped, the rest of the batch was delivered.",
                        p.key,
                    )
