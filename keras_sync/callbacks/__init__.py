"""Keras callbacks that keras-sync adds to `Sync.fit`, and the public ones users can add themselves."""

from __future__ import annotations

from typing import Any


def default_callbacks(sync: Any, model: Any, user_callbacks: Any) -> list[Any]:
    """The user's callbacks plus the ones the config asks for (sync metrics, backup and restore)."""
    callbacks = list(user_callbacks or [])
    from keras_sync.callbacks.backup import backup_callbacks

    callbacks[:0] = backup_callbacks(sync)  # first: restores optimizer.iterations before others read it
    if sync.config.mlflow.enabled:
        callbacks += mlflow_callbacks(sync)
    return callbacks


def mlflow_callbacks(sync: Any) -> list[Any]:
    """The sync-metrics callbacks of ``sync``'s config; every worker runs them, the chief writes."""
    from keras_sync.callbacks._run import writer_for
    from keras_sync.callbacks.allreduce_probe import AllReduceProbe
    from keras_sync.callbacks.run_params import RunParams
    from keras_sync.callbacks.sync_metrics import SyncMetrics
    from keras_sync.callbacks.weight_divergence import WeightDivergence

    cfg = sync.config.mlflow
    writer = writer_for(sync)
    metrics = SyncMetrics(writer, log_every_n_steps=cfg.log_every_n_steps)
    out: list[Any] = [RunParams(writer, sync)]
    if cfg.allreduce_probe:
        out.append(AllReduceProbe(writer))
    return out + [metrics, WeightDivergence(writer, step_source=metrics)]
