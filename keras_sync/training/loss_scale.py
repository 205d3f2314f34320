"""What one device decides on the summed gradients: the float16 loss-scale skip, clipping, sparse rows.

Keras decides finiteness from the first replica's gradients and clips each replica's share;
`apply_summed` hands the optimizer the sum instead. An all-reduced `tf.IndexedSlices` repeats a row
per replica, which Adam squares per slice: `merging_update_step` sums duplicate rows first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from keras_sync.upstream.keras_fixes import sums_pass_through
from keras_sync.upstream.patching import patched

#: The smallest magnitude float16 rounds to inf: its largest finite value 65504 plus half a step (16).
FLOAT16_OVERFLOW = 65520.0


def from_float16(grad: Any) -> bool:
    """Whether a replica's local ``grad`` was computed in float16 (a float16 gradient cast back)."""
    tensor = grad.values if isinstance(grad, tf.IndexedSlices) else grad
    op = getattr(tensor, "op", None)  # an eager tensor has none
    return op is not None and op.type == "Cast" and op.inputs[0].dtype == tf.float16


def applies_here(optimizer: Any, num_replicas: int) -> bool:
    """Whether ``optimizer`` is a LossScaleOptimizer whose finite decision needs the summed gradients."""
    return (
        num_replicas > 1
        and hasattr(optimizer, "dynamic_scale")
        and tf.distribute.has_strategy()
        and not no_merge_call()  # then Keras decides per replica: a path left unchanged
    )


def no_merge_call() -> bool:
    """TensorFlow's own test (Keras's `LossScaleOptimizer` uses it): XLA on GPUs runs without merge_call."""
    return bool(getattr(tf.__internal__.distribute, "strategy_supports_no_merge_call", bool)())


def clips(optimizer: Any) -> bool:
    """Whether ``optimizer`` clips its gradients (``clipnorm``, ``global_clipnorm``, ``clipvalue``)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    keys = ("clipnorm", "global_clipnorm", "clipvalue")
    return any((getattr(inner, k, None) or 0) > 0 for k in keys)


def apply_summed(
    optimizer: Any,
    apply_fn: Callable[..., Any],
    grads: list[Any],
    trainable_variables: Any,
    half: list[bool] | None = None,
) -> Any:
    """``apply_fn`` on the replicas' summed gradients, so the optimizer clips and skips as one device
    does; with ``half`` (float16 gradients) a sum not finite in float16 skips (NaNs). The sums pass
    Keras's own all-reduce (`keras_fixes.sums_pass_through`); without that, the first replica hands
    over the sum and the others zeros, which Keras sums again."""
    if half is not None:
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
    ctx = tf.distribute.get_replica_context()
    present = [i for i, g in enumerate(grads) if g is not None]
    # An IndexedSlices stays one: its all-reduce gathers every replica's rows, clipped as one device's.
    summed = (
        ctx.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in present]) if present else []
    )
    skip = tf.constant(False)
    for i, s in zip(present, summed):
        if half is not None:
            limit = tf.cast(FLOAT16_OVERFLOW if half[i] else float("inf"), s.dtype)
            skip = skip | ~tf.reduce_all(tf.math.is_finite(s)) | tf.reduce_any(tf.abs(s) >= limit)
    passing = sums_pass_through(optimizer)
    first = tf.equal(ctx.replica_id_in_sync_group, 0)
    out = list(grads)
    for i, s in zip(present, summed):
        if passing is not None:
            mine = s
        elif isinstance(s, tf.IndexedSlices):
            mine = tf.IndexedSlices(
                s.values * tf.cast(first, s.values.dtype), s.indices, s.dense_shape
            )
        else:
            mine = tf.where(first, s, tf.zeros_like(s))
        if half is not None:
            mine = tf.where(skip, tf.fill(tf.shape(s), tf.constant(float("nan"), s.dtype)), mine)
        out[i] = mine
    with patched(passing or []):
        return apply_fn(out, trainable_variables)


def merging_update_step(update_step: Callable[..., Any]) -> Callable[..., Any]:
    """``update_step`` with each row of a `tf.IndexedSlices` gradient once (values summed)."""

    def step(gradient: Any, variable: Any, lr: Any) -> Any:
        if isinstance(gradient, tf.IndexedSlices):
            rows, position = tf.unique(gradient.indices)
            values = tf.math.unsorted_segment_sum(gradient.values, position, tf.shape(rows)[0])
            gradient = tf.IndexedSlices(values, rows, gradient.dense_shape)
        return update_step(gradient, variable, lr)

    return step


def with_inner(optimizers: list[Any]) -> list[Any]:
    """The optimizers and those they wrap (a `LossScaleOptimizer`'s inner one updates the weights)."""
    out: list[Any] = []
    for optimizer in optimizers:
        while optimizer is not None and not any(o is optimizer for o in out):
            out.append(optimizer)
            optimizer = getattr(optimizer, "inner_optimizer", None)
    return out
