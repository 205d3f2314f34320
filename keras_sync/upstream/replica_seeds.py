"""Keras random ops draw their own numbers on each replica, as for the examples of one device's batch.

A mirrored `SeedGenerator` gives every replica the same dropout masks and augmentations.
`per_replica_seeds` folds the replica id into each op's seed in ``_cast_seed`` (no public hook):
replica 0 keeps the seed, the others draw independent streams (one device's in distribution).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

from keras_sync.upstream.patching import original, patched

#: The module whose ``_cast_seed`` every Keras TensorFlow random op calls on its seed.
MODULE = "keras.src.backend.tensorflow.random"


def _folded(cast_seed: Any) -> Any:
    def _cast_seed(seed: Any) -> Any:
        seed = cast_seed(seed)
        import tensorflow as tf

        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync <= 1:
            return seed
        replica = tf.cast(context.replica_id_in_sync_group, seed.dtype)
        folded = tf.random.experimental.stateless_fold_in(seed, replica)
        return tf.where(tf.equal(replica, 0), seed, tf.cast(folded, seed.dtype))

    return _cast_seed


@contextlib.contextmanager
def per_replica_seeds() -> Iterator[None]:
    """While this is entered (a train step's trace), Keras random ops in a replica context draw per replica.

    Re-entrant and safe from several threads (`MirroredStrategy` traces its replicas in threads of
    their own); Keras's own function is back once the last one leaves.
    """
    from keras_sync.upstream import internals as _internals

    _internals.require("replica_random_streams")
    module = importlib.import_module(MODULE)
    with patched([(module, "_cast_seed", _folded(original(module, "_cast_seed")))]):
        yield
