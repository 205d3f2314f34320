"""`WeightDivergence`: after each epoch, whether the replicas' copies of the weights drifted apart."""

from __future__ import annotations

import functools
from typing import Any

import keras

from keras_sync.callbacks._once import log_step
from keras_sync.measures import reduce as _reduce
from keras_sync.measures.fingerprints import summarize
from keras_sync.training.context import check_shared
from keras_sync.training.instrument import probe_of
from keras_sync.upstream.strategy_facts import distributed_variable


class WeightDivergence(keras.callbacks.Callback):
    """Log ``sync/weight_divergence`` and ``sync/diverged_variables`` at the end of every epoch.

    Both are 0 when healthy: anything else means an all-reduce or a custom update broke the sync.
    Every mirrored variable is compared through a fingerprint per copy (a wrap-around checksum of
    its bits, its mean and RMS) in one ``all_gather``. Every worker runs it; one writes.

    Args:
        writer: a started `keras_sync.tracking.MlflowWriter`, or None on a worker that must
            take part without writing.
        shared: the `keras_sync.callbacks.SharedState` of this fit's keras-sync callbacks: logs at
            its ``step`` and records its points there. Default: its own, and the optimizer's
            iteration count as the step.
    """

    def __init__(self, writer: Any = None, *, shared: Any = None):
        super().__init__()
        _reduce.check_writer(writer, "log_metrics")
        self.writer, self.shared = writer, check_shared(shared)
        self._gather: Any = None  # the traced comparison of this fit's model, made at its first use

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self._gather = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._gather is None:
            self._gather = _traced_gather(self.model)
        if self._gather is False:
            return
        found = summarize(self._gather().numpy().tolist())
        if self.writer is not None:
            step = log_step(self.shared, self.model)
            metrics = {"sync/weight_divergence": found.value}
            metrics["sync/diverged_variables"] = float(found.diverged_variables)
            self.writer.log_metrics(metrics, step=step)
            self.shared.record(metrics, step)


def mirrored_variables(model: Any) -> list[Any]:
    """The model's and optimizer's variables that every replica keeps a copy of."""
    import tensorflow as tf

    out, seen = [], set()
    optimizer = getattr(model, "optimizer", None)
    for v in [*model.variables, *(optimizer.variables if optimizer is not None else [])]:
        tv = distributed_variable(v)
        if (
            isinstance(tv, tf.distribute.DistributedValues)
            and id(tv) not in seen
            and tv.shape.is_fully_defined()
            and tv.shape.num_elements()
            and getattr(tv, "synchronization", None) != tf.VariableSynchronization.ON_READ
            and (tv.dtype.is_floating or tv.dtype.is_integer or tv.dtype.is_bool)  # not complex
        ):
            seen.add(id(tv))
            out.append(tv)
    return out


def _traced_gather(model: Any) -> Any:
    """``model``'s traced comparison (False: nothing to compare), kept on its replica probe so
    that each fit of the same model and variables calls one trace instead of tracing again."""
    variables = mirrored_variables(model)
    if not variables:
        return False
    probe, key = probe_of(model), tuple(id(v) for v in variables)
    kept = getattr(probe, "weight_gather", None)
    if kept is not None and kept[0] == key:
        return kept[1]
    gather = _gather_fn(model, variables)
    if probe is not None:
        probe.weight_gather = (key, gather)  # holds the variables: their ids stay theirs
    return gather


def _fingerprints(values: list[Any]) -> Any:
    """[checksum_hi, checksum_lo, mean, rms] of each of one replica's copies, [len(values), 4];
    few ops per variable (each is traced and placed), the rest once on the stacked vectors."""
    import tensorflow as tf

    flat, first = tf.constant([-1]), tf.constant(0)
    checksums, sums, squares, sizes = [], [], [], []
    for value in values:
        value = tf.reshape(value, flat)
        if value.dtype == tf.bool:
            bits = tf.cast(value, tf.uint32)
        elif value.dtype.size < 4:
            small = {1: tf.uint8, 2: tf.uint16}[value.dtype.size]
            bits = tf.cast(value if value.dtype == small else tf.bitcast(value, small), tf.uint32)
        else:  # 4 bytes: same shape; 8 bytes: a trailing axis of 2 words
            bits = value if value.dtype == tf.uint32 else tf.bitcast(value, tf.uint32)
            if value.dtype.size == 8:
                bits = tf.reshape(bits, flat)
        # unsigned: wraps mod 2**32, order-independent; raw ops: no constant made per call
        checksums.append(tf.raw_ops.Sum(input=bits, axis=first))
        x = value if value.dtype == tf.float32 else tf.cast(value, tf.float32)
        sums.append(tf.raw_ops.Sum(input=x, axis=first))
        # One contraction (BLAS, no temporary): ~4x faster here than reduce_sum(square(x)).
        squares.append(tf.einsum("i,i->", x, x))
        sizes.append(float(value.shape.num_elements()))
    checksum = tf.stack(checksums)
    hi = tf.cast(tf.bitwise.right_shift(checksum, 16), tf.float32)  # < 2**16: exact in float32
    lo = tf.cast(tf.bitwise.bitwise_and(checksum, 0xFFFF), tf.float32)
    n = tf.constant(sizes, tf.float32)
    return tf.stack([hi, lo, tf.stack(sums) / n, tf.sqrt(tf.stack(squares) / n)], axis=1)


def _gather_fn(model: Any, variables: list[Any]) -> Any:
    """A traced function: every replica's fingerprints of ``variables``, [replicas, variables, 4]."""
    import tensorflow as tf

    strategy = model.distribute_strategy

    def replica_fn() -> Any:
        # In a replica context a mirrored variable reads as this replica's own copy.
        local = _fingerprints([tf.convert_to_tensor(v) for v in variables])  # [variables, 4]
        return tf.distribute.get_replica_context().all_gather(local[None], axis=0)

    def gather() -> Any:
        return strategy.experimental_local_results(strategy.run(replica_fn))[0]

    # A partial is its own key: TensorFlow counts retraces per code object (a warning from a
    # process's 5th model on). Autograph would only cost: the loops are over Python lists.
    return tf.function(functools.partial(gather), autograph=False)
