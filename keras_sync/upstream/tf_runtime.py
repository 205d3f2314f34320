"""TensorFlow's private reads with a public fallback: the global seed, what a `tf.data` pipeline holds."""

from __future__ import annotations

import importlib
from typing import Any

from keras_sync.upstream import internals as _internals


def global_seed_set() -> bool:
    """Whether the script called `tf.random.set_seed` (no public API tells; False if TF no longer does)."""
    if not _internals.available(_internals.GLOBAL_SEED):
        return False
    return importlib.import_module("tensorflow.python.eager.context").global_seed() is not None


def pipeline_batch_size(ds: Any) -> int | None:
    """The batch size TensorFlow's `tf.distribute` reads from a pipeline; None when it cannot tell."""
    try:
        module = importlib.import_module("tensorflow.python.data.experimental.ops.distribute")
        size = int(module.compute_batch_size(ds))
    except Exception:
        return None
    return size if size > 0 else None


def dataset_inputs(ds: Any) -> list[Any]:
    """The datasets ``ds`` reads ([] for a source, or when TensorFlow no longer tells)."""
    try:
        return list(ds._inputs())
    except (AttributeError, NotImplementedError, ValueError):
        return []


def batch_fields(ds: Any) -> tuple[int | None, bool, Any] | None:
    """(static batch size, drop_remainder, input dataset) of a batching op; None for another op."""
    size = getattr(ds, "_batch_size", None)
    if size is None or not _internals.available(_internals.DATASET_GRAPH):
        return None
    import tensorflow as tf

    drop = getattr(ds, "_drop_remainder", None)
    static_drop = drop is not None and bool(tf.get_static_value(drop))
    return tf.get_static_value(size), static_drop, getattr(ds, "_input_dataset", None)


def map_function(ds: Any) -> Any:
    """The traced function of an ``interleave``/``flat_map`` (None for another op)."""
    return getattr(getattr(ds, "_map_func", None), "function", None)
