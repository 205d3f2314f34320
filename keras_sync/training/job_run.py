"""The MLflow run of a `Sync`: which run a job writes to, opened by the chief only.

One writer per `Sync` object, kept across `fit` calls (one run, steps continue). Which run:

- when a relaunch restores the backup in ``fault_tolerance.backup_dir``: the run recorded with
  that backup (`record_run` writes it before every save), unless that run is FINISHED (and its
  job id was not explicit); a preempted or failed worker's exit ends it KILLED or FAILED, so
  the relaunch continues it;
- else ``mlflow.job_id`` / ``$KERAS_SYNC_JOB_ID`` (set by ``keras-sync launch`` for its
  restarts): the run with that job id, created once and shared, also after it finished;
- else a new run.

The fits of a job write one run, their steps continuing: a fit's first step follows the last step
of the fit before it, whether it trains the same model further or a new one (the keras-io
distributed-training guide fits a new model in each `run_training()`). Without that, a new
model's steps 1, 2, ... would be taken for steps the run already has and dropped. The job's
`keras_sync.training.context.JobState` (`job_state`) holds that last step, and the params its
fits logged: one with the same value is not sent again, one whose value changed goes under
``fit_<n>.<key>``. A resumed fit continues at the step saved with its backup, so what it trains
again is what MLflow drops. The fits of a job are those of one `Sync`, or of every `Sync` of this
process with the same explicit job id (``mlflow.job_id``, ``$KERAS_SYNC_JOB_ID``: they write one run).

`Sync.fit` ends the run when it returns (`end_run_after_fit`, `MlflowWriter.end_run`): the end is
queued after the metrics, so the run is FINISHED once MLflow has them all. Where the process is
killed as soon as training returns (Ray Train) fit waits for that; elsewhere the courier delivers in
the background and the exit waits for what is left, with one line. The writer stays open, and the
next `fit` of the same `Sync` reopens the same run, steps continuing, through the same courier.
Ending the run at fit's end rather than at exit matters where a worker is ended without `atexit`
(Ray Train V2 stops its workers with `ray.kill`): the orphaned courier then finds everything
delivered and removes the spool. The writer closes when the process exits (`atexit`) or with
`close_writer(sync)`; a `fit` after that opens a new writer on the same run id.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("keras_sync")
_writers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_recorded: weakref.WeakKeyDictionary[Any, tuple[str, dict[str, Any]]] = weakref.WeakKeyDictionary()
_jobs: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # Sync -> its JobState
_named_jobs: dict[
    tuple[Any, ...], Any
] = {}  # (job id, tracking URI, experiment) -> the JobState of that run
#: The file in the backup directory that names the job's run (deleted with the backup).
RUN_RECORD = "keras_sync_run.json"


def writer_for(sync: Any, *, early: bool = False, started: Any = None) -> Any:
    """The started `MlflowWriter` of ``sync`` on the chief; None on other workers.

    ``early``: from `keras_sync.load`: the writer and its courier start, but the run is begun
    only by the first record logged (a `Sync` that never fits makes no run). ``started``: a writer
    `start_writer` made for this `Sync`'s config before the `Sync` existed; it becomes the `Sync`'s.
    """
    if not sync.is_chief:
        return None
    writer = _writers.get(sync)
    if writer is not None and not writer.closed:
        return writer
    ended = (
        writer  # the run an earlier fit of this Sync ended: this Sync continues it, FINISHED or not
    )
    if ended is None and started is not None and not started.closed:
        writer = started
    elif ended is not None and ended.run_id is not None:
        writer = start_writer(sync.config, early=early, continue_run=(ended.job_id, ended.run_id))
    else:
        writer = start_writer(sync.config, early=early)
    if ended is None:
        # Said when the courier has created the run (or MLflow failed first), from the writer's
        # thread: a first run builds its sqlite store and imports MLflow meanwhile, and training
        # does not wait for that. (A writer started early has begun no run yet: nothing said before this.)
        writer.when_run_known(lambda w: announce(w, sync))
    _writers[sync] = writer
    return writer


def job_state(sync: Any) -> Any:
    """The `JobState` of ``sync``'s job: its own, or the one of every `Sync` of its explicit job id.

    Every worker keeps the same (the steps a worker logs decide its collective reads), so it is
    decided from the config alone.
    """
    state = _jobs.get(sync)
    if state is None:
        from keras_sync.training.context import JobState

        cfg = sync.config.mlflow
        if cfg.job_id:
            state = _named_jobs.setdefault(
                (cfg.job_id, cfg.tracking_uri, cfg.experiment), JobState()
            )
        else:
            state = JobState()
        _jobs[sync] = state
    return state


def start_writer(
    config: Any, *, early: bool = True, continue_run: tuple[str, str] | None = None
) -> Any:
    """A started `MlflowWriter` for ``config`` (the job's run rule above), from the config alone.

    `keras_sync.load` calls it before building the strategy when the process is surely the chief
    (one process: ``mirrored``, ``one_device``, ``default``), so that the courier imports MLflow
    while TensorFlow is imported rather than while the first `fit` trains; `writer_for` adopts it.
    ``early``: the run is begun only by the first record logged (nothing logged, no run).
    ``continue_run``: (job id, run id) of the run an earlier `fit` of the same `Sync` ended.
    """
    from keras_sync.cluster import killed_when_training_returns
    from keras_sync.tracking import MlflowWriter, resolve_tracking_uri

    cfg = config.mlflow
    uri, _ = resolve_tracking_uri(cfg.tracking_uri)
    job_id, explicit, run_id = cfg.job_id, True, None
    restored = restored_run(config.fault_tolerance.backup_dir)
    if continue_run is not None:
        (job_id, run_id), explicit = continue_run, True
    elif restored is not None:  # wins over a job id: `keras-sync launch` makes a new one per launch
        job_id, explicit, run_id = (
            restored["job_id"],
            bool(restored.get("explicit")),
            restored.get("run_id"),
        )
    writer = MlflowWriter(
        tracking_uri=uri,
        experiment=cfg.experiment,
        run_name=cfg.run_name,
        job_id=job_id,
        job_id_explicit=explicit,
        run_id=run_id,
        spool_dir=cfg.spool_dir,
        wait_at_end_of_fit=killed_when_training_returns(),
    )
    writer.start(defer_begin=early)
    return writer


def announce(writer: Any, sync: Any) -> None:
    """Print one line on where this job's metrics go: URI, experiment, run id, how to open it."""
    run_id = writer.run_id
    if run_id is None and writer.say_refused_once():
        return  # where the metrics wait and how to deliver them, in its one line
    where = f"MLflow at {writer.shown_uri}, experiment {writer.experiment!r}"
    if run_id is None:
        failed = writer.failure()
        why = f"not reachable yet ({failed['error']})" if failed else "not created yet"
        line = (
            f"keras-sync: metrics go to {where}; the run is {why}. They wait in {writer.spool_path} "
            "and are delivered when MLflow answers."
        )
    else:
        line = (
            f"keras-sync: metrics go to {where}, run {run_id}; {how_to_open(writer, sync, run_id)}"
        )
    print(line, file=sys.stderr, flush=True)


def how_to_open(writer: Any, sync: Any, run_id: str) -> str:
    """How to see the run: its page on a tracking server, else the command that serves the local store."""
    url = writer.run_url()
    if url:
        return f"open {url}"
    from keras_sync.tracking.shell_hint import console_command

    source = sync.config.source
    if source not in ("<defaults>", "<dict>"):
        return f"view it with: {console_command()} ui {shlex.quote(os.path.abspath(source))}"
    mlflow = console_command("mlflow", "mlflow")
    return f"view it with: {mlflow} ui --backend-store-uri {shlex.quote(writer.shown_uri)}"


def restored_run(backup_dir: str | None) -> dict[str, Any] | None:
    """The run recorded with the backup in ``backup_dir``, if a relaunch will restore one; else None.

    The manifest of the checkpoint to restore names its run (written with it); ``keras_sync_run.json``
    is the older record, read when the manifest has none. A damaged one is said in one line.
    """
    if not backup_dir:
        return None
    from keras_sync.training import backup_files as _backup_files

    latest = _backup_files.choose(backup_dir).latest
    if latest is None:
        return None
    from_backup = _backup_files.manifest_run(latest)
    path = Path(backup_dir) / RUN_RECORD
    record: Any = None
    try:
        record = json.loads(path.read_text())
        damaged = (
            None
            if isinstance(record, dict) and isinstance(record.get("job_id"), str)
            else "not a run record"
        )
    except FileNotFoundError:
        damaged = None  # a backup from before runs were recorded, or without MLflow
    except (OSError, ValueError) as e:
        damaged = type(e).__name__
    if damaged is not None:
        record = None
        found = (
            (
                f"the run {from_backup.get('run_id') or 'of job ' + from_backup['job_id']} named by the backup "
                f"{os.path.basename(latest)} is continued"
            )
            if from_backup
            else "a new run is started"
        )
        print(
            f"keras-sync: the run record {path} is damaged ({damaged}); {found}",
            file=sys.stderr,
            flush=True,
        )
    return from_backup or record


def run_record(writer: Any) -> dict[str, Any]:
    """What names the run of ``writer``: job id (and whether the user gave it), run id, experiment, store."""
    return {
        "job_id": writer.job_id,
        "explicit": writer.job_id_explicit,
        "run_id": writer.run_id,
        "experiment": writer.experiment,
        "tracking_uri": writer.shown_uri,
    }


def record_run(writer: Any, backup_dir: str) -> None:
    """Write the job id and run id of ``writer`` into ``backup_dir``, next to the backup.

    `keras_sync.callbacks.backup` calls it before every save (chief only); a relaunch that
    restores that backup continues the run it names (`restored_run`). Each checkpoint's manifest
    holds the same record, so a damaged file still leads to the run.
    """
    record = run_record(writer)
    path = Path(backup_dir) / RUN_RECORD
    if _recorded.get(writer) == (str(path), record) and path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{RUN_RECORD}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    _recorded[writer] = (str(path), record)


def end_run_after_fit(sync: Any, limit_s: float = 120.0) -> None:
    """End the run when `fit` returns and wait while MLflow receives the rest (at most ``limit_s``).

    `MlflowWriter.end_run`: the writer stays open for the next `fit`. When MLflow is away or
    refusing, a warning says so and delivery goes on in the background (the end included).
    """
    from keras_sync.cluster import killed_when_training_returns

    writer = _writers.get(sync)
    if writer is not None and not writer.closed and hasattr(writer, "end_run"):
        killed = killed_when_training_returns()
        # Elsewhere fit returns at once: the courier delivers the rest (the run's end after it) in
        # the background, and the exit waits for what is left (`MlflowWriter.close`).
        writer.end_run(timeout_s=limit_s, wait_for_report=killed, wait=killed)


@contextlib.contextmanager
def run_ends_after_fit(sync: Any) -> Iterator[None]:
    """While `Sync.fit` runs: the writer's end-of-fit wait is left to `end_run_after_fit` (one wait, not two)."""
    writer = _writers.get(sync)
    if writer is None or writer.closed or not hasattr(writer, "fit_ends_run"):
        yield
        return
    with writer.fit_ends_run():
        yield


def shared_run_for(sync: Any) -> Any:
    """A context manager: ``sync``'s run is MLflow's active run while mlflow.keras.autolog() is on (chief only)."""
    from keras_sync.tracking import autolog as _autolog
    from keras_sync.tracking import resolve_tracking_uri

    writer = _writers.get(sync)
    uri, _ = resolve_tracking_uri(sync.config.mlflow.tracking_uri)
    return _autolog.shared_run(writer, uri, is_chief=sync.is_chief)


def current_writer(sync: Any) -> Any:
    """The writer ``sync`` logs with (open, or closed after its `fit`), or None if it has none."""
    return _writers.get(sync)


def close_writer(sync: Any, timeout_s: float | None = None) -> None:
    """End the MLflow run of ``sync`` now (FINISHED), waiting while delivery progresses (at most ``timeout_s``).

    The writer is kept (closed): `writer_for` then continues its run, and `Sync.run_id` still names it.
    """
    writer = _writers.get(sync)
    if writer is not None and not writer.closed:
        writer.close(timeout_s=timeout_s)
