"""Sparse gradients reach the optimizer with each row once, on one device and on N replicas alike.

An embedding's gradient is a `tf.IndexedSlices` with one slice per row looked up; the all-reduce
concatenates the replicas' slices, so on N replicas a row can appear N times. SGD applies the sum,
which is the dense row; Adam, RMSprop or Adagrad square each slice (``g0^2 + g1^2`` instead of
``(g0 + g1)^2``) and silently train apart from one device. `merging_update_step` merges duplicate
rows (values summed) before an optimizer's `update_step`, as TensorFlow 1's optimizers did; a
gradient without duplicates passes with the same values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def merge_duplicate_rows(gradient: Any) -> Any:
    """``gradient`` with each row of a `tf.IndexedSlices` once (values summed); anything else as is.

    >>> import tensorflow as tf                                             # doctest: +SKIP
    >>> g = tf.IndexedSlices(tf.constant([[1.0], [2.0], [4.0]]), tf.constant([3, 0, 3]))  # doctest: +SKIP
    >>> m = merge_duplicate_rows(g)                                         # doctest: +SKIP
    >>> m.indices.numpy().tolist(), m.values.numpy().ravel().tolist()     # doctest: +SKIP
    ([3, 0], [5.0, 2.0])
    """
    import tensorflow as tf

    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    rows, position = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(gradient.values, position, tf.shape(rows)[0])
    return tf.IndexedSlices(values, rows, gradient.dense_shape)


def merging_update_step(update_step: Callable[..., Any]) -> Callable[..., Any]:
    """An `update_step` that merges a sparse gradient's duplicate rows before ``update_step`` sees it."""

    def update_step_merging_rows(gradient: Any, variable: Any, learning_rate: Any) -> Any:
        return update_step(merge_duplicate_rows(gradient), variable, learning_rate)

    update_step_merging_rows.merges_rows = True  # type: ignore[attr-defined]
    return update_step_merging_rows


def with_inner(optimizers: list[Any]) -> list[Any]:
    """The optimizers and the ones they wrap (a `LossScaleOptimizer`'s inner optimizer updates the weights)."""
    out: list[Any] = []
    for optimizer in optimizers:
        while optimizer is not None and not any(o is optimizer for o in out):
            out.append(optimizer)
            optimizer = getattr(optimizer, "inner_optimizer", None)
    return out
