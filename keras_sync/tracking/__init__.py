"""MLflow tracking that never stalls training and loses nothing.

`MlflowWriter` is what the keras-sync callbacks write through. The training thread only appends
to an in-memory queue; a daemon thread moves it to a spool directory every 0.2 s
(`keras_sync.tracking.spool`); a child process, the courier (`keras_sync.tracking.courier`), delivers the spool
to MLflow in batches and deletes what it delivered. The spool files are the only interface
between the two, so a killed training process loses at most 0.2 s of records, a restarted job
delivers what its predecessor left, and ``keras-sync sync-spool DIR`` (`replay_spool`) delivers
a spool whose process has ended, without duplicating a point.

Every param, tag and text artifact is scrubbed of secrets first: credentials in URIs and the
values of environment variables whose names say TOKEN, PASSWORD, SECRET or API_KEY.

MLflow is imported on first use (in the courier), never by ``import keras_sync``.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import re
import subprocess
import sys
import threading
import time
import uuid
import warnings
import weakref
from collections import deque
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from keras_sync.config import MlflowConfig
from keras_sync.errors import TrackingError
from keras_sync.tracking import courier as _courier
from keras_sync.tracking.handover import Handover, step_ranges
from keras_sync.tracking.records import (
    BEGIN,
    BOOKKEEPING,
    CREDENTIALS,
    END,
    FILE,
    MAX_KEY_LENGTH,
    MAX_PARAM_VALUE_LENGTH,
    MAX_TAG_VALUE_LENGTH,
    METRICS,
    MODEL,
    PARAMS,
    REPORT,
    STOP,
    STORE_FAILING,
    TAGS,
    TEXT,
    cause_in_a_word,
    cause_in_words,
    is_http,
    is_last_record,
)
from keras_sync.tracking.redact import redact_text as _redact
from keras_sync.tracking.redact import redact_uri
from keras_sync.tracking.redact import secrets_of as _secrets_of
from keras_sync.tracking.spool import Position, SpoolDir, SpoolFull

_log = logging.getLogger("keras_sync.tracking")

#: Where spools go when ``spool_dir`` is not given (relative to the working directory).
DEFAULT_SPOOL_DIR = MlflowConfig().spool_dir  # `mlflow.spool_dir`'s default, declared once
_TRUNCATED = "...[truncated]"

_RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")
_JOB_ID = re.compile(r"^[\w.:/@+\-]{1,250}$")
_BAD_KEY_CHARS = re.compile(r"[^\w.\- :/]")
#: How often the writer's thread moves queued records to the spool (seconds).
SPOOL_INTERVAL_S = 0.2
#: A wait for delivery gives up when the delivered position has not moved for this long (seconds).
STALL_S = 30.0
#: ... or, before the courier's first attempt (it imports MLflow, may migrate a fresh store: 2-4 s
#: on a quiet machine, a minute seen on an overloaded one), this long.
STARTUP_S = 120.0
#: Kept free in the spool directory (the file ``reserve``) for the records that end a run whose
#: spool filled its disk: which steps were lost, and the run's status.
RESERVE_BYTES = 16 * 1024
LOST_TAG = "keras_sync.metrics_lost"


def resolve_tracking_uri(
    configured: str | None, *, cwd: str | os.PathLike[str] | None = None
) -> tuple[str, str]:
    """Fill in MLflow's default tracking URI when the config has none.

    The one precedence rule (flag > ``$MLFLOW_TRACKING_URI`` > YAML > default) is applied by
    `keras_sync.config.load_config`; this only adds the last step: MLflow 3's own default,
    ``sqlite:///<cwd>/mlflow.db``. Returns ``(uri, "config")`` or ``(uri, "default")``.
    """
    if configured:
        return configured, "config"
    base = Path(cwd) if cwd is not None else Path.cwd()
    return f"sqlite:///{base.resolve() / 'mlflow.db'}", "default"


def run_url(tracking_uri: str, experiment_id: str | None, run_id: str) -> str | None:
    """The MLflow UI page of a run on a tracking server (credentials removed); None for a local store."""
    if not is_http(tracking_uri) or experiment_id is None:
        return None
    base = redact_uri(tracking_uri).split("?", 1)[0].rstrip("/")
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def _metric_key(key: str) -> str:
    clean = _BAD_KEY_CHARS.sub("_", str(key)).lstrip("/")
    clean = re.sub(r"/+", "/", clean).replace("..", "__")[:MAX_KEY_LENGTH]
    return clean if clean not in ("", ".") else "_"


def _clip(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[: limit - len(_TRUNCATED)] + _TRUNCATED


_live_writers: weakref.WeakSet[MlflowWriter] = weakref.WeakSet()


_exit_status: str | None = None
#: The longest a preempted process (its run ending KILLED) waits at exit for delivery (seconds).
PREEMPTED_EXIT_WAIT_S = 10.0


def end_runs_at_exit_as(status: str) -> None:
    """Make the exit's close of open writers end their runs with ``status`` instead of FINISHED.

    `keras_sync.cluster.preemption.exit_now` sets KILLED: a preempted job is not finished, and the
    relaunch that restores its backup reopens that run (a FINISHED run is only reopened for an
    explicit job id).
    """
    global _exit_status
    if status not in _RUN_STATUSES:
        raise TrackingError(
            f"Invalid value for argument `status`. Received: status={status!r}. "
            f"Expected one of {', '.join(_RUN_STATUSES)}."
        )
    _exit_status = status


@atexit.register
def _close_at_exit() -> None:
    # An uncaught exception has been printed by now, and left sys.last_type behind.
    status = (
        "FAILED" if getattr(sys, "last_type", None) is not None else (_exit_status or "FINISHED")
    )
    # What `fit` left to deliver in the background is waited for here, while delivery makes
    # progress, with one line saying what is left and that Ctrl-C leaves it in the spool. A
    # preempted job (KILLED) has a grace period to keep: its relaunch delivers what is left.
    limit = PREEMPTED_EXIT_WAIT_S if status == "KILLED" else None
    for w in list(_live_writers):
        w.close(timeout_s=limit, status=status, at_exit=True)


def _lower_thread_priority() -> None:
    """Nice the spooling thread a little (Linux threads have their own nice value): when the cores
    are busy, the training goes first; moving records to a file is never urgent."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 5)
    except (AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
        pass


@runtime_checkable
class Writer(Protocol):
    """What the keras-sync callbacks write through: `MlflowWriter`, or an object of your own.

    A callback calls only these methods, on the chief only (other workers get ``writer=None``).
    Each must return quickly: the callbacks call them from the training thread. ``step`` is the
    global optimizer step (1-based, continued across the fits of a job); ``timestamp_ms`` the wall
    time of that step (milliseconds since the epoch: points are logged in groups, each keeps its own
    step's time). Two more are used when present: ``flush_to_spool(timeout_s)``
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


class MlflowWriter:
    """Log metrics, params, tags and text to one MLflow run without ever blocking the caller.

    Calls only queue records; a daemon thread spools them and a courier process delivers them
    (restarted if it dies; retrying with backoff while MLflow is unreachable). `flush` and
    `close` wait while delivery makes progress, not while MLflow is known to be failing; what is
    not delivered stays in ``spool_path`` and a warning says why and how to deliver it.

    Which run: ``run_id`` (a run recorded with the job's backup) if given and usable, else the
    run tagged ``keras_sync.job_id`` = ``job_id``, else a new run with that tag. A FINISHED run
    is reopened only when ``job_id_explicit`` (the user named the job). Without ``job_id`` every
    writer starts a new run. A run never gets two points at one (key, step): points at steps
    the run already has for that key are dropped (a restored job trains them again).

    Args:
        tracking_uri: MLflow tracking URI.
        experiment: experiment name; created if missing.
        run_name: name of a new run.
        job_id: the job's id (see above); also names its spool directory.
        job_id_explicit: whether the user gave ``job_id`` (``$KERAS_SYNC_JOB_ID``, ``mlflow.job_id``).
        run_id: a run to continue (recorded with a backup).
        spool_dir: parent directory of spools; default: that of ``mlflow.spool_dir`` (`DEFAULT_SPOOL_DIR`).

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
    ):
        if not tracking_uri or not isinstance(tracking_uri, str):
            raise TrackingError(
                f"Invalid value for argument `tracking_uri`. Received: "
                f"tracking_uri={tracking_uri!r}. Expected a non-empty URI string."
            )
        if not experiment or not isinstance(experiment, str):
            raise TrackingError(
                f"Invalid value for argument `experiment`. Received: "
                f"experiment={experiment!r}. Expected a non-empty name."
            )
        if job_id is not None and not _JOB_ID.match(str(job_id)):
            raise TrackingError(
                f"Invalid value for argument `job_id`. Received: job_id={job_id!r}. "
                "Expected 1-250 letters, digits or `_.:/@+-` (no quotes or spaces)."
            )
        self._uri = tracking_uri
        self.shown_uri = redact_uri(tracking_uri)
        self._secrets = _secrets_of(tracking_uri, os.environ)
        self.experiment = experiment
        root = Path(spool_dir or DEFAULT_SPOOL_DIR)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrackingError(
                f"Invalid value for argument `spool_dir`. Received: spool_dir={str(root)!r}, "
                f"which cannot be created ({e.strerror}). Expected a writable directory."
            ) from None
        self.job_id = job_id or f"run-{uuid.uuid4().hex[:12]}"
        self.job_id_explicit = bool(job_id and job_id_explicit)
        self._header = {
            "v": 2,
            "experiment": experiment,
            "run_name": run_name,
            "job_id": self.job_id,
            "explicit": self.job_id_explicit,
            "tracking_uri": self.shown_uri,
            "run_id": run_id,
        }
        self._spool = SpoolDir(root.resolve() / re.sub(r"[^\w.\-]", "_", self.job_id))
        self._queue: deque[tuple[int, dict[str, Any]]] = deque()
        self._seq = itertools.count(1)
        self._last_seq = self._spooled_seq = 0
        self._spooled_pos: Position = (0, 0)
        self._wake = threading.Event()
        self._spooled = threading.Condition()
        self._thread: threading.Thread | None = None
        self._launcher: _courier.Launcher | None = None
        self._courier: subprocess.Popen[bytes] | None = None
        self._closing = self._closed = self._dead = self._end_spooled = self._finished = False
        self._warned_fit = False
        self._said_refused = False  # the one line on refused credentials was said
        self._said_lock = threading.Lock()
        self._begin_deferred = self._begin_at_open_deferred = False  # start(defer_begin=True)
        self._run_ended = False  # end_run() was called and nothing was logged since
        self._deferred_report: dict[str, Any] | None = (
            None  # queued after end_run's wait (log_sync_report)
        )
        #: Set by `keras_sync.Sync.fit` while its `fit` runs: it ends the run itself when fit
        #: returns (`end_run`), so `end_of_fit` need not wait for delivery a first time.
        self.run_ends_after_fit = False
        #: Whether `end_of_fit` waits for delivery. `keras_sync.training.job_run.writer_for` sets it only
        #: where the process is killed as soon as training returns (Ray Train); elsewhere what is left
        #: is delivered in the background and waited for at exit (`close`).
        self.wait_at_end_of_fit = True
        #: Called once, from the spooling thread, when the run id is known or MLflow first fails
        #: before it is (the line that says where the metrics go); None: nothing to call.
        self.on_run: Any = None
        self._status: dict[str, Any] | None = None
        self._key_cache: dict[str, str] = {}
        self._run: dict[str, Any] = {}
        self._handover = Handover()  # records the spool could not take (disk full), for the courier
        self._spool_error: str | None = None  # why the spool stopped taking records
        _live_writers.add(self)

    @property
    def spool_path(self) -> Path:
        """The spool directory of this writer's run."""
        return self._spool.path

    @property
    def closed(self) -> bool:
        """Whether `close` was called (a closed writer logs nothing more)."""
        return self._closed

    @property
    def run_id(self) -> str | None:
        """The MLflow run id, once the courier has created or found the run."""
        if not self._run.get("run_id"):
            self._run = self._spool.run() or self._handover.news.get("run", {})
        return self._run.get("run_id")

    @property
    def experiment_id(self) -> str | None:
        return self._run.get("experiment_id") if self.run_id else None

    def run_url(self) -> str | None:
        """The run's page on a tracking server (without credentials); None for a local store or no run yet."""
        run_id = self.run_id
        return run_url(self._uri, self.experiment_id, run_id) if run_id else None

    def wait_for_run(self, timeout_s: float) -> str | None:
        """Wait up to ``timeout_s`` for the run id, unless MLflow is known to be failing; return it."""
        deadline = time.monotonic() + timeout_s
        while self.run_id is None and time.monotonic() < deadline and self.failure() is None:
            time.sleep(0.05)
        return self.run_id

    def failure(self) -> dict[str, Any] | None:
        """The courier's last failed attempt (``error``, ``cause``), or None if it last succeeded."""
        status = self._courier_status()
        return status if status is not None and not status.get("ok") else None

    def _answering(self, failed: dict[str, Any] | None, within_s: float = STALL_S) -> bool:
        """Whether MLflow, though some requests fail, answered one within ``within_s`` (delivery goes on)."""
        at = failed.get("answered_at") if failed is not None else None
        return isinstance(at, (int, float)) and time.time() - at < within_s

    def refused_credentials(self) -> bool:
        """True when the tracking server's last answer was HTTP 401 or 403 (credentials refused)."""
        failed = self.failure()
        return failed is not None and failed.get("cause") == CREDENTIALS

    def say_refused_once(self) -> bool:
        """If the credentials were refused, say so in one line (once per writer); True if they were.

        Every later message about undelivered records stays silent then: this line already says
        where they are kept and how to deliver them, and a refused credential does not fix itself.
        """
        failed = self.failure()
        if failed is None or failed.get("cause") != CREDENTIALS:
            return False
        with self._said_lock:
            if self._said_refused:
                return True
            self._said_refused = True
        again = f"keras-sync sync-spool {self.spool_path}"
        if self.shown_uri != self._uri:
            again += " --tracking-uri URI"
        _log.warning(
            "keras-sync: MLflow at %s refused the credentials (%s); training goes on and the metrics "
            "are kept in %s. Set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
            "MLFLOW_TRACKING_TOKEN), then deliver them with: %s",
            self.shown_uri,
            failed.get("error"),
            self.spool_path,
            again,
        )
        return True

    def _courier_status(self) -> dict[str, Any] | None:
        """The courier's last outcome: from its pipe when it has one (a full disk keeps the file old)."""
        return self._handover.news.get("status") or self._spool.status()

    def _progress(self) -> tuple[Position, int]:
        """How far delivery got: the spool position, and the number of held records MLflow has."""
        pos = self._spool.delivered()
        news = self._handover.news
        if "pos" in news:
            pos = max(pos, tuple(news["pos"]))  # type: ignore[assignment]
        return pos, self._handover.acked()

    def _reached(self, target: tuple[Position, int]) -> bool:
        pos, held = self._progress()
        return pos >= target[0] and held >= target[1]

    # ---- the caller's side: O(1), no I/O ----
    def start(self, defer_begin: bool = False) -> None:
        """Start the spooling thread and the courier; returns at once.

        ``defer_begin``: the run is begun (found or created) by the first record logged, not now;
        a writer that logs nothing makes no run. The courier still starts now: it imports MLflow
        and builds a first run's store before there is anything to deliver.
        """
        if self._thread is None:
            # The run starts now, not when the thread gets to write its "begin" record: on a busy
            # machine that came after close() had stamped the end (start_time > end_time seen).
            self._started_ms = int(time.time() * 1000)
            self._begin_deferred = self._begin_at_open_deferred = defer_begin
            self._launcher = (
                _courier.Launcher()
            )  # on this thread: the courier is not niced with the spooling
            self._thread = threading.Thread(
                target=self._loop, name="keras-sync-mlflow", daemon=True
            )
            self._thread.start()

    def _put(self, rec: dict[str, Any]) -> None:
        if self._closing:
            raise TrackingError("MlflowWriter is closed; create a new writer to log more.")
        if self._dead:
            return  # the spool failed and said so once; do not grow memory forever
        if (
            self._begin_deferred and rec["k"] != STOP
        ):  # the first record begins the run (start(defer_begin))
            self._begin_deferred = False
            self._started_ms = int(time.time() * 1000)
            self._queue.append((next(self._seq), {"k": BEGIN, "ts": self._started_ms}))
        if self._run_ended and rec["k"] not in (END, STOP, REPORT):
            # Logging after end_run: the run is reopened (RUNNING again), this writer's run only.
            self._run_ended = False
            self._queue.append(
                (next(self._seq), {"k": BEGIN, "ts": int(time.time() * 1000), "reopen": True})
            )
        seq = next(self._seq)
        self._queue.append((seq, rec))
        self._last_seq = seq

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
        """Queue a file or directory to upload to the run under ``artifact_path``.

        It is copied now, beside the spool (`keras_sync.tracking.artifacts`), so the caller may change or
        delete it at once; it is uploaded in order with the metrics and survives an outage like
        them (not scrubbed: it may be binary). ``as_model="model"``: ``local_path`` is a directory
        written by an MLflow flavour's ``save_model``; it becomes the run's LoggedModel of that
        name, at ``step``.
        """
        from keras_sync.tracking import artifacts as _artifacts

        if self._closing or self._closed:
            raise TrackingError("MlflowWriter is closed; create a new writer to log more.")
        staged = _artifacts.stage(self.spool_path, local_path)
        if as_model:
            self._put({"k": MODEL, "src": str(staged), "name": str(as_model), "step": int(step)})
        else:
            self._put({"k": FILE, "src": str(staged), "dir": artifact_path})

    def log_sync_report(
        self, history: dict[str, Any], artifact_file: str, *, fit_end: bool = False
    ) -> None:
        """Queue the data of a sync report; the courier draws it and uploads the PNG as ``artifact_file``.

        ``history`` is `keras_sync.tracking.report_plot.SyncHistory.to_dict()`. Drawing takes
        ~0.7 s of matplotlib: in the courier, training and the end-of-fit wait do not pay it.
        ``fit_end``: the report of a fit's end. Under `keras_sync.Sync.fit` (``run_ends_after_fit``)
        it is queued after the run's end, once `end_run` has waited for the metrics: it reaches
        MLflow just after `fit` returns. Others (each epoch's) are queued at once.
        """
        rec = {"k": REPORT, "f": str(artifact_file), "h": history}
        if fit_end and self.run_ends_after_fit:
            self._deferred_report = rec
        else:
            # Each epoch's (`sync_report: epoch`) is drawn at once, as asked, not held by the courier.
            self._put(rec if fit_end else {**rec, "now": True})

    def _put_deferred_report(self, now: bool = False) -> None:
        """Queue the fit-end report; ``now``: the courier draws it at once instead of holding it until the
        spool is idle (`keras_sync.tracking.deliver.RunSender.hold_reports`)."""
        rec, self._deferred_report = self._deferred_report, None
        if rec is not None:
            self._put({**rec, "now": True} if now else rec)

    # ---- waiting ----
    def flush_to_spool(self, timeout_s: float = 10.0) -> bool:
        """Wait up to ``timeout_s`` until everything queued so far is in the spool.

        A process killed after this loses none of those records; a backup calls it so that the
        metrics up to its step are as durable as the backup.
        """
        target = self._last_seq
        if self._thread is None or not self._thread.is_alive():
            return not self._queue
        self._wake.set()
        with self._spooled:
            return self._spooled.wait_for(
                lambda: self._spooled_seq >= target or self._dead, timeout=timeout_s
            )

    def flush(
        self, timeout_s: float | None = None, stall_s: float = STALL_S, progress: Any = None
    ) -> bool:
        """Wait until MLflow has everything queued so far; True if it has.

        Waits while delivery makes progress: returns False at once when the courier's last
        attempt failed and MLflow answered nothing for ``stall_s`` (known to be away or refusing;
        a server that fails some requests and answers others is waited for), after ``stall_s``
        without progress, or after ``timeout_s`` (None: no limit besides those).
        """
        if not self.flush_to_spool(timeout_s=30.0 if timeout_s is None else timeout_s):
            return False
        target = (self._spooled_pos, self._handover.last)
        start = last_move = time.monotonic()
        deadline = start + timeout_s if timeout_s is not None else float("inf")
        seen = self._progress()
        while not self._reached(target):
            failed = self.failure()
            if (failed is not None and not self._answering(failed, stall_s)) or self._dead:
                return False
            now = time.monotonic()
            first_attempt_pending = self._courier_status() is None
            if now >= deadline or now - last_move > (
                STARTUP_S if first_attempt_pending else stall_s
            ):
                return False
            time.sleep(0.02)
            pos = self._progress()
            if pos != seen:
                seen, last_move = pos, time.monotonic()
            if (
                progress is not None
            ):  # also while nothing moves: the exit's line says what it waits for
                progress()
        return True

    def end_of_fit(self) -> None:
        """At the end of a `fit`: wait while delivery makes progress; else warn once, naming the cause.

        Under `keras_sync.Sync.fit` (``run_ends_after_fit``) it returns at once: `end_run` waits after fit.
        """
        if self.run_ends_after_fit or not self.wait_at_end_of_fit or self.flush():
            return
        self._warn_undelivered()

    def _warn_undelivered(self) -> None:
        if self.say_refused_once():
            return
        message = self.undelivered_message(final=False)
        if message and not self._warned_fit:
            self._warned_fit = True
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def end_run(
        self,
        status: str = "FINISHED",
        timeout_s: float | None = 120.0,
        *,
        wait_for_report: bool = False,
        wait: bool = True,
    ) -> bool:
        """End the run with ``status`` and wait while delivery makes progress; True if MLflow has it all.

        The fit-end sync report (queued after the end) is waited for only with ``wait_for_report``:
        where the process is killed as soon as training returns (Ray Train kills a worker's whole
        process tree, its courier included), it would otherwise be left in the spool.

        Unlike `close`, the writer stays open, with its spooling thread and courier process: the
        next record logged reopens the same run (RUNNING, steps continuing), as the next `fit` of a
        `Sync` does, without starting a courier again. What is not delivered yet (MLflow away) goes
        on being delivered in the background, and a warning says where it waits.

        ``wait=False``: only queue the end (and the report after it) and return False at once; the
        courier delivers them after the metrics, so the run is FINISHED only once MLflow has those.
        """
        if status not in _RUN_STATUSES:
            raise TrackingError(
                f"Invalid value for argument `status`. Received: status={status!r}. "
                f"Expected one of {', '.join(_RUN_STATUSES)}."
            )
        if self._closed:
            return not self._spool.path.is_dir()
        if not self._run_ended:
            status = self._mark_losses(status)
            self._put({"k": END, "status": status, "ts": int(time.time() * 1000), "last": False})
            self._run_ended = True
        self.start()
        if not wait:
            self._put_deferred_report()
            self._wake.set()
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

    def _cause(self) -> str:
        """Why delivery is behind, in words (the courier's last failure, or what it is doing)."""
        failed = self.failure()
        if failed is not None:
            cause = cause_in_words(failed.get("cause"), self.shown_uri)
            cause += f" ({failed.get('error', '')})"
        elif self._courier is None or self._courier.poll() is not None:
            cause = f"the courier process that delivers to {self.shown_uri} is not running"
        elif self._courier_status() is None:
            cause = (
                f"the courier process had not reached {self.shown_uri} yet (it starts by importing "
                "MLflow: seconds, more on a busy machine)"
            )
        else:
            cause = (
                f"delivery to {self.shown_uri} made no progress for {STALL_S:g} s (the courier "
                "process gets no CPU time, or MLflow does not answer)"
            )
        return cause

    def undelivered_message(self, final: bool = True) -> str | None:
        """Why some records are not in MLflow, and where they are; None if everything arrived."""
        held = [rec for rec in self._handover.unacknowledged() if rec["k"] not in BOOKKEEPING]
        pending = (
            len(self._queue)
            + len(held)
            + sum(
                rec["k"] not in BOOKKEEPING
                for _, rec in self._spool.read(self._progress()[0], max_records=10**9)
            )
        )
        if pending == 0:
            return None
        cause = self._cause()
        if held and not final:
            steps = step_ranges([rec["s"] for rec in held if rec["k"] == METRICS]) or "none"
            return (
                f"keras-sync: {pending} MLflow record(s) are not delivered yet: {cause}. The spool "
                f"{self.spool_path} cannot be written ({self._spool_error}), so {len(held)} of them (steps "
                f"{steps}) wait in this process's memory: they are lost if it ends before MLflow takes them."
            )
        points = self.points_left()
        what = f"{pending} MLflow record(s)" + (f" ({points} metric point(s))" if points else "")
        if final:
            where = f"Deliver them with: keras-sync sync-spool {self.spool_path}"
            if self.shown_uri != self._uri:
                where += " --tracking-uri URI (the spool keeps the URI without its credentials)"
        else:
            where = (
                f"Delivery goes on in the background while this process runs; what is left at exit "
                f"stays there for `keras-sync sync-spool {self.spool_path}`"
            )
        return (
            f"keras-sync: {what} are not delivered yet: {cause}. They are kept in "
            f"{self.spool_path}. {where}."
        )

    def close(
        self, timeout_s: float | None = 10.0, status: str = "FINISHED", *, at_exit: bool = False
    ) -> None:
        """End the run with ``status``; wait for delivery while it progresses (at most ``timeout_s``).

        What could not be delivered stays in the spool and a `RuntimeWarning` says why and how to
        deliver it. At interpreter exit, writers not closed are closed (FAILED after an uncaught
        exception), ``at_exit``: with no limit but delivery's progress, and one line on stderr
        while points are left (how many, where, that Ctrl-C leaves them in the spool).
        """
        if status not in _RUN_STATUSES:
            raise TrackingError(
                f"Invalid value for argument `status`. Received: status={status!r}. "
                f"Expected one of {', '.join(_RUN_STATUSES)}."
            )
        if self._closed:
            return
        self._closed = True
        _live_writers.discard(self)
        if not self._run_ended:
            self._put_deferred_report()  # a fit that raised before end_run: the report before the end
        if (
            self._run_ended or self._begin_deferred
        ):  # ended and nothing since, or never begun: only stop the courier
            self._put({"k": STOP})
        else:
            status = self._mark_losses(status)
            self._put({"k": END, "status": status, "ts": int(time.time() * 1000)})
        self.start()
        never_begun = (
            self._begin_deferred
        )  # nothing logged: no run, nothing to deliver; the courier goes
        line = None
        try:
            line = _ExitLine(self) if at_exit and not never_begun else None
            delivered = never_begun or self.flush(
                timeout_s=timeout_s, progress=line.update if line else None
            )
        except (
            KeyboardInterrupt
        ):  # Ctrl-C at exit: leave the rest in the spool, say how to deliver it
            delivered = False
        finally:
            if line is not None:
                line.done()
        self._closing = True
        self._wake.set()
        assert self._thread is not None
        self._thread.join(5.0)
        courier = self._courier
        if delivered and courier is not None and not never_begun:
            try:  # it ends once it has delivered the "end" record
                courier.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
        self._handover.pump()  # forget what the courier acknowledged last
        held = bool(self._handover.unacknowledged() or self._handover.dropped)
        message = None if delivered or held else self.undelivered_message(final=True)
        cause = self._cause()  # while the courier is still there to ask
        if message and self.say_refused_once():
            message = None  # said in its one line already
        if courier is not None and courier.poll() is None:
            # Waiting was given up (or the end was delivered and it is still exiting): after
            # close nothing runs in the background; the spool keeps what is left. SIGKILL: the
            # courier ignores SIGTERM (meant for the trainer when a scheduler signals a whole job step).
            courier.kill()
            courier.wait()
        self._handover.settle()
        self._handover.pump()
        self._handover.disconnect()
        self.run_id  # noqa: B018 - read the run id before the spool that holds it may be removed
        if held and not delivered:
            message = self._spill_held(cause)
        self._spool.close_segment()
        self._spool.unlock("writer")
        if (
            message is None
            and not self._thread.is_alive()
            and (never_begun or self._all_delivered())
        ):
            self._spool.remove()  # everything is in MLflow: the spool has done its job
            from keras_sync.tracking import artifacts as _artifacts

            _artifacts.remove_staging_if_empty(self.spool_path)
        elif message:
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def points_left(self) -> int:
        """Metric points queued, spooled or held that MLflow does not have yet."""
        recs = [rec for _, rec in self._queue] + self._handover.unacknowledged()
        recs += [rec for _, rec in self._spool.read(self._progress()[0], max_records=10**9)]
        return sum(len(rec.get("d", ())) for rec in recs if rec.get("k") == METRICS)

    # ---- the background thread: spool, and look after the courier ----
    def _loop(self) -> None:
        _lower_thread_priority()
        restarts, respawn_at = 0, 0.0
        try:
            self._open_spool()
            self._check_store()
            while True:
                self._wake.clear()  # before draining: a flush from now on is not lost
                self._drain_to_spool()
                self._handover.pump()
                closing = self._closing
                if (
                    self._courier is not None
                    and self._courier.poll() is not None
                    and not self._finished
                ):
                    self._handover.settle()  # its last word on the pipe, before judging its exit
                    if self._end_spooled and self._reached(
                        (self._spooled_pos, self._handover.last)
                    ):
                        self._finished = (
                            True  # it delivered the run's end and stopped, as it should
                        )
                    elif not closing:
                        restarts += 1
                        _log.warning(
                            "keras-sync's MLflow courier process exited (code %s); restarting it "
                            "(records are kept in %s).",
                            self._courier.returncode,
                            self.spool_path,
                        )
                        respawn_at = time.monotonic() + min(0.5 * 2**restarts, 30.0)
                        self._courier = None
                if self._courier is None and not closing and time.monotonic() >= respawn_at:
                    self._spawn_courier()
                self._watch_status()
                self._tell_run()
                if closing:
                    return
                self._wake.wait(SPOOL_INTERVAL_S)
        except OSError as e:  # the spool directory itself failed (removed)
            self._dead = True
            _log.error(
                "keras-sync cannot write its MLflow spool %s (%s); MLflow logging stops "
                "for this run.",
                self.spool_path,
                e,
            )
        finally:
            with self._spooled:
                self._spooled.notify_all()

    def _check_store(self) -> None:
        """A local sqlite store that cannot be created is known now, not after the courier imported MLflow."""
        from keras_sync.tracking.sqlite_store import check_creatable

        try:
            check_creatable(self._uri)
        except (
            TrackingError
        ) as e:  # the courier says the same once it tries, and "ok" if it is fixed by then
            self._handover.news = {
                **self._handover.news,
                "status": {
                    "ok": False,
                    "at": time.time(),
                    "error": f"TrackingError: {e}",
                    "cause": STORE_FAILING,
                    "uri": self.shown_uri,
                },
            }

    def _spawn_courier(self) -> None:
        try:
            ends = (
                self._handover.connect()
            )  # its pipes: records the spool cannot take, and its news
        except OSError:
            ends = None
        try:
            self._courier = self._launcher.call(
                lambda: _courier.spawn(self._spool, self._uri, header=self._header, pipe_fds=ends)
            )
        except OSError as e:
            self._courier = None
            self._handover.disconnect()
            _log.error(
                "keras-sync cannot start its MLflow courier process (%s); records are kept in %s "
                "(deliver them with: keras-sync sync-spool %s).",
                e,
                self.spool_path,
                self.spool_path,
            )
        finally:
            for fd in ends or ():
                os.close(fd)  # the courier's ends: its copies are its own

    def _tell_run(self) -> None:
        """Call `on_run` once the run id is known (or MLflow failed before it was)."""
        failed = self.failure()
        if (
            self.on_run is not None
            and not self._begin_deferred
            and (self.run_id is not None or (failed is not None and not self._answering(failed)))
        ):
            on_run, self.on_run = self.on_run, None
            try:
                on_run(self)
            except Exception as e:
                _log.debug("on_run failed: %s", e)

    def _watch_status(self) -> None:
        """Log the courier's first failure and its recovery (in this process, where logging is set up)."""
        status = self._courier_status()
        was_ok = self._status is None or self._status.get("ok")
        if status is not None and not status.get("ok") and status.get("cause") == CREDENTIALS:
            self.say_refused_once()
        elif status is not None and not status.get("ok") and was_ok:
            _log.warning(
                "keras-sync: MLflow at %s is %s (%s); records are kept in %s, retrying in the background.",
                self.shown_uri,
                cause_in_a_word(status.get("cause")),
                status.get("error"),
                self.spool_path,
            )
        elif status is not None and status.get("ok") and not was_ok:
            _log.info(
                "keras-sync: MLflow at %s is reachable again; the spool backlog is being delivered.",
                self.shown_uri,
            )
        self._status = status

    def _open_spool(self) -> None:
        """Take the job's spool directory (or continue the one a crashed process left)."""
        if not self._spool.lock("writer"):
            # The same job id is logging elsewhere right now: this writer keeps its own spool.
            busy = self._spool.path
            self._spool = SpoolDir(busy.with_name(f"{busy.name}.{os.getpid()}-{id(self):x}"))
            self._spool.lock("writer")
            _log.warning(
                "Spool %s is in use by another writer; this one writes %s.", busy, self.spool_path
            )
        (self._spool.path / "status.json").unlink(
            missing_ok=True
        )  # a predecessor's outcome is not ours
        begin = getattr(self, "_started_ms", None) or int(time.time() * 1000)
        try:  # a full disk from the start: the courier has the header from its environment
            self._spool.write_header(self._header)
            self._spooled_pos = self._spool.start_segment()
            reserve = self._spool.path / "reserve"
            if not reserve.exists():
                reserve.write_bytes(b"\0" * RESERVE_BYTES)
        except OSError as e:
            self._spool_failed(e.strerror or str(e))
        if not self._begin_at_open_deferred:
            self._spool_or_hold([{"k": BEGIN, "ts": begin}])

    def _drain_to_spool(self) -> None:
        recs: list[dict[str, Any]] = []
        last = None
        while self._queue:
            seq, rec = self._queue.popleft()
            last = seq
            rec = self._clean(rec)
            if rec is not None:
                recs.append(rec)
                self._end_spooled |= is_last_record(rec)
        if recs:
            self._spool_or_hold(recs)
        if last is not None:
            with self._spooled:
                self._spooled_seq = last
                self._spooled.notify_all()

    def _spool_or_hold(self, recs: list[dict[str, Any]]) -> None:
        """Append to the spool; what it refuses, and everything after, goes to the courier from memory."""
        if self._spool_error is None:
            try:
                self._spooled_pos = self._spool.append(recs)
                if self._spool.remade is not None:
                    _log.warning(
                        "keras-sync: the MLflow spool %s was deleted while this run logged into it; keras-sync "
                        "made it again and %s (the courier sends them again; MLflow keeps one point per step). "
                        "Records of earlier segments not yet delivered went with it. Fix: leave "
                        "mlflow.spool_dir alone while a job runs, or set it to a folder nothing cleans.",
                        self.spool_path,
                        self._spool.remade,
                    )
                    self._spool.remade = None
                return
            except SpoolFull as e:
                self._spooled_pos = e.pos
                recs = recs[e.done :]
                self._spool_failed(e.reason)
        for rec in recs:
            self._handover.hold(rec)

    def _spool_failed(self, reason: str) -> None:
        if self._spool_error is None:
            self._spool_error = reason
            _log.warning(
                "keras-sync cannot write its MLflow spool %s (%s): from here on the records are kept in "
                "memory (at most %d MB) and handed to the courier directly; none is lost while MLflow "
                "takes them.",
                self.spool_path,
                reason,
                self._handover.max_bytes // 2**20,
            )

    def _all_delivered(self) -> bool:
        return not self._handover.unacknowledged() and not self._spool.read(
            self._progress()[0], max_records=1
        )

    def _lost_text(self, steps: list[int], others: int) -> str:
        what = f"the points of steps {step_ranges(steps)}" if steps else "no metric points"
        if others:
            what += f" and {others} other record(s)"
        return (
            f"{what}: the spool {self.spool_path} could not be written ({self._spool_error}) while "
            f"MLflow did not take them"
        )

    def _mark_losses(self, status: str) -> str:
        """Before the run's end: records dropped over the memory bound make it FAILED, with a tag naming them."""
        if not self._handover.dropped:
            return status
        steps, others = self._handover.lost_steps([])
        self._put({"k": TAGS, "d": {LOST_TAG: self._lost_text(steps, others)}})
        return "FAILED"

    def _spill_held(self, cause: str) -> str | None:
        """After the courier stopped: put what MLflow did not take into the spool if the disk has room
        again; else end the spooled run FAILED with a tag naming what is lost. Returns the line to show."""
        records = self._handover.unacknowledged()
        try:
            self._spooled_pos = self._spool.append(records)
            records = []
        except SpoolFull as e:
            self._spooled_pos = e.pos
            records = records[e.done :]
        if not records and not self._handover.dropped:
            return self.undelivered_message(final=True)  # all of it in the spool after all
        steps, others = self._handover.lost_steps(records)
        lost = self._lost_text(steps, others)
        (self._spool.path / "reserve").unlink(missing_ok=True)  # room for the run's end
        end = [
            {"k": TAGS, "d": {LOST_TAG: lost[:MAX_TAG_VALUE_LENGTH]}},
            {"k": END, "status": "FAILED", "ts": int(time.time() * 1000)},
        ]
        try:
            self._spooled_pos = self._spool.append(end)
            after = (
                f"the rest is in the spool: `keras-sync sync-spool {self.spool_path}` delivers it and ends "
                f"the run FAILED with the tag {LOST_TAG}"
            )
        except SpoolFull:
            after = f"nothing more fits in {self.spool_path}: the run stays RUNNING in MLflow"
        return f"keras-sync: MLflow lost {lost} ({cause}); {after}."

    def _clean(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        k = rec["k"]
        if k == METRICS:
            out = {}
            for key, v in rec["d"].items():
                clean = self._key_cache.get(key)
                if clean is None:
                    clean = self._key_cache[key] = _metric_key(key)
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
                _clip(_redact(key, self._secrets), MAX_KEY_LENGTH): _clip(
                    _redact(v, self._secrets), limit
                )
                for key, v in rec["d"].items()
            }
        elif k == TEXT:
            rec["text"] = _redact(rec["text"], self._secrets)
        return rec


class _ExitLine:
    """The one line shown while the exit waits for delivery; on a terminal its count goes down in place.

    Shown at once when metric points are left, else once the wait passes `EXIT_QUIET_S` (the sync
    report being drawn, the run's end on a slow server): a short wait stays quiet, a long one says why.
    """

    def __init__(self, writer: MlflowWriter):
        self._w = writer
        self._shown = False
        self._tty = bool(getattr(sys.stderr, "isatty", lambda: False)())
        self._start = self._last = time.monotonic()
        left = writer.points_left()
        if left:
            self._show(left)

    def _text(self, left: int) -> str:
        w = self._w
        if left:
            what = f"{left} metric point(s) not in MLflow yet ({w.shown_uri}); delivering them before exit"
        else:
            what = (
                f"waiting for MLflow ({w.shown_uri}) to receive the run's last records (the sync report "
                "picture, drawn now, and the run's end) before exit"
            )
        return (
            f"keras-sync: {what}. They are kept in {w.spool_path}: Ctrl-C leaves them there for "
            f"`keras-sync sync-spool {w.spool_path}`"
        )

    def _show(self, left: int) -> None:
        self._shown, self._last = True, time.monotonic()
        end = "" if self._tty else "\n"
        print(("\r" if self._tty else "") + self._text(left), end=end, file=sys.stderr, flush=True)

    def update(self) -> None:
        now = time.monotonic()
        if (
            not self._shown
            and now - self._start >= EXIT_QUIET_S
            or self._shown
            and self._tty
            and now - self._last >= 0.5
        ):
            self._show(self._w.points_left())

    def done(self) -> None:
        if self._shown and self._tty:
            print(file=sys.stderr, flush=True)


#: How long the exit waits for delivery before a line says what it waits for (seconds).
EXIT_QUIET_S = 2.0


#: How long ``keras-sync sync-spool`` retries failing requests before it gives up (seconds).
REPLAY_TIMEOUT_S = 600.0


def replay_spool(
    spool_path: str | os.PathLike[str],
    tracking_uri: str | None = None,
    *,
    timeout_s: float = REPLAY_TIMEOUT_S,
    progress: Any = None,
) -> int:
    """Deliver what a spool directory holds; return the metric points sent.

    Idempotent: the delivered position moves after every batch, and a step a metric already has
    is not sent again. ``tracking_uri`` defaults to the one in the spool (kept without
    credentials: pass it again if the server needs them). A fully delivered spool is removed.
    Backs ``keras-sync sync-spool DIR``.

    Each request that fails (no answer, HTTP 503) is retried on its own as the courier does
    (`keras_sync.tracking.retry`) until ``timeout_s`` has passed (0: each request is tried once);
    a refusal (a bad request, refused credentials) stops at once. ``progress(sent, total, failures)``
    is called after each request that failed or delivered points: metric points sent, points the
    spool held, and what failed in words ("7 of 40 requests failed with HTTP 503", or "").
    """
    path = Path(spool_path)
    if path.is_file():  # a file of the spool (its header, a segment) names the spool too
        path = path.parent
    spool = SpoolDir(path)
    if not path.is_dir():
        raise TrackingError(
            f"Invalid value for argument `spool_path`. Received: spool_path={str(spool_path)!r}, "
            "which does not exist. Expected a spool directory left by a writer (a fully "
            "delivered spool is removed, so there is nothing left to send)."
        )
    if spool.header() is None:
        raise TrackingError(
            f"Invalid value for argument `spool_path`. Received: spool_path={str(spool_path)!r}. "
            "Expected a keras-sync spool directory (it holds header.json and *.jsonl segments)."
        )
    if not spool.lock("writer") or not spool.lock("deliver"):
        spool.unlock("writer")
        raise TrackingError(
            f"Spool {path} is in use by a running keras-sync writer, which delivers it itself; "
            "replay it after that process has ended."
        )
    delivery = _courier.Delivery(spool, tracking_uri)
    deadline = time.monotonic() + max(0.0, timeout_s)
    delivery.give_up = lambda: time.monotonic() >= deadline
    total = sum(
        len(rec["d"])
        for _, rec in spool.read(delivery.pos, max_records=10**9)
        if rec["k"] == METRICS
    )
    if progress is not None:
        delivery.on_progress = lambda: progress(
            delivery.sender.points_sent, total, delivery.sender.retrier.summary()
        )
    try:
        sent = delivery.deliver_available()
        delivery.sender.release_report()  # one a courier held when its process ended
    except Exception as e:
        from keras_sync.tracking.deliver import refused_credentials

        http = refused_credentials(e)
        if http is not None:  # the status, not the server's page
            raise TrackingError(
                f"Could not deliver spool {path}: MLflow at {delivery.shown_uri} refused the credentials (HTTP {http}). "
                "Set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) and run "
                "`keras-sync sync-spool` again; nothing delivered is sent twice."
            ) from None
        from keras_sync.tracking.deliver import is_transient

        failures = delivery.sender.retrier.summary()
        if (
            is_transient(e) and failures
        ):  # retried until the time was up: what happened, not the last error
            left = total - delivery.sender.points_sent
            raise TrackingError(
                f"Could not deliver spool {path} to MLflow at {delivery.shown_uri} within {timeout_s:g} s: "
                f"{failures}; {left} of {total} metric point(s) are left in it. Nothing delivered is sent twice; "
                "run `keras-sync sync-spool` again (a longer --timeout waits longer)."
            ) from None
        raise TrackingError(
            f"Could not deliver spool {path} to MLflow at {delivery.shown_uri}: "
            f"{_redact(str(e), delivery.secrets)[:500].rstrip('.')}. Nothing delivered is sent twice; run "
            "`keras-sync sync-spool` again once MLflow there can take them (or give --tracking-uri)."
        ) from None
    finally:
        spool.unlock("deliver")
        spool.unlock("writer")
    if (
        not delivery.pending()
    ):  # not spool.pending(): on a full disk the delivered position may not be on file
        spool.remove()
    return sent
