"""Keras callbacks that keras-sync adds to `Sync.fit`, and the public ones users can add themselves.

Each callback stands alone: it is given a writer (the `keras_sync.tracking.Writer` protocol), the
facts it needs (a frozen `RunContext`, or plain arguments) and, to share a step counter and
flushes with the others, one `SharedState`. Given the same `SharedState`, they work in any order.
"""

from __future__ import annotations

from typing import Any

from keras_sync.training.context import RunContext, SharedState

__all__ = ["RunContext", "SharedState", "default_callbacks", "mlflow_callbacks"]


def default_callbacks(
    sync: Any, model: Any, user_callbacks: Any, *, per_replica_batch_size: int | None = None
) -> list[Any]:
    """The user's callbacks plus the ones the config asks for (sync metrics, backup and restore).

    ``per_replica_batch_size``: the batch this `fit` uses, when not the configured one.
    """
    from keras_sync.callbacks.backup import backup_callbacks
    from keras_sync.training.job_run import job_state

    # One shared state: the backup flushes the held sync metrics into the writer before it saves
    # (so a kill loses no step it will not train again), whatever the list's order. The job's next
    # one: this fit's steps continue after the job's earlier fits, its params are checked against theirs.
    shared = job_state(sync).next_fit()
    context = sync.context(per_replica_batch_size=per_replica_batch_size)
    # The backup first: a directory owned by another job, or only damaged backups, stop fit before a run is opened.
    backups = backup_callbacks(sync, shared=shared)
    ours = (
        mlflow_callbacks(sync, context=context, shared=shared) if sync.config.mlflow.enabled else []
    )
    return ours + backups + list(user_callbacks or [])


def mlflow_callbacks(
    sync: Any, *, context: RunContext | None = None, shared: SharedState | None = None
) -> list[Any]:
    """The sync-metrics callbacks of ``sync``'s config; every worker runs them, the chief writes."""
    from keras_sync.callbacks.allreduce_probe import AllReduceProbe
    from keras_sync.callbacks.fit_params import FitParams
    from keras_sync.callbacks.run_params import RunParams
    from keras_sync.callbacks.sync_metrics import SyncMetrics
    from keras_sync.callbacks.weight_divergence import WeightDivergence
    from keras_sync.training.job_run import writer_for

    cfg = sync.config.mlflow
    context = context or sync.context()
    shared = shared or SharedState()
    writer = writer_for(sync)
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
    out += [
        SyncMetrics(writer, log_every_n_steps=cfg.log_every_n_steps, shared=shared),
        WeightDivergence(writer, shared=shared),
    ]
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
