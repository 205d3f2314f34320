"""Keras's loss scaling (``keras.src.losses.loss``): Keras divides every loss by the replica count
(keras-team/keras#14104); read in a custom `train_step`, identities in a test step (no gradient)."""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator
from typing import Any

from keras_sync.upstream import internals as _internals
from keras_sync.upstream.patching import original, patched

UPSTREAM_ISSUE = "keras-team/keras#14104 (a custom train_step under a tf.distribute strategy)"
_SCALING = ("scale_loss_for_distribution", "unscale_loss_for_distribution")
_tls = threading.local()


def module() -> Any:
    """``keras.src.losses.loss``, whose scaling functions the train-step trace replaces."""
    return importlib.import_module(_internals.LOSS)


def missing() -> str | None:
    """What the train-step trace needs from `module()` and this Keras no longer has (None: nothing)."""
    return _internals.missing("evaluate_loss")


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
        was, _tls.testing = getattr(_tls, "testing", False), True
        try:
            with patched(scaling):
                return step(data)
        finally:
            _tls.testing = was

    if not model.__dict__.get("_keras_sync_eval_unscaled"):  # a test function traced without it
        model.test_function = None
    with patched([(model, "test_step", test_step)]):
        yield
