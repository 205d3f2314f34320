"""Gradient accumulation under every strategy: one optimizer update every N micro-batches.

Keras's own all-reduces inside a `tf.cond` in the replica context, which `MirroredStrategy` refuses.
Here each replica sums its own gradients, and every N-th micro-batch (decided in the cross-replica
context, as Keras's `LossScaleOptimizer` does) they apply their mean. A backup waits for that batch.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from keras import ops

from keras_sync.errors import UsageError
from keras_sync.training.loss_scale import no_merge_call


def replica_local(initial: Any, name: str) -> Any:
    """A variable with one copy per replica, never all-reduced nor trained (create it in the scope)."""
    return tf.Variable(
        initial,
        name=name,
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.NONE,
    )


class GradientAccumulator:
    """Per-replica gradient sums for the variables of ``model``, and the accumulating ``apply``."""

    def __init__(self, model: Any, steps: int):
        self.steps, self.optimizer = int(steps), model.optimizer
        self._strategy, self._vars = model.distribute_strategy, list(model.trainable_variables)
        self._index = {id(v): i for i, v in enumerate(self._vars)}
        with self._strategy.scope():
            self._sums = [
                replica_local(tf.zeros(tuple(v.shape), v.dtype), "keras_sync_gradient_sum")
                for v in self._vars
            ]
            self._micro = replica_local(tf.constant(0, tf.int64), "keras_sync_micro_batches")

    def pending(self) -> bool:
        """True between two updates: micro-batches have been summed but not applied yet."""
        micro = self._strategy.experimental_local_results(self._micro)[0]  # the same everywhere
        return int(micro.numpy()) % self.steps != 0

    def apply(self, apply_fn: Any, grads: list[Any], trainable_variables: Any) -> None:
        """Add ``grads`` to this replica's sums; on every N-th call, ``apply_fn`` their mean."""
        tvs = self._vars if trainable_variables is None else list(trainable_variables)
        if any(id(v) not in self._index for v in tvs):
            raise UsageError(
                "runtime.gradient_accumulation_steps: the train step applies gradients to a variable "
                "not among model.trainable_variables when fit started. Fix: set "
                "gradient_accumulation_steps: 1 for this model."
            )
        idx = [self._index[id(v)] for v in tvs]
        for i, g in zip(idx, grads):
            if g is not None:  # an IndexedSlices is summed dense
                self._sums[i].assign_add(tf.cast(tf.convert_to_tensor(g), self._sums[i].dtype))
        micro = self._micro.assign_add(1)
        is_update = tf.equal(tf.math.floormod(micro, self.steps), 0)
        present = [g is not None for g in grads]

        def update() -> None:
            mean = [
                self._sums[i] / tf.cast(self.steps, self._sums[i].dtype) if p else None
                for i, p in zip(idx, present)
            ]
            apply_fn(mean, tvs)
            for i in idx:
                self._sums[i].assign(tf.zeros_like(self._sums[i]))

        if no_merge_call():  # the condition stays in the replica context
            ops.cond(is_update, update, lambda: None)
            return

        def cross_replica(distribution: Any, is_update: Any) -> None:
            # Every replica counted the same micro-batches: take the first one's decision.
            pred = distribution.experimental_local_results(is_update)[0]
            ops.cond(
                pred, lambda: distribution.extended.call_for_each_replica(update), lambda: None
            )

        tf.distribute.get_replica_context().merge_call(cross_replica, args=(is_update,))
