"""MLflow tracking that never stalls training and loses nothing.

`MlflowWriter` is what the keras-sync callbacks write through. The training thread only appends
to a queue; a thread moves it to a spool directory (`keras_sync.tracking.spooler`); a child
process, the courier (`keras_sync.tracking.courier`), delivers the spool to MLflow in batches
through its public client and deletes what it delivered. A killed training process loses at most
a fraction of a second of records, a restarted job delivers what its predecessor left, and
``keras-sync sync-spool DIR`` (`replay_spool`) delivers a spool whose process has ended, without
duplicating a point.

Every param, tag and text artifact is scrubbed of secrets first: credentials in URIs and the
values of environment variables whose names say TOKEN, PASSWORD, SECRET or API_KEY.

MLflow is imported on first use (in the courier), never by ``import keras_sync``.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from keras_sync.config import MlflowConfig
from keras_sync.errors import TrackingError
from keras_sync.tracking import waiting
from keras_sync.tracking.courier import replay_spool
from keras_sync.tracking.records import (
    BEGIN,
    END,
    FILE,
    METRICS,
    MODEL,
    PARAMS,
    REPORT,
    STOP,
    TAGS,
    TEXT,
    RecordCleaner,
)
from keras_sync.tracking.redact import redact_uri, secrets_of
from keras_sync.tracking.spool import SpoolDir
from keras_sync.tracking.spooler import LOST_TAG, Spooler
from keras_sync.tracking.uris import resolve_tracking_uri, run_url
from keras_sync.tracking.waiting import end_runs_at_exit_as

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

#: Where spools go when ``spool_dir`` is not given (relative to the working directory).
DEFAULT_SPOOL_DIR = MlflowConfig().spool_dir
_JOB_ID = re.compile(r"^[\w.:/@+\-]{1,250}$")


@runtime_checkable
class Writer(Protocol):
    """What the keras-sync callbacks write through: `MlflowWriter`, or an object of your own.

    A callback calls only these methods, on the chief only (other workers get ``writer=None``).
    Each must return quickly: the callbacks call them from the training thread. ``step`` is the
    global optimizer step (1-based, continued across the fits of a job); ``timestamp_ms`` the wall
    time of that step (milliseconds since the epoch). Used when present: ``flush_to_spool(timeout_s)``
    (a backup makes the metrics up to its step durable first), ``end_of_fit()`` (at the end of
    each `fit`) and ``end_run(status, timeout_s)`` (when `keras_sync.Sync.fit` returns).
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


def _checked(tracking_uri: str, experiment: str, job_id: str | None, spool_dir: Any) -> Path:
    """The writer's arguments checked; returns the parent folder of spools, created."""
    for name, value in (("tracking_uri", tracking_uri), ("experiment", experiment)):
        if not value or not isinstance(value, str):
            what = "URI string" if name == "tracking_uri" else "name"
            raise TrackingError(
                f"Invalid value for argument `{name}`. Received: {name}={value!r}. "
                f"Expected a non-empty {what}."
            )
    if job_id is not None and not _JOB_ID.match(str(job_id)):
        raise TrackingError(
            f"Invalid value for argument `job_id`. Received: job_id={job_id!r}. "
            "Expected 1-250 letters, digits or `_.:/@+-` (no quotes or spaces)."
        )
    root = Path(spool_dir or DEFAULT_SPOOL_DIR)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TrackingError(
            f"Invalid value for argument `spool_dir`. Received: spool_dir={str(root)!r}, "
            f"which cannot be created ({e.strerror}). Expected a writable directory."
        ) from None
    return root


