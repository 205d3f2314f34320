"""The write-ahead spool behind `keras_sync.tracking.MlflowWriter`, and its delivery to MLflow.

A spool is a JSONL file, one record per line, plus a ``<spool>.offset`` file that holds the byte
offset up to which records have been delivered. Records are appended before delivery is tried;
the offset moves only after MLflow accepted them, so a crash in between re-sends a batch at
worst, and the SQL stores behind MLflow drop metric points identical in key, value, step and
timestamp (their primary key), so such a re-send does not duplicate a point.

Record kinds (``"k"``): ``header`` (first line: experiment, run name, job id, redacted URI),
``run`` (the run id, once known), ``m`` (metrics at one step), ``p`` (params), ``t`` (tags),
``a`` (a text artifact), ``end`` (the run ended with a status).

Nothing here imports MLflow at import time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one writer per spool is then on the user
    fcntl = None  # type: ignore[assignment]

_log = logging.getLogger("keras_sync.tracking")

# MLflow reads its HTTP retry settings from the environment on every request. Retrying is ours
# to do (with backoff, in the background), so each of our calls runs with retries off and a short
# timeout; the lock keeps two of our threads from interleaving their save/restore.
_ENV_LOCK = threading.Lock()
_FAST_FAIL_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
    # set_terminated otherwise prints "View run ... at: <tracking URI>" to stdout, password included.
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}


@contextlib.contextmanager
def fast_fail_env(tracking_uri: str, timeout_s: int) -> Iterator[None]:
    """Run MLflow HTTP calls with no retries and a short timeout; restore the user's values after."""
    if not tracking_uri.startswith(("http://", "https://")):
        yield
        return
    wanted = dict(_FAST_FAIL_ENV, MLFLOW_HTTP_REQUEST_TIMEOUT=str(max(1, int(timeout_s))))
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in wanted}
        os.environ.update(wanted)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def is_transient(exc: BaseException) -> bool:
    """True if a failed MLflow call may succeed later (server down, overloaded, store locked)."""
    code = getattr(exc, "error_code", None)
    if code is None:
        return True  # OSError, requests errors: the network
    return code in {"INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED",
                    "DEADLINE_EXCEEDED", "ABORTED", "IO_ERROR"}


