"""Keras random ops draw their own numbers on each replica, as for the examples of one device's batch.

Keras's random ops (``keras.random.*`` with a seed or a `SeedGenerator`, and through them
Dropout, GaussianNoise and the random augmentation layers) are TensorFlow's stateless ops fed a
seed that `SeedGenerator` keeps in a variable. Under a `tf.distribute` strategy that variable is
mirrored, so every replica feeds the same seed and draws the same numbers: a GAN's latent
vectors, a dropout mask or an augmentation repeat N times in the global batch, and the model
trains on N times fewer distinct draws than on one device.

`per_replica_seeds` folds the replica's id into the seed of each Keras random op traced in a
replica context (``tf.random.experimental.stateless_fold_in``), inside
``keras.src.backend.tensorflow.random`` where every such op turns its seed into TensorFlow's
(``_cast_seed``: no public hook exists). Replica 0 keeps the seed, so one replica draws what
one device draws; the others draw independent streams. The runs stay equal to one device in
distribution, not in value. Random ops outside a replica context (a `tf.data` map, eager code)
are untouched.
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
