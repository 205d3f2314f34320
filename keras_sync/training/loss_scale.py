"""`mixed_float16` on several replicas: the loss-scale decision of one device, taken on the summed gradients.

Keras's `LossScaleOptimizer` (TensorFlow backend, under a strategy that uses ``merge_call``)
decides whether a step's gradients are finite from the *first replica's local* gradients (Keras 3
all-reduces inside the inner optimizer, afterwards). So a replica other than the first whose
float16 gradients overflowed is not seen (its inf reaches the weights), and a sum that overflows
float16 on one device (the step skipped, the scale halved) is finite on every replica's share.

`apply` takes the decision on the summed gradients, as one device does: it all-reduces the
gradients itself, and a step is skipped when a sum is not finite or when a gradient that the
backward pass computed in float16 sums to a magnitude float16 rounds to inf (>= 65520). Keras's
own logic then runs on that: the skipped step's gradients are handed over as NaN (every replica
skips and halves the scale), a finite step's as the sum. The sum is not all-reduced twice: the
inner optimizer's ``_all_reduce_sum_gradients`` passes it through while this apply traces
(private; without it each replica hands over the sum on the first replica and zeros on the
others, which Keras's all-reduce sums back exactly, at the cost of a second all-reduce).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

#: The smallest magnitude float16 rounds to inf: its largest finite value 65504 plus half a step (16).
FLOAT16_OVERFLOW = 65520.0
_REDUCE = "_all_reduce_sum_gradients"
_lock = threading.Lock()
_passing: dict[
    int, list[Any]
] = {}  # id(inner optimizer) -> [count of replicas inside apply, original attr]


def from_float16(grad: Any) -> bool:
    """Whether ``grad`` (a replica's local gradient, as the tape returned it) was computed in float16.

    A float32 variable used by a float16 layer is cast on the way in; its gradient is the float16
    gradient cast back.
    """
    import tensorflow as tf

    t = grad.values if isinstance(grad, tf.IndexedSlices) else grad
    op = getattr(t, "op", None)
    try:
        return op is not None and op.type == "Cast" and op.inputs[0].dtype == tf.float16
    except (AttributeError, IndexError):
        return False


def applies_here(optimizer: Any, num_replicas: int) -> bool:
    """Whether ``optimizer`` is a LossScaleOptimizer whose finite decision needs the summed gradients."""
    import tensorflow as tf

    if (
        num_replicas <= 1
        or not hasattr(optimizer, "dynamic_scale")
        or not hasattr(optimizer, "inner_optimizer")
    ):
        return False
    # TensorFlow's own test (Keras's LossScaleOptimizer reads it too): without merge_call Keras
    # takes each replica's decision on its own, a path this module does not change.
    no_merge_call = getattr(
        tf.__internal__.distribute, "strategy_supports_no_merge_call", lambda: False
    )
    return tf.distribute.has_strategy() and not no_merge_call()


def apply(
    optimizer: Any,
    apply_fn: Callable[..., Any],
    grads: list[Any],
    trainable_variables: Any,
    half: list[bool],
) -> Any:
    """``apply_fn(grads, ...)`` of a LossScaleOptimizer, with one device's finite decision (see the module).

    ``half[i]``: whether ``grads[i]`` was computed in float16 (`from_float16` of the tape's gradient).
    """
    import tensorflow as tf

    ctx = tf.distribute.get_replica_context()
    present = [i for i, g in enumerate(grads) if g is not None]
    dense = [
        tf.convert_to_tensor(grads[i]) for i in present
    ]  # an IndexedSlices as one device's dense sum
    summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, dense) if dense else []
    skip = tf.constant(False)
    for i, s in zip(present, summed):
        skip = tf.logical_or(skip, tf.logical_not(tf.reduce_all(tf.math.is_finite(s))))
        if half[i]:
            skip = tf.logical_or(
                skip, tf.reduce_any(tf.abs(s) >= tf.cast(FLOAT16_OVERFLOW, s.dtype))
            )
    inner = optimizer.inner_optimizer
    passing = _can_pass()
    first = tf.equal(ctx.replica_id_in_sync_group, 0)
    out = list(grads)
    for i, s in zip(present, summed):
        mine = s if passing else tf.where(first, s, tf.zeros_like(s))
        out[i] = tf.where(skip, tf.fill(tf.shape(s), tf.constant(float("nan"), s.dtype)), mine)
    return _handed_over(inner, apply_fn, out, trainable_variables)


def clips(optimizer: Any) -> bool:
    """Whether ``optimizer`` clips its gradients (``clipnorm``, ``global_clipnorm``, ``clipvalue``)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return any(
        (getattr(inner, k, None) or 0) > 0 for k in ("clipnorm", "global_clipnorm", "clipvalue")
    )


def apply_summed(
    optimizer: Any, apply_fn: Callable[..., Any], grads: list[Any], trainable_variables: Any
) -> Any:
    """``apply_fn`` on the gradients summed over the replicas, so the optimizer clips what one device clips.

    Keras clips in ``optimizer.apply`` (`BaseOptimizer._clip_gradients`) *before* its TensorFlow
    backend all-reduces (``_backend_update_step``): each replica clips its own share, and the sum of
    clipped shares is not the clipped sum (plain `MirroredStrategy` too). Here the
    gradients are all-reduced first and the optimizer's own all-reduce passes the sum through, as
    in `apply` (without that private hook: the sum on the first replica, zeros on the others; the
    clipping of a zero is zero, so Keras's all-reduce still sums to the clipped sum).
    """
    import tensorflow as tf

    ctx = tf.distribute.get_replica_context()
    present = [i for i, g in enumerate(grads) if g is not None]
    # An IndexedSlices (an embedding's gradient) stays one: its all-reduce gathers every replica's rows,
    # and Keras clips the rows as one device does (a dense sum would merge repeated rows first).
    summed = (
        ctx.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in present]) if present else []
    )
    passing = _can_pass()
    first = tf.equal(ctx.replica_id_in_sync_group, 0)
    out = list(grads)
    for i, s in zip(present, summed):
        if passing:
            out[i] = s
        elif isinstance(s, tf.IndexedSlices):
            out[i] = tf.IndexedSlices(
                s.values * tf.cast(first, s.values.dtype), s.indices, s.dense_shape
            )
        else:
            out[i] = tf.where(first, s, tf.zeros_like(s))
    return _handed_over(
        getattr(optimizer, "inner_optimizer", optimizer), apply_fn, out, trainable_variables
    )