class MlflowWriter:
    """Log metrics, params, tags and files to one MLflow run without ever blocking the caller.

    Calls only queue records; a thread spools them and a courier process delivers them.
    `flush` and `close` wait while delivery makes progress; what is not delivered stays in
    ``spool_path`` and a warning says why and how to deliver it.

    Which run: ``run_id`` if given and usable, else the run tagged ``keras_sync.job_id`` =
    ``job_id`` (a FINISHED one only if ``job_id_explicit``), else a new run with that tag. Points at
    steps the run already has for their key are dropped: one point per (key, step).

    Args:
        tracking_uri: MLflow tracking URI.
        experiment: experiment name; created if missing.
        run_name: name of a new run.
        job_id: the job's id (see above); also names its spool directory.
        job_id_explicit: whether the user gave ``job_id`` (``$KERAS_SYNC_JOB_ID``, ``mlflow.job_id``).
        run_id: a run to continue (recorded with a backup).
        spool_dir: parent directory of spools; default: that of ``mlflow.spool_dir``.
        wait_at_end_of_fit: whether `end_of_fit` waits for delivery (where the process is killed
            as soon as training returns); elsewhere the exit waits for what is left.

    Example:
        >>> w = MlflowWriter(tracking_uri="sqlite:///mlflow.db", experiment="demo")  # doctest: +SKIP
        >>> w.start(); w.log_metrics({"loss": 0.3}, step=1); w.close()  # doctest: +SKIP
    """

    # ---- set up, and where the run is ----

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
        root = _checked(tracking_uri, experiment, job_id, spool_dir)
        self._uri, self.shown_uri = tracking_uri, str(redact_uri(tracking_uri))
        self.experiment = experiment
        self.job_id = job_id or f"run-{uuid.uuid4().hex[:12]}"
        self.job_id_explicit = bool(job_id and job_id_explicit)
        self.wait_at_end_of_fit = wait_at_end_of_fit
        header: dict[str, Any] = {
            "v": 2,
            "experiment": experiment,
            "run_name": run_name,
            "job_id": self.job_id,
        }
        header.update(explicit=self.job_id_explicit, tracking_uri=self.shown_uri, run_id=run_id)
        spool = SpoolDir(root.resolve() / re.sub(r"[^\w.\-]", "_", self.job_id))
        cleaner = RecordCleaner(secrets_of(tracking_uri, os.environ))
        self._sp = Spooler(spool, tracking_uri, header, cleaner)
        self._closed = self._warned_fit = False
        self._begin_deferred = False  # start(defer_begin=True): the first record begins the run
        self._run_ended = False  # end_run() was called and nothing was logged since
        self._ends_after_fit = False  # inside `fit_ends_run`
        self._deferred_report: dict[str, Any] | None = None  # the fit-end report, after end_run
        waiting.live_writers.add(self)

    @property
    def spool_path(self) -> Path:
        """The spool directory of this writer's run."""
        return self._sp.spool.path

    @property
    def closed(self) -> bool:
        """Whether `close` was called (a closed writer logs nothing more)."""
        return self._closed

    @property
    def run_id(self) -> str | None:
        """The MLflow run id, once the courier has created or found the run."""
        return self._sp.run().get("run_id")

    @property
    def experiment_id(self) -> str | None:
        return self._sp.run().get("experiment_id")

    def run_url(self) -> str | None:
        """The run's page on a tracking server (without credentials); None for a local store."""
        return run_url(self._uri, self.experiment_id, self.run_id) if self.run_id else None

    def wait_for_run(self, timeout_s: float) -> str | None:
        """Wait up to ``timeout_s`` for the run id, unless MLflow is known to be failing; return it."""
        deadline = time.monotonic() + timeout_s
        while self.run_id is None and time.monotonic() < deadline and self.failure() is None:
            time.sleep(0.05)
        return self.run_id

    def failure(self) -> dict[str, Any] | None:
        """The courier's last failed attempt (``error``, ``cause``), or None if it last succeeded."""
        return self._sp.failure()

    def say_refused_once(self) -> bool:
        """If the credentials were refused, say so in one line (once per writer); True if they were."""
        return self._sp.say_refused_once()

    def when_run_known(self, callback: Callable[[MlflowWriter], None]) -> None:
        """Call ``callback(writer)`` once, from the spooling thread, when the run id is known or
        MLflow failed before it was (the line that says where the metrics go)."""
        self._sp.on_run = lambda: callback(self)

    # ---- the caller's side: no I/O ----
    def start(self, defer_begin: bool = False) -> None:
        """Start the spooling thread and the courier; returns at once. ``defer_begin``: the first
        record logged begins the run (a writer that logs nothing makes none)."""
        if self._sp.thread is None:  # the run starts now, not when the thread spools its "begin"
            self._begin_deferred = defer_begin
            self._sp.start(None if defer_begin else int(time.time() * 1000))

    def _put(self, rec: dict[str, Any]) -> None:
        if self._sp.closing:
            raise TrackingError("MlflowWriter is closed; create a new writer to log more.")
        if self._sp.dead:
            return  # the spool failed and said so once; do not grow memory forever
        if self._begin_deferred and rec["k"] != STOP:
            self._begin_deferred = False
            self._sp.put({"k": BEGIN, "ts": int(time.time() * 1000)})
        if self._run_ended and rec["k"] not in (END, STOP, REPORT):
            # Logging after end_run: the run is reopened (RUNNING again), this writer's run only.
            self._run_ended = False
            self._sp.put({"k": BEGIN, "ts": int(time.time() * 1000), "reopen": True})
        self._sp.put(rec)

    def log_metrics(
        self, metrics: dict[str, float], step: int, timestamp_ms: int | None = None
    ) -> None:
        """Queue metric values at ``step``; keys MLflow would refuse are rewritten (``a@b`` -> ``a_b``)."""
        ts = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
        self._put({"k": METRICS, "s": int(step), "ts": ts, "d": dict(metrics)})

    def log_params(self, params: dict[str, object]) -> None:
        """Queue params; values are stringified, scrubbed of secrets and cut to 6000 characters."""
        self._put({"k": PARAMS, "d": {str(k): str(v) for k, v in params.items()}})

    def set_tags(self, tags: dict[str, str]) -> None:
        """Queue run tags; values are scrubbed of secrets and cut to 8000 characters."""
        self._put({"k": TAGS, "d": {str(k): str(v) for k, v in tags.items()}})

    def log_text_artifact(self, text: str, artifact_file: str) -> None:
        """Queue a text file to store as the run artifact ``artifact_file``, scrubbed of secrets."""
        self._put({"k": TEXT, "f": str(artifact_file), "text": str(text)})

    def log_artifact_file(
        self,
        local_path: str | os.PathLike[str],
        artifact_path: str | None = None,
        *,
        as_model: str | None = None,
        step: int = 0,
    ) -> None:
        """Queue a file or directory to upload under ``artifact_path``; copied now (the caller may
        change it at once) and uploaded in order with the metrics. ``as_model="model"``: a directory
        an MLflow flavour's ``save_model`` wrote, logged as the run's LoggedModel at ``step``."""
        from keras_sync.tracking import artifacts as _artifacts

        if self._sp.closing or self._closed:
            raise TrackingError("MlflowWriter is closed; create a new writer to log more.")
        staged = _artifacts.stage(self.spool_path, local_path)
        if as_model:
            self._put({"k": MODEL, "src": str(staged), "name": str(as_model), "step": int(step)})
        else:
            self._put({"k": FILE, "src": str(staged), "dir": artifact_path})

    def log_sync_report(
        self, history: dict[str, Any], artifact_file: str, *, fit_end: bool = False
    ) -> None:
        """Queue a `SyncHistory.to_dict()`; the courier draws it as the PNG ``artifact_file``.
        ``fit_end`` inside `fit_ends_run`: queued after the run's end (`end_run`)."""
        rec = {"k": REPORT, "f": str(artifact_file), "h": history}
        if fit_end and self._ends_after_fit:
            self._deferred_report = rec
        else:
            self._put(rec if fit_end else {**rec, "now": True})

    def _put_deferred_report(self, now: bool = False) -> None:  # now: drawn at once, not when idle
        rec, self._deferred_report = self._deferred_report, None
        if rec is not None:
            self._put({**rec, "now": True} if now else rec)

    @contextlib.contextmanager
    def fit_ends_run(self) -> Iterator[None]:
        """While `Sync.fit` runs: `end_run` follows it, so `end_of_fit` does not wait a first time."""
        self._ends_after_fit = True
        try:
            yield
        finally:
            self._ends_after_fit = False

    # ---- waiting ----
    def flush_to_spool(self, timeout_s: float = 10.0) -> bool:
        """Wait up to ``timeout_s`` until everything queued so far is in the spool (then a killed
        process loses none of it: a backup calls this first)."""
        return self._sp.flush_to_spool(timeout_s)

    def flush(
        self, timeout_s: float | None = None, stall_s: float = waiting.STALL_S, progress: Any = None
    ) -> bool:
        """Wait until MLflow has all queued so far, while delivery progresses; True if it has."""
        if not self.flush_to_spool(timeout_s=30.0 if timeout_s is None else timeout_s):
            return False
        return waiting.wait_delivered(self._sp, timeout_s, stall_s, progress)

    def end_of_fit(self) -> None:
        """At the end of a `fit`: wait while delivery makes progress; else warn once, naming the cause."""
        if self._ends_after_fit or not self.wait_at_end_of_fit or self.flush():
            return
        self._warn_undelivered()

    def _warn_undelivered(self) -> None:
        if self.say_refused_once():
            return
        message = self.undelivered_message(final=False)
        if message and not self._warned_fit:
            self._warned_fit = True
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def undelivered_message(self, final: bool = True) -> str | None:
        """Why some records are not in MLflow, and where they are; None if everything arrived."""
        return self._sp.undelivered_message(final)

    def points_left(self) -> int:
        """Metric points queued, spooled or held that MLflow does not have yet."""
        return self._sp.points_left()

    def _put_end(self, status: str, **extra: Any) -> None:
        """The run's end; records dropped over the memory bound make it FAILED, with a tag naming them."""
        tag = self._sp.loss_tag()
        if tag is not None:
            self._put(tag)
            status = "FAILED"
        self._put({"k": END, "status": status, "ts": int(time.time() * 1000), **extra})

    def end_run(
        self,
        status: str = "FINISHED",
        timeout_s: float | None = 120.0,
        *,
        wait_for_report: bool = False,
        wait: bool = True,
    ) -> bool:
        """End the run with ``status`` and wait while delivery makes progress; True if MLflow has it all.

        The writer stays open: the next record logged reopens the same run, steps continuing. The
        fit-end report is waited for only with ``wait_for_report``. ``wait=False``: only queue the
        end (and the report after it) and return False at once.
        """
        waiting.check_status(status)
        if self._closed:
            return not self.spool_path.is_dir()
        if not self._run_ended:
            self._put_end(status, last=False)
            self._run_ended = True
        self.start()
        if not wait:
            self._put_deferred_report()
            self._sp.wake.set()
            return False
        delivered = self.flush(timeout_s=timeout_s)
        if self._deferred_report is not None:
            self._put_deferred_report(now=wait_for_report)
            if wait_for_report and delivered:
                delivered = self.flush(timeout_s=timeout_s)
            else:  # in the spool at once: a restart or `keras-sync sync-spool` finds it if we are killed
                self.flush_to_spool(timeout_s=5.0)
        if not delivered:
            self._warn_undelivered()
        return delivered

    def close(
        self, timeout_s: float | None = 10.0, status: str = "FINISHED", *, at_exit: bool = False
    ) -> None:
        """End the run with ``status``; wait for delivery while it progresses (at most ``timeout_s``).
        What is left stays in the spool, and a `RuntimeWarning` says why and how to deliver it.
        ``at_exit``: one line on stderr says what the wait is for."""
        waiting.check_status(status)
        if self._closed:
            return
        self._closed = True
        waiting.live_writers.discard(self)
        if not self._run_ended:
            self._put_deferred_report()  # a fit that raised before end_run: the report before the end
        never_begun = self._begin_deferred  # nothing logged: no run; the courier only goes
        if self._run_ended or never_begun:
            self._put({"k": STOP})
        else:
            self._put_end(status)
        self.start()
        line, delivered = None, False
        try:
            line = waiting.ExitLine(self._sp) if at_exit and not never_begun else None
            delivered = never_begun or self.flush(timeout_s, progress=line.update if line else None)
        except KeyboardInterrupt:  # Ctrl-C at exit: the rest stays in the spool, and is said
            delivered = False
        finally:
            if line is not None:
                line.done()
        message = self._sp.shut_down(delivered, never_begun)
        if message:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
