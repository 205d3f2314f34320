"""`AllReduceProbe`: time one all-reduce of a tensor the size of the model's gradients, once."""

from __future__ import annotations

import statistics
import time
from typing import Any

import keras

from keras_sync.callbacks._once import check_int, log_step
from keras_sync.training.context import check_shared


class AllReduceProbe(keras.callbacks.Callback):
    """At the start of the first `fit`, log ``sync/allreduce_ms`` and ``sync/allreduce_gbps``.

    It sums a float32 tensor with one element per trainable parameter: a warm-up, then ``repeats``
    timed calls; the median is logged after the first batch, with ``bytes * 8 / seconds / 1e9``.
    Every worker runs it. Off by default (``mlflow.allreduce_probe: true``).

    Args:
        writer: a started `keras_sync.tracking.MlflowWriter`, or None on non-writing workers.
        repeats: timed all-reduces (>= 1).
        shared: the `keras_sync.callbacks.SharedState` of this fit (default: its own; the step is
            then the optimizer's).
    """

    def __init__(self, writer: Any = None, *, repeats: int = 5, shared: Any = None):
        super().__init__()
        check_int("repeats", repeats, 1)
        self.writer, self.repeats, self.shared = writer, repeats, check_shared(shared)
        self._metrics: dict[str, float] | None = None
        self._done = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self._done:
            self._done = True
            ms, nbytes = time_allreduce(self.model, self.repeats)
            if self.writer is not None and ms is not None:
                gbps = nbytes * 8 / (ms / 1000.0) / 1e9 if ms > 0 else 0.0
                self._metrics = {"sync/allreduce_ms": ms, "sync/allreduce_gbps": gbps}

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._metrics is not None:
            metrics, self._metrics = self._metrics, None
            self.writer.log_metrics(metrics, step=log_step(self.shared, self.model))


def time_allreduce(model: Any, repeats: int = 5) -> tuple[float | None, int]:
    """Median milliseconds of a sum all-reduce of the model's gradient size, and its bytes."""
    import tensorflow as tf

    strategy = model.distribute_strategy
    size = int(sum(int(tf.size(w)) for w in model.trainable_weights))
    if size == 0:
        return None, 0

    def reduce() -> Any:
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.zeros([size], tf.float32))

    @tf.function(autograph=False)
    def step() -> Any:
        return strategy.experimental_local_results(strategy.run(reduce))[0][0]

    step().numpy()  # trace and warm up the collective
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step().numpy()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times), size * 4