def _handed_over(
    inner: Any, apply_fn: Callable[..., Any], sums: list[Any], trainable_variables: Any
) -> Any:
    """``apply_fn(sums, ...)`` with ``inner``'s all-reduce passing the sums through, when Keras has that hook
    (`_can_pass`); without it the caller put the sums on the first replica only, for Keras to sum back."""
    if not _can_pass():
        return apply_fn(sums, trainable_variables)
    _enter(inner)
    try:
        return apply_fn(sums, trainable_variables)
    finally:
        _leave(inner)


def _can_pass() -> bool:
    """Whether Keras's inner all-reduce is the one keras-sync can pass a sum through.

    Probed by `keras_sync.upstream.internals`.
    """
    from keras_sync.upstream import internals as _internals

    global _passes
    if _passes is None:
        _passes = _internals.available(_internals.LOSS_SCALE_REDUCE)
    return _passes


_passes: bool | None = None


def _enter(inner: Any) -> None:
    """Make ``inner``'s all-reduce pass the (already summed) gradients through while replicas trace."""
    with _lock:
        entry = _passing.get(id(inner))
        if entry is None:
            _passing[id(inner)] = [1, vars(inner).get(_REDUCE)]
            # A function, not state for Keras's tracker (as the other shims on Keras objects).
            object.__setattr__(inner, _REDUCE, lambda grads_and_vars: list(grads_and_vars))
        else:
            entry[0] += 1


def _leave(inner: Any) -> None:
    with _lock:
        entry = _passing[id(inner)]
        entry[0] -= 1
        if entry[0] == 0:
            del _passing[id(inner)]
            if entry[1] is None:
                object.__delattr__(inner, _REDUCE)
            else:
                object.__setattr__(inner, _REDUCE, entry[1])
