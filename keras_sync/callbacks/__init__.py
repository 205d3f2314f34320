"""Keras callbacks that keras-sync adds to `Sync.fit`, and the public ones users can add themselves.

Each callback stands alone: it is given a writer (the `keras_sync.tracking.Writer` protocol), the
facts it needs (a frozen `RunContext`, or plain arguments) and, to share a step counter and
flushes with the others, one `SharedState`; with the same `SharedState` they work in any order.
`fit_callbacks` builds the one list `Sync.fit` and `Sync.callbacks` run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from keras_sync.training.context import RunContext, SharedState

if TYPE_CHECKING:
    from keras_sync.session import Sync

__all__ = ["RunContext", "SharedState", "fit_callbacks", "mlflow_callbacks"]


def fit_callbacks(
    sync: Sync,
    user_callbacks: Any,
    *,
    global_batch: int,
    expected: int | None = None,
    data: Any = None,
    per_replica_batch_size: int | None = None,
    record: bool = False,
) -> list[Any]:
    """The callbacks of one `fit` of ``sync``, in their order.

    The runtime setup, the sync-metrics callbacks (the chief writes), the backups, the user's, the
    run-time checks (`keras_sync.training.run_checks`: they read what the backups restored) and,
    with ``record`` in a verify run, the recorder. ``per_replica_batch_size``: this fit's batch
    when not the configured one.
    """
    from keras_sync.callbacks.backup import BackupAndRestore, backup_callbacks
    from keras_sync.training import run_checks, runtime

    context = sync.context(per_replica_batch_size=per_replica_batch_size)
    out = [runtime.setup_callback(sync.config.runtime)]
    # One state for the fit, the job's next: the backup flushes the held metrics before it saves,
    # and this fit's steps and params continue the job's earlier fits'.
    shared = sync.job_run.job.next_fit()
    # The backups are made first: a directory owned by another job, or only damaged backups, stop
    # fit before a run is opened.
    backups = backup_callbacks(
        context, sync.strategy, open_writer=sync.job_run.writer, shared=shared
    )
    if sync.config.mlflow.enabled:
        out += mlflow_callbacks(context, sync.job_run.writer(), shared)
    out += backups + list(user_callbacks or [])
    mine = [c for c in out if isinstance(c, BackupAndRestore)]
    out.append(
        run_checks.checks_callback(
            context,
            sync.job_run.writer() if sync.config.mlflow.enabled else None,
            global_batch=global_batch,
            expected=expected,
            data=data,
            backups=mine,
        )
    )
    if record and sync.config.verify is not None:
        from keras_sync.training import verify_record

        source = getattr(sync.input_facts, "source", None)
        out.append(
            verify_record.callback(
                sync.context(), input_source=source, base_batch_size=sync.base_batch_size
            )
        )
    return out


def mlflow_callbacks(context: RunContext, writer: Any, shared: SharedState) -> list[Any]:
    """The sync-metrics callbacks the config of ``context`` asks for; every worker runs them, and
    ``writer`` is None except on the chief."""
    from keras_sync.callbacks.allreduce_probe import AllReduceProbe
    from keras_sync.callbacks.fit_params import FitParams
    from keras_sync.callbacks.run_params import RunParams
    from keras_sync.callbacks.sync_metrics import SyncMetrics
    from keras_sync.callbacks.weight_divergence import WeightDivergence

    cfg = context.config.mlflow
    out: list[Any] = [
        RunParams(writer, context, shared=shared),
        FitParams(
            writer,
            per_replica_batch_size=context.per_replica_batch_size,
            num_replicas=context.num_replicas,
            shared=shared,
        ),
    ]
    if cfg.allreduce_probe:
        out.append(AllReduceProbe(writer, shared=shared))
    out.append(SyncMetrics(writer, log_every_n_steps=cfg.log_every_n_steps, shared=shared))
    out.append(WeightDivergence(writer, shared=shared))
    if cfg.system_metrics:
        from keras_sync.callbacks.system_metrics import SystemMetrics

        out.append(SystemMetrics(writer, shared=shared))
    if cfg.sync_report != "off":
        from keras_sync.callbacks.sync_report import SyncReport

        out.append(SyncReport(writer, when=cfg.sync_report, shared=shared))
    if cfg.log_model:
        from keras_sync.callbacks.model_logging import ModelLogging

        out.append(ModelLogging(writer))
    return out
