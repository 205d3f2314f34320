"""MLflow tracking that never stalls training and loses nothing: `MlflowWriter` only queues
records; a thread (`keras_sync.tracking.spooler`) moves them to a spool directory and a courier
process delivers it. A restarted job, or ``keras-sync sync-spool DIR``, delivers what a killed
process left, once."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import sys
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from keras_sync.config import MlflowConfig
from keras_sync.errors import TrackingError
from keras_sync.tracking import records
from keras_sync.tracking.artifacts import stage
from keras_sync.tracking.courier import replay_spool
from keras_sync.tracking.redact import redact_uri, secrets_of
from keras_sync.tracking.spool import SpoolDir
from keras_sync.tracking.spooler import LOST_TAG, STALL_S, Spooler

__all__ = [
    "LOST_TAG",
    "MlflowWriter",
    "Writer",
    "end_runs_at_exit_as",
    "redact_uri",
    "replay_spool",
    "resolve_tracking_uri",
    "run_url",
]

_JOB_ID = re.compile(r"^[\w.:/@+\-]{1,250}$")
#: Records that do not reopen a run `end_run` ended (any other does, its steps continuing).
_NOT_REOPENING = (records.END, records.STOP, records.REPORT)
_CLOSED = "MlflowWriter is closed; create a new writer to log more."
RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")
#: The longest a preempted process (its run ending KILLED) waits at exit for delivery (seconds).
PREEMPTED_EXIT_WAIT_S = 10.0
_live_writers: weakref.WeakSet[MlflowWriter] = weakref.WeakSet()
_exit_status: str | None = None


def resolve_tracking_uri(
    configured: str | None, *, cwd: str | os.PathLike[str] | None = None
) -> tuple[str, str]:
    """``(configured, "config")``, or MLflow 3's default ``(sqlite:///<cwd>/mlflow.db, "default")``."""
    if configured:
        return configured, "config"
    base = Path(cwd) if cwd is not None else Path.cwd()
    return f"sqlite:///{base.resolve() / 'mlflow.db'}", "default"


def run_url(tracking_uri: str, experiment_id: str | None, run_id: str) -> str | None:
    """The MLflow UI page of a run on a tracking server (credentials removed); None for a local store."""
    if not records.is_http(tracking_uri) or experiment_id is None:
        return None
    base = str(redact_uri(tracking_uri)).split("?", 1)[0].rstrip("/")
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


@runtime_checkable
class Writer(Protocol):
    """What the keras-sync callbacks write through (on the chief, from the training thread, so
    quickly): `MlflowWriter` or an object of your own; ``step`` is the job's optimizer step.
    Used when present: ``flush_to_spool(timeout_s)``, ``end_of_fit()``, ``end_run(status, timeout_s)``.
    """

    def log_metrics(
        self, metrics: dict[str, float], step: int, timestamp_ms: int | None = None
    ) -> None: ...

    def log_params(self, params: dict[str, object]) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def log_text_artifact(self, text: str, artifact_file: str) -> None: ...

    def log_artifact_file(
        self, local_path: str | os.PathLike[str], artifact_path: str | None = None
    ) -> None: ...

    def flush(self, timeout_s: float | None = None) -> bool: ...


def _invalid(name: str, value: Any, expected: str) -> TrackingError:
    return TrackingError(
        f"Invalid value for argument `{name}`. Received: {name}={value!r}. Expected {expected}."
    )


def _check_status(status: str) -> None:
    if status not in RUN_STATUSES:
        raise _invalid("status", status, f"one of {', '.join(RUN_STATUSES)}")


def _now_ms() -> int:
    return int(time.time() * 1000)


def end_runs_at_exit_as(status: str) -> None:
    """Make the exit's close of open writers end their runs with ``status`` instead of FINISHED
    (a preempted process's KILLED run is reopened by its relaunch)."""
    global _exit_status
    _check_status(status)
    _exit_status = status


