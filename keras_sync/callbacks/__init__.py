"""Keras callbacks that keras-sync adds to `Sync.fit`, and the public ones users can add themselves."""

from __future__ import annotations

from typing import Any


def default_callbacks(sync: Any, model: Any, user_callbacks: Any, *, per_replica_batch_size: int | None = None) -> list[Any]:
    """The user's callbacks plus the ones the config asks for (sync metrics, backup and restore).

    ``per_replica_batch_size``: the batch this `fit` uses, when not the configured one.
    """
    from keras_sync.callbacks.backup import backup_callbacks

    # Order: the sync metrics log a step before the backup of that step is saved (the backup puts
    # them in the spool first, so a kill loses no step it will not train again); the backup
    # restores optimizer.iterations in on_train_begin before the user's callbacks run.
    ours = mlflow_callbacks(sync, per_replica_batch_size=per_replica_batch_size) if sync.config.mlflow.enabled else []
    backups = backup_callbacks(sync)
    for backup in backups:  # the sync metrics still held in the probe's ring go first
        backup.before_save += [cb.emit for cb in ours if hasattr(cb, "emit")]
    return ours + backups + list(user_callbacks or [])


def mlflow_callbacks(sync: Any, *, per_replica_batch_size: int | None = None) -> list[Any]:
    """The sync-metrics callbacks of ``sync``'s config; every worker runs them, the chief writes."""
    from keras_sync.callbacks._run import writer_for
    from keras_sync.callbacks.allreduce_probe import AllReduceProbe
    from keras_sync.callbacks.fit_params import FitParams
    from keras_sync.callbacks.run_params import RunParams
    from keras_sync.callbacks.sync_metrics import SyncMetrics
    from keras_sync.callbacks.weight_divergence import WeightDivergence

    cfg = sync.config.mlflow
    writer = writer_for(sync)
    report = None
    if cfg.sync_report != "off":
        from keras_sync.callbacks.sync_report import SyncReport

        report = SyncReport(writer, when=cfg.sync_report)
    drawn = report.recorder if report is not None else writer  # the report sees what these log
    metrics = SyncMetrics(drawn, log_every_n_steps=cfg.log_every_n_steps)
    out: list[Any] = [RunParams(writer, sync),
                      FitParams(writer, per_replica_batch_size=per_replica_batch_size or sync.per_replica_batch_size,
                                num_replicas=sync.num_replicas)]
    if cfg.allreduce_probe:
        out.append(AllReduceProbe(writer))
    out += [metrics, WeightDivergence(drawn, step_source=metrics)]
    if cfg.system_metrics:
        from keras_sync.callbacks.system_metrics import SystemMetrics

        out.append(SystemMetrics(writer, step_source=metrics))
    # After the metrics: at train end they have logged their last steps when these run.
    if report is not None:
        out.append(report)
    if cfg.log_model:
        from keras_sync.callbacks.model_logging import ModelLogging

        out.append(ModelLogging(writer))
    return out
