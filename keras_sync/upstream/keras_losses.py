"""Keras's loss reduction (``keras.src.losses.loss``): Keras divides every loss by the replica count
(keras-team/keras#14104), read in a custom `train_step`, identities in a test step (no gradient); a
masked mean weighed as one device's."""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from keras_sync.upstream import internals as _internals
from keras_sync.upstream.patching import Patch, original, patched

UPSTREAM_ISSUE = "keras-team/keras#14104 (a custom train_step under a tf.distribute strategy)"
_SCALING = ("scale_loss_for_distribution", "unscale_loss_for_distribution")
_tls = threading.local()


def module() -> Any:
    """``keras.src.losses.loss``, whose scaling functions the train-step trace replaces."""
    return importlib.import_module(_internals.LOSS)


def masked_means_weighed(weight_of: Callable[[], tuple[Any, int] | None]) -> list[Patch]:
    """Keras's loss reduction, shimmed so that a replica's masked mean (over its own unmasked
    entries) becomes its part of the mean over the whole step's, once weighed by its share of the
    examples: ``weight_of()`` gives (that share times N, N), or None to leave the loss as it is.
    [] when Keras's reduction moved (each replica keeps its own mean, as plain Keras does)."""
    if not _internals.available(_internals.MASKED_LOSS):
        return []
    losses = module()
    keras_own = original(losses, "reduce_weighted_values")

    def reduce_weighted_values(
        values: Any,
        sample_weight: Any = None,
        mask: Any = None,
        reduction: Any = "sum_over_batch_size",
        dtype: Any = None,
    ) -> Any:
        out = keras_own(values, sample_weight, mask, reduction, dtype)
        if mask is None or reduction not in ("mean", "sum_over_batch_size"):
            return out
        weighed = weight_of()
        if weighed is None:
            return out
        import tensorflow as tf

        (weight, n), valid = weighed, tf.reduce_sum(tf.cast(mask, tf.float32))
        total = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, valid)
        share = tf.math.divide_no_nan(valid * float(n), tf.cast(weight, tf.float32) * total)
        return out * tf.cast(share, out.dtype)

    return [(losses, "reduce_weighted_values", reduce_weighted_values)]


def missing() -> str | None:
    """What the train-step trace needs from `module()` and this Keras no longer has (None: nothing)."""
    return _internals.missing("evaluate_loss")


def _example_share(data: Any, n: int) -> Any:
    """This replica's share of the step's examples, times ``n`` (an all-reduce)."""
    import tensorflow as tf

    first = next(t for t in tf.nest.flatten(data) if t is not None and len(t.shape) > 0)
    local = tf.cast(tf.shape(first)[0], tf.float32)
    total = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, local)
    return tf.math.divide_no_nan(local * float(n), total)


@contextlib.contextmanager
def unscaled_eval_losses(model: Any) -> Iterator[None]:
    """For this span, ``model``'s test step (wrapped on the instance) tracks losses not divided
    by the replica count; a test function traced before without it is traced again."""
    _internals.require("evaluate_loss")
    losses, step = module(), model.test_step

    def identity_in_test_step(keras_own: Any) -> Any:
        return lambda value: value if getattr(_tls, "testing", False) else keras_own(value)

    scaling = [(losses, n, identity_in_test_step(original(losses, n))) for n in _SCALING]

    def test_step(data: Any) -> Any:
        object.__setattr__(model, "_keras_sync_eval_unscaled", True)
        n = int(model.distribute_strategy.num_replicas_in_sync)
        was, _tls.testing = getattr(_tls, "testing", False), True
        try:
            # A masked loss is tracked as one device's: Keras weighs each replica's by its examples.
            masked = masked_means_weighed(lambda: (_example_share(data, n), n))
            with patched(scaling + masked):
                return step(data)
        finally:
            _tls.testing = was

    if not model.__dict__.get("_keras_sync_eval_unscaled"):  # a test function traced without it
        model.test_function = None
    with patched([(model, "test_step", test_step)]):
        yield
