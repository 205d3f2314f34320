"""Keras callbacks that keras-sync adds to `Sync.fit`, and the public ones users can add themselves.

Each callback stands alone: it is given a writer (the `keras_sync.tracking.Writer` protocol), the
facts it needs (a frozen `RunContext`, or plain arguments) and, to share a step counter and
flushes with the others, one `SharedState`. Given the same `SharedState`, they work in any order.
`fit_callbacks` is the one place that builds the list `Sync.fit` and `Sync.callbacks` run.
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

    The runtime setup first (once `fit` has built the model: gradient accumulation, custom
    train steps), then the config's sync-metrics and backup callbacks, the user's, the run-time
    checks (`keras_sync.training.run_checks`: they read what the others restored) and, with
    ``record`` in a verify run, the recorder. ``per_replica_batch_size``: this fit's batch when
    not the configured one.
    """
    from keras_sync.callbacks.backup import BackupAndRestore, backup_callbacks
    from keras_sync.training import run_checks, runtime
    from keras_sync.training.job_run import job_state, writer_for

    context = sync.context(per_replica_batch_size=per_replica_batch_size)
    out = [runtime.setup_callback(sync.config.runtime)]
    # One shared state: the backup flushes the held sync metrics before it saves, whatever the
    # order. The job's next one: this fit's steps and params continue the job's earlier fits'.
    shared = job_state(sync).next_fit()
    # The backup first: a directory owned by another job, or only damaged backups, stop fit
    # before a run is opened.
    backups = backup_callbacks(
        context, sync.strategy, open_writer=lambda: writer_for(sync), shared=shared
    )
    if sync.config.mlflow.enabled:
        out += mlflow_callbacks(sync, context=context, shared=shared)
    out += backups + list(user_callbacks or [])
    out.append(
        run_checks.checks_callback(
            sync,
            global_batch=global_batch,
            expected=expected,
            data=data,
            backups=[c for c in out if isinstance(c, BackupAndRestore)],
        )
    )
    if record and sync.config.verify is not None:
        from keras_sync.training import verify_record

        facts = sync.input_facts
        out.append(
            verify_record.callback(
                sync.context(),
                input_source=getattr(facts, "source", None),
                base_batch_size=sync.base_batch_size,
            )
        )
    return out


def mlflow_callbacks(
    sync: Sync, *, context: RunContext | None = None, shared: SharedState | None = None
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