class SpoolFile:
    """Append records to a spool and read back those not yet delivered."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.offset_path = Path(f"{self.path}.offset")
        self._fh: Any = None

    # -- writing (one writer at a time: the writer's thread, or a replay) --
    def _open(self) -> Any:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "ab")  # noqa: SIM115 - held open for the writer's life
        return self._fh

    def lock(self) -> bool:
        """Take the spool for this process until `close`; False if a live writer or replay holds it."""
        if fcntl is None:
            return True
        try:
            fcntl.flock(self._open().fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            self.close()
            return False

    def append(self, records: list[dict[str, Any]]) -> list[int]:
        """Append records, flush them to the OS, and return the offset just past each one."""
        self._open()
        ends = []
        for rec in records:
            self._fh.write(json.dumps(rec, separators=(",", ":")).encode() + b"\n")
            ends.append(self._fh.tell())
        self._fh.flush()
        return ends

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def delivered_offset(self) -> int:
        try:
            return int(self.offset_path.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def mark_delivered(self, offset: int) -> None:
        tmp = self.offset_path.with_name(self.offset_path.name + ".tmp")
        tmp.write_text(str(offset))
        os.replace(tmp, self.offset_path)

    def repair_tail(self) -> int:
        """Cut a last line torn by a crash (appending after it would corrupt the next record); return the size."""
        if not self.path.exists():
            return 0
        data = self.path.read_bytes()
        keep = data.rfind(b"\n") + 1
        if keep != len(data):
            with open(self.path, "r+b") as fh:
                fh.truncate(keep)
        return keep

    # -- reading --
    def read(self, start: int = 0, max_records: int | None = None) -> list[tuple[int, dict[str, Any]]]:
        """Records from byte ``start`` on, each with the offset just past it; a torn last line is skipped."""
        out: list[tuple[int, dict[str, Any]]] = []
        if not self.path.exists():
            return out
        with open(self.path, "rb") as fh:
            fh.seek(start)
            pos = start
            for line in fh:
                if not line.endswith(b"\n") or (max_records is not None and len(out) >= max_records):
                    break  # a torn line was written half-way when the process died
                pos += len(line)
                out.append((pos, json.loads(line)))
        return out

    def header(self) -> dict[str, Any] | None:
        recs = self.read(0, max_records=1)
        return recs[0][1] if recs and recs[0][1].get("k") == "header" else None

    def last_run_id(self) -> str | None:
        run_id = None
        for _, rec in self.read(0):
            if rec.get("k") == "run":
                run_id = rec["run_id"]
        return run_id


class Deliverer:
    """Sends spooled records to one MLflow run through `MlflowClient`, creating the run if needed."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str | None,
                 job_id: str | None, run_id: str | None = None, request_timeout_s: int = 5):
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.job_id = job_id
        self.run_id = run_id
        self.request_timeout_s = request_timeout_s
        self._client: Any = None
        # Per metric key, the highest step the run has; set by a "dedupe" record (a job resumed
        # from a backup retrains the steps after its last backup: their points are dropped).
        self.floors: dict[str, int] | None = None

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        with fast_fail_env(self.tracking_uri, self.request_timeout_s):
            return fn(*args, **kwargs)

    def client(self) -> Any:
        if self._client is None:
            from mlflow import MlflowClient

            from keras_sync._sqlite_store import ensure_sqlite_store

            ensure_sqlite_store(self.tracking_uri)  # a kill while MLflow builds it would leave it half-built

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def ensure_run(self) -> tuple[str, bool]:
        """Return (run id, created or resumed now); find a run by job id before creating one."""
        if self.run_id is not None:
            return self.run_id, False
        c = self.client()
        exp = self._call(c.get_experiment_by_name, self.experiment)
        if exp is not None:
            exp_id = exp.experiment_id
        else:
            try:
                exp_id = self._call(c.create_experiment, self.experiment)
            except Exception as e:  # another process created it first
                if getattr(e, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                    raise
                exp_id = self._call(c.get_experiment_by_name, self.experiment).experiment_id
        if self.job_id is not None:
            found = self._call(
                c.search_runs, [exp_id],
                filter_string=f"tags.`keras_sync.job_id` = '{self.job_id}'",
                max_results=1, order_by=["attributes.start_time ASC"])
            if found:
                self.run_id = found[0].info.run_id
                if found[0].info.status != "RUNNING":
                    self._call(c.update_run, self.run_id, status="RUNNING")
                return self.run_id, True
        tags = {"keras_sync.job_id": self.job_id} if self.job_id is not None else None
        run = self._call(c.create_run, exp_id, run_name=self.run_name, tags=tags)
        self.run_id = run.info.run_id
        return self.run_id, True

    def send(self, records: list[dict[str, Any]]) -> int:
        """Deliver records in order (the run must exist); return how many metric points were sent."""
        from mlflow.entities import Metric, Param, RunTag

        c = self.client()
        metrics: list[Any] = []
        params: list[Any] = []
        tags: list[Any] = []
        sent = 0

        def flush() -> None:
            nonlocal sent
            if metrics or params or tags:
                self._send_batch(metrics, params, tags)
                sent += len(metrics)
                if self.floors is not None:
                    for m in metrics:
                        self.floors[m.key] = max(self.floors.get(m.key, m.step), m.step)
                metrics.clear(), params.clear(), tags.clear()

        for rec in records:
            k = rec["k"]
            if k == "m":
                if len(metrics) + len(rec["d"]) + len(params) + len(tags) > 1000:
                    flush()
                floors, step = self.floors, rec["s"]
                metrics.extend(Metric(key, v, rec["ts"], step) for key, v in rec["d"].items()
                               if floors is None or step > floors.get(key, step - 1))
            elif k == "dedupe":
                flush()
                if self.floors is None:
                    self.floors = self._logged_steps()
            elif k in ("p", "t"):
                if len(params) + len(tags) + len(rec["d"]) > 100:
                    flush()
                target, cls = (params, Param) if k == "p" else (tags, RunTag)
                target.extend(cls(key, v) for key, v in rec["d"].items())
            elif k == "a":
                flush()
                self._call(c.log_text, self.run_id, rec["text"], rec["f"])
            elif k == "end":
                flush()
                self._call(c.set_terminated, self.run_id, status=rec["status"])
        flush()
        return sent

    def _logged_steps(self) -> dict[str, int]:
        """The highest step of every metric the run already has."""
        c = self.client()
        run = self._call(c.get_run, self.run_id)
        floors: dict[str, int] = {}
        for key in run.data.metrics:
            history = self._call(c.get_metric_history, self.run_id, key)
            if history:
                floors[key] = max(m.step for m in history)
        return floors

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
                    _log.warning("MLflow refused param %r (logged before with another value?); "
                                 "it is dropped, the rest of the batch was delivered.", p.key)
