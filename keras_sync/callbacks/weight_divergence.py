"""`WeightDivergence`: after each epoch, how far the replicas' copies of the weights drifted apart."""

from __future__ import annotations

import weakref
from typing import Any

import keras

from keras_sync.callbacks import _reduce
from keras_sync.strategy import in_multi_worker_mode


class WeightDivergence(keras.callbacks.Callback):
    """Log ``sync/weight_divergence`` at the end of every epoch.

    The value is the largest absolute difference, over every mirrored variable (model weights
    and optimizer state) and every element, between any two replicas' copies:
    ``max_v max_i (max_r v_r[i] - min_r v_r[i])``. Synchronous training keeps the copies equal,
    so it is 0 when healthy; anything else means an all-reduce or a custom update broke the
    sync. Per-replica state (metric accumulators, ON_READ variables) is left out.

    Under `multi_worker_mirrored` the copies of every worker are compared, with one
    `all_gather` per variable; every worker must run this callback (it is a collective), and
    only the one given a ``writer`` writes.

    Args:
        writer: a started `keras_sync.tracking.MlflowWriter`, or None on a worker that must
            take part without writing.
        step_source: an object with a ``global_step`` attribute (the `SyncMetrics` callback) to
            log at the same MLflow step; default: the optimizer's iteration count.

    Example:
        >>> cb = WeightDivergence(writer)  # doctest: +SKIP
        >>> model.fit(x, y, epochs=3, callbacks=[cb])  # doctest: +SKIP
    """

    def __init__(self, writer: Any = None, *, step_source: Any = None):
        super().__init__()
        _reduce.check_writer(writer, "log_metrics")
        self.writer = writer
        self.step_source = step_source

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        value = divergence(self.model)
        if self.writer is None or value is None:
            return
        step = getattr(self.step_source, "global_step", None)
        if step is None:
            step = int(self.model.optimizer.iterations.numpy())
        self.writer.log_metrics({"sync/weight_divergence": value}, step=step)


def mirrored_variables(model: Any) -> list[Any]:
    """The model's and optimizer's variables that every replica keeps a copy of."""
    import tensorflow as tf

    out, seen = [], set()
    candidates = list(model.variables)
    if getattr(model, "optimizer", None) is not None:
        candidates += list(model.optimizer.variables)
    for v in candidates:
        tv = getattr(v, "_value", v)  # a Keras variable wraps the tf.Variable
        if not isinstance(tv, tf.distribute.DistributedValues) or id(tv) in seen:
            continue
        if not tv.shape.is_fully_defined() or tv.shape.num_elements() == 0:
            continue
        if getattr(tv, "synchronization", None) == tf.VariableSynchronization.ON_READ:
            continue
        seen.add(id(tv))
        out.append(tv)
    return out


def divergence(model: Any) -> float | None:
    """``sync/weight_divergence`` of ``model`` now (None without replicated variables)."""
    import numpy as np

    strategy = model.distribute_strategy
    variables = mirrored_variables(model)
    if not variables:
        return None
    if in_multi_worker_mode(strategy):
        return float(_multi_worker_fn(model, variables)().numpy())
    worst = 0.0
    for v in variables:
        copies = [np.asarray(c.numpy(), dtype=np.float64) for c in strategy.experimental_local_results(v)]
        if len(copies) < 2:
            continue
        stacked = np.stack(copies)
        worst = max(worst, float(np.max(stacked.max(axis=0) - stacked.min(axis=0), initial=0.0)))
    return worst


# One traced all-gather function per model (its variables do not change after the first fit).
_fns: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _multi_worker_fn(model: Any, variables: list[Any]) -> Any:
    import tensorflow as tf

    cached = _fns.get(model)
    if cached is not None:
        return cached
    strategy = model.distribute_strategy

    def replica_fn() -> Any:
        ctx = tf.distribute.get_replica_context()
        worst = tf.constant(0.0, tf.float64)
        for v in variables:
            local = tf.cast(tf.reshape(tf.identity(v), [1, -1]), tf.float64)  # this replica's copy
            copies = ctx.all_gather(local, axis=0)
            worst = tf.maximum(worst, tf.reduce_max(tf.reduce_max(copies, 0) - tf.reduce_min(copies, 0)))
        return worst

    @tf.function
    def fn() -> Any:
        return strategy.experimental_local_results(strategy.run(replica_fn))[0]

    _fns[model] = fn
    return fn

