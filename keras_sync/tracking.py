"""MLflow tracking that never stalls training and loses nothing.

`MlflowWriter` is what the sync-metrics callback writes through: the training thread only
appends to an in-memory queue; a daemon thread writes each record to a local JSONL spool first
(write-ahead), and a child process (the courier, `keras_sync._courier`) sends batches from the
spool with `MlflowClient.log_batch`, retrying with backoff while the server is down. MLflow's
per-point Python cost then runs outside the training process and never holds its GIL. What is
still undelivered at `close()` stays in the spool, and ``keras-sync sync-spool PATH``
(`replay_spool`) delivers it later without duplicating a point.

Every param, tag and text artifact is scrubbed of secrets first: credentials in URIs and the
values of environment variables whose names say TOKEN, PASSWORD, SECRET or API_KEY.

MLflow is imported on first use, never by ``import keras_sync``.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import re
import sys
import threading
import time
import uuid
import warnings
import weakref
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from keras_sync._courier import Courier
from keras_sync._spool import Deliverer, SpoolFile
from keras_sync.redact import redact_uri
from keras_sync.redact import redact_text as _redact
from keras_sync.redact import secrets_of as _secrets_of
from keras_sync.errors import TrackingError

_log = logging.getLogger("keras_sync.tracking")

#: Where spools go when ``spool_dir`` is not given (relative to the working directory).
DEFAULT_SPOOL_DIR = ".keras_sync_spool"
MAX_PARAM_VALUE_LENGTH = 6000  # MLflow 3.x; longer values are refused
MAX_TAG_VALUE_LENGTH = 8000
MAX_KEY_LENGTH = 250
_TRUNCATED = "...[truncated]"

_RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")
_JOB_ID = re.compile(r"^[\w.:/@+\-]{1,250}$")
_BAD_KEY_CHARS = re.compile(r"[^\w.\- :/]")


def resolve_tracking_uri(configured: str | None, *, environ: Mapping[str, str] | None = None,
                         cwd: str | os.PathLike[str] | None = None) -> tuple[str, str]:
    """Pick the tracking URI: the config's, else ``MLFLOW_TRACKING_URI``, else a sqlite file here.

    Returns ``(uri, source)`` with source ``"file"``, ``"env"`` or ``"default"``; the default is
    MLflow 3's own, ``sqlite:///<cwd>/mlflow.db``.
    """
    environ = os.environ if environ is None else environ
    if configured:
        return configured, "file"
    if environ.get("MLFLOW_TRACKING_URI"):
        return environ["MLFLOW_TRACKING_URI"], "env"
    base = Path(cwd) if cwd is not None else Path.cwd()
    return f"sqlite:///{base.resolve() / 'mlflow.db'}", "default"


def _metric_key(key: str) -> str:
    clean = _BAD_KEY_CHARS.sub("_", str(key)).lstrip("/")
    clean = re.sub(r"/+", "/", clean).replace("..", "__")[:MAX_KEY_LENGTH]
    return clean if clean not in ("", ".") else "_"


def _clip(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[: limit - len(_TRUNCATED)] + _TRUNCATED


_live_writers: weakref.WeakSet[MlflowWriter] = weakref.WeakSet()
_ATEXIT_TIMEOUT_S = 5.0


@atexit.register
def _close_at_exit() -> None:
    # An uncaught exception has been printed by now, and left sys.last_type behind.
    status = "FAILED" if getattr(sys, "last_type", None) is not None else "FINISHED"
    for w in list(_live_writers):
        w.close(timeout_s=_ATEXIT_TIMEOUT_S, status=status)


def _lower_thread_priority() -> None:
    """Nice the writer's thread (Linux threads have their own nice value): when the cores are busy
    training, the replicas go first and spooling waits; it never matters when they are idle."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
        pass


#: How often the writer's thread moves queued records to the spool file (seconds).
SPOOL_INTERVAL_S = 0.2