@atexit.register
def _close_at_exit() -> None:
    """Close the writers left open: FAILED after an uncaught exception, else the exit status."""
    status = "FAILED" if getattr(sys, "last_type", None) else (_exit_status or "FINISHED")
    limit = PREEMPTED_EXIT_WAIT_S if status == "KILLED" else None
    for w in list(_live_writers):
        w.close(timeout_s=limit, status=status, at_exit=True)


class MlflowWriter:
    """Log metrics, params, tags and files to one MLflow run without ever blocking the caller.

    `flush` and `close` wait while delivery makes progress; what is not delivered stays in
    ``spool_path`` and a warning says why and how to deliver it. One point per (key, step).

    Args:
        tracking_uri: MLflow tracking URI.
        experiment: experiment name; created if missing.
        run_name: name of a new run.
        job_id: the job's id: its run is the one tagged ``keras_sync.job_id``; names its spool.
        job_id_explicit: whether the user gave ``job_id``: a FINISHED run with it is reopened.
        run_id: a run to continue (recorded with a backup), tried first.
        spool_dir: parent directory of spools; default: that of ``mlflow.spool_dir``.
        wait_at_end_of_fit: whether `end_of_fit` waits for delivery (else the exit does).

    Example:
        >>> w = MlflowWriter(tracking_uri="sqlite:///mlflow.db", experiment="demo")  # doctest: +SKIP
        >>> w.start(); w.log_metrics({"loss": 0.3}, step=1); w.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        tracking_uri: str,
        experiment: str,
        run_name: str | None = None,
        job_id: str | None = None,
        job_id_explicit: bool = True,
        run_id: str | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
        wait_at_end_of_fit: bool = True,
    ):
        if job_id is not None and not _JOB_ID.match(str(job_id)):
            raise _invalid(
                "job_id", job_id, "1-250 letters, digits or `_.:/@+-` (no quotes or spaces)"
            )
        root = Path(spool_dir or MlflowConfig().spool_dir)
        self.shown_uri = str(redact_uri(tracking_uri))
        self.experiment = experiment
        self.job_id = job_id or f"run-{uuid.uuid4().hex[:12]}"
        self.job_id_explicit = bool(job_id and job_id_explicit)
        self.wait_at_end_of_fit = wait_at_end_of_fit
        header = {"v": 2, "experiment": experiment, "run_name": run_name, "job_id": self.job_id}
        header.update(explicit=self.job_id_explicit, tracking_uri=self.shown_uri, run_id=run_id)
        spool = SpoolDir(root.resolve() / re.sub(r"[^\w.\-]", "_", self.job_id))
        cleaner = records.RecordCleaner(secrets_of(tracking_uri, os.environ))
        self._sp = Spooler(spool, tracking_uri, header, cleaner)
        self.closed = self._warned = self._ends_after_fit = False
        # The BEGIN the next record needs: "first" (deferred), "reopen" (after end_run), or None.
        self._begin: str | None = None
        self._deferred_report: dict[str, Any] | None = None  # the fit-end report, after end_run
        _live_writers.add(self)

    @property
    def spool_path(self) -> Path:
        return self._sp.spool.path

    @property
    def run_id(self) -> str | None:
        """The MLflow run id, once the courier has created or found the run."""
        return self._sp.run().get("run_id")

    def run_url(self) -> str | None:
        """The run's page on a tracking server (without credentials); None for a local store."""
        run = self._sp.run()  # its experiment_id comes with its run_id
        return run_url(self._sp.uri, run.get("experiment_id"), run.get("run_id", ""))

    def wait_for_run(self, timeout_s: float) -> str | None:
        """Wait up to ``timeout_s`` for the run id, unless MLflow is known to be failing."""
        deadline = time.monotonic() + timeout_s
        while self.run_id is None and time.monotonic() < deadline and self.failure() is None:
            time.sleep(0.05)
        return self.run_id

    def failure(self) -> dict[str, Any] | None:
        """The courier's last failed attempt (``error``, ``cause``), or None if it last succeeded."""
        return self._sp.failure()

    def say_refused_once(self) -> bool:
        """If the credentials were refused, say so in one line (once); True if they were."""
        return self._sp.say_refused_once()

    def when_run_known(self, callback: Callable[[MlflowWriter], None]) -> None:
        """Call ``callback(self)`` once (spooling thread) when the run is known or MLflow failed."""
        self._sp.on_run = lambda: callback(self)

    def undelivered_message(self, final: bool = True) -> str | None:
        """Why some records are not in MLflow, and where; None if everything arrived."""
        return self._sp.undelivered_message(final)

    def start(self, defer_begin: bool = False) -> None:
        """Start spooling; ``defer_begin``: the first record logged begins the run (none without)."""
        if self._sp.thread is None:
            self._begin = "first" if defer_begin else None
            self._sp.start(None if defer_begin else _now_ms())

    def _put(self, rec: dict[str, Any] | None) -> None:
        if self._sp.closing:
            raise TrackingError(_CLOSED)
        if rec is None or self._sp.dead:
            return  # a dead spool said so once; do not grow memory forever
        if (self._begin == "first" and rec["k"] != records.STOP) or (
            self._begin == "reopen" and rec["k"] not in _NOT_REOPENING
        ):
            reopen = {"reopen": True} if self._begin == "reopen" else {}
            self._sp.put({"k": records.BEGIN, "ts": _now_ms(), **reopen})
            self._begin = None
        self._sp.put(rec)

    def log_metrics(
        self, metrics: dict[str, float], step: int, timestamp_ms: int | None = None
    ) -> None:
        """Queue metric values at ``step``; keys MLflow would refuse are rewritten (``a@b`` -> ``a_b``)."""
        ts = _now_ms() if timestamp_ms is None else int(timestamp_ms)
        self._put({"k": records.METRICS, "s": int(step), "ts": ts, "d": dict(metrics)})

    def log_params(self, params: dict[str, object]) -> None:
        """Queue params; values are stringified, scrubbed of secrets and cut to 6000 characters."""
        self._put({"k": records.PARAMS, "d": {str(k): str(v) for k, v in params.items()}})

    def set_tags(self, tags: dict[str, str]) -> None:
        """Queue run tags; values are scrubbed of secrets and cut to 8000 characters."""
        self._put({"k": records.TAGS, "d": {str(k): str(v) for k, v in tags.items()}})

    def log_text_artifact(self, text: str, artifact_file: str) -> None:
        """Queue a text file to store as the run artifact ``artifact_file``, scrubbed of secrets."""
        self._put({"k": records.TEXT, "f": str(artifact_file), "text": str(text)})

    def log_artifact_file(
        self,
        local_path: str | os.PathLike[str],
        artifact_path: str | None = None,
        *,
        as_model: str | None = None,
        step: int = 0,
    ) -> None:
        """Queue a file or directory (copied now) to upload under ``artifact_path``; ``as_model``:
        a ``save_model`` directory, logged as the run's LoggedModel of that name at ``step``."""
        if self._sp.closing or self.closed:
            raise TrackingError(_CLOSED)
        staged = str(stage(self.spool_path, local_path))
        if as_model:
            self._put({"k": records.MODEL, "src": staged, "name": str(as_model), "step": int(step)})
        else:
            self._put({"k": records.FILE, "src": staged, "dir": artifact_path})

    def log_sync_report(
        self, history: dict[str, Any], artifact_file: str, *, fit_end: bool = False
    ) -> None:
        """Queue a `SyncHistory.to_dict()` to draw as ``artifact_file`` (``fit_end``: after the end)."""
        rec = {"k": records.REPORT, "f": str(artifact_file), "h": history}
        if fit_end and self._ends_after_fit:
            self._deferred_report = rec
        else:
            self._put(rec)

    def _put_deferred_report(self) -> bool:
        rec, self._deferred_report = self._deferred_report, None
        self._put(rec)
        return rec is not None

    @contextlib.contextmanager
    def fit_ends_run(self) -> Iterator[None]:
        """While `Sync.fit` runs: `end_run` follows it, so `end_of_fit` does not wait a first time."""
        self._ends_after_fit = True
        try:
            yield
        finally:
            self._ends_after_fit = False

    def flush_to_spool(self, timeout_s: float = 10.0) -> bool:
        """Wait up to ``timeout_s`` until all queued so far is in the spool (safe from a kill)."""
        return self._sp.flush_to_spool(timeout_s)

    def flush(
        self, timeout_s: float | None = None, stall_s: float = STALL_S, progress: Any = None
    ) -> bool:
        """Wait until MLflow has all queued so far, while delivery progresses; True if it has."""
        if not self.flush_to_spool(timeout_s=30.0 if timeout_s is None else timeout_s):
            return False
        return self._sp.wait_delivered(timeout_s, stall_s, progress)

    def end_of_fit(self) -> None:
        """At the end of a `fit`: wait while delivery makes progress; else warn once, naming the cause."""
        if not (self._ends_after_fit or not self.wait_at_end_of_fit or self.flush()):
            self._warn_undelivered()

    def _warn_undelivered(self) -> None:
        if not (self.say_refused_once() or self._warned):
            message = self.undelivered_message(final=False)
            self._warned = message is not None
            if message:
                warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _put_end(self, status: str, **extra: Any) -> None:
        """FAILED, tagged, if records were dropped over the memory bound."""
        lost = self._sp.lost_text([]) if self._sp.dropped else None
        if lost:
            self._put({"k": records.TAGS, "d": {LOST_TAG: lost}})
        self._put(
            {"k": records.END, "status": "FAILED" if lost else status, "ts": _now_ms(), **extra}
        )

    def end_run(
        self,
        status: str = "FINISHED",
        timeout_s: float | None = 120.0,
        *,
        wait_for_report: bool = False,
        wait: bool = True,
    ) -> bool:
        """End the run and wait while delivery progresses; True if MLflow has it all. The next
        record reopens it; ``wait=False`` only queues the end; ``wait_for_report``: wait for it too."""
        _check_status(status)
        if self.closed:
            return not self.spool_path.is_dir()
        if self._begin != "reopen":
            self._put_end(status, last=False)
            self._begin = "reopen"
        self.start()
        if not wait:
            self._put_deferred_report()
            self._sp.wake.set()
            return False
        delivered = self.flush(timeout_s=timeout_s)
        if self._put_deferred_report():
            if wait_for_report and delivered:
                delivered = self.flush(timeout_s=timeout_s)
            else:  # in the spool now: a restart or `keras-sync sync-spool` finds it after a kill
                self.flush_to_spool(timeout_s=5.0)
        if not delivered:
            self._warn_undelivered()
        return delivered

    def close(
        self, timeout_s: float | None = 10.0, status: str = "FINISHED", *, at_exit: bool = False
    ) -> None:
        """End the run; wait while delivery progresses (at most ``timeout_s``); a `RuntimeWarning`
        says why what is left stays in the spool. ``at_exit``: a line says what the wait is for."""
        _check_status(status)
        if self.closed:
            return
        self.closed = True
        _live_writers.discard(self)
        if self._begin != "reopen":
            self._put_deferred_report()  # a fit that raised before end_run: the report first
        never_begun = self._begin == "first"  # nothing logged: no run; the courier only goes
        if self._begin is None:
            self._put_end(status)
        else:
            self._put({"k": records.STOP})
        self.start()
        try:  # the line's first print is inside: a Ctrl-C may come as it is shown
            line = self._sp.exit_line() if at_exit and not never_begun else None
            delivered = never_begun or self.flush(timeout_s, progress=line)
        except KeyboardInterrupt:  # Ctrl-C at exit: the rest stays in the spool, and is said
            delivered = False
        message = self._sp.shut_down(delivered, never_begun)
        if message:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
