"""Keras callbacks that keras-sync adds to `Sync.fit`, and the public ones users can add themselves.

Each callback stands alone: it gets a writer (the `keras_sync.tracking.Writer` protocol), the
facts it needs and the fit's one `SharedState`, so they work in any order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from keras_sync.training.context import RunContext, SharedState

if TYPE_CHECKING:
    from keras_sync.training.job_run import JobRun

__all__ = ["RunContext", "SharedState", "fit_callbacks", "mlflow_callbacks"]


def fit_callbacks(
    context: RunContext,
    user_callbacks: Any,
    *,
    job_run: JobRun,
    strategy: Any,
    global_batch: int,
    expected: int | None = None,
    data: Any = None,
) -> list[Any]:
    """The callbacks of one `fit`, in order: the runtime setup, the sync metrics, the backups, the
    user's and the run-time checks (they read what the backups restored)."""
    from keras_sync.callbacks.backup import BackupAndRestore, backup_callbacks
    from keras_sync.training import run_checks, runtime

    enabled = context.config.mlflow.enabled
    # The job's next state: its steps and params continue the job's earlier fits'.
    shared = job_run.job.next_fit()
    # Backups first: another job's directory, or only damaged backups, stop fit before a run opens.
    backups = backup_callbacks(context, strategy, open_writer=job_run.writer, shared=shared)
    writer = job_run.writer() if enabled else None
    out = [runtime.setup_callback(context.config.runtime)]
    if enabled:
        out += mlflow_callbacks(context, writer, shared)
    out += backups + list(user_callbacks or [])
    mine = [c for c in out if isinstance(c, BackupAndRestore)]
    out.append(
        run_checks.checks_callback(
            context, writer, global_batch=global_batch, expected=expected, data=data, backups=mine
        )
    )
    return out


def mlflow_callbacks(context: RunContext, writer: Any, shared: SharedState) -> list[Any]:
    """The sync-metrics callbacks the config of ``context`` asks for; every worker runs them, and
    ``writer`` is None except on the chief."""
    from keras_sync.callbacks.allreduce_probe import AllReduceProbe
    from keras_sync.callbacks.fit_params import FitParams
    from keras_sync.callbacks.model_logging import ModelLogging
    from keras_sync.callbacks.run_params import RunParams
    from keras_sync.callbacks.sync_metrics import SyncMetrics
    from keras_sync.callbacks.sync_report import SyncReport
    from keras_sync.callbacks.system_metrics import SystemMetrics
    from keras_sync.callbacks.weight_divergence import WeightDivergence

    cfg = context.config.mlflow
    replicas = context.num_replicas
    batch = context.per_replica_batch_size
    out: list[Any] = [
        RunParams(writer, context, shared=shared),
        FitParams(writer, per_replica_batch_size=batch, num_replicas=replicas, shared=shared),
    ]
    if cfg.allreduce_probe:
        out.append(AllReduceProbe(writer, shared=shared))
    out.append(SyncMetrics(writer, log_every_n_steps=cfg.log_every_n_steps, shared=shared))
    out.append(WeightDivergence(writer, shared=shared))
    if cfg.system_metrics:
        out.append(SystemMetrics(writer, shared=shared))
    if cfg.sync_report != "off":
        out.append(SyncReport(writer, when=cfg.sync_report, shared=shared))
    if cfg.log_model:
        out.append(ModelLogging(writer))
    return out
