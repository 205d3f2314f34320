"""TensorFlow's private reads with a public fallback: the global seed, a pipeline's batch size."""

from __future__ import annotations

import importlib
from typing import Any

from keras_sync.upstream import internals as _internals


def global_seed_set() -> bool:
    """Whether the script called `tf.random.set_seed` (False when TensorFlow no longer tells).

    No public API tells it.
    """
    if not _internals.available(_internals.GLOBAL_SEED):
        return False
    return importlib.import_module("tensorflow.python.eager.context").global_seed() is not None


def pipeline_batch_size(ds: Any) -> int | None:
    """The batch size TensorFlow itself reads from a pipeline (what `tf.distribute` uses to split
    batches, `input_lib._make_rebatch_fn`); None when it cannot tell."""
    try:
        module = importlib.import_module("tensorflow.python.data.experimental.ops.distribute")
        size = int(module.compute_batch_size(ds))
    except Exception:
        return None
    return size if size > 0 else None
