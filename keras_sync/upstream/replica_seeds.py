"""Keras random ops draw their own numbers on each replica: a mirrored `SeedGenerator` gives every
replica the same dropout masks, so the replica id is folded into each op's seed in ``_cast_seed``
(no public hook); replica 0 keeps the seed."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

from keras_sync.upstream import internals as _internals
from keras_sync.upstream.patching import original, patched

MODULE = "keras.src.backend.tensorflow.random"


@contextlib.contextmanager
def per_replica_seeds() -> Iterator[None]:
    """While a train step traces, Keras random ops in a replica context draw per replica (re-entrant,
    from several threads: `MirroredStrategy` traces each replica in its own)."""
    _internals.require("replica_random_streams")
    module = importlib.import_module(MODULE)
    keras_own = original(module, "_cast_seed")

    def _cast_seed(seed: Any) -> Any:
        seed = keras_own(seed)
        import tensorflow as tf

        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync <= 1:
            return seed
        replica = tf.cast(context.replica_id_in_sync_group, seed.dtype)
        folded = tf.random.experimental.stateless_fold_in(seed, replica)
        return tf.where(tf.equal(replica, 0), seed, tf.cast(folded, seed.dtype))

    with patched([(module, "_cast_seed", _cast_seed)]):
        yield