class MlflowWriter:
    """Log metrics, params, tags and text to one MLflow run without ever blocking the caller.

    Calls only queue records; a daemon thread spools them to ``spool_path`` and a child process
    started by `start` delivers them in batches (restarted if it dies). While the server is
    unreachable it keeps retrying with backoff (0.5 s up to 30 s). ``close()`` waits at most
    ``timeout_s``; whatever is still undelivered stays in the spool and a `RuntimeWarning` says
    how to deliver it (``keras-sync sync-spool PATH``).

    Args:
        tracking_uri: MLflow tracking URI (see `resolve_tracking_uri`).
        experiment: experiment name; created if missing.
        run_name: name of a new run (ignored when an existing run is resumed).
        job_id: the same job id resumes the same run (tag ``keras_sync.job_id``) and reuses the
            same spool file, so a restarted job also delivers what its predecessor left behind.
        spool_dir: directory of spool files; default ``./.keras_sync_spool``.
        flush_interval_s: how often the courier sends what was spooled (it runs in its own
            process, so sending often costs the training nothing; it keeps the wait of the
            flush at train end short).
        max_batch: metric points per `log_batch` call (MLflow accepts at most 1000).

    Example:
        >>> w = MlflowWriter(tracking_uri="sqlite:///mlflow.db", experiment="demo")  # doctest: +SKIP
        >>> w.start(); w.log_metrics({"loss": 0.3}, step=1); w.close()  # doctest: +SKIP
    """

    def __init__(self, *, tracking_uri: str, experiment: str, run_name: str | None = None,
                 job_id: str | None = None, spool_dir: str | os.PathLike[str] | None = None,
                 flush_interval_s: float = 0.25, max_batch: int = 1000):
        if not tracking_uri or not isinstance(tracking_uri, str):
            raise TrackingError(f"Invalid value for argument `tracking_uri`. Received: "
                                f"tracking_uri={tracking_uri!r}. Expected a non-empty URI string.")
        if not experiment or not isinstance(experiment, str):
            raise TrackingError(f"Invalid value for argument `experiment`. Received: "
                                f"experiment={experiment!r}. Expected a non-empty name.")
        if job_id is not None and not _JOB_ID.match(str(job_id)):
            raise TrackingError(f"Invalid value for argument `job_id`. Received: job_id={job_id!r}. "
                                "Expected 1-250 letters, digits or `_.:/@+-` (no quotes or spaces).")
        if not flush_interval_s > 0:
            raise TrackingError(f"Invalid value for argument `flush_interval_s`. Received: "
                                f"flush_interval_s={flush_interval_s!r}. Expected a number > 0.")
        if not 1 <= int(max_batch) <= 1000:
            raise TrackingError(f"Invalid value for argument `max_batch`. Received: "
                                f"max_batch={max_batch!r}. Expected 1..1000 (MLflow's batch limit).")
        self._uri = tracking_uri
        self._shown_uri = redact_uri(tracking_uri)
        self._secrets = _secrets_of(tracking_uri, os.environ)
        self._flush_interval_s = float(flush_interval_s)
        self._max_batch = int(max_batch)
        self._experiment, self._run_name, self._job_id = experiment, run_name, job_id
        try:
            Path(spool_dir or DEFAULT_SPOOL_DIR).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrackingError(f"Invalid value for argument `spool_dir`. Received: "
                                f"spool_dir={str(spool_dir or DEFAULT_SPOOL_DIR)!r}, which cannot be "
                                f"created ({e.strerror}). Expected a writable directory.") from None
        name = re.sub(r"[^\w.\-]", "_", job_id) if job_id else f"run-{uuid.uuid4().hex[:12]}"
        self.spool_path = Path(spool_dir or DEFAULT_SPOOL_DIR).resolve() / f"{name}.spool.jsonl"
        self._spool = SpoolFile(self.spool_path)
        self._queue: deque[tuple[int, dict[str, Any]]] = deque()
        self._seq = itertools.count(1)
        self._last_seq = 0
        self._delivered_seq = 0
        self._spooled_seq = 0
        # Spool offsets: written (_spooled_end), owed to MLflow (_owed_end: the run record is not),
        # delivered (_delivered_end, as the courier reports it); (last seq, owed end) of each drain.
        self._spooled_end = self._owed_end = self._delivered_end = self._resume_from = 0
        self._seq_marks: deque[tuple[int, int]] = deque()
        self._wake = threading.Event()
        self._progress = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = self._abandon = self._closed = self._dead = self._urgent = False
        self._courier: Courier | None = None
        self._courier_done = threading.Event()
        self._run_id: str | None = None
        self._new_run: str | None = None
        self._key_cache: dict[str, str] = {}
        _live_writers.add(self)

    # ---- the caller's side: O(1), no I/O ----
    @property
    def run_id(self) -> str | None:
        """The MLflow run id, once the background thread has created or found the run."""
        return self._run_id

    def start(self) -> None:
        """Start the background thread, which opens (or resumes) the run; returns at once."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="keras-sync-mlflow", daemon=True)
            self._thread.start()

    def _put(self, rec: dict[str, Any]) -> None:
        if self._closing:
            raise TrackingError("MlflowWriter is closed; create a new writer to log more.")
        if self._dead:
            return  # the spool failed and said so once; do not grow memory forever
        seq = next(self._seq)
        self._queue.append((seq, rec))
        self._last_seq = seq
        if len(self._queue) >= self._max_batch:
            self._wake.set()

    def log_metrics(self, metrics: dict[str, float], step: int, timestamp_ms: int | None = None) -> None:
        """Queue metric values at ``step``; keys MLflow would refuse are rewritten (``a@b`` -> ``a_b``)."""
        ts = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
        self._put({"k": "m", "s": int(step), "ts": ts, "d": dict(metrics)})

    def skip_logged_steps(self) -> None:
        """From here on, drop metric points at steps the run already has for that metric.

        A job resumed from a backup retrains the steps between its last backup and the crash;
        calling this before logging them keeps the run free of duplicate steps. Points queued
        before the call (an earlier process's undelivered spool included) are delivered first
        and count as already logged.
        """
        self._put({"k": "dedupe"})

    def log_params(self, params: dict[str, object]) -> None:
        """Queue params; values are stringified, scrubbed of secrets and cut to 6000 characters."""
        self._put({"k": "p", "d": {str(k): str(v) for k, v in params.items()}})

    def set_tags(self, tags: dict[str, str]) -> None:
        """Queue run tags; values are scrubbed of secrets and cut to 8000 characters."""
        self._put({"k": "t", "d": {str(k): str(v) for k, v in tags.items()}})

    def log_text_artifact(self, text: str, artifact_file: str) -> None:
        """Queue a text file to store as the run artifact ``artifact_file``, scrubbed of secrets."""
        self._put({"k": "a", "f": str(artifact_file), "text": str(text)})

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait up to ``timeout_s`` for everything queued so far to reach MLflow; True if it did."""
        target = self._last_seq
        self._urgent = True
        self._wake.set()
        if self._thread is None or not self._thread.is_alive():
            return not self._queue and self._delivered_end >= self._owed_end
        with self._progress:
            return self._progress.wait_for(
                lambda: self._delivered_seq >= target and self._delivered_end >= self._resume_from,
                timeout=timeout_s)

    def flush_to_spool(self, timeout_s: float = 10.0) -> bool:
        """Wait up to ``timeout_s`` until everything queued so far is in the spool file.

        A process killed after this loses none of those records (the spool survives it); a
        backup calls it so that metrics up to the backup's step are as durable as the backup.
        """
        target = self._last_seq
        if self._thread is None or not self._thread.is_alive():
            return not self._queue
        self._wake.set()
        with self._progress:
            return self._progress.wait_for(lambda: self._spooled_seq >= target or self._dead, timeout=timeout_s)

    def close(self, timeout_s: float = 10.0, status: str = "FINISHED") -> None:
        """End the run with ``status`` and stop the thread, waiting at most ``timeout_s``.

        What could not be delivered stays in the spool; a `RuntimeWarning` names it. At
        interpreter exit, writers not closed are closed with a 5 s wait (FAILED after an
        uncaught exception).
        """
        if status not in _RUN_STATUSES:
            raise TrackingError(f"Invalid value for argument `status`. Received: status={status!r}. "
                                f"Expected one of {', '.join(_RUN_STATUSES)}.")
        if self._closed:
            return
        self._closed = True
        _live_writers.discard(self)
        self._put({"k": "end", "status": status})
        self._closing = self._urgent = True
        self.start()
        self._wake.set()
        assert self._thread is not None
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._abandon = True  # stop retrying: `keras-sync sync-spool` takes over from here
            self._wake.set()
            self._thread.join(1.5)
        # The courier may still be inside one call (it is stopped within 3 s): then keep the spool.
        delivered = max(self._delivered_end, self._spool.delivered_offset())
        left = len(self._queue) + sum(rec["k"] not in ("header", "run") for _, rec in self._spool.read(delivered))
        if not left and not self._thread.is_alive():
            # Everything reached MLflow: the write-ahead log has done its job.
            for p in (self.spool_path, self._spool.offset_path):
                p.unlink(missing_ok=True)
            return
        if not left:
            return
        creds = ("" if self._shown_uri == self._uri else
                 " (the spool stores the URI without credentials: pass it again)")
        warnings.warn(
            f"keras-sync: {left} MLflow record(s) were not delivered to {self._shown_uri} "
            f"within {timeout_s:g} s; they are kept in {self.spool_path}. Deliver them when "
            f"the server is back with: keras-sync sync-spool {self.spool_path}{creds}",
            RuntimeWarning, stacklevel=2)

    # ---- the background thread: spool, and the courier process that delivers ----
    def _loop(self) -> None:
        _lower_thread_priority()
        told, stop_sent, respawn_at, restarts = -1, False, 0.0, 0
        try:
            self._open_spool()
            while not self._abandon:
                self._wake.clear()  # before draining: a flush() from now on is not lost
                urgent, self._urgent = self._urgent, False
                # The spool is written every SPOOL_INTERVAL_S, whatever the delivery schedule, so a
                # killed process (or one killed during an outage) loses at most that much.
                self._drain_to_spool()
                run_id, self._new_run = self._new_run, None
                if run_id is not None:  # lets a replay or a restart find the run (not owed to MLflow)
                    (self._spooled_end,) = self._spool.append([{"k": "run", "run_id": run_id}])
                if self._courier is None or (not self._courier.alive() and self._courier_done.is_set()):
                    if self._courier is not None:
                        restarts += 1
                        code = self._courier.proc.poll()
                        _log.warning("keras-sync's MLflow courier process exited (code %s); restarting it "
                                     "(records are kept in %s).", code, self.spool_path)
                        self._courier = None
                        respawn_at = time.monotonic() + min(0.5 * 2 ** restarts, 30.0)
                    if time.monotonic() >= respawn_at:
                        self._spawn_courier()
                        told, stop_sent = -1, False
                        respawn_at = time.monotonic() + 30.0  # if the spawn itself failed
                if self._courier is not None:
                    if self._spooled_end > told or urgent:
                        self._courier.send({"go": self._spooled_end, "urgent": urgent})
                        told = self._spooled_end
                    if self._closing and not stop_sent:
                        stop_sent = self._courier.send({"stop": True})
                if self._closing and self._delivered_end >= self._owed_end and not self._queue:
                    return
                self._wake.wait(SPOOL_INTERVAL_S)
        except OSError as e:  # the spool itself failed (disk full, directory removed)
            self._dead = True
            _log.error("keras-sync cannot write its MLflow spool %s (%s); MLflow logging stops "
                       "for this run.", self.spool_path, e)
        finally:
            if self._courier is not None:
                if self._abandon or self._dead:
                    self._courier.send({"abandon": True})
                self._courier.end(wait_s=1.0)
            self._spool.close()
            with self._progress:
                self._progress.notify_all()

    def _spawn_courier(self) -> None:
        settings = {
            "spool_path": str(self.spool_path), "tracking_uri": self._uri, "experiment": self._experiment,
            "run_name": self._run_name, "job_id": self._job_id, "flush_interval_s": self._flush_interval_s,
            "max_batch": self._max_batch, "spooled": self._spooled_end, "delivered": self._delivered_end,
            "resume_from": self._resume_from, "run_id": self._run_id,  # a restarted courier keeps the run
        }
        self._courier_done = threading.Event()
        done = self._courier_done
        try:
            self._courier = Courier(settings, lambda msg: self._on_courier(msg, done))
        except OSError as e:
            self._courier = None
            _log.error("keras-sync cannot start its MLflow courier process (%s); records are kept in %s "
                       "(deliver them with: keras-sync sync-spool %s).", e, self.spool_path, self.spool_path)

    def _on_courier(self, msg: dict[str, Any] | None, done: threading.Event) -> None:
        """A message from the courier (in its reader thread); None when it has exited."""
        if msg is None:
            done.set()
            self._wake.set()
        elif "delivered" in msg:
            with self._progress:
                self._delivered_end = max(self._delivered_end, int(msg["delivered"]))
                self._pop_delivered_marks()
                self._progress.notify_all()
        elif "run" in msg:
            self._run_id = msg["run"]
            if msg.get("fresh"):
                self._new_run = msg["run"]
                self._wake.set()
        elif "log" in msg:
            _log.log(int(msg["log"]), "%s", msg.get("msg", ""))

    def _open_spool(self) -> None:
        """Create the spool, or continue one an earlier process with the same job id left."""
        if not self._spool.lock():
            # The same job id is still logging elsewhere (another live process or writer):
            # its spool is its own, so this writer keeps a separate one.
            busy = self.spool_path
            self.spool_path = busy.with_name(busy.name.replace(".spool.jsonl",
                                                               f".{os.getpid()}-{id(self):x}.spool.jsonl"))
            self._spool = SpoolFile(self.spool_path)
            self._spool.lock()
            _log.warning("Spool %s is in use by another writer; this one writes %s.", busy,
                         self.spool_path)
        size = self._spool.repair_tail()
        if size == 0:
            (size,) = self._spool.append([{"k": "header", "v": 1, "experiment": self._experiment,
                                           "run_name": self._run_name, "job_id": self._job_id,
                                           "tracking_uri": self._shown_uri}])
            self._spool.mark_delivered(size)
        # What the earlier process did not deliver (up to _resume_from) goes first.
        self._spooled_end = self._owed_end = self._resume_from = size
        self._delivered_end = min(self._spool.delivered_offset(), size)

    def _drain_to_spool(self) -> None:
        recs: list[tuple[int, dict[str, Any]]] = []
        last = None
        while self._queue:
            seq, rec = self._queue.popleft()
            last = seq
            rec = self._clean(rec)
            if rec is not None:
                recs.append((seq, rec))
        if recs:
            ends = self._spool.append([rec for _, rec in recs])
            self._spooled_end = self._owed_end = ends[-1]
        if last is not None:  # records up to `last` are delivered once the courier passes _owed_end
            with self._progress:
                self._spooled_seq = last
                self._seq_marks.append((last, self._owed_end))
                self._pop_delivered_marks()
                self._progress.notify_all()

    def _pop_delivered_marks(self) -> None:
        while self._seq_marks and self._seq_marks[0][1] <= self._delivered_end:
            self._delivered_seq = self._seq_marks.popleft()[0]

    def _clean(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        k = rec["k"]
        if k == "m":
            out = {}
            for key, v in rec["d"].items():
                clean = self._key_cache.get(key)
                if clean is None:
                    clean = self._key_cache[key] = _metric_key(key)
                    if clean != key:
                        _log.warning("Metric key %r is not valid in MLflow; logged as %r.", key, clean)
                try:
                    out[clean] = float(v)
                except (TypeError, ValueError):
                    _log.warning("Metric %r=%r is not a number; dropped.", key, v)
            rec["d"] = out
            return rec if out else None
        if k in ("p", "t"):
            limit = MAX_PARAM_VALUE_LENGTH if k == "p" else MAX_TAG_VALUE_LENGTH
            rec["d"] = {_clip(_redact(key, self._secrets), MAX_KEY_LENGTH):
                        _clip(_redact(v, self._secrets), limit) for key, v in rec["d"].items()}
        elif k == "a":
            rec["text"] = _redact(rec["text"], self._secrets)
        return rec


def replay_spool(spool_path: str | os.PathLike[str], tracking_uri: str | None = None) -> int:
    """Deliver what a spool holds beyond its delivered offset; return the metric points sent.

    Idempotent: the offset moves after every batch, so a second replay sends nothing. The run is
    the one recorded in the spool, else the one with the spool's job id, else a new run.
    ``tracking_uri`` defaults to the one in the spool (stored without credentials: pass it again
    if the server needs them). Backs ``keras-sync sync-spool PATH``.
    """
    spool = SpoolFile(spool_path)
    if not spool.path.is_file():
        raise TrackingError(f"Invalid value for argument `spool_path`. Received: "
                            f"spool_path={str(spool_path)!r}, which does not exist. Expected a "
                            "spool file left by a writer (a fully delivered spool is removed).")
    if not spool.lock():
        raise TrackingError(f"Spool {spool_path} is in use by a running keras-sync writer, which "
                            "delivers it itself; replay it after that process has ended.")
    try:
        return _replay_locked(spool, spool_path, tracking_uri)
    finally:
        spool.close()


def _replay_locked(spool: SpoolFile, spool_path: str | os.PathLike[str],
                   tracking_uri: str | None) -> int:
    spool.repair_tail()
    header = spool.header()
    if header is None:
        raise TrackingError(f"Invalid value for argument `spool_path`. Received: "
                            f"spool_path={str(spool_path)!r}. Expected a keras-sync spool file "
                            "(*.spool.jsonl) whose first line is its header.")
    uri = tracking_uri or header["tracking_uri"]
    if not any(rec["k"] not in ("header", "run") for _, rec in spool.read(spool.delivered_offset())):
        spool.mark_delivered(spool.repair_tail())
        return 0
    deliverer = Deliverer(uri, header["experiment"], header.get("run_name"), header.get("job_id"),
                          run_id=spool.last_run_id())
    try:
        _, fresh = deliverer.ensure_run()
        if fresh:
            spool.append([{"k": "run", "run_id": deliverer.run_id}])
        sent = 0
        while chunk := spool.read(spool.delivered_offset(), max_records=100):
            sent += deliverer.send([rec for _, rec in chunk])
            spool.mark_delivered(chunk[-1][0])
        return sent
    except Exception as e:
        raise TrackingError(
            f"Could not deliver spool {spool_path} to MLflow at {redact_uri(uri)}: "
            f"{_redact(str(e), _secrets_of(uri, os.environ))[:500]}. Nothing delivered is sent "
            "twice; run `keras-sync sync-spool` again when the server is reachable.") from None
