"""One MLflow run per job, opened by the chief only.

Which run: the one in the manifest of the backup a relaunch restores; else the run of
``mlflow.job_id`` / ``$KERAS_SYNC_JOB_ID`` (``keras-sync launch``), created once; else a new one.
A job's fits write one run, their steps continuing; the next `fit` reopens the run a fit ended.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from typing import Any

from keras_sync.cluster import killed_when_training_returns
from keras_sync.tracking import MlflowWriter, autolog, resolve_tracking_uri
from keras_sync.training import backup_files
from keras_sync.training.context import JobState

#: (job id, tracking URI, experiment) -> the JobState of that explicit job id's run in this process.
_named_jobs: dict[tuple[Any, ...], JobState] = {}


class JobRun:
    """The MLflow run of one `Sync`: its writer on the chief, and the `JobState` every worker keeps."""

    def __init__(self, config: Any, is_chief: bool):
        self.config, self.is_chief, cfg = config, is_chief, config.mlflow
        key = (cfg.job_id, cfg.tracking_uri, cfg.experiment)
        self.job = _named_jobs.setdefault(key, JobState()) if cfg.job_id else JobState()
        self.current: Any = None  # the last writer (open, or closed after `close`)

    def writer(self, *, early: bool = False, started: Any = None) -> Any:
        """The started `MlflowWriter` on the chief (``started``: one made before the `Sync`), else None."""
        ended = self.current
        if not self.is_chief or self._open() is not None:
            return self._open()
        if ended is None and started is not None and not started.closed:
            self.current = started
        else:  # a fit ended the run: continue it (FINISHED or not)
            again = None if ended is None or ended.run_id is None else (ended.job_id, ended.run_id)
            self.current = start_writer(self.config, early=early, continue_run=again)
        if ended is None:  # said once the run exists, from the writer's thread
            self.current.when_run_known(lambda w: announce(w, self.config))
        return self.current

    def _open(self) -> Any:
        return None if self.current is None or self.current.closed else self.current

    def end_after_fit(self) -> None:
        """End the run when `fit` returns; wait for MLflow only where the process is killed then."""
        if (writer := self._open()) is not None:
            killed = writer.wait_at_end_of_fit  # as `start_writer` asked the cluster
            writer.end_run(wait_for_report=killed, wait=killed)

    def ends_after_fit(self) -> Any:
        """While `Sync.fit` runs: the writer's end-of-fit wait is left to `end_after_fit`."""
        writer = self._open()
        return writer.fit_ends_run() if writer is not None else contextlib.nullcontext()

    def shared_run(self) -> Any:
        """A context manager: this run is MLflow's active run while mlflow.keras.autolog() is on."""
        uri, _ = resolve_tracking_uri(self.config.mlflow.tracking_uri)
        return autolog.shared_run(self.current, uri, is_chief=self.is_chief)

    def close(self, timeout_s: float | None = None) -> None:
        """End the run now (FINISHED), waiting at most ``timeout_s``; a later `writer` continues it."""
        if self._open() is not None:
            self.current.close(timeout_s=timeout_s)


def start_writer(
    config: Any, *, early: bool = True, continue_run: tuple[str, str] | None = None
) -> Any:
    """A started `MlflowWriter` on the run chosen as above. ``continue_run``: (job id, run id) a fit ended."""
    cfg, backup_dir = config.mlflow, config.fault_tolerance.backup_dir
    job_id, explicit, run_id = cfg.job_id, True, None
    # The newest manifest's run, unverified: `backup_callbacks` checks the files once per fit.
    prefixes = backup_files.checkpoints(backup_dir) if backup_dir else []
    restored = next(filter(None, map(backup_files.manifest_run, prefixes)), None)
    if continue_run is not None:
        job_id, run_id = continue_run
    elif restored is not None:  # wins over a job id: `keras-sync launch` makes a new one per launch
        job_id, run_id = restored["job_id"], restored.get("run_id")
        explicit = bool(restored.get("explicit"))
    writer = MlflowWriter(
        tracking_uri=resolve_tracking_uri(cfg.tracking_uri)[0],
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


def announce(writer: Any, config: Any) -> None:
    """Print one line on where this job's metrics go: URI, experiment, run id, how to open it."""
    run_id = writer.run_id
    if run_id is None and writer.say_refused_once():
        return  # where the metrics wait and how to deliver them, in its one line
    where = f"MLflow at {writer.shown_uri}, experiment {writer.experiment!r}"
    if run_id is not None:
        if url := writer.run_url():
            how = f"open {url}"
        elif config.source not in ("<defaults>", "<dict>"):
            how = f"view it with: keras-sync ui {shlex.quote(os.path.abspath(config.source))}"
        else:
            how = f"view it with: mlflow ui --backend-store-uri {shlex.quote(writer.shown_uri)}"
        line = f"metrics go to {where}, run {run_id}; {how}"
    else:
        failed = writer.failure()
        why = f"not reachable yet ({failed['error']})" if failed else "not created yet"
        line = (
            f"metrics go to {where}; the run is {why}. They wait in {writer.spool_path} "
            "and are delivered when MLflow answers."
        )
    print(f"keras-sync: {line}", file=sys.stderr, flush=True)
