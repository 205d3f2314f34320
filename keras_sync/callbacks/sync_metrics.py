"""`SyncMetrics`: per-step synchronisation metrics of a distributed `fit`, written to MLflow."""

from __future__ import annotations

import time
import warnings
from typing import Any

import keras

from keras_sync.callbacks import _reduce
from keras_sync.errors import UsageError

#: Metrics that need Keras's default `train_step` (measured inside it, per replica).
PER_REPLICA_METRICS = ("sync/replica_{i}/loss", "sync/replica_{i}/grad_norm", "sync/grad_norm_spread")
_warned_classes: set[type] = set()


class SyncMetrics(keras.callbacks.Callback):
    """Log what synchronous data-parallel training is doing, every ``log_every_n_steps`` steps.

    The MLflow ``step`` is the global optimizer step (1-based, continued across `fit` calls and
    restarts). Every logged step gets:

    - ``sync/replica_{i}/loss``: replica ``i``'s own mean loss on its shard, before the
      cross-replica mean (comparable to a single-device loss; Keras divides it by the replica
      count internally, we undo that);
    - ``sync/replica_{i}/grad_norm``: the global norm of replica ``i``'s local gradient before
      the all-reduce, scaled like the loss (the gradient of the replica's own mean loss; the
      optimizer applies the mean of these gradients);
    - ``sync/grad_norm_spread``: ``(max - min) / mean`` of those norms;
    - ``sync/step_time_ms``: mean wall time per step since the last logged step, from the
      start of the step (including fetching its batch) to its logs; the first step of a `fit`
      includes tracing;
    - ``sync/examples_per_sec`` (all replicas) and ``sync/examples_per_sec_per_replica``;
    - ``sync/learning_rate``: the learning rate the optimizer applied in that step;
    - the Keras logs under their Keras names (``loss``, metrics; running means of the epoch),
      and at each epoch's last step the ``val_*`` logs.

    ``i`` runs over all replicas of the job: under `multi_worker_mirrored` the values are
    gathered from every worker (a collective on the logged steps, so every worker must run
    this callback); only the worker given a ``writer`` writes.

    A model that overrides `train_step` keeps it: the per-replica loss, grad norm and spread
    are then missing (a one-time warning says so), the rest is logged.

    Args:
        writer: a started `keras_sync.tracking.MlflowWriter`; None on workers that only take
            part in the gathers.
        log_every_n_steps: log every N optimizer steps (>= 1).
        flush_timeout_s: at train end, wait at most this long for MLflow to have every point
            (the rest stays in the spool and is delivered in the background).

    Example:
        >>> writer = MlflowWriter(tracking_uri="sqlite:///mlflow.db", experiment="demo")  # doctest: +SKIP
        >>> writer.start()  # doctest: +SKIP
        >>> model.fit(ds, epochs=3, callbacks=[SyncMetrics(writer, log_every_n_steps=10)])  # doctest: +SKIP
    """

    def __init__(self, writer: Any = None, *, log_every_n_steps: int = 1, flush_timeout_s: float = 10.0):
        super().__init__()
        self.flush_timeout_s = float(flush_timeout_s)
        if writer is not None and not hasattr(writer, "log_metrics"):
            raise UsageError(f"Invalid value for argument `writer`. Received: writer={writer!r}. Expected a "
                             "keras_sync.tracking.MlflowWriter, or None on workers that do not write.")
        if isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise UsageError(f"Invalid value for argument `log_every_n_steps`. Received: "
                             f"log_every_n_steps={log_every_n_steps!r}. Expected an integer >= 1.")
        self.writer = writer
        self.every = log_every_n_steps
        #: The global optimizer step after the last finished step (None before the first one).
        self.global_step: int | None = None
        self._probe: Any = None
        self._num_replicas = 1
        self._busy_s = 0.0
        self._t0 = 0.0
        self._examples_at_log = 0.0
        self._steps_since_log = 0
        self._first_batch = 0

    def set_model(self, model: Any) -> None:
        # Runs before `fit` builds its train function: the moment to instrument train_step.
        super().set_model(model)
        from keras_sync import _instrument

        self._probe = _instrument.instrument(model)
        self._num_replicas = self._probe.num_replicas
        if not self._probe.per_replica_supported:
            _warn_custom_train_step(model)

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.global_step = None
        self._busy_s, self._steps_since_log = 0.0, 0

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.global_step is None:
            # Read once, after every on_train_begin (BackupAndRestore may have restored it).
            self.global_step = int(self.model.optimizer.iterations.numpy())
            self._examples_at_log = sum(r[2] for r in self._probe.read())
            if self.global_step > 0 and self.writer is not None and hasattr(self.writer, "skip_logged_steps"):
                # Resumed (a backup restored the step count) or a later fit: a crashed process may
                # have logged steps past the backup, which this one trains again; keep one point each.
                self.writer.skip_logged_steps()
        self._first_batch = batch
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._busy_s += time.perf_counter() - self._t0
        steps = max(batch - self._first_batch + 1, 1)  # > 1 with steps_per_execution
        self._steps_since_log += steps
        prev = self.global_step or 0
        self.global_step = prev + steps
        if _reduce.crossed_log_step(prev, self.global_step, self.every):
            self._log_step(logs)

    def _log_step(self, logs: dict | None) -> None:
        rows = self._probe.read()  # a collective under multi-worker: every worker runs it
        if self.writer is None:
            self._reset_interval(rows)
            return
        metrics = _reduce.replica_metrics([r[0] for r in rows], [r[1] for r in rows])
        examples = sum(r[2] for r in rows) - self._examples_at_log
        if self._steps_since_log:
            metrics["sync/step_time_ms"] = 1000.0 * self._busy_s / self._steps_since_log
        metrics.update(_reduce.throughput(examples, self._busy_s, self._num_replicas))
        lr = rows[0][3] if rows else float("nan")
        if lr == lr:  # not NaN
            metrics["sync/learning_rate"] = lr
        for k, v in (logs or {}).items():
            if isinstance(v, (int, float)):
                metrics[k] = v
        self.writer.log_metrics(metrics, step=self.global_step)
        self._reset_interval(rows)

    def _reset_interval(self, rows: list[tuple[float, float, float, float]]) -> None:
        self._examples_at_log = sum(r[2] for r in rows)
        self._busy_s, self._steps_since_log = 0.0, 0

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.writer is None or self.global_step is None:
            return
        val = {k: v for k, v in (logs or {}).items() if k.startswith("val_") and isinstance(v, (int, float))}
        if val:
            self.writer.log_metrics(val, step=self.global_step)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.writer is None:
            return
        # Bounded wait: metrics are in MLflow when fit returns, unless the server is away; then
        # they stay in the spool and the writer's thread keeps delivering (or `keras-sync sync-spool`).
        if not self.writer.flush(timeout_s=self.flush_timeout_s):
            warnings.warn(
                f"keras-sync: some metrics are not in MLflow yet (tracking server slow or away); they are kept in "
                f"{getattr(self.writer, 'spool_path', 'the spool')} and delivered in the background while this "
                "process lives, or later with `keras-sync sync-spool PATH`.",
                UserWarning,
                stacklevel=2,
            )


def _warn_custom_train_step(model: Any) -> None:
    cls = type(model)
    if cls in _warned_classes:
        return
    _warned_classes.add(cls)
    warnings.warn(
        f"keras-sync: {cls.__name__} overrides train_step, so {', '.join(PER_REPLICA_METRICS)} are not logged: "
        "they are measured inside Keras's default train_step, before the all-reduce. Still logged: "
        "sync/step_time_ms, sync/examples_per_sec, sync/examples_per_sec_per_replica, sync/learning_rate, "
        "sync/weight_divergence and the Keras logs. To get them, use Keras's train_step (override "
        "compute_loss instead).",
        UserWarning,
        stacklevel=2,
    )
